"""The checks ``verify_runner`` runs on a runner someone else wrote.

The runner is a black box: its buffers, padding, metadata and dispatch are
its own. What can be held against eager is what it returns and what it
leaves in the module's state, on every real batch from one token to past
its largest graph, and whether it ran graphs at all. Each check is
registered as the manager's are (``Check``), with the words of the table in
docs/runners.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..checks.builtin.common import finding_of, where_of
from ..checks.builtin.replay import drawn_value
from ..checks.compare import first_difference
from ..checks.floor import Verdict, across_shapes
from ..checks.registry import Check, CheckRegistry, failed, passed, skipped
from ..checks.report import Finding, Outcome
from ..checks.verify_context import clone_tree
from ..plan import BatchDescriptor, GraphMode
from .runner_context import Call, RunnerContext

__all__ = ["RUNNER_CHECKS"]


def _raised(call: Call) -> Outcome:
    exc = call.error
    assert exc is not None
    return failed(
        f"the runner raised {type(exc).__name__} on a real batch of {call.batch.num_tokens} tokens: {exc}",
        Finding(real_batch=call.batch.shape()),
    )


def _calls_of(ctx: RunnerContext, desc: BatchDescriptor) -> list[Call]:
    calls = ctx.calls()
    return [calls[n] for n in ctx.token_counts(desc)]


def real_batches(ctx: RunnerContext, desc: BatchDescriptor) -> Outcome | None:
    """Every real batch the descriptor stands for: the runner's outputs equal eager on the unpadded batch,
    held to the measured floor across shapes (``checks/floor.py``), or bit for bit with ``batch_invariant``."""
    rtol, atol = ctx.tolerance()
    worst_abs, measured = 0.0, 0
    calls = _calls_of(ctx, desc)
    for call in calls:
        if call.error is not None:
            return _raised(call)
        if ctx.batch_invariant:
            diff = first_difference(call.got, call.expected)
            verdict = Verdict(
                diff is None,
                diff,
                ""
                if diff is None
                else f"the runner's outputs differ from eager on the unpadded batch bit for bit "
                f"(batch_invariant) ({where_of(diff)})",
            )
        else:
            verdict = across_shapes(
                call.got,
                call.expected,
                functools.partial(_padded_output, ctx, call, desc),
                rtol=rtol,
                atol=atol,
                roundoff=ctx.roundoff,
            )
        measured += verdict.floor_used
        if not verdict.passed:
            diff = verdict.diff
            return failed(
                f"{verdict.why}: rows cut wrongly, a graph too small for the batch, or inputs the graph "
                "does not read",
                finding_of(diff, call.batch) if diff is not None else Finding(real_batch=call.batch.shape()),
                batches=len(calls),
                floor_measured=measured,
            )
        worst_abs = max(worst_abs, verdict.figures.get("max_abs", 0.0))
    return passed(batches=len(calls), max_abs=worst_abs, floor_measured=measured)


def _padded_output(ctx: RunnerContext, call: Call, desc: BatchDescriptor) -> Any:
    """Eager at the capture size, cut to the real rows; None where no floor can be measured."""
    padded = ctx.padded(call, desc)
    return padded[0] if padded is not None else None


def state(ctx: RunnerContext, desc: BatchDescriptor) -> Outcome | None:
    """After each real batch, what the forward writes equals eager's outside ``scratch_state``: bit for bit
    where eager's real rows wrote nothing, and where they wrote, held to the floor across shapes."""
    rtol, atol = ctx.tolerance()
    calls = _calls_of(ctx, desc)
    for call in calls:
        if call.error is not None:
            return _raised(call)
        assert call.got_state is not None and call.expected_state is not None
        found = _state_difference(ctx, call, desc, rtol, atol)
        if found is not None:
            name, diff, why = found
            return failed(
                f"after the runner, module state '{name}' differs from eager's ({why}): padded "
                "rows wrote where real ones live (a padding slot that is live, a table with the previous "
                "step's entries), or the runner skipped a write. Declare a region padded rows may write "
                "with scratch_state",
                finding_of(diff, call.batch),
                batches=len(calls),
            )
    return passed(batches=len(calls))


def _state_difference(
    ctx: RunnerContext, call: Call, desc: BatchDescriptor, rtol: float | None, atol: float | None
) -> tuple[str, Any, str] | None:
    """(name, where, why) of the first state tensor the runner left otherwise than eager, or None."""
    assert call.got_state is not None and call.expected_state is not None
    if ctx.batch_invariant:
        diff = ctx.state_difference(call.got_state, call.expected_state, use_scratch=True)
        return (diff.path, diff, diff.reason) if diff is not None else None
    return ctx.state_across_shapes(
        call.got_state,
        call.expected_state,
        ctx.state0,
        functools.partial(_padded_state, ctx, call, desc),
        rtol=rtol,
        atol=atol,
    )


def _padded_state(ctx: RunnerContext, call: Call, desc: BatchDescriptor) -> dict[str, torch.Tensor] | None:
    padded = ctx.padded(call, desc)
    return padded[1] if padded is not None else None


def graph_coverage(ctx: RunnerContext, desc: BatchDescriptor) -> Outcome | None:
    """On CUDA, how many of the descriptor's real batches replayed a CUDA graph; within the capture sizes, all must."""
    if ctx.device.type != "cuda":
        return skipped(
            "no CUDA device: CUDA graph replays cannot be counted here (on the CPU a runner runs "
            "eagerly on its own terms)"
        )
    calls = _calls_of(ctx, desc)
    graphed = [c.batch.num_tokens for c in calls if c.replays > 0]
    eager = [c.batch.num_tokens for c in calls if c.replays == 0 and c.error is None]
    figures: dict[str, Any] = {"calls": len(calls), "graphed": len(graphed), "eager_sizes": eager}
    reasons = list(getattr(ctx.runner, "skip_reasons", None) or [])
    if reasons:
        figures["skip_reasons"] = reasons
    if desc.mode is GraphMode.NONE or not eager:
        return passed(**figures)
    why = f"; the runner says: {'; '.join(reasons)}" if reasons else ""
    return failed(
        f"{len(eager)} of {len(calls)} real batches this capture size serves replayed no CUDA graph (token "
        f"counts {eager}): the runner ran them eagerly{why}",
        Finding(real_batch=ctx.batch(eager[0]).shape()),
        **figures,
    )


def determinism(ctx: RunnerContext, desc: BatchDescriptor) -> Outcome | None:
    """Two calls on the same inputs, from the same state and seed, return bit-identical outputs."""
    batch = ctx.batch(ctx.token_counts(desc)[-1])
    inputs = ctx.make(batch)

    def called(_: int) -> Any:
        out, _ = ctx.call_runner(inputs)
        ctx.synchronize()
        return clone_tree(out)

    outs = ctx.from_one_state(called)
    diff = first_difference(outs[1], outs[0])
    if diff is None:
        return None
    return failed(
        f"two calls on the same inputs from the same state differ ({where_of(diff)}): state kept "
        "outside the module's buffers, or nondeterministic kernels",
        finding_of(diff, batch),
    )


def _other_values(inputs: dict[str, Any], seed: int) -> tuple[dict[str, Any], str]:
    """Inputs with fresh floating values, where ``make_inputs`` returns the same ones every call."""
    gen = torch.Generator().manual_seed(seed + 7919)
    drawn = dict(inputs)
    floats = [
        n for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
    ]
    for name in floats:
        drawn[name] = drawn_value(inputs[name], gen)
    return drawn, ", ".join(repr(n) for n in floats)


def fresh_inputs(ctx: RunnerContext, desc: BatchDescriptor) -> Outcome | None:
    """A call after another one of the same size, on other inputs, still equals eager on its own inputs."""
    batch = ctx.batch(ctx.token_counts(desc)[-1])
    first, second = ctx.make(batch), ctx.make(batch)
    made = ""
    if first_difference(first, second) is None:
        second, made = _other_values(second, ctx.seed)
        if not made:
            return failed(
                "the check could not run: make_inputs returns the same values on every call and has "
                "no floating input the harness could give other values. Return fresh values from "
                "make_inputs (draw them from torch's generator)",
                Finding(real_batch=batch.shape()),
            )
    rtol, atol = ctx.tolerance()
    with ctx.preserved_state() as state0:
        ctx.call_runner(first)
        ctx.synchronize()
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        out, _ = ctx.call_runner(second)
        ctx.synchronize()
        got = clone_tree(out)
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        expected = ctx.eager(second)
    diff = first_difference(got, expected, rtol=rtol, atol=atol)
    figures = {"harness_inputs": made} if made else {}
    if diff is None:
        return passed(**figures)
    return failed(
        f"after a call on other inputs of the same size, the runner's outputs differ from eager "
        f"({where_of(diff)}): values of the first call kept (a metadata tensor captured by reference "
        "and never refreshed, a table not copied again)",
        finding_of(diff, batch),
        **figures,
    )


def output_lifetime(ctx: RunnerContext, descs: Sequence[BatchDescriptor]) -> Outcome | None:
    """An output the runner returned keeps its values after later calls of the same and other sizes."""
    for desc in descs:
        batch = ctx.batch(ctx.token_counts(desc)[-1])
        other = ctx.batch(ctx.token_counts(descs[0] if desc is not descs[0] else descs[-1])[-1])
        with ctx.preserved_state():
            first, _ = ctx.call_runner(ctx.make(batch))
            ctx.synchronize()
            kept = clone_tree(first)
            for later in (batch, other):
                ctx.call_runner(ctx.make(later))
            ctx.synchronize()
            try:
                diff = first_difference(first, kept)
            except (
                Exception
            ) as exc:  # torch refuses to read it (CUDA graph trees): the same finding, told by torch
                return failed(
                    f"an output returned for {batch.num_tokens} tokens could not be read after later "
                    f"calls: {type(exc).__name__}: {exc}. Clone outputs before the next call",
                    Finding(real_batch=batch.shape()),
                )
        if diff is not None:
            path = "graph" if desc.mode is not GraphMode.NONE else "eager fallback"
            return failed(
                f"an output returned on the {path} path changed when later calls ran ({where_of(diff)}): "
                "it is a view of memory the runner reuses (a static output buffer); return a copy",
                finding_of(diff, batch),
            )
    return passed(descriptors=len(descs))


RUNNER_CHECKS = CheckRegistry(
    [
        Check(
            "real_batches",
            real_batches,
            compares="every real batch from 1 token to past the largest capture size: the runner's outputs equal "
            "the module's eager forward on the unpadded batch within the dtype's tolerance, or held to the "
            "measured floor (eager on the batch padded to the capture size, as `real_batches` of `verify` "
            "does; bit for bit with `batch_invariant=True`)",
            catches="a dispatcher that serves a batch with a graph too small, outputs cut to the wrong rows, inputs "
            "or metadata the graph does not read",
            applies="never",
        ),
        Check(
            "state",
            state,
            compares="after each real batch, what the module's forward writes (its KV cache, say) equals eager's "
            "outside the declared `scratch_state` regions: bit for bit where eager's real rows wrote nothing, "
            "held to the measured floor where they wrote (bit for bit with `batch_invariant=True`; snapshot "
            "and restored around each comparison); a tensor eager never writes that the runner changed fails "
            "once, at the end",
            catches="padded tokens given a live KV slot, per-request tables copied without clearing the previous "
            "step's entries, writes the runner skips",
            applies="never",
        ),
        Check(
            "fresh_inputs",
            fresh_inputs,
            compares="a call after another of the same size on other inputs still equals eager (where make_inputs "
            "returns the same values every call, the harness draws fresh floating values)",
            catches="forward-context tensors captured by reference at capture and never refreshed",
            applies="never: where no input can be changed, it fails saying it could not run",
        ),
        Check(
            "determinism",
            determinism,
            compares="two calls on the same inputs, from the same state and seed, are bit-identical",
            catches="state kept outside the module's buffers, nondeterministic kernels",
            applies="never",
        ),
        Check(
            "graph_coverage",
            graph_coverage,
            compares="on CUDA, `torch.cuda.CUDAGraph.replay` counted during each call: every real batch within the "
            "capture sizes replays a graph (the eager fallback's are counted, not required)",
            catches="a runner that silently runs eagerly (torch.compile skipping CUDA graphs, with the reason it "
            "gives; sizes never captured)",
            applies="no CUDA device (reported as skipped)",
        ),
        Check(
            "output_lifetime",
            output_lifetime,
            scope="module",
            compares="an output returned for one batch keeps its values after later calls of the same and another "
            "size, on the graph path and the eager fallback",
            catches="outputs returned as views of graph memory that the next replay overwrites (CUDA graph trees' "
            "'overwritten by a subsequent run')",
            applies="never",
        ),
    ]
)
