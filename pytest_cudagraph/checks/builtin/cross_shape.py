"""``real_batches``: each real batch a descriptor serves, run through its graph, against eager at
the graph's padded shape bit for bit (the question across shapes is ``padded_size``'s), or,
where no float64 reference runs, against eager on the unpadded batch within the floor of the
module's own precision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import peers
from ...plan import Batch, BatchDescriptor
from .. import causes
from ..compare import Difference, first_difference
from ..divergence import locate_divergence
from ..floor import Verdict, across_shapes
from ..registry import Check
from ..report import Finding, Outcome
from ..verify_context import Snapshot, VerifyContext, clone_tree
from .common import batch_norm_hint, explaining, finding_of, opaque_output, python_hint, where_of


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
            "the module draws random numbers, which cannot match unpadded eager draw for draw (the rng "
            "check covers them)",
            skipped=True,
        )
    if ctx.host_draws():
        return Outcome(
            "real_batches",
            desc,
            True,
            "the module hands a kernel host numbers that move on every call, so eager cannot match itself "
            "across runs (the rng check names them)",
            skipped=True,
            detail="a seed or an offset kept in Python and handed to a kernel: two eager runs of one batch "
            "differ, and a graph holds the numbers of its capture, so neither eager nor a graph can be held "
            "to the other",
        )
    reference = ctx.reference if ctx.reference is not None and ctx.reference.ready else None
    rows = ctx.rows_ndim(desc)
    totals: dict[str, Any] = {"batches": len(batches), "max_abs": 0.0, "floor_measured": 0, "floor_max": 0.0}
    if reference is not None:
        totals["reference"] = "padded_size"
    # fresh_inputs' eager run at the padded shape of the most padded batch, where it is the one this
    # check would make next (``ctx.shares_eager``): the same inputs, state and seed.
    shared = ctx.fresh_eager.pop(desc, None) if reference is not None else None
    for i, batch in enumerate(batches):
        if shared is not None and (i or shared.batch != batch):
            shared = None
        # make_inputs first, then the snapshot, as every check does: a make_inputs that updates the
        # module (a weight sync between batches) is part of the state both runs start from.
        inputs = shared.inputs if shared is not None else ctx.make(batch)
        with ctx.preserved_state() as state0:
            ctx.seed_all(ctx.seed)
            got = ctx.run(clone_tree(inputs), batch)
            ctx.restore(state0)
            ctx.seed_all(ctx.seed)
            if reference is not None:
                # The same program as the graph: eager on the inputs the graph read, padding included,
                # queued for the reference before eager runs (a forward may write its inputs in place).
                padded_inputs = (
                    shared.padded if shared is not None else ctx.load(desc, clone_tree(inputs), batch)
                )
                queued = reference.queue(
                    desc, batch, inputs, padded_inputs, ctx.manager.output_dims(desc), first=i == 0
                )
                if queued is not None:
                    queued.outside = ctx.python.outside_now()
                eager = shared.output if shared is not None else ctx.eager(padded_inputs, desc)
                at_padded = ctx.manager.cut_output(desc, eager, batch)
                diff = first_difference(got, at_padded)
                if diff is None:
                    if shared is not None:
                        ctx.padding_base[desc] = (batch, inputs, clone_tree(got))
                    continue
                # A failure's diagnosis: on a rank of several, on this rank alone (no peer runs it).
                with peers.alone():
                    why = _attributes_held(ctx, desc, batch, padded_inputs, got, state0) or _not_the_program(
                        ctx, desc, diff
                    )
                    verdict = Verdict(False, diff, why)
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
        with peers.alone():  # a failure's diagnosis: on a rank of several, on this rank alone
            cause = _held_value(ctx, desc, inputs, batch, state0) or _capture_path(
                ctx, inputs, batch, state0, got, expected, None if ctx.batch_invariant else padded, rows
            )
            if cause:
                verdict.why = f"{cause}. What the check saw: {verdict.why}"
            return _real_batch_failure(ctx, desc, batch, inputs, verdict, totals, against_real=True)
    return Outcome("real_batches", desc, True, figures=totals)


def _attributes_held(
    ctx: VerifyContext,
    desc: BatchDescriptor,
    batch: Batch,
    padded: dict[str, Any],
    got: Any,
    state0: Snapshot,
) -> str:
    """Where the module's Python values changed since ``desc`` was captured (by make_inputs, a refit)
    and, put back to the capture's, eager at the padded shape gives the graph's real rows: that,
    in words; ``""`` otherwise."""
    changed = ctx.python.changed_since_capture(desc)
    if not changed:
        return ""
    confirmed, changed = explaining(
        ctx, desc, padded, state0, got, changed, cut=lambda out: ctx.manager.cut_output(desc, out, batch)
    )
    ctx.restore(state0)
    if not confirmed:
        return ""
    return causes.attributes_changed(
        desc.label(), changed, confirmed=True, outside=ctx.python.described(changed)
    )


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
        return opaque_output("real_batches", desc, diff, batch)
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


def _held_value(
    ctx: VerifyContext, desc: BatchDescriptor, inputs: dict[str, Any], batch: Batch, state0: Snapshot
) -> str:
    """Where a Python input the graph holds at its capture's value is not the batch's, whether that
    value decides: eager at the graph's padded shape with the graph's value against the same with the
    batch's, bit for bit (the same program but for the value), where eager repeats itself with the
    graph's. ``""`` when no such input differs, the value changes nothing, or eager does not repeat
    itself (then the difference says nothing of the value)."""
    padded = ctx.load(desc, clone_tree(inputs), batch)
    held = ctx.python.held_values(padded, inputs)
    if not held:
        return ""
    runs = []
    for values in (padded, padded, {**padded, **{n: b for n, (_, b) in held.items()}}):
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        runs.append(ctx.eager(clone_tree(values), desc))
    ctx.restore(state0)
    if first_difference(runs[0], runs[1]) is not None or first_difference(runs[0], runs[2]) is None:
        return ""
    return causes.held_python_input(
        desc.label(), held, explains=None, per_shape=ctx.python.values_per_shape(desc, held)
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


REAL_BATCHES = Check(
    "real_batches",
    real_batches,
    compares="the smallest and the largest real batch a descriptor serves (every batch of a trace with "
    "`--cudagraph-trace`), run through the graph, return real rows equal bit for bit to eager at the "
    "graph's padded shape on the inputs the graph read (the same program); whether eager at the padded "
    "shape computes the real rows as eager on the real batch does is left to `padded_size`, in float64. "
    "Where the module cannot run in float64 (or `padded_size` is deselected), the real rows are held to "
    "eager on the *unpadded* batch: within the dtype's tolerance, else within the measured floor "
    "(eager at the graph's padded shape against eager on the unpadded batch; a few multiples are "
    "allowed), failing a systematic difference (a scale, an offset per feature, a scale per row) and "
    "one beyond what rounding at the products' precision can do (bit for bit with "
    "`batch_invariant=True`); both figures are reported",
    catches="a graph that serves a padded real batch otherwise than eager at its shape does (values frozen "
    "at capture, a stale buffer the real batch reads); where no float64 reference runs, computations that "
    "depend on the padded batch size: statistics over the whole batch, padded rows included; a Python "
    "branch on the token count, or a scale computed from it, down to a few percent on bf16 logits; "
    "outputs cut wrongly; a module that computes something else when it is captured (attention metadata "
    "planned per request count and shared by decode graphs of several query lengths), named as such when "
    "eager on its capture path differs from eager as users run it; a Python number among the inputs that "
    "decides the result (each graph holds its capture's), Python attributes changed since capture, "
    "each named with its values, and what forward reads from outside the module (a forward context) "
    "that changed since capture, named where it lives with the line that read it",
    applies="no real batch dispatches to the descriptor; the module draws random numbers, told by its use "
    "of a generator or by host numbers handed to a kernel that move on every call (the `rng` check covers them). With the float64 reference it runs each descriptor's "
    "smallest real batch only: its largest, a batch of the graph's own size, is what `fresh_inputs` holds; "
    "and for a module that writes and draws nothing, the eager run at the padded shape is `fresh_inputs`' own "
    "(the same inputs, state and seed), not run again",
)
