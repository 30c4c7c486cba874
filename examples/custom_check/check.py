"""The engine's own check, in the shape every downstream check takes.

``kv_cache_check()`` returns a ``Check``: for each captured descriptor, run
a real batch through the graphs (``ctx.run``, the path users take) and
compare the cache before and after, slot by slot, outside the slots the
batch owns and the scratch region padded tokens may write.
"""

from __future__ import annotations

import torch

from pytest_cudagraph.checks import Check, Finding, Outcome, VerifyContext, failed, first_difference, skipped
from pytest_cudagraph.plan import BatchDescriptor


def kv_cache_check(*, cache: str = "kv", slots: str = "slot_mapping", scratch: slice | None = None) -> Check:
    """A check that ``cache`` (a buffer of the module) changes only in the rows ``slots`` names."""

    def kv_cache_outside_slots(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome | None:
        buffers = dict(ctx.module.named_buffers())
        if cache not in buffers:
            return skipped(f"the module has no buffer {cache!r}")
        batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
        inputs = ctx.make(batch)
        if slots not in inputs:
            return skipped(f"make_inputs gives no {slots!r}")
        with ctx.preserved_state():
            before = buffers[cache].detach().clone()
            ctx.run(inputs, batch)
            ctx.manager.synchronize()
            after = buffers[cache].detach().clone()
        owned = torch.zeros(before.shape[0], dtype=torch.bool, device=before.device)
        owned[inputs[slots].to(before.device)] = True
        if scratch is not None:
            owned[scratch] = True
        changed = ((after != before).flatten(1).any(1) & ~owned).nonzero().flatten().tolist()
        if not changed:
            return None
        slot = changed[0]
        diff = first_difference(after[slot], before[slot])
        return failed(
            f"run() changed {len(changed)} slot(s) of the KV cache {cache!r} that the batch does not own, the "
            f"first is slot {slot}: tokens write into another request's cache (check how slots are computed "
            f"from {slots!r})",
            Finding(
                output=f"{cache}[{slot}]",
                index=diff.index if diff else None,
                got=diff.got if diff else None,
                expected=diff.expected if diff else None,
                real_batch=batch.shape(),
            ),
        )

    return Check(
        "kv_cache_outside_slots",
        kv_cache_outside_slots,
        compares=f"the KV cache {cache!r} after a real batch runs through run(), slot by slot, against before: "
        f"only the slots {slots!r} names (and the scratch region) may change",
        catches="tokens that write into slots another request owns",
        applies=f"the module has no buffer {cache!r}, or make_inputs gives no {slots!r}",
    )
