"""``address_stability``: every tensor graphs read by address stays where it was."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...plan import BatchDescriptor
from ..registry import Check
from ..report import Finding, Outcome
from ..verify_context import VerifyContext


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


ADDRESS_STABILITY = Check(
    "address_stability",
    address_stability,
    scope="module",
    prepare=record_addresses,
    compares="static buffers and every module parameter and buffer keep their addresses (and stay the same "
    "tensor objects) through capture, replays and eager runs",
    catches="buffers rebound in `forward` (`self.x = self.x * a + b`): graphs keep reading the old memory",
    applies="never",
)
