"""Planted bugs in torch's own layers, each beside its correct twin.

- ``BidirectionalSelfAttention``: ``nn.MultiheadAttention`` used as a
  decoder's self-attention but called without ``attn_mask``: every token sees
  every other, the padded ones included. Caught by ``padded_size`` (and
  ``padding_isolation``). Twin: ``torch_models.CausalSelfAttention``.
- A ``BasicBlock`` left in train mode (``basic_block().train()``): BatchNorm
  normalises with the statistics of the whole batch, padded images included,
  and updates its running statistics from them. Caught by ``padded_size``
  (the module is verified in the mode it is in). Twin: the same block in eval
  mode, ``basic_block()``.
"""

from __future__ import annotations

import torch
from torch import nn

from .torch_models import EMBED, HEADS, BasicBlock, basic_block

__all__ = ["BidirectionalSelfAttention", "bidirectional_self_attention", "training_block"]


class BidirectionalSelfAttention(nn.Module):
    """Self-attention with no mask: the decoder forgot ``attn_mask`` (the bug)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.mha(x, x, x, need_weights=False)


def bidirectional_self_attention() -> BidirectionalSelfAttention:
    torch.manual_seed(0)
    return BidirectionalSelfAttention(nn.MultiheadAttention(EMBED, HEADS, batch_first=True)).eval()


def training_block() -> BasicBlock:
    """The basic block, still in train mode when it is captured (the bug)."""
    return basic_block().train()
