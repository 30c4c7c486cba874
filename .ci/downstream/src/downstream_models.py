"""The downstream project's own modules: a two-layer MLP, and the same MLP with a bug."""

from __future__ import annotations

import torch
from torch import nn


class TwoLayerMLP(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CountingMLP(TwoLayerMLP):
    """Bug: Python state changed in forward. A graph runs Python only at capture,
    so replay keeps the capture-time count while eager multiplies by the new one."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * self.calls


def make_inputs(
    num_tokens: int, num_reqs: int, *, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, 16, device=device)}
