"""A Python number as an input: a graph freezes it at capture, so each batch's value is lost.

Caught before capture: the manager refuses an input that changes as a Python
value and says to pass it as a tensor. It prints:

    ValueError: input 'temperature' is a Python value that changes from batch to batch
    (1.766632777287572 at 7 tokens, 1.6369316044104538 at 11); a graph freezes Python values at capture.
    Pass it as a tensor, or read the padded shape from pytest_cudagraph.current_descriptor()
"""

from __future__ import annotations

import random

import torch

from .common import Base, D


class ScaledByTemperature(Base):
    def forward(self, x: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
        return self.lin(x) / temperature


def scalar_inputs(device: str | torch.device = "cpu"):
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, object]:
        return {"x": torch.randn(num_tokens, D, device=device), "temperature": random.uniform(0.5, 2.0)}

    return make_inputs


def tensor_inputs(device: str | torch.device = "cpu"):
    """The fix: the temperature of each token, as a tensor the graph reads on every replay."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {
            "x": torch.randn(num_tokens, D, device=device),
            "temperature": torch.rand(num_tokens, 1, device=device) + 0.5,
        }

    return make_inputs
