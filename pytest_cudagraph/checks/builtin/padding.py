"""``padding_isolation``: real rows and state unchanged whatever padded rows hold."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ...plan import Batch, BatchDescriptor
from ...units import counted
from ..compare import first_difference
from ..registry import Check
from ..report import REASON_LIMIT, Outcome
from ..verify_context import VerifyContext, clone_tree
from .common import batch_norm_hint, finding_of, outside_hint, quantization_fix, where_of

# Finite fills are what padded rows hold in an engine: zeros, stale rows of an
# earlier batch, hidden states of pad tokens. NaN and inf are a strictness on
# top (nonfinite_padding=True): a causal attention block, correct under every
# finite padding, still turns 0 * NaN into NaN in P @ V.
_LARGE = 1.0e4  # a stale activation far from the real rows' scale, finite in fp16 and its squares in fp32


_FINITE_FILLS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("zeros", lambda t: t.zero_()),
    ("random values", lambda t: t.normal_()),
    ("large finite values", lambda t: t.fill_(_LARGE)),
]


_NONFINITE_FILLS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("NaN", lambda t: t.fill_(float("nan"))),
    ("inf", lambda t: t.fill_(float("inf"))),
]


# Integer rows (ids, positions, indices) of padding hold other valid values: the largest make_inputs
# gives at the descriptor's shape, or values drawn in its range there. A padded row a module counts,
# routes or indexes by shows.
_INT_FILLS: list[tuple[str, Callable[[torch.Tensor, int, int, torch.Generator], Any]]] = [
    ("the largest value make_inputs gives", lambda t, lo, hi, gen: t.fill_(hi)),
    (
        "other values within make_inputs' range",
        lambda t, lo, hi, gen: t.copy_(torch.randint(lo, hi + 1, t.shape, generator=gen)),
    ),
]


def _fill_plans(
    ctx: VerifyContext, desc: BatchDescriptor, batch: Batch
) -> tuple[list[tuple[str, str, Callable[[], None]]], list[str], list[str]]:
    """How padded rows are filled, one plan a run: (label, the inputs it fills, fill). The first is
    the base (floats zeroed, integers at their pad value); then each finite (and, when asked, each
    non-finite) floating fill, then each integer fill, integers with a declared pad value (whose
    padding is the module's semantics, a slot the engine reserves) left alone."""
    manager = ctx.manager
    views = manager.padding_views(desc, batch)
    floats = [(name, v) for name, v in views if v.is_floating_point()]
    declared = manager.declared_pads
    ranges = ctx.integer_ranges(desc)
    ints = [
        (name, v)
        for name, v in views
        if not v.is_floating_point()
        and v.dtype != torch.bool
        and name not in declared
        and ranges.get(name, (0, 0))[0] < ranges.get(name, (0, 0))[1]
    ]

    def zero_floats() -> None:
        for _, view in floats:
            view.zero_()

    plans: list[tuple[str, str, Callable[[], None]]] = [
        ("zeros" if floats else "their pad value", "", zero_floats)
    ]
    float_names = ", ".join(f"'{name}'" for name, _ in floats)
    for label, fill in _FINITE_FILLS[1:] + (_NONFINITE_FILLS if ctx.nonfinite_padding else []):
        if floats:
            plans.append((label, float_names, functools.partial(_fill_all, floats, fill)))
    gen = torch.Generator().manual_seed(ctx.seed + 104729)
    for label, int_fill in _INT_FILLS:
        for name, view in ints:
            lo, hi = ranges[name]
            plans.append(
                (label, f"'{name}'", functools.partial(_fill_int, zero_floats, view, int_fill, lo, hi, gen))
            )
    return plans, [name for name, _ in floats], [name for name, _ in ints]


def _fill_all(views: list[tuple[str, torch.Tensor]], fill: Callable[[torch.Tensor], Any]) -> None:
    for _, view in views:
        fill(view)


def _fill_int(
    zero_floats: Callable[[], None],
    view: torch.Tensor,
    fill: Callable[[torch.Tensor, int, int, torch.Generator], Any],
    lo: int,
    hi: int,
    gen: torch.Generator,
) -> None:
    zero_floats()
    drawn = torch.empty(view.shape, dtype=torch.int64)
    fill(drawn, lo, hi, gen)
    view.copy_(drawn.to(device=view.device, dtype=view.dtype))


# Why padding_isolation leaves an input's padded entries as they are at a batch, by cause: the words
# of the skip's reason, then of its detail; {names} the inputs, then the verb and pronoun that agree.
_UNFILLED: dict[str, tuple[str, str]] = {
    # The batch is padded (or the check had stopped before it): in the other count where not in this one.
    "tokens": ("{names} {has} a row per token", "{names} {has} a row per token, and no token is padded"),
    "reqs": ("{names} {has} a row per request", "{names} {has} a row per request, and no request is padded"),
    "fixed": ("{names} {does} not follow the batch", "{names} {does} not follow the batch (a fixed size)"),
    "multi": (
        "{names} {follows} the batch in several dimensions (a mask)",
        "{names} {follows} the batch in several dimensions (a square mask): {its} padded entries hold the "
        "value pad_values declares, which the module reads as meaning, so another fill is another program",
    ),
    "declared": (
        "pad_values declares the padding of {names}",
        "pad_values declares what padded rows of {names} hold: a slot the engine reserves, the module's meaning",
    ),
    "bool": (
        "{names} {is} boolean, kept at {its} pad value",
        "{names} {is} boolean: padded rows keep {its} pad value",
    ),
    "one_value": (
        "make_inputs gives {names} one value",
        "make_inputs gives {names} one value at this descriptor's shape, so no other value is known to be "
        "valid there (an index that stays an index)",
    ),
    "complex": ("{names} {is} complex", "{names} {is} complex, which no fill is made for"),
}
_MORE = "; {n}: the detail says why"
_PLURAL = {"has": "have", "does": "do", "follows": "follow", "is": "are", "its": "their"}


def _said(cause: str, names: list[str], *, long: bool = False, counted_only: bool = False) -> str:
    """``cause``'s words for ``names`` (the detail's where ``long``): each named, or (``counted_only``) how many."""
    many = len(names) > 1
    if counted_only:
        who = counted(len(names), "input")
    else:
        quoted = [repr(n) for n in names]
        who = quoted[0] if not many else f"{', '.join(quoted[:-1])} and {quoted[-1]}"
    words = _UNFILLED[cause][1 if long else 0]
    return words.format(names=who, **{w: _PLURAL[w] if many else w for w in _PLURAL})


def _unfilled(
    ctx: VerifyContext, desc: BatchDescriptor, batch: Batch, inputs: dict[str, Any]
) -> dict[str, list[str]]:
    """cause -> the tensor inputs padding_isolation leaves as they are at ``batch`` under ``desc``,
    for that cause (``_fill_plans`` fills every other; this says why not, input by input)."""
    manager = ctx.manager
    specs = manager.input_specs
    padded = {name for name, _ in manager.padding_views(desc, batch)}
    declared = manager.declared_pads
    causes: dict[str, list[str]] = {}
    for name, value in inputs.items():
        spec = specs.get(name)
        if not isinstance(value, torch.Tensor) or spec is None or spec.is_python:
            continue
        cause: str
        if spec.kind in ("tokens", "reqs") and name not in padded:
            cause = spec.kind
        elif spec.kind not in ("tokens", "reqs"):
            cause = "multi" if spec.kind == "multi" else "fixed"
        elif name in declared:
            cause = "declared"
        elif value.dtype == torch.bool:
            cause = "bool"
        elif value.is_complex():
            cause = "complex"
        else:  # an integer input make_inputs gives one value at the descriptor's shape
            cause = "one_value"
        causes.setdefault(cause, []).append(name)
    return causes


def _nothing_to_fill(
    ctx: VerifyContext, desc: BatchDescriptor, batch: Batch, inputs: dict[str, Any]
) -> tuple[str, str]:
    """The skip's (reason, detail) where no input has padded rows that can hold other values at this
    descriptor's most padded real batch: what is padded there, and what each input is that leaves it
    out, in the words that are true for it (a row per the count not padded, a declared pad value,
    one value from make_inputs)."""
    reqs = ctx.manager.capture_reqs(desc)
    padded = [
        f"{what} ({real} of {rows})"
        for what, real, rows in (
            ("tokens", batch.num_tokens, desc.num_tokens),
            ("requests", batch.num_reqs, reqs),
        )
        if real < rows
    ]
    lead = (
        f"only {padded[0]} are padded here" if len(padded) == 1 else f"{' and '.join(padded)} are padded here"
    )
    causes = _unfilled(ctx, desc, batch, inputs)
    if not causes:
        reason = f"no padded row to fill: {lead}, and no input is a tensor"
        return reason, ""
    # Each cause with its inputs named (else counted) while it fits, room left for the count of the
    # inputs after it; the detail names them all.
    reason = f"no padded row to fill: {lead}"
    told = 0
    for i, (cause, names) in enumerate(causes.items()):
        room = REASON_LIMIT - (len(_MORE.format(n="99 more inputs")) if i + 1 < len(causes) else 0)
        said = f"{reason}; {_said(cause, names)}"
        if len(said) > room:
            said = f"{reason}; {_said(cause, names, counted_only=True)}"
        if len(said) > room:
            break
        reason, told = said, told + len(names)
    others = sum(len(names) for names in causes.values()) - told
    if others:
        reason += _MORE.format(n=counted(others, "more input" if told else "input"))
    detail = (
        "padding_isolation fills padded rows with other values (floating inputs: random and large ones; "
        "integer inputs: the largest make_inputs gives, then others in its range) and holds real rows and "
        f"state unchanged; in this descriptor's most padded real batch (num_tokens={batch.num_tokens} of "
        f"{desc.num_tokens}, num_reqs={batch.num_reqs} of {reqs}) no input has padded rows it can fill: "
        + "; ".join(_said(c, names, long=True) for c, names in causes.items())
    )
    return reason, detail


_STATE_FIX = (
    "mask the write, so that a padded row leaves the state as it was: select the written values "
    "with torch.where(is_padding, old, new), or give padded rows a zero weight in the update (an "
    "index_add_/scatter_add_ of zeros), or send them to a scratch slot named in scratch_state"
)


def _leak_fix(label: str) -> str:
    """How to fix padding that reaches real rows, for the fill that showed it."""
    if label in dict(_NONFINITE_FILLS):
        return (
            "mask by selection, not by multiplication: torch.where(is_padding[:, None], 0.0, x) "
            "before anything mixes rows (0 * NaN is NaN, a selection never reads the padded value)"
        )
    if label in dict(_INT_FILLS):
        return (
            "mask the padded rows before anything counts, routes or gathers by them (torch.where on "
            "is_padding, or a pad id declared in pad_values that the module ignores)"
        )
    return (
        "mask the padded rows before anything mixes rows (torch.where(is_padding[:, None], 0.0, x) "
        "before a sum, mean or pooling; -inf for padded keys in attention scores), or keep statistics per "
        "row/token instead of over the batch"
    )


def padding_isolation(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    batch = ctx.padded_batch(desc)
    manager = ctx.manager
    if batch is None or (
        batch.num_tokens == desc.num_tokens and batch.num_reqs == manager.capture_reqs(desc)
    ):
        return Outcome(
            "padding_isolation",
            desc,
            True,
            skipped=True,
            message="no real batch of this descriptor leaves padded rows",
        )
    plans, floats, ints = _fill_plans(ctx, desc, batch)
    # real_batches' run of this batch is the base (floats at zero, integers at their pad value) where
    # it ran the graph on fresh_inputs' inputs with every floating input padded with zeros: the
    # same replay of the same inputs, state and seed (ctx.padding_base says when it is kept).
    declared = manager.declared_pads
    base = ctx.padding_base.pop(desc, None)
    if base is not None and (base[0] != batch or any(declared.get(name, 0) != 0 for name in floats)):
        base = None
    inputs = base[1] if base is not None else ctx.make(batch)
    if len(plans) == 1:
        reason, detail = _nothing_to_fill(ctx, desc, batch, inputs)
        return Outcome("padding_isolation", desc, True, reason, skipped=True, detail=detail)
    results: list[tuple[str, str, Any, dict[str, torch.Tensor]]] = []
    with ctx.preserved_state() as state0:
        for label, filled, fill in plans:
            if base is not None and not results:
                results.append((label, filled, base[2], ctx.snapshot()))
                continue
            ctx.restore(state0)
            manager.load_inputs(desc, inputs, batch)
            with torch.no_grad():
                fill()
            ctx.seed_all(ctx.seed)
            manager.replay(desc)
            manager.synchronize()
            out = clone_tree(manager.real_rows(desc, batch))
            results.append((label, filled, out, ctx.snapshot()))
    base_label, _, base_out, base_state = results[0]
    for label, filled, out, state in results[1:]:
        strict = (
            ""
            if label not in dict(_NONFINITE_FILLS)
            else (
                " (found by nonfinite_padding=True, a strictness beyond engines, which pad with finite values: "
                "every finite padding tried left the real rows unchanged; typically 0 * NaN where a weight is 0)"
            )
        )
        instead = "their pad value" if label in dict(_INT_FILLS) else base_label
        diff = first_difference(out, base_out)
        if diff is not None:
            finding = finding_of(diff, batch)
            # Both values are the graph's: with padded rows holding this fill, and holding the base's.
            finding.sides = (
                f"the graph with padded rows of {label}",
                f"the graph with padded rows of {instead}",
            )
            quantized = quantization_fix(ctx)
            finding.fix = quantized or _leak_fix(label)
            return Outcome(
                "padding_isolation",
                desc,
                False,
                f"real rows change when padded rows of {filled} hold {label} instead of {instead}: padding "
                f"leaks into real rows ({where_of(diff)}){strict}{batch_norm_hint(ctx)}"
                f"{outside_hint(ctx, desc)}"
                + (
                    f"; the forward quantizes to {' and '.join(ctx.observer.quantized)} (fix below)"
                    if quantized
                    else ""
                ),
                finding,
                figures={"fill": label, "nonfinite": bool(strict)},
            )
        diff = ctx.state_difference(state, base_state, use_scratch=True)
        if diff is not None:
            written = finding_of(diff, batch)
            written.fix = _STATE_FIX
            return Outcome(
                "padding_isolation",
                desc,
                False,
                f"module state '{diff.path}' changes when padded rows of {filled} hold {label} instead of "
                f"{instead}: padded rows write into state (mask them out through is_padding, or route them to a "
                f"scratch slot and name it in scratch_state){strict}",
                written,
                figures={"fill": label, "nonfinite": bool(strict)},
            )
    return Outcome(
        "padding_isolation",
        desc,
        True,
        figures={
            "fills": [label for label, _, _, _ in results],
            "floating": floats,
            "integer": ints,
            "base": "real_batches' run" if base is not None else "its own replay",
        },
    )


PADDING_ISOLATION = Check(
    "padding_isolation",
    padding_isolation,
    compares="real-row outputs and module state are identical whether padded rows of floating inputs hold "
    "zeros, random values or large finite values, as padded rows of an engine do (stale rows, "
    "hidden states of pad tokens); with `nonfinite_padding=True` (marker keyword, "
    "`--cudagraph-nonfinite-padding`, ini `cudagraph_nonfinite_padding`) also NaN and inf, a "
    "strictness whose failures say so. Padded rows of integer inputs (ids, positions, indices) hold "
    "the largest value `make_inputs` gives, then other values in its range; inputs whose padding "
    "is declared semantics in `pad_values` (a reserved slot, a square mask) are not filled",
    catches="attention that reads padded keys (bidirectional over the padded sequence), pooling over padded "
    "rows, batch statistics (a BatchNorm in train mode is named), a quantization scale over the whole batch "
    "(told to quantize per token), padded rows writing into state "
    "(an expert load counted by the pad id; allow a scratch region with `scratch_state`); strict: "
    "masking by multiplication (`0 * NaN = NaN`)",
    applies="no real batch of the descriptor leaves padded rows; no input has padded rows that can hold "
    "other values",
)
