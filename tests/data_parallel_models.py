"""Data-parallel training steps for tests/test_data_parallel.py: each bug with its correct twin.

Top level, so that spawned ranks can unpickle them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pytest_cudagraph.training import TrainingStep

D = 4
#: Micro-steps a gradient-accumulating loop sums before its optimizer step.
ACCUMULATE = 2


def build(rank: int, world_size: int) -> nn.Module:
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_regressor(rank: int, world_size: int) -> nn.Module:
    return Regressor()


def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(num_tokens, D),
        "y": torch.randn(num_tokens, 1),
        "weight": torch.ones(num_tokens),
    }


def masked_loss(out: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The mean over the real rows: padded rows weigh 0."""
    w = inputs["weight"][:, None]
    return ((out - inputs["y"]) ** 2 * w).sum() / w.sum()


def padded_mean_loss(out: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The bug: the mean over every row the graph holds, padded rows too."""
    return ((out - inputs["y"]) ** 2).mean()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class _Accumulating:
    """A loop that sums ``ACCUMULATE`` micro-steps' gradients before its optimizer step."""

    def __init__(self, ddp: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        self.ddp, self.optimizer, self.loss_fn = ddp, optimizer, loss_fn
        self.micro = 0

    def backward(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        loss = self.loss_fn(self.ddp(x=inputs["x"]), inputs)
        loss.backward()
        return loss.detach()

    def boundary(self) -> bool:
        return (self.micro + 1) % ACCUMULATE == 0


class SyncedCaptureUnderNoSync(_Accumulating):
    """The bug: one graph, captured at a synced micro-step, replayed for every micro-step; eager
    runs the accumulating ones under no_sync(), the graph all-reduces at each."""

    def run(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        with contextlib.nullcontext() if self.boundary() else self.ddp.no_sync():  # type: ignore[operator]
            return self.backward(inputs)

    def between(self) -> None:
        self.micro += 1
        if self.micro % ACCUMULATE == 0:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)


class NoSyncCaptureSyncedOutside(_Accumulating):
    """The twin: every micro-step captured under no_sync(), the gradients all-reduced outside the
    graph at the last micro-step, before the optimizer's step."""

    def run(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        with self.ddp.no_sync():  # type: ignore[operator]
            return self.backward(inputs)

    def between(self) -> None:
        self.micro += 1
        if self.micro % ACCUMULATE == 0:
            world = dist.get_world_size()
            with torch.no_grad():
                for p in self.ddp.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)


def synced_capture_under_no_sync(ddp: nn.Module, optimizer: Any, loss_fn: Any) -> TrainingStep:
    loop = SyncedCaptureUnderNoSync(ddp, optimizer, loss_fn)
    return TrainingStep(run=loop.run, between=loop.between)


def no_sync_capture_synced_outside(ddp: nn.Module, optimizer: Any, loss_fn: Any) -> TrainingStep:
    loop = NoSyncCaptureSyncedOutside(ddp, optimizer, loss_fn)
    return TrainingStep(run=loop.run, between=loop.between)
