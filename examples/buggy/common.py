"""What the gallery's modules share: a token-shaped input and a linear layer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

D = 8


def token_inputs(device: str | torch.device = "cpu") -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, D, device=device)}

    return make_inputs


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
