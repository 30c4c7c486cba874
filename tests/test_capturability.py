"""The table of what a CUDA capture holds, learned on a GPU, and the emulator that asks it.

The emulator must refuse what CUDA refuses, op by op (its CPU refuses nothing), name what the
table does not cover, replay in-place shape changes as a graph does, and refuse sparse tensors
with a finding instead of an internal error.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from examples.buggy.common import D, token_inputs
from pytest_cudagraph import guard, verify
from pytest_cudagraph.capturability import (
    DEPENDS,
    HELD,
    REFUSED,
    VALUE_RULES_SOURCE,
    Table,
    load_table,
    pattern,
)

SIZES = (1, 2, 4)


def _verify(module: nn.Module, device: torch.device, backend: str, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return verify(
        module.to(device),
        token_inputs(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        **kwargs,
    )


def test_the_shipped_table_loads_and_says_where_it_was_learned() -> None:
    table = load_table()
    assert table is not None, "pytest_cudagraph/data/capturability.json is missing"
    assert table.torch_version and table.device and table.date and table.cases > 0
    kinds = {v.kind for patterns in table.ops.values() for v in patterns.values()}
    assert kinds <= {HELD, REFUSED, DEPENDS} and {HELD, REFUSED} <= kinds
    assert Table.from_json(table.to_json()) == table


def test_the_table_names_ops_this_torch_has() -> None:
    table = load_table()
    assert table is not None
    missing = []
    for name in table.ops:
        namespace, _, rest = name.partition(".")
        packet, _, overload = rest.rpartition(".")
        found = getattr(getattr(torch.ops, namespace), packet, None)
        if found is None or not hasattr(found, overload):
            missing.append(name)
    # Learned on another torch: a few private ops may come and go, the bulk must not.
    assert len(missing) <= len(table.ops) // 50, missing


def test_the_table_is_in_step_with_the_guards_own_rules() -> None:
    """Where the guard refuses an op whatever its arguments (a sync, a data-dependent shape), the
    table, learned independently on a GPU, saw CUDA refuse it too for some device pattern."""
    table = load_table()
    assert table is not None
    seen = [op for op in guard._DATA_DEPENDENT if str(op) in table.ops]
    assert len(seen) >= 3
    for op in seen:
        kinds = {v.kind for p, v in table.ops[str(op)].items() if "h" not in p}
        assert kinds & {REFUSED, DEPENDS}, (op, table.ops[str(op)])


def test_the_pattern_tells_a_boolean_mask_a_host_tensor_a_0_dim_value_and_numbers() -> None:
    x, mask = torch.ones(3), torch.ones(3, dtype=torch.bool)
    assert pattern((x, [mask], torch.tensor(1.0)), {"accumulate": False}) == "Tb0s"
    assert pattern((x, [mask]), {}, lambda t: t is mask) == "Th"


def test_the_pattern_tells_an_empty_tensor() -> None:
    assert pattern((torch.ones(0, 0), torch.ones(3), torch.ones(0, dtype=torch.bool)), {}) == "eTe"
    empty = torch.ones(0)
    assert pattern((empty,), {}, lambda t: t is empty) == "h"  # where it lives comes first


def test_an_empty_tensor_takes_a_full_ones_held_verdict_but_never_its_refusal() -> None:
    from pytest_cudagraph.capturability import Verdict

    table = Table(
        "t",
        "d",
        "now",
        1,
        {"aten.solve.default": {"T": Verdict(REFUSED, "sync")}, "aten.add.Tensor": {"TT": Verdict(HELD, "")}},
    )
    assert table.verdict("aten.add.Tensor", "eT") == Verdict(HELD, "")  # less work than a full one
    assert table.verdict("aten.solve.default", "e") is None  # CUDA's solvers return early on an empty one
    assert table.verdict("aten.add.Tensor", "eT", exact=True) is None


def test_the_shipped_table_holds_an_empty_matrix_where_it_refuses_a_full_one() -> None:
    """Learned on the GPU: an empty matrix needs no error check read back to the host."""
    table = load_table()
    assert table is not None
    both = [
        op
        for op, patterns in table.ops.items()
        if patterns.get("T", None) is not None
        and patterns["T"].kind == REFUSED
        and patterns.get("e", None) is not None
        and patterns["e"].kind == HELD
    ]
    assert len(both) >= 3, both


def test_a_verdict_carries_over_numbers_but_not_other_tensor_kinds() -> None:
    from pytest_cudagraph.capturability import Verdict

    table = Table(
        "t",
        "d",
        "now",
        1,
        {
            "aten.x.default": {"TTs": Verdict(HELD, "")},
            "aten.y.default": {"T": Verdict(HELD, ""), "T0": Verdict(REFUSED, "r")},
        },
    )
    assert table.verdict("aten.x.default", "TT") == Verdict(HELD, "")  # another count of numbers
    assert table.verdict("aten.x.default", "TbT") is None  # a boolean mask it never saw
    assert table.verdict("aten.x.default", "Ts") == Verdict(HELD, "")  # one answer, its kinds all seen
    assert table.verdict("aten.x.default", "0s") is None  # a 0-dim value it never saw
    assert table.verdict("aten.y.default", "T0s").kind == REFUSED
    assert table.verdict("aten.y.default", "0") is None  # seen kinds, but no one answer
    assert table.verdict("aten.y.default", "Tb") is None
    assert table.verdict("aten.z.default", "T") is None


def test_the_emulator_refuses_what_the_table_says_cuda_refuses_and_passes_its_twin() -> None:
    from examples.buggy.device_solver import InvertsInForward, InvertsWithoutCheck

    report = _verify(InvertsInForward(), torch.device("cpu"), "emulate", checks=["capture_safety"])
    told = [o for o in report.failures if o.check == "capture_safety"]
    assert told and len(told) == len(SIZES)
    assert all(
        "aten._linalg_check_errors.default (a CUDA graph capture refuses it" in o.message
        and "learned on" in o.message
        for o in told
    )
    assert _verify(InvertsWithoutCheck(), torch.device("cpu"), "emulate").ok


def test_without_the_table_the_emulator_misses_it() -> None:
    """What the table adds: the CPU runs the host check without complaint."""
    from examples.buggy.device_solver import InvertsInForward

    with guard.no_capturability_table():
        assert _verify(InvertsInForward(), torch.device("cpu"), "emulate", checks=["capture_safety"]).ok


class WritesThroughHostMask(nn.Linear):
    """``out[mask] = 0`` with a mask made on the host: torch finds its rows on the host, and CUDA
    captures the write (seen in the table); a mask computed on the device would need a sync."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        mask = torch.tensor([i % 2 == 0 for i in range(out.shape[1])])
        out[:, mask] = out[:, :1].expand(-1, D // 2)
        return out


class WritesThroughDeviceMask(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        out[out > 0] = 0.5 * x.sum()  # a boolean mask on the device: nonzero, a sync
        return out


def test_a_write_through_a_host_boolean_mask_is_held_and_one_through_a_device_mask_refused() -> None:
    cpu = torch.device("cpu")
    held = _verify(WritesThroughHostMask(D, D), cpu, "emulate", checks=["capture_safety"])
    assert held.ok, held.format()
    refused = _verify(WritesThroughDeviceMask(D, D), cpu, "emulate", checks=["capture_safety"])
    assert refused.failures and all("index_put_" in o.message for o in refused.failures)


class Lin(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_an_op_the_table_does_not_cover_is_named_not_known(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = Table("2.0", "a test GPU", "today", 1, {})
    monkeypatch.setattr(guard, "capturability_table", lambda: empty)
    monkeypatch.setattr("pytest_cudagraph.checks.engine.capturability_table", lambda: empty)
    report = _verify(Lin(D, D), torch.device("cpu"), "emulate")
    assert report.ok  # not known is no failure
    notes = [n for n in report.notes if "is not known to the emulator" in n]
    assert len(notes) == 1 and "aten.addmm.default" in notes[0] and "a test GPU" in notes[0]
    assert "NOTE capture_safety: whether a CUDA graph capture holds" in report.format()


def test_a_covered_module_gets_no_not_known_note() -> None:
    report = _verify(Lin(D, D), torch.device("cpu"), "emulate")
    assert report.ok and not [n for n in report.notes if "not known" in n]


# -- in-place shape changes, replayed as a graph replays them ---------------------------------
class TransposesInPlace(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x) * 2
        h.transpose_(0, 1)
        h = h * 1.5
        h.t_()
        return h + 1


class SqueezesInPlace(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x) * 2
        h.unsqueeze_(0)
        h = h + 1
        h.squeeze_(0)
        return h * 3


class ResizesInPlace(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x) + 0
        h.resize_(h.shape[0] * D)
        h = h * 2
        return h.view(-1, D)


class StridesInPlace(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x) + 0
        h.as_strided_((h.shape[1], h.shape[0]), (1, D))
        return h * 2


@pytest.mark.parametrize("cls", [TransposesInPlace, SqueezesInPlace, ResizesInPlace, StridesInPlace])
def test_in_place_shape_changes_replay_as_a_graph_replays_them(
    cls: type[nn.Linear], backend: str, device: torch.device
) -> None:
    report = _verify(cls(D, D), device, backend)
    assert report.ok, report.format()


class SparseMix(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = super().forward(x).relu().to_sparse()
        return torch.sparse.mm(s, self.weight)


def test_a_sparse_tensor_is_a_finding_on_the_emulator_never_an_internal_error() -> None:
    with guard.no_capturability_table():  # the emulator's own refusal, not the table's
        report = _verify(SparseMix(D, D), torch.device("cpu"), "emulate")
    told = [o for o in report.failures if o.check == "capture_safety"]
    assert told and all(
        "sparse tensor (torch.sparse_coo): the emulator records ops on strided tensors only" in o.message
        for o in told
    )
    assert not any("could not run" in o.message or "storage" in o.message for o in report.failures)


# -- CUDA: an op that fails the capture itself ---------------------------------------------------
@pytest.mark.cuda
def test_an_op_that_fails_a_cuda_capture_is_a_finding_that_names_it() -> None:
    from examples.buggy.device_solver import InvertsInForward

    device = torch.device("cuda", torch.cuda.current_device())
    with guard.no_capturability_table():  # the raw failure, not the table's foresight
        report = _verify(InvertsInForward(), device, "cuda", checks=["capture_safety"])
    told = [o for o in report.failures if o.check == "capture_safety"]
    assert told and all("(a CUDA graph capture refuses it:" in o.message for o in told), report.format()
    # With the table, the guard stops it before the device runs it, and says where that was learned.
    report = _verify(InvertsInForward(), device, "cuda", checks=["capture_safety"])
    assert report.failures and all("learned on" in o.message for o in report.failures), report.format()


@pytest.mark.cuda
def test_a_sparse_tensor_does_not_break_the_cuda_guard() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    report = _verify(SparseMix(D, D), device, "cuda")
    assert not any(
        "Cannot access storage" in o.message or "could not run" in o.message for o in report.outcomes
    )


# -- value rules: where shapes and values decide -------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
PROBE = json.loads((ROOT / "docs" / "data" / "capturability_h200_value_rules.json").read_text())


def _value_rules_script() -> Any:
    spec = importlib.util.spec_from_file_location("value_rules", ROOT / "scripts" / "value_rules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VALUE_RULES_SCRIPT = _value_rules_script()


def _emulated_capture(fn: Any, args: Any, kwargs: Any) -> tuple[bool, str]:
    """One call captured by the emulator, its guard as shipped: (held, the finding)."""
    from pytest_cudagraph.backends.emulate import EmulateBackend
    from pytest_cudagraph.guard import CaptureGuard, ModuleTracker

    tracker = ModuleTracker(nn.Module())
    found: list[Any] = []
    capture_guard = CaptureGuard(tracker, torch.device("cpu"), on_violation=found.append)
    with torch.no_grad():
        EmulateBackend(torch.device("cpu")).capture(lambda: fn(*args, **kwargs), capture_guard)
    return not found, "; ".join(v.describe() for v in found)


def test_the_value_rules_were_held_to_the_gpu_they_name() -> None:
    assert f"{PROBE['device']}, torch {PROBE['torch']}" == VALUE_RULES_SOURCE
    assert set(PROBE["calls"]) == set(VALUE_RULES_SCRIPT.CALLS), "re-run scripts/value_rules.py probe"
    answers = {r["captured"] for r in PROBE["calls"].values()}
    assert answers == {True, False}
    # Every ruled op was asked both ways.
    for op in ("equal", "isin", "linalg_lu_factor_ex", "linalg_lu", "one_hot", "segment_reduce"):
        asked = {r["captured"] for label, r in PROBE["calls"].items() if label.split()[0] == op}
        assert asked == {True, False}, op


@pytest.mark.parametrize("label", sorted(PROBE["calls"]))
def test_the_emulator_answers_each_value_rule_call_as_the_gpu_did(label: str) -> None:
    """The calls the H200 answered (isin's sizes, LU's shapes and batches, equal's shapes, one_hot's
    class count, segment_reduce's lengths): the emulator captures exactly those it captured."""
    gpu = PROBE["calls"][label]
    held, finding = _emulated_capture(*VALUE_RULES_SCRIPT.build(label, torch.device("cpu")))
    assert held == gpu["captured"], (
        f"{label}: the GPU {'held' if gpu['captured'] else 'refused'} it; {finding}"
    )
    if not held:
        assert "(held to NVIDIA H200" in finding or "one_hot(num_classes=-1)" in finding, finding


class _RuledOps(TorchDispatchMode):
    """What the value rules say of each op a call dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from pytest_cudagraph.capturability import value_rule

        verdict = value_rule(str(func), args, kwargs or {})
        if verdict is not None:
            self.kinds.append(verdict.kind)
        return func(*args, **(kwargs or {}))


@pytest.mark.cuda
def test_the_value_rules_answer_as_this_gpu_does() -> None:
    """On a GPU, whatever its torch: each call's raw capture against what the guard's rule says."""
    stream = torch.cuda.Stream()
    learning = VALUE_RULES_SCRIPT._learning_script()
    wrong = []
    for label in VALUE_RULES_SCRIPT.CALLS:
        if label.startswith("one_hot"):
            continue  # a composite op: its rule lives in the emulator's function mode
        fn, args, kwargs = VALUE_RULES_SCRIPT.build(label, torch.device("cuda"))
        with _RuledOps() as ops:
            fn(*args, **kwargs)
        seen = ops.kinds
        captured = VALUE_RULES_SCRIPT._captured_on_cuda(label, stream, learning)["captured"]
        if seen != [HELD if captured else REFUSED]:
            wrong.append((label, seen, captured))
    assert not wrong


def test_the_device_captures_fast_path_keeps_every_verdict_the_table_and_the_rules_give() -> None:
    # The guard on a device (meta stands in for CUDA: not the CPU) skips building the pattern of an
    # op whose table refuses nothing without a host tensor, when no argument is on the host: the
    # rules alone decide then. What the table refuses, what the rules refuse, what both hold.
    aten = torch.ops.aten
    found = guard.CaptureGuard(guard.ModuleTracker(nn.Identity()), torch.device("meta"))
    a = torch.empty(3, 3, device="meta")
    found.check_dispatch(aten.cholesky.default, (a,), {})  # refused by the table alone
    found.check_dispatch(aten.add.Tensor, (a, a), {})  # held
    found.check_dispatch(aten.mul.Tensor, (a, a.bool()), {})  # held, with a boolean operand
    found.check_dispatch(aten.nonzero.default, (a,), {})  # refused by the rules (and the table)
    found.check_dispatch(aten.add.Tensor, (a, torch.ones(3, 3)), {})  # a host tensor on the device's path
    ops = [v.op for v in found.violations]
    assert ops == ["aten.cholesky.default", "aten.nonzero.default", "aten.add.Tensor"], ops
    assert "learned on" in found.violations[0].reason
