"""A rotary table made for the padded length: dynamic NTK scaling inside a graph.

Dynamic NTK scaling (``rope_scaling={"rope_type": "dynamic"}`` in Hugging Face
configs) raises the rotary base once a sequence is longer than the model was
trained for, from the sequence's own length. In a graph the length is the
padded one: a graph captured at 8 tokens rotates 5 real tokens with the table
made for 8, while eager on those 5 tokens uses the table for 5. Rounding never
does that, and only by a few percent here, so ``padded_size`` catches it in
float64. The fix: a table that does not depend on the batch (static scaling, or
the length passed in as a tensor the graph reads).

Caught by ``padded_size``.
"""

from __future__ import annotations

import torch

from .common import Base, D

#: The length the toy model was trained for: longer batches scale the base.
TRAINED_LENGTH = 4
BASE = 10000.0


def _rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate pairs of features by position times each pair's frequency."""
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = torch.arange(x.shape[0], device=x.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[:, 0::2], x[:, 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(1)


class DynamicNTKRotary(Base):
    """Scales the rotary base from the batch's token count, as dynamic NTK scaling does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]  # the padded count inside a graph
        base = BASE * max(1.0, length / TRAINED_LENGTH) ** (D / (D - 2))
        return self.lin(_rotate(x, base))


class StaticRotary(Base):
    """One table for every batch: the base of the longest length served, fixed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_rotate(x, BASE * 2.0 ** (D / (D - 2))))
