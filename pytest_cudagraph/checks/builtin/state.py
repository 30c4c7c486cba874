"""``state``: what forwards write, and inputs eager writes in place, end as eager leaves them."""

from __future__ import annotations

import torch

from ...plan import BatchDescriptor
from ..compare import first_difference
from ..registry import Check
from ..report import Outcome
from ..verify_context import VerifyContext, clone_tree
from .common import finding_of


def state(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    batch = ctx.exact_batch(desc)
    kept = ctx.exact_eager.pop(desc, None)
    if kept is not None and not ctx.observer.written:
        # No forward writes module state (every op of every capture, the first pass and the guarded
        # runs seen: a graph writes what its capture wrote), and replay_matches_eager's eager run
        # left its inputs as they were loaded: then run() can end in no other state, nor leave the
        # caller's inputs otherwise than eager did (it never writes them), and the comparison needs
        # no run of its own.
        if first_difference(kept[0], ctx.load(desc, ctx.manager.capture_sample(desc), batch)) is None:
            return Outcome(
                "state", desc, True, figures={"compared": "no state written, no input written by eager"}
            )
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


STATE = Check(
    "state",
    state,
    compares="what forwards write (module buffers, parameters written in place), and inputs that eager "
    "mutates in place, end in the same state after `run()` as after eager at the captured shape (what "
    "forwards write is snapshot and restored around each comparison, so a graph-safe counter buffer "
    "passes; nothing else is copied; where no forward writes module state and eager wrote no input, "
    "there is nothing that could end otherwise, and nothing runs); and, where forwards write module "
    "state, after the smallest "
    "real batch as after eager on its real rows (bit for bit where those wrote nothing, the "
    "measured floor where they wrote)",
    catches="in-place writes to inputs (the graph writes its static copy, never the caller's tensor); "
    "padded rows writing where no real row does (a count of the pad id, a live KV slot)",
    applies="never",
)
