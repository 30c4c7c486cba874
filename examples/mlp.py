"""The smallest case: a residual MLP block over a flat batch of tokens."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLPBlock(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_inputs(
    num_tokens: int, num_reqs: int, *, d: int = 64, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, d, device=device)}
