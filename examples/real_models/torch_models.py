"""torch's own layers, at tiny sizes, with seeded random weights (no transformers needed).

- ``nn.TransformerEncoderLayer`` in its default sequence-first layout:
  ``src (T, 1, E)``, a causal ``src_mask (T, T)`` and ``is_causal=True``.
  The square mask follows ``num_tokens`` in *both* dimensions; its padded
  rows and columns must hold ``-inf`` (a padded key that real queries may
  not see), hence ``pad_values={"src_mask": float("-inf")}``. With zeros
  there, every real token would be allowed to attend every padded one.
- ``nn.MultiheadAttention`` as causal self-attention, batch first:
  ``x (1, T, E)`` and ``attn_mask (T, T)``, padded with ``-inf`` likewise.
- ``BasicBlock``: a ResNet basic block (conv, BatchNorm, ReLU, twice, plus
  the identity) over a batch of images ``(N, C, H, W)`` whose N follows
  ``num_tokens``; BatchNorm holds trained-looking running statistics and the
  block is verified in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "ATTENTION_PADS",
    "EMBED",
    "ENCODER_PADS",
    "BasicBlock",
    "CausalSelfAttention",
    "basic_block",
    "causal_mask",
    "causal_self_attention",
    "encoder_inputs",
    "encoder_layer",
    "image_inputs",
    "self_attention_inputs",
]

EMBED = 32
HEADS = 4
FEEDFORWARD = 64
CHANNELS = 8
IMAGE = 8  # 8x8 images

#: A causal mask's padded rows and columns hide padded keys: -inf, never 0.
ENCODER_PADS = {"src_mask": float("-inf")}
ATTENTION_PADS = {"attn_mask": float("-inf")}

Inputs = Callable[[int, int], dict[str, Any]]


def causal_mask(num_tokens: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The additive causal mask ``(T, T)``: 0 on and below the diagonal, -inf above."""
    return nn.Transformer.generate_square_subsequent_mask(num_tokens, device=device)


def encoder_layer(dropout: float = 0.0) -> nn.TransformerEncoderLayer:
    """A one-layer ``nn.TransformerEncoderLayer`` (sequence first), in eval mode unless trained later."""
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=FEEDFORWARD, dropout=dropout).eval()


def encoder_inputs(device: str | torch.device = "cpu") -> Inputs:
    """``src (T, 1, E)``, ``src_mask (T, T)`` and ``is_causal=True`` (a Python constant)."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {
            "src": torch.randn(num_tokens, 1, EMBED, device=device),
            "src_mask": causal_mask(num_tokens, device),
            "is_causal": True,
        }

    return make_inputs


class CausalSelfAttention(nn.Module):
    """``nn.MultiheadAttention`` called as self-attention: ``mha(x, x, x, attn_mask=...)``.

    Why the wrapper: self-attention passes *one* tensor as query, key and
    value. Three keyword inputs would become three static buffers, three
    distinct tensors, and ``nn.MultiheadAttention`` then leaves its
    self-attention path (it tests ``query is key``). The output is the
    module's own ``(attn_output, None)`` tuple, unchanged.
    """

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.mha(x, x, x, attn_mask=attn_mask, need_weights=False)


def causal_self_attention() -> CausalSelfAttention:
    torch.manual_seed(0)
    return CausalSelfAttention(nn.MultiheadAttention(EMBED, HEADS, batch_first=True)).eval()


def self_attention_inputs(device: str | torch.device = "cpu") -> Inputs:
    """``x (1, T, E)`` (batch first: tokens in the second dimension) and ``attn_mask (T, T)``."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {
            "x": torch.randn(1, num_tokens, EMBED, device=device),
            "attn_mask": causal_mask(num_tokens, device),
        }

    return make_inputs


class BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3-BN-ReLU-conv3x3-BN, plus the identity, then ReLU."""

    def __init__(self, channels: int = CHANNELS) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(images)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + images)


def basic_block() -> BasicBlock:
    """A basic block with running statistics that look trained (not the 0 / 1 of a fresh BatchNorm), in eval mode."""
    torch.manual_seed(0)
    block = BasicBlock()
    with torch.no_grad():
        for bn in (block.bn1, block.bn2):
            bn.running_mean.normal_(0.0, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0.0, 0.1)
    return block.eval()


def image_inputs(device: str | torch.device = "cpu") -> Inputs:
    """A batch of ``num_tokens`` images ``(N, C, H, W)``: one image per token row."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"images": torch.randn(num_tokens, CHANNELS, IMAGE, IMAGE, device=device)}

    return make_inputs
