"""``replay_matches_eager`` and ``fresh_inputs``: replay against eager at the captured shape, bit
for bit, on the capture's inputs and on fresh ones.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import faults, peers
from ...plan import Batch, BatchDescriptor
from .. import causes
from ..compare import first_difference, leaves, same_print, tree_print
from ..divergence import locate_divergence
from ..registry import Check
from ..report import Finding, Outcome
from ..verify_context import FreshEager, VerifyContext, clone_tree, python_values
from .common import explaining, finding_of, nothing_to_compare, opaque_output, where_of


def _compare_padded(
    ctx: VerifyContext,
    desc: BatchDescriptor,
    batch: Batch,
    inputs: dict[str, Any],
    check: str,
    fresh: bool,
    share: bool = False,
    poisoned: bool = False,
) -> Outcome:
    """Replay against eager at the captured shape on ``inputs`` loaded for ``batch``, bit for bit.
    ``share``: where they agree, the eager run is kept for ``real_batches`` (``ctx.fresh_eager``).
    ``poisoned``: the graphs' free memory is poisoned (the first way) just before the replay, which
    where they agree is kept as ``determinism``'s first replay (``ctx.first_replay``)."""
    with ctx.preserved_state() as state0:
        padded = ctx.load(desc, inputs, batch)
        # On a rank of several, the replay and eager below are skipped only where every rank skips them.
        if not fresh and not peers.any_rank([not _matches_the_warm_up(ctx, desc)])[0]:
            # Where it left its inputs as loaded, the state check takes this "eager run" as it would
            # take the one below: the inputs as they were, no state written.
            ctx.exact_eager[desc] = (padded, state0, ctx.snapshot())
            return Outcome(
                check,
                desc,
                True,
                figures={"real_batch": batch.shape(), "eager": "the capture's warm-up, by its print"},
            )
        poisonable = ctx.manager.poison_free(0) if poisoned else False
        # The replay is queued and eager's Python runs while the device replays (one phase for both,
        # which waits for the device at its end: an error of either shows there).
        with ctx.phase("replay, then eager on its inputs", desc), faults.synchronizing(False):
            ctx.seed_all(ctx.seed)
            graph = ctx.replay(desc, wait=False)
            ctx.restore(state0)
            ctx.seed_all(ctx.seed)
            read = clone_tree(padded) if share else None
            eager = ctx.eager(padded, desc)
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
            return nothing_to_compare(check, desc, eager, batch)  # told once, by replay_matches_eager
        if diff is None:
            if read is not None:
                ctx.fresh_eager[desc] = FreshEager(batch, inputs, read, eager)
            printed = tree_print(graph) if poisonable else None
            if printed is not None:
                ctx.first_replay[desc] = (batch, inputs, printed)
            return Outcome(check, desc, True, figures={"real_batch": batch.shape()})
        if diff.opaque:
            return opaque_output(check, desc, diff, batch)
        # A failure's diagnosis: on a rank of several, on this rank alone (no peer runs it).
        with peers.alone():
            # Why they differ, from here on: eager again from the same state and seed, the module's plain
            # Python values read around it (read only now: walking the module tree on every comparison
            # that passes costs more, at real size, than the comparison does).
            ctx.restore(state0)
            before = {**python_values(ctx.module), **ctx.python.written_now()}
            ctx.seed_all(ctx.seed)
            again = ctx.eager(padded, desc)
            after = {**python_values(ctx.module), **ctx.python.written_now()}
            changed = [k for k in after if before.get(k, object()) != after[k]]
            differs = first_difference(again, eager) is not None
            draws = ctx.host_draws() if changed or differs else []
            if draws:
                return Outcome(
                    check,
                    desc,
                    False,
                    f"{causes.host_numbers(draws)} ({where_of(diff)}; the rng check names it)",
                    finding_of(diff, batch),
                )
            if changed:
                name = changed[0]
                return Outcome(
                    check,
                    desc,
                    False,
                    causes.python_state_per_forward(
                        ctx.python.describe(name), before.get(name), after[name], where_of(diff)
                    ),
                    finding_of(diff, batch),
                )
            uninitialized = ctx.uninitialized()
            if uninitialized:
                return Outcome(
                    check, desc, False, f"{uninitialized} ({where_of(diff)})", finding_of(diff, batch)
                )
            unconfirmed = ""
            attributes = ctx.python.changed_since_capture(desc)
            if attributes:
                # Put back to what the graph holds, does eager give the graph's result? Then that is why.
                confirmed, attributes = explaining(ctx, desc, padded, state0, graph, attributes)
                said = causes.attributes_changed(
                    desc.label(), attributes, confirmed=confirmed, outside=ctx.python.described(attributes)
                )
                if confirmed:
                    return Outcome(check, desc, False, f"{said} ({where_of(diff)})", finding_of(diff, batch))
                unconfirmed = f". {said}"
            if differs:
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
            check,
            desc,
            False,
            f"{what} ({where_of(diff)}){unconfirmed}",
            finding_of(diff, batch, submodule, segment),
        )


def _matches_the_warm_up(ctx: VerifyContext, desc: BatchDescriptor) -> bool:
    """Whether a replay on the capture's inputs (loaded) has the print of the capture's warm-up
    output, where that warm-up stands for eager: an eager run at this shape on these very inputs,
    which it left as they were, by a module in which nothing but the kernels can make two eager
    runs differ (``ctx.repeats_itself``). The warm-up ran on the path a capture takes
    (``VerifyContext.watch_warmup``), as the eager run below does. False sends the check to its
    own eager run, which tells why they differ, if they do."""
    warm = ctx.warm_prints.pop(desc, None)
    if warm is None or not ctx.repeats_itself(desc):
        return False
    before, after, out = warm
    if before is None or after is None or out is None or not out[1] or not same_print(before, after):
        return False  # a leaf it cannot print, no tensor to compare, or the warm-up wrote an input
    ctx.seed_all(ctx.seed)
    replayed = tree_print(ctx.replay(desc))
    return replayed is not None and same_print(replayed, out)


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
        if isinstance(v, torch.Tensor) and v.numel() and not getattr(specs.get(name), "is_python", False)
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


def _unchangeable(ctx: VerifyContext, inputs: dict[str, Any]) -> str:
    """Why ``drawn_inputs`` changed nothing, of the user's inputs: no floating input, and each integer
    one holds one value in every row, so that neither a permutation of its rows nor a draw in the
    range make_inputs gives it at the largest shape (one value too) is another value."""
    specs = ctx.manager.input_specs
    held = [
        repr(name)
        for name, v in inputs.items()
        if isinstance(v, torch.Tensor) and v.numel() and not getattr(specs.get(name), "is_python", False)
    ]
    if not held:
        return "no input is a tensor"
    one = len(held) == 1
    names = held[0] if one else f"{', '.join(held[:-1])} and {held[-1]}"
    return (
        f"no floating input, and {names} {'holds' if one else 'hold'} one value in every row, the only one "
        "make_inputs gives, so neither permuting rows nor drawing in its range changes "
        + ("it" if one else "them")
    )


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
                f"can be given other values by the harness ({_unchangeable(ctx, second)}). {_RETURN_FRESH}",
                Finding(real_batch=batch.shape()),
            )
    # The second set is the one compared: the first only tells whether make_inputs draws. (A replay
    # on the first set before the comparison, which every verification paid until issue #48, added
    # nothing: what a replay leaves in graph memory for the next is determinism's to find, with
    # that memory poisoned two ways, and replay_matches_eager's replay of the capture's inputs came
    # just before.)
    try:
        outcome = _compare_padded(
            ctx,
            desc,
            batch,
            second,
            "fresh_inputs",
            fresh=True,
            share=not made and batch == ctx.padded_batch(desc) and ctx.shares_eager(desc),
            poisoned=ctx.shares_replay(desc),
        )
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


REPLAY_MATCHES_EAGER = Check(
    "replay_matches_eager",
    replay_matches_eager,
    compares="on the very inputs a graph was captured with, replay equals eager bit for bit (NaN equals NaN, "
    "-0.0 differs from 0.0; shape, dtype and strides too). Where nothing but the kernels can make two eager "
    "runs differ (no random draws, no state of its own written), the capture's warm-up, an eager run on those "
    "very inputs that left them as they were, is the eager side, held by a print of its bits (two sums of its "
    "bit patterns, plain and weighted by position); a replay with another print is compared with an eager "
    "run of its own on the path a capture takes, which says where and why they differ",
    catches="Python state changed by every forward, the module's or outside it (named: `inner.calls: 3 -> 4`, "
    "`STEPS['step'] (a module-level dict of ..., read at ...): 12 -> 13`); Python attributes that "
    "something other than forward changed since capture (a refit in make_inputs, a scheduler), named with "
    "their values at capture and now where, put back, they give eager the graph's result; host numbers "
    "that seed a kernel (named, as `rng` names them); nondeterministic eager (said so instead)",
    applies="never",
)


FRESH_INPUTS = Check(
    "fresh_inputs",
    fresh_inputs,
    compares="after capture, new inputs give replay equal to eager. Where `make_inputs` returns the same "
    "values on every call (`torch.ones`, `arange`), the harness makes its own: fresh floating "
    "values in the observed range, or integer rows permuted (then drawn) within it. Where `determinism` runs "
    "after it on a module in which nothing but graph memory can change a replay, the graphs' free memory is "
    "poisoned (its first way) before this replay, which `determinism` takes as its first",
    catches="tensors computed at warm-up and memoised (by identity, say), stale buffers, values frozen at "
    "capture; what forward reads from outside the module (a forward context, a module-level dict, a class "
    "attribute, a closure cell, a ContextVar, a thread-local) that changed since capture, named where it "
    "lives with the line that read it and both values, and a tensor put there in place of the captured "
    "one, named as replaced",
    applies="never: where no input can be changed (no tensor input, or only integers of one value), the "
    "check fails saying it could not run",
)
