"""Where a real batch goes in the static buffers of a graph: the load plan that copies it into the
window a graph of its descriptor reads and pads the rest (``new_load_plan``: made once per pair of
shapes, kept by the runtime part), and the part of each buffer that holds padding
(``padding_views``, which the padding check fills)."""

from __future__ import annotations

import torch

from ..plan import Batch
from .layout import InputSpec, PadValue
from .types import BlockLoadPlan, LoadPlan

__all__ = ["new_load_plan", "padding_views"]


def new_load_plan(
    specs: list[tuple[str, InputSpec]], is_padding: torch.Tensor | None, tokens: int, reqs: int, batch: Batch
) -> LoadPlan:
    """The views a batch is copied into for a graph of ``tokens`` tokens and ``reqs`` request rows."""
    loads: list[tuple[str, torch.Tensor, torch.Tensor | None, PadValue]] = []
    blocks: list[tuple[str, torch.Tensor, torch.Tensor | None, int | float | bool]] = []
    edges: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
    for name, spec in specs:
        buf = spec.buffer
        assert buf is not None
        if spec.kind == "fixed":
            loads.append((name, buf, None, 0))
            continue
        # The graph of this descriptor reads this window of the buffer.
        window = spec.window(tokens, reqs)
        if spec.kind == "multi":
            real_block = window
            for d, kind, offset in spec.dims:
                real_block = real_block.narrow(
                    d, 0, (batch.num_tokens if kind == "tokens" else batch.num_reqs) + offset
                )
            padded = real_block.shape != window.shape
            assert spec.pad != "edge"  # refused by infer_layout: a block has no last row
            blocks.append((name, real_block, window if padded else None, spec.pad))
            continue
        real = spec.rows(batch.num_tokens, batch.num_reqs)
        rows = spec.rows(tokens, reqs)
        head = window.narrow(spec.dim, 0, real)
        tail = window.narrow(spec.dim, real, rows - real) if rows > real else None
        if tail is not None and spec.pad == "edge" and spec.dim != 0:
            edges.append((name, head, tail, spec.dim))
        else:
            loads.append((name, head, tail, spec.pad))
    masks: list[tuple[torch.Tensor, bool]] = []
    if is_padding is not None:
        masks.append((is_padding[: batch.num_tokens], False))
        if tokens > batch.num_tokens:
            masks.append((is_padding[batch.num_tokens : tokens], True))
    return BlockLoadPlan(loads, masks, blocks, edges) if blocks or edges else LoadPlan(loads, masks)


def padding_views(
    specs: list[tuple[str, InputSpec]], tokens: int, reqs: int, batch: Batch
) -> list[tuple[str, torch.Tensor]]:
    """(input name, the view of its static buffer that holds padding) when
    ``batch`` runs under a graph of ``tokens`` tokens and ``reqs`` request
    rows, for every input with one dimension that follows the batch and
    padding to hold; in input order.

    These are the entries a graph reads but no real token or request put
    there: what they hold must not reach the real rows' outputs, so a check
    may fill them with anything. Inputs with several dimensions that follow
    the batch (a square mask) are left out: their padded entries hold the
    value ``pad_values`` declares, which the module reads as meaning (a
    mask's 'masked out'), so another fill is another program, not padding.
    """
    views: list[tuple[str, torch.Tensor]] = []
    for name, spec in specs:
        if spec.kind not in ("tokens", "reqs"):
            continue
        real = spec.rows(batch.num_tokens, batch.num_reqs)
        rows = spec.rows(tokens, reqs)
        if rows > real:
            views.append((name, spec.window(tokens, reqs).narrow(spec.dim, real, rows - real)))
    return views
