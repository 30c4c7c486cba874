"""The built-in checks' code (``builtin.py`` registers each with its description). Each takes the
context and a descriptor and returns an ``Outcome``.

Every check restores the module's state when it is done, so the checks do
not disturb one another and a graph-safe counter buffer passes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import faults
from ..context import running
from ..guard import ModuleTracker, Violation, find_violations
from ..observe import MODULE_INTERNALS
from ..plan import Batch, BatchDescriptor, GraphMode
from .compare import Difference, first_difference, leaves
from .divergence import locate_divergence
from .floor import Verdict, across_shapes
from .report import Finding, Outcome
from .verify_context import Snapshot, VerifyContext, clone_tree, python_values

__all__ = [
    "address_stability",
    "attributes_restored",
    "capture_safety",
    "drawn_value",
    "finding_of",
    "output_lifetime",
    "record_addresses",
    "tensor_attributes",
    "where_of",
]

# The seams other layers build their checks with (runner/'s checks): where a difference is
# (``finding_of``, ``where_of``) and fresh values for an input (``drawn_value``).


def finding_of(
    diff: Difference, batch: Batch | None = None, submodule: str | None = None, segment: str | None = None
) -> Finding:
    return Finding(
        output=diff.path,
        index=diff.index,
        got=diff.got,
        expected=diff.expected,
        real_batch=batch.shape() if batch is not None else None,
        submodule=submodule,
        segment=segment,
        max_abs=diff.max_abs,
        max_ulp=diff.max_ulp,
    )


def where_of(diff: Difference) -> str:
    path = diff.path or "the output"
    return f"{path}: {diff.reason}"


def batch_norm_hint(ctx: VerifyContext) -> str:
    """Why padded rows reach real ones when a BatchNorm is in train mode (the module is verified as it is)."""
    names = [
        name
        for name, m in ctx.module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if not names:
        return ""
    return (
        f". '{names[0] or type(ctx.module).__name__}' is a BatchNorm in train mode: it normalises with the "
        "statistics of the whole batch, padded rows included (call module.eval() to verify inference)"
    )


# -- before capture -------------------------------------------------------
def capture_safety(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> list[Outcome]:
    """Run each descriptor's shape eagerly under the guard and list every op a graph cannot hold."""
    outcomes = []
    manager = ctx.manager
    tracker = ModuleTracker(ctx.module)
    for desc in descs:
        reqs = manager.capture_reqs(desc)
        batch = ctx.exact_batch(desc)
        with ctx.preserved_state() as state0:

            def run(first_only: bool, desc: BatchDescriptor = desc, batch: Batch = batch) -> list[Violation]:
                kwargs = ctx.load(desc, ctx.make(batch), batch)

                def forward() -> None:
                    with ctx.phase("eager", desc), torch.no_grad(), running(desc):
                        ctx.module(**kwargs)

                return find_violations(
                    forward,
                    tracker,
                    manager.device,
                    exempt=manager.eager_modules(desc),
                    first_only=first_only,
                )

            try:
                violations = run(first_only=False)
            except Exception as exc:
                if faults.is_sticky(exc):
                    raise  # the process's CUDA context is gone: verify tells it, no check can go on
                finding = Finding(submodule=tracker.failed_path)
                why = (
                    f"the module fails eagerly at this shape (tokens={desc.num_tokens}, reqs={reqs}): "
                    f"{faults.described(exc, manager.device)}"
                )
                # Every op ran, so the op that failed may be one a graph cannot hold (on a GPU, a CPU
                # tensor as a device op's operand fails eagerly too): run again from the same state,
                # stopping before the first such op, to name it.
                ctx.restore(state0)
                try:
                    met = run(first_only=True)
                except Exception as again:
                    if faults.is_sticky(again):
                        raise
                    met = []  # no such op before it fails: the failure is eager's own
                if met:
                    why += f"; on its way it meets an op a graph cannot hold: {met[0].describe()}"
                    finding = Finding(submodule=met[0].module_path, ops=[met[0].describe()])
                outcomes.append(Outcome("capture_safety", desc, False, why, finding))
                continue
        if violations:
            first = violations[0]
            outcomes.append(
                Outcome(
                    "capture_safety",
                    desc,
                    False,
                    f"{len(violations)} op(s) cannot be captured in a graph; the first is {first.describe()}",
                    Finding(submodule=first.module_path, ops=[v.describe() for v in violations]),
                )
            )
        else:
            outcomes.append(Outcome("capture_safety", desc, True))
    return outcomes


# -- replay against eager ---------------------------------------------------
def _compare_padded(
    ctx: VerifyContext, desc: BatchDescriptor, batch: Batch, inputs: dict[str, Any], check: str, fresh: bool
) -> Outcome:
    with ctx.preserved_state() as state0:
        padded = ctx.load(desc, inputs, batch)
        ctx.seed_all(ctx.seed)
        graph = ctx.replay(desc)
        ctx.restore(state0)
        before = python_values(ctx.module)
        ctx.seed_all(ctx.seed)
        eager = ctx.eager(padded, desc)
        after = python_values(ctx.module)
        if not fresh:
            # The state check compares run() with this very eager run at the captured shape: kept
            # for it (the inputs as eager left them, the state it started from and the state it
            # left) until the descriptor is done.
            ctx.exact_eager[desc] = (padded, state0, ctx.snapshot())
        diff = first_difference(graph, eager, check_strides=True)
        if (
            diff is None
            and not fresh
            and not any(isinstance(leaf, torch.Tensor) for _, leaf in leaves(eager))
        ):
            return _nothing_to_compare(check, desc, eager, batch)  # told once, by replay_matches_eager
        if diff is None:
            return Outcome(check, desc, True, figures={"real_batch": batch.shape()})
        if diff.opaque:
            return _opaque_output(check, desc, diff, batch)
        changed = [k for k in after if before.get(k, object()) != after[k]]
        if changed:
            name = changed[0]
            return Outcome(
                check,
                desc,
                False,
                f"Python state changes on every forward ({name}: {before.get(name)!r} -> {after[name]!r}), "
                f"but a graph runs Python only at capture, so replay keeps the capture-time value "
                f"({where_of(diff)}); keep such state in a registered buffer updated in place",
                finding_of(diff, batch),
            )
        uninitialized = ctx.uninitialized()
        if uninitialized:
            return Outcome(check, desc, False, f"{uninitialized} ({where_of(diff)})", finding_of(diff, batch))
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        again = ctx.eager(padded, desc)
        if first_difference(again, eager) is not None:
            return Outcome(
                check,
                desc,
                False,
                "eager differs from itself on the same inputs, state and seed: the module is nondeterministic "
                "(state outside registered buffers, or nondeterministic kernels), so replay cannot be compared "
                "bit for bit",
                finding_of(diff, batch),
            )
    submodule, segment = locate_divergence(ctx, desc, inputs, batch, against_real=False)
    what = (
        "with fresh inputs after capture, replay differs from eager: values or tensors computed at capture "
        "were frozen into the graph"
        if fresh
        else "replay differs from eager on the inputs the graph was captured with"
    )
    return Outcome(
        check, desc, False, f"{what} ({where_of(diff)})", finding_of(diff, batch, submodule, segment)
    )


def _nothing_to_compare(check: str, desc: BatchDescriptor, output: Any, batch: Batch) -> Outcome:
    what = "None" if output is None else f"a {type(output).__name__} with no tensor in it"
    return Outcome(
        check,
        desc,
        False,
        f"forward returned {what}: there is nothing to compare between replay and eager, so no check can "
        "tell whether the graph is right. Return the output tensor(s) from forward (a module that writes "
        "its result into a buffer: return that buffer)",
        Finding(output="the output", real_batch=batch.shape()),
    )


def _opaque_output(check: str, desc: BatchDescriptor, diff: Difference, batch: Batch) -> Outcome:
    return Outcome(
        check,
        desc,
        False,
        f"forward returns {diff.reason} at {diff.path or 'the output'}: a graph runs Python only at capture, so "
        "every replay hands back the object made then, holding graph memory of the capture's shape. Return "
        "tensors instead (a transformers model: use_cache=False, or a static cache passed in)",
        Finding(output=diff.path, real_batch=batch.shape()),
    )


def replay_matches_eager(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    # Exactly the inputs the graph was captured on: the graph must reproduce
    # eager there before anything else can be trusted.
    batch = ctx.exact_batch(desc)
    return _compare_padded(
        ctx, desc, batch, ctx.manager.capture_sample(desc), "replay_matches_eager", fresh=False
    )


def drawn_value(value: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fresh floating values in ``value``'s observed range (around it, when it holds one value)."""
    finite = value[torch.isfinite(value)].float()
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    if lo == hi:
        half = max(abs(lo), 1.0) / 2
        lo, hi = lo - half, lo + half
    drawn = torch.rand(value.shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo
    return drawn.to(dtype=value.dtype, device=value.device)


def _permuted_rows(
    value: torch.Tensor, dim: int, gen: torch.Generator, observed: tuple[int, int]
) -> tuple[torch.Tensor, str]:
    """``value``'s rows along ``dim`` in another order; if that changes nothing, integers drawn in the
    ``observed`` range (what make_inputs gives at the largest shape, so an index stays a valid index).
    With what was done ("" when nothing could change)."""
    n = value.shape[dim]
    if n > 1:
        perm = torch.randperm(n, generator=gen)
        if torch.equal(perm, torch.arange(n)):  # never the identity
            perm = perm.roll(1)
        permuted = value.index_select(dim, perm.to(value.device))
        if not torch.equal(permuted, value):
            return permuted, "rows permuted"
    lo, hi = observed
    if value.dtype == torch.bool or lo == hi:
        return value, ""  # one value: any other may be out of range
    drawn = torch.randint(lo, hi + 1, value.shape, generator=gen, dtype=torch.int64)
    if torch.equal(drawn.to(value.device), value.long()):
        drawn = torch.where(drawn == lo, hi, lo)
    return drawn.to(dtype=value.dtype, device=value.device), f"drawn in [{lo}, {hi}]"


def _observed_ranges(ctx: VerifyContext, names: list[str]) -> dict[str, tuple[int, int]]:
    """(min, max) of each integer input at the largest shape make_inputs is asked for."""
    manager = ctx.manager
    largest = ctx.make(Batch(num_tokens=manager.max_tokens, num_reqs=manager.max_reqs))
    ranges = {}
    for name in names:
        value = largest.get(name)
        if isinstance(value, torch.Tensor) and value.numel() and value.dtype != torch.bool:
            ranges[name] = (int(value.min()), int(value.max()))
        else:
            ranges[name] = (0, 0)
    return ranges


def drawn_inputs(ctx: VerifyContext, inputs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Inputs the harness draws where ``make_inputs`` gives the same values every call, and what it changed.

    Floating inputs get fresh values in their observed range. Only where there
    are none are integer inputs changed, and only within what make_inputs
    gives: rows permuted along the batch, else integers drawn in the range
    make_inputs gives at the largest shape, so an index stays a valid index.
    ("", unchanged) when nothing can change.
    """
    gen = torch.Generator().manual_seed(ctx.seed + 7919)
    specs = ctx.manager.input_specs
    tensors = {
        name: v
        for name, v in inputs.items()
        if isinstance(v, torch.Tensor) and v.numel() and getattr(specs.get(name), "kind", "") != "const"
    }
    drawn = dict(inputs)
    floats = [name for name, v in tensors.items() if v.is_floating_point()]
    for name in floats:
        drawn[name] = drawn_value(tensors[name], gen)
    if floats:
        return drawn, f"fresh floating values in {', '.join(repr(n) for n in floats)}"
    changed = []
    observed = _observed_ranges(ctx, list(tensors))
    for name, value in tensors.items():
        spec = specs.get(name)
        dims = getattr(spec, "dims", ())
        new, how = _permuted_rows(value, dims[0][0] if dims else 0, gen, observed[name])
        if how:
            drawn[name] = new
            changed.append(f"integers of {name!r} {how}")
    return drawn, ", ".join(changed)


_RETURN_FRESH = "Return fresh values from make_inputs (draw them from torch's generator)"


def fresh_inputs(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    """After capture, new inputs give replay equal to eager (values frozen at capture show here)."""
    batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
    first = ctx.make(batch)
    second = ctx.make(batch)
    made = ""
    if first_difference(first, second) is None:
        # make_inputs is deterministic (torch.ones, arange): the harness draws
        # the fresh inputs itself rather than leave the check undone.
        second, made = drawn_inputs(ctx, second)
        if not made:
            return Outcome(
                "fresh_inputs",
                desc,
                False,
                "the check could not run: make_inputs returns the same values on every call, and no input "
                "can be given other values by the harness (no floating input; integer inputs hold one value "
                f"each). {_RETURN_FRESH}",
                Finding(real_batch=batch.shape()),
            )
    # Replay once on one new set, then check a second one.
    with ctx.preserved_state():
        ctx.load(desc, first, batch)
        ctx.replay(desc)
    try:
        outcome = _compare_padded(ctx, desc, batch, second, "fresh_inputs", fresh=True)
    except Exception as exc:
        if not made:
            raise
        return Outcome(
            "fresh_inputs",
            desc,
            False,
            f"the check could not run: make_inputs returns the same values on every call, and on the inputs "
            f"the harness drew instead ({made}) the module raised {type(exc).__name__}: {exc}. {_RETURN_FRESH}",
            Finding(real_batch=batch.shape()),
        )
    if made:
        outcome.figures["harness_inputs"] = made
        if not outcome.passed:
            outcome.message += (
                f" [make_inputs returns the same values on every call, so the harness drew "
                f"these inputs: {made}]"
            )
    return outcome


# -- real batches ------------------------------------------------------------
def real_batches(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    """Every real batch the descriptor serves: real rows against eager at the graph's padded shape
    bit for bit, the rest left to ``padded_size``'s float64 reference; where the module cannot run in
    float64, against eager on the unpadded batch within the measured floor (``checks/floor.py``), or
    bit for bit with ``batch_invariant``."""
    batches = ctx.checked_batches(desc)
    if not batches:
        return Outcome(
            "real_batches",
            desc,
            True,
            skipped=True,
            message="no real batch dispatches to this descriptor"
            if ctx.given_batches is None
            else "no batch of the trace (the given batches) dispatches to this descriptor",
        )
    if ctx.module_is_random(desc):
        return Outcome(
            "real_batches",
            desc,
            True,
            skipped=True,
            message="the module draws random numbers, which cannot match unpadded eager draw for "
            "draw (the rng check covers them)",
        )
    reference = ctx.reference if ctx.reference is not None and ctx.reference.ready else None
    rows = ctx.rows_ndim(desc)
    totals: dict[str, Any] = {"batches": len(batches), "max_abs": 0.0, "floor_measured": 0, "floor_max": 0.0}
    if reference is not None:
        totals["reference"] = "padded_size"
    for i, batch in enumerate(batches):
        # make_inputs first, then the snapshot, as every check does: a make_inputs that updates the
        # module (a weight sync between batches) is part of the state both runs start from.
        inputs = ctx.make(batch)
        with ctx.preserved_state() as state0:
            ctx.seed_all(ctx.seed)
            got = ctx.run(clone_tree(inputs), batch)
            ctx.restore(state0)
            ctx.seed_all(ctx.seed)
            if reference is not None:
                # The same program as the graph: eager on the inputs the graph read, padding included,
                # queued for the reference before eager runs (a forward may write its inputs in place).
                padded_inputs = ctx.load(desc, clone_tree(inputs), batch)
                reference.queue(
                    desc, batch, inputs, padded_inputs, ctx.manager.output_dims(desc), first=i == 0
                )
                at_padded = ctx.manager.cut_output(desc, ctx.eager(padded_inputs, desc), batch)
                diff = first_difference(got, at_padded)
                verdict = Verdict(
                    diff is None, diff, "" if diff is None else _not_the_program(ctx, desc, diff)
                )
                if verdict.passed:
                    continue
                return _real_batch_failure(ctx, desc, batch, inputs, verdict, totals, against_real=False)
            # As users run the module without graphs: a capture-only path
            # (code that asks whether it is captured) is held to eager too.
            expected = ctx.eager_real(clone_tree(inputs), batch, captured_path=False)
            if ctx.batch_invariant:
                diff = first_difference(got, expected)
                verdict = Verdict(
                    diff is None,
                    diff,
                    ""
                    if diff is None
                    else f"real rows differ from eager on the unpadded batch bit for bit "
                    f"(batch_invariant) ({where_of(diff)})",
                )
            else:

                def padded(
                    state0: dict[str, torch.Tensor] = state0,
                    inputs: dict[str, Any] = inputs,
                    batch: Batch = batch,
                ) -> Any:
                    ctx.restore(state0)
                    ctx.seed_all(ctx.seed)
                    return ctx.eager_padded(desc, clone_tree(inputs), batch)

                verdict = across_shapes(
                    got, expected, padded, rtol=ctx.rtol, atol=ctx.atol, roundoff=ctx.roundoff, rows_ndim=rows
                )
        _tally(totals, verdict)
        if verdict.passed:
            continue
        cause = _capture_path(
            ctx, inputs, batch, state0, got, expected, None if ctx.batch_invariant else padded, rows
        )
        if cause:
            verdict.why = f"{cause}. What the check saw: {verdict.why}"
        return _real_batch_failure(ctx, desc, batch, inputs, verdict, totals, against_real=True)
    return Outcome("real_batches", desc, True, figures=totals)


def _not_the_program(ctx: VerifyContext, desc: BatchDescriptor, diff: Difference) -> str:
    """Why the graph's real rows differ from eager on the very inputs it read (padding included)."""
    return (
        f"the graph's real rows differ from eager at its padded shape on the inputs the graph read, padding "
        f"included ({where_of(diff)}): the same program at the same shape, so they must agree bit for bit. "
        "Either the graph runs something else than eager on these inputs (state or values frozen at capture: "
        "fresh_inputs and replay_matches_eager say more), or eager is not reproducible (determinism says so)"
    )


def _real_batch_failure(
    ctx: VerifyContext,
    desc: BatchDescriptor,
    batch: Batch,
    inputs: dict[str, Any],
    verdict: Verdict,
    totals: dict[str, Any],
    *,
    against_real: bool,
) -> Outcome:
    diff = verdict.diff
    if diff is not None and diff.opaque:
        return _opaque_output("real_batches", desc, diff, batch)
    submodule, segment = (
        locate_divergence(ctx, desc, inputs, batch, against_real=against_real)
        if diff is not None and diff.index is not None
        else (None, None)
    )
    finding = (
        finding_of(diff, batch, submodule, segment) if diff is not None else Finding(real_batch=batch.shape())
    )
    return Outcome(
        "real_batches",
        desc,
        False,
        f"{verdict.why}{batch_norm_hint(ctx)}{python_hint(ctx)}",
        finding,
        figures={**totals, **verdict.figures},
    )


def _capture_path(
    ctx: VerifyContext,
    inputs: dict[str, Any],
    batch: Batch,
    state0: Snapshot,
    got: Any,
    expected: Any,
    padded: Callable[[], Any] | None,
    rows: list[int],
) -> str:
    """Why real rows differ when the module computes something else under capture: on the unpadded
    batch itself, eager on its capture path differs from eager as users run it, and the graph agrees
    with the capture path where it disagreed with users' eager (``""`` otherwise: then the padding,
    not the path, is the likelier cause).

    The second half matters at real size: transformers asks whether it is captured and builds its
    attention mask another way, another kernel runs, and over 32 bf16 layers the two paths differ
    by more than the tolerance in rounding alone (a Llama-8B shape on an H200). A failure the path
    does not explain (a scale at the padded shape) is then named for what it is, not for the path.
    """
    # ``expected``, eager as users run it, the check ran already from the same state and seed.
    ctx.restore(state0)
    ctx.seed_all(ctx.seed)
    on_path = ctx.eager_real(clone_tree(inputs), batch, captured_path=True)
    ctx.restore(state0)
    diff = first_difference(on_path, expected, rtol=ctx.rtol, atol=ctx.atol)
    if diff is None:
        return ""
    if padded is None:  # batch_invariant: bit for bit, the graph against the capture path
        explained = first_difference(got, on_path) is None
    else:
        explained = across_shapes(
            got, on_path, padded, rtol=ctx.rtol, atol=ctx.atol, roundoff=ctx.roundoff, rows_ndim=rows
        ).passed
    ctx.restore(state0)
    if not explained:
        return ""
    return (
        "the module computes something else when it is captured: on the unpadded batch itself, eager on its "
        "capture path (torch.cuda.is_current_stream_capturing() answering True) differs from eager as users "
        f"run it ({where_of(diff)}), and the graph agrees with the capture path. Look for a branch on "
        "capturing, or state kept for captures (metadata planned per request count or per token count, "
        "shared by graphs of several query lengths)"
    )


def python_hint(ctx: VerifyContext) -> str:
    """Where forwards change Python state, that is the likelier cause of a difference than the padding."""
    if not ctx.python_written:
        return ""
    return (
        f". Forward changes Python state ({', '.join(ctx.python_written[:3])}) on every call, which a graph "
        "freezes at capture: replay_matches_eager names it"
    )


def _tally(totals: dict[str, Any], verdict: Verdict) -> None:
    """The worst figures over a descriptor's real batches, for the report."""
    figures = verdict.figures
    totals["max_abs"] = max(totals["max_abs"], figures.get("max_abs", 0.0))
    if verdict.floor_used:
        totals["floor_measured"] += 1
        for leaf in figures.values():
            if isinstance(leaf, dict):
                totals["max_abs"] = max(totals["max_abs"], leaf.get("graph_max", 0.0))
                totals["floor_max"] = max(totals["floor_max"], leaf.get("floor_max", 0.0))


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
    if len(plans) == 1:
        return Outcome(
            "padding_isolation",
            desc,
            True,
            skipped=True,
            message="no input has padded rows that can hold other values (no floating input; integer "
            "inputs hold one value each, or their pad value is declared in pad_values)",
        )
    inputs = ctx.make(batch)
    results: list[tuple[str, str, Any, dict[str, torch.Tensor]]] = []
    with ctx.preserved_state() as state0:
        for label, filled, fill in plans:
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
            return Outcome(
                "padding_isolation",
                desc,
                False,
                f"real rows change when padded rows of {filled} hold {label} instead of {instead}: padding "
                f"leaks into real rows ({where_of(diff)}){strict}{batch_norm_hint(ctx)}",
                finding_of(diff, batch),
                figures={"fill": label, "nonfinite": bool(strict)},
            )
        diff = ctx.state_difference(state, base_state, use_scratch=True)
        if diff is not None:
            return Outcome(
                "padding_isolation",
                desc,
                False,
                f"module state '{diff.path}' changes when padded rows of {filled} hold {label} instead of "
                f"{instead}: padded rows write into state (mask them out through is_padding, or route them to a "
                f"scratch slot and name it in scratch_state){strict}",
                finding_of(diff, batch),
                figures={"fill": label, "nonfinite": bool(strict)},
            )
    return Outcome(
        "padding_isolation",
        desc,
        True,
        figures={"fills": [label for label, _, _, _ in results], "floating": floats, "integer": ints},
    )


# -- side outputs --------------------------------------------------------------
def tensor_attributes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Plain tensor attributes of the module tree (not parameters or buffers), by dotted name."""
    found: dict[str, torch.Tensor] = {}
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr not in MODULE_INTERNALS and isinstance(value, torch.Tensor):
                found[f"{path}.{attr}" if path else attr] = value
    return found


def _set_attribute(module: torch.nn.Module, dotted: str, value: Any) -> None:
    path, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(path) if path else module
    if value is None:
        owner.__dict__.pop(attr, None)
    else:
        owner.__dict__[attr] = value


@contextlib.contextmanager
def attributes_restored(module: torch.nn.Module) -> Iterator[None]:
    """Put the module tree's tensor attributes back (the objects themselves) when the block ends."""
    saved = tensor_attributes(module)
    try:
        yield
    finally:
        now = tensor_attributes(module)
        for name in set(saved) | set(now):
            if saved.get(name) is not now.get(name):
                _set_attribute(module, name, saved.get(name))


def _rebound_attributes(ctx: VerifyContext, desc: BatchDescriptor) -> list[str]:
    """Tensor attributes that forward binds to a new tensor on every call (two eager calls, once a
    verification, at the first descriptor's captured shape: one the device has run already)."""
    if ctx.rebound_attributes is None:
        batch = ctx.exact_batch(desc)
        inputs = ctx.make(batch)
        module = ctx.module
        with ctx.preserved_state() as state0, attributes_restored(module):
            seen = [tensor_attributes(module)]
            for _ in range(2):
                ctx.restore(state0)
                ctx.seed_all(ctx.seed)
                ctx.eager_real(clone_tree(inputs), batch)
                seen.append(tensor_attributes(module))
        before, first, second = seen
        ctx.rebound_attributes = [
            name
            for name, value in second.items()
            if first.get(name) is not value and before.get(name) is not first.get(name)
        ]
    return ctx.rebound_attributes


def _shape(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "nothing"


def side_outputs(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    """A tensor that forward stores on the module (``self.hidden = h``) is stale after replay.

    Python runs only at capture: after a replay the attribute still holds the
    tensor stored while capturing, padded to the capture size and in graph
    memory that later replays overwrite. Compared with what eager leaves there
    for the same real batch, with the attributes as capture left them.
    """
    rebound = _rebound_attributes(ctx, desc)
    if not rebound:
        return Outcome("side_outputs", desc, True, figures={"rebound_attributes": 0})
    batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
    inputs = ctx.make(batch)
    module = ctx.module
    with ctx.preserved_state() as state0, attributes_restored(module):
        ctx.seed_all(ctx.seed)
        ctx.eager_real(clone_tree(inputs), batch)
        attrs = tensor_attributes(module)
        expected = {name: clone_tree(attrs.get(name)) for name in rebound}
        # As a serving loop has them: what the last capture stored.
        for name in rebound:
            _set_attribute(module, name, ctx.captured_attributes.get(name))
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        ctx.run(clone_tree(inputs), batch)
        ctx.manager.synchronize()
        attrs = tensor_attributes(module)
        got = {name: clone_tree(attrs.get(name)) for name in rebound}
    for name in rebound:
        # Within tolerance: the attribute is compared with unpadded eager.
        diff = first_difference(got[name], expected[name], rtol=ctx.rtol, atol=ctx.atol)
        if diff is None:
            continue
        diff.path = f"module attribute '{name}'"
        return Outcome(
            "side_outputs",
            desc,
            False,
            f"forward stores a new tensor in the plain attribute '{name}' on every call, but a graph runs "
            f"Python only at capture: after replay '{name}' still holds the tensor stored at capture "
            f"({_shape(got[name])}, in graph memory that later replays overwrite) where eager leaves "
            f"{_shape(expected[name])}{'' if diff.reason.startswith('shape') else f' ({diff.reason})'}. "
            f"Return it from forward, or copy it into a "
            f"registered buffer in place (self.{name.rpartition('.')[2]}.copy_(...))",
            finding_of(diff, batch),
            figures={"rebound_attributes": len(rebound)},
        )
    return Outcome("side_outputs", desc, True, figures={"rebound_attributes": len(rebound)})


# -- state, determinism, lifetime, rng ------------------------------------------
def state(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    batch = ctx.exact_batch(desc)
    kept = ctx.exact_eager.pop(desc, None)
    # The eager side: replay_matches_eager's run on the capture sample when it ran (one eager
    # forward saved per descriptor), else a run of its own on fresh inputs.
    inputs = ctx.manager.capture_sample(desc) if kept is not None else ctx.make(batch)
    with ctx.preserved_state() as state0:
        if kept is not None:
            ctx.restore(kept[1])  # the state that eager run started from
        graph_inputs = clone_tree(inputs)
        ctx.seed_all(ctx.seed)
        ctx.run(graph_inputs, batch)
        ctx.manager.synchronize()
        graph_state = ctx.snapshot()
        if kept is not None:
            padded, _, eager_state = kept
            eager_inputs = {name: padded[name] for name in graph_inputs}
        else:
            ctx.restore(state0)
            eager_inputs = clone_tree(inputs)
            ctx.seed_all(ctx.seed)
            ctx.eager_real(eager_inputs, batch)
            eager_state = ctx.snapshot()
    diff = ctx.state_difference(graph_state, eager_state, use_scratch=False)
    if diff is not None:
        return Outcome(
            "state",
            desc,
            False,
            f"module state '{diff.path}' ends differently after run() than after eager",
            finding_of(diff, batch),
        )
    diff = first_difference(graph_inputs, eager_inputs)
    if diff is not None:
        return Outcome(
            "state",
            desc,
            False,
            f"input {diff.path} is mutated in place by eager but not by run(): the graph writes into its "
            "static copy, never the caller's tensor (return the result instead of writing into an input)",
            finding_of(diff, batch),
        )
    return _state_padded(ctx, desc) or Outcome("state", desc, True)


def _state_padded(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome | None:
    """The state a padded batch leaves, against eager on its real rows: a padded row that writes
    where no real row does (a count of the pad id, a live KV slot) shows here. Only where forwards
    write module state at all (seen op by op); declared ``scratch_state`` regions exempt."""
    batch = ctx.padded_batch(desc)
    exact = ctx.exact_batch(desc)
    if (
        batch is None
        or (batch.num_tokens, batch.num_reqs) == (exact.num_tokens, exact.num_reqs)
        or not ctx.observer.written
    ):
        return None
    inputs = ctx.make(batch)
    with ctx.preserved_state() as state0:
        ctx.seed_all(ctx.seed)
        ctx.run(clone_tree(inputs), batch)
        ctx.manager.synchronize()
        graph_state = ctx.snapshot()
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        ctx.eager_real(clone_tree(inputs), batch)
        eager_state = ctx.snapshot()

        def padded_state() -> dict[str, torch.Tensor]:
            ctx.restore(state0)
            ctx.seed_all(ctx.seed)
            ctx.eager_padded(desc, clone_tree(inputs), batch)
            return ctx.snapshot()

        found = ctx.state_across_shapes(
            graph_state, eager_state, state0, padded_state, rtol=ctx.rtol, atol=ctx.atol
        )
    if found is None:
        return None
    name, diff, why = found
    return Outcome(
        "state",
        desc,
        False,
        f"after a padded batch, module state '{name}' differs from what eager leaves on its real rows ({why}): "
        "padded rows write into state (a count of the pad id, a live slot). Mask them out through is_padding, "
        "or route them to a scratch region and name it in scratch_state",
        finding_of(diff, batch),
    )


def determinism(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
    inputs = ctx.make(batch)

    # Three replays of the same inputs from one state and seed, the graphs' free memory (their
    # intermediates between replays) poisoned just before each: one poison twice, then the other.
    # The first two must agree (state outside registered buffers and nondeterministic kernels make
    # them differ); a graph that reads what nobody wrote gives one result per poison, where plain
    # replays read whatever the last one left. A backend that cannot poison replays plainly.
    poisons = (0, 0, 1)
    poisonable = True

    def poisoned(i: int) -> Any:
        nonlocal poisonable
        ctx.load(desc, inputs, batch)
        poisonable = ctx.manager.poison_free(poisons[i]) and poisonable
        return ctx.replay(desc)

    outs = ctx.from_one_state(poisoned, len(poisons))
    diff = first_difference(outs[1], outs[0])
    graph_diff = None
    if poisonable and diff is None:
        graph_diff = first_difference(outs[2], outs[0])
    read_poison = (
        f"with the graph's free memory poisoned one way before each of two replays of the same inputs they agree, "
        f"and poisoned the other way they differ ({where_of(graph_diff)})"
        if graph_diff is not None
        else ""
    )
    uninitialized = ctx.uninitialized()
    if uninitialized:
        # Undefined whether the two replays happened to agree: the memory they read is anybody's.
        shown = diff or graph_diff
        return Outcome(
            "determinism",
            desc,
            False,
            f"{uninitialized}; a replay reads it too: {read_poison}" if read_poison else uninitialized,
            finding_of(shown, batch) if shown is not None else Finding(real_batch=batch.shape()),
        )
    if graph_diff is not None:
        return Outcome(
            "determinism",
            desc,
            False,
            f"a replay reads graph memory nobody wrote: {read_poison}. No op the dispatcher sees reads "
            "unwritten memory, so it happens below it (in a custom op's or an extension's own buffer, say): write "
            "that buffer fully first, or make it with zeros",
            finding_of(graph_diff, batch),
        )
    if diff is None:
        return Outcome("determinism", desc, True)
    return Outcome(
        "determinism",
        desc,
        False,
        f"two replays of the same inputs, from the same module state and seed, differ ({where_of(diff)}): "
        "the module keeps state outside its registered buffers, or uses nondeterministic kernels",
        finding_of(diff, batch),
    )


def _lifetime(ctx: VerifyContext, desc: BatchDescriptor, batch: Batch) -> Outcome | None:
    """None when an output returned by run() kept its values through a later run."""
    inputs, later = ctx.make(batch), ctx.make(batch)
    with ctx.preserved_state():
        first = ctx.run(inputs, batch)
        kept = clone_tree(first)
        ctx.run(later, batch)  # a later batch of the same shape rewrites whatever it aliases
        ctx.manager.synchronize()
    diff = first_difference(first, kept)
    if diff is None:
        return None
    path = "graph" if desc.mode is not GraphMode.NONE else "eager (NONE)"
    return Outcome(
        "output_lifetime",
        desc,
        False,
        f"an output returned by run() on the {path} path changed when later batches ran ({where_of(diff)}): "
        "it aliases memory the module or the graph reuses; return a fresh tensor",
        finding_of(diff, batch),
    )


def output_lifetime(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> Outcome:
    """Outputs of run() keep their values after later runs, on every graph and on the eager path.

    On the graph path run() copies the real rows out, so this guards the
    manager's contract; on the eager path (a batch larger than every graph)
    the module's own outputs are returned, and a module returning a buffer it
    rewrites fails here.
    """
    manager = ctx.manager
    for desc in descs:
        failed = _lifetime(ctx, desc, ctx.padded_batch(desc) or ctx.exact_batch(desc))
        if failed is not None:
            return failed
    n = manager.max_tokens + 1
    batch = Batch(num_tokens=n, num_reqs=min(manager.config.max_num_reqs, max(1, (n + 1) // 2)))
    eager_desc = manager.dispatch_batch(batch)
    if eager_desc.mode is GraphMode.NONE:
        failed = _lifetime(ctx, eager_desc, batch)
        if failed is not None:
            return failed
    return Outcome("output_lifetime", None, True, figures={"graphs": len(descs), "eager_path": True})


def rng(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    if ctx.uninitialized():
        # What a replay and an eager run read from unwritten memory is the allocator's, so their
        # agreement, and eager's with itself, would be chance: the verdict would change run to run.
        return Outcome(
            "rng",
            desc,
            True,
            skipped=True,
            message="the forward reads memory nobody wrote, so draws cannot be compared (determinism reports it)",
        )
    batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
    inputs = ctx.make(batch)
    if not ctx.module_is_random(desc):
        # Eager draws nothing: the graph must not either. Replays alone say so;
        # where they disagree the full comparison below tells why.
        def replayed() -> Any:
            ctx.load(desc, inputs, batch)
            return ctx.replay(desc)

        with ctx.preserved_state() as state0:
            replays = []
            for seed in (ctx.seed, ctx.seed + 1):
                ctx.restore(state0)
                ctx.seed_all(seed)
                replays.append(replayed())
        if first_difference(replays[0], replays[1]) is None:
            return Outcome(
                "rng", desc, True, message="the module draws no random numbers", figures={"random": False}
            )
    draws: dict[tuple[str, int], Any] = {}
    with ctx.preserved_state() as state0:
        padded = ctx.load(desc, inputs, batch)
        for seed in (ctx.seed, ctx.seed + 1):
            ctx.restore(state0)
            ctx.seed_all(seed)
            draws["eager", seed] = ctx.eager(padded, desc)
            ctx.restore(state0)
            ctx.load(desc, inputs, batch)
            ctx.seed_all(seed)
            draws["graph", seed] = ctx.replay(desc)
        ctx.restore(state0)
        again = ctx.replay(desc)  # no reseed: the generator has moved on
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        repeat = ctx.eager(padded, desc)
    s0, s1 = ctx.seed, ctx.seed + 1
    if first_difference(repeat, draws["eager", s0]) is not None:
        return Outcome(
            "rng",
            desc,
            True,
            skipped=True,
            message="eager is not reproducible under the same seed and state, so draws cannot be "
            "compared (the determinism and replay checks report why)",
        )
    # Random if either side's output depends on the seed.
    random = any(
        first_difference(draws[side, s0], draws[side, s1]) is not None for side in ("eager", "graph")
    )
    if not random:
        return Outcome(
            "rng", desc, True, message="the module draws no random numbers", figures={"random": False}
        )
    diff = first_difference(draws["graph", s0], draws["eager", s0])
    if diff is not None:
        return Outcome(
            "rng",
            desc,
            False,
            f"under the same seed, replay draws differ from eager draws ({where_of(diff)}): the graph does "
            "not read the seeded generator the way eager does (a seed set inside forward, or a private "
            "generator)",
            finding_of(diff, batch),
        )
    # ``again`` follows the seed-s1 replay without reseeding: the generator
    # must have moved on since.
    if first_difference(again, draws["graph", s1]) is None:
        return Outcome(
            "rng",
            desc,
            False,
            "two successive replays drew the same random values: the graph does not advance the generator",
            Finding(output=""),
        )
    return Outcome("rng", desc, True, figures={"random": True})


# -- after everything: addresses -------------------------------------------------
def _addresses(ctx: VerifyContext) -> dict[str, tuple[torch.Tensor, int]]:
    tensors = {f"static input '{n}'": t for n, t in ctx.manager.static_inputs.items()}
    for name, t in ctx._state_items():
        tensors[f"module tensor '{name}'"] = t
    return {name: (t, t.data_ptr()) for name, t in tensors.items()}


def record_addresses(ctx: VerifyContext) -> None:
    """Before capture: every tensor graphs read by address, the object and its address now."""
    ctx.prepared["address_stability"] = _addresses(ctx)


def address_stability(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> Outcome:
    if ctx.rebound_outside:
        # Seen as it happened: the allocator may hand the old address back later, so the addresses
        # below, read at the end, can agree though every graph read the old memory in between.
        name = next(iter(ctx.rebound_outside))
        return Outcome(
            "address_stability",
            None,
            False,
            f"module tensor '{name}' moved: make_inputs rebound it to new memory (param.data = new, or a new "
            "tensor assigned), and graphs keep reading the old memory. Update it in place (param.copy_(new))",
            Finding(output=f"module tensor '{name}'"),
        )
    before: dict[str, tuple[torch.Tensor, int]] = ctx.prepared["address_stability"]
    after = _addresses(ctx)
    for name, (tensor, ptr) in before.items():
        now = after.get(name)
        # The object, not only the address: a rebound buffer can land at the
        # old address again once the allocator reuses it.
        if now is None or now[0] is not tensor or now[1] != ptr:
            moved = (
                "it is gone"
                if now is None
                else (
                    f"it was rebound to another tensor (address {ptr:#x} -> {now[1]:#x})"
                    if now[0] is not tensor
                    else f"its storage moved ({ptr:#x} -> {now[1]:#x})"
                )
            )
            return Outcome(
                "address_stability",
                None,
                False,
                f"{name} moved: {moved}, and graphs keep reading the old memory. Update it in place "
                "(copy_, mul_, add_) instead of rebinding the attribute",
                Finding(output=name),
            )
    missing = set(after) - set(before)
    if missing:
        return Outcome(
            "address_stability",
            None,
            False,
            f"new module tensors appeared after capture: {sorted(missing)}",
            Finding(),
        )
    return Outcome("address_stability", None, True)
