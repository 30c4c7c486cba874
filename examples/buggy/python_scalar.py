"""A Python number drawn for every batch (a sampling temperature): each graph holds the value its
capture was given, so every later batch is scaled by that one.

Caught by ``padded_size``, which names the input, the value the graph holds and the batch's, and
says that only a tensor serves it (make_inputs gives another value at the same shape, so no one
value for every size can). It prints (abridged):

    FAIL padded_size            FULL-T8-R4
         ...: input 'temperature' is a Python value, which a graph holds at the value its capture was
         given: FULL-T8-R4 holds temperature=1.86..., this batch has temperature=0.87..., and the graph's
         result depends on it (...). Pass it as a tensor input (the graph then reads each batch's value
         from its static buffer): make_inputs gives it another value at the same shape, which no one
         value can serve
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
