"""The mutants of the capturability table learned on a GPU and of its value rules (issue #27)."""

from __future__ import annotations

from ..common import CAPTURABILITY, CB, GD, GDV, Mutant, pair, twin

TABLE: list[Mutant] = [
    # -- issue #27: the capturability table learned on a GPU -----------------------------------------
    Mutant(
        "guard-table-unasked",
        GD,
        "            found is None\n            and self.by_provenance\n            and not self.suspended\n            and table is not None\n            and not _is_view(func)",
        "            False\n            and self.by_provenance\n            and not self.suspended\n            and table is not None\n            and not _is_view(func)",
        (*CAPTURABILITY, pair("InvertsInForward")),
        "the emulator passes an op the table says CUDA refuses",
    ),
    Mutant(
        "guard-learned-outranked",
        GD,
        "            learned = self._learned(table, func, args, kwargs, exact=True)",
        "            learned = None",
        CAPTURABILITY,
        "a write through a host boolean mask, which CUDA captures, is refused by the general rule",
    ),
    Mutant(
        "guard-not-known-silent",
        GD,
        "                self.tracker.not_known.setdefault(str(func), self.tracker.path)",
        "                pass",
        CAPTURABILITY,
        "an op the table does not cover passes in silence",
    ),
    # -- issue #48: the device capture's fast path ----------------------------------------------------
    Mutant(
        "guard-device-fast-path-trusts-the-table",
        "pytest_cudagraph/guard/rules.py",
        'v.kind == REFUSED for p, v in entry.items() if "h" not in p',
        'False and v.kind == REFUSED for p, v in entry.items() if "h" not in p',
        (
            "tests/test_capturability.py::"
            "test_the_device_captures_fast_path_keeps_every_verdict_the_table_and_the_rules_give",
        ),
        "on a device the guard skips the table for an op it refuses without a host tensor (cholesky)",
    ),
]

VALUE_RULES: list[Mutant] = [
    # -- issue #27: value rules, where shapes and values decide (held to the H200) ------------------
    Mutant(
        "rule-equal-shapes",
        CB,
        "    if a.shape != b.shape:",
        "    if False:",
        CAPTURABILITY,
        "torch.equal of two shapes, which returns early and CUDA captures, is refused",
    ),
    Mutant(
        "rule-isin-boundary",
        CB,
        "    if tests.numel() < few:",
        "    if tests.numel() <= few:",
        CAPTURABILITY,
        "isin at the heuristic's boundary, which sorts and syncs on CUDA, is held",
    ),
    Mutant(
        "rule-lu-batch",
        CB,
        "(m <= 128 and batch <= 16)",
        "m <= 128",
        CAPTURABILITY,
        "a batch of 17 LUs of 17 x 17, which takes MAGMA and syncs, is held",
    ),
    Mutant(
        "rule-segment-unsafe",
        CB,
        '    if _arg(args, kwargs, 6, "unsafe"):',
        "    if False:",
        CAPTURABILITY,
        "segment_reduce(unsafe=True), which checks nothing on the host, is refused",
    ),
    Mutant(
        "guard-value-rule-unasked",
        GD,
        "            ruled = value_rule(str(func), args, kwargs)",
        "            ruled = None",
        CAPTURABILITY,
        "the table's majority answer decides where sizes do (isin of many elements in few)",
    ),
    Mutant(
        "guard-one-hot-count-missed",
        GDV,
        "    elif num_classes == -1 and isinstance(labels, torch.Tensor) and labels.numel() > 0:",
        "    elif False:",
        (*CAPTURABILITY, pair("CountsClasses")),
        "one_hot without num_classes, which reads the labels back on CUDA, is held",
    ),
    Mutant(
        "guard-one-hot-cpu-check",
        GDV,
        "    torch.nn.functional.one_hot: _one_hot,\n",
        "",
        (*CAPTURABILITY, twin("CountsClassesGiven")),
        "one_hot with num_classes is refused for the CPU's own range check, which CUDA does not run",
    ),
]
