"""A GPU suite with faults among correct tests (docs/reliability.md runs it on an H200).

Not part of the test suite: its faulty tests fail on purpose. Run with
``python -m pytest scripts/fault_suite -p pytest_cudagraph.plugin`` (with
``-n 2`` to see pytest-xdist replace a poisoned worker).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

D = 64
pytestmark = pytest.mark.cuda


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 4 * D)
        self.b = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


class OutOfRange(nn.Module):
    """An embedding indexed past its end on batches of 8 tokens and more: a device-side assert."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids + (100 if ids.shape[0] >= 8 else 0))


class HostSync(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        return self.b(h * (2 if h.sum().item() > 0 else 1))


class Huge(MLP):
    """Asks for 256 GiB while a capture records: out of memory."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if torch.cuda.is_current_stream_capturing():
            y = y + torch.empty(1 << 38, dtype=torch.uint8, device=x.device)[: y.numel()].view_as(y).float()
        return y


def x_inputs(t: int, r: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(t, D)}


def id_inputs(t: int, r: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, 16, (t,))}


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8])
def test_a_correct(cudagraph_verify):
    cudagraph_verify(MLP(), x_inputs)


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8])
def test_b_device_assert(cudagraph_verify):
    cudagraph_verify(OutOfRange(), id_inputs)


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8])
def test_c_correct(cudagraph_verify):
    cudagraph_verify(MLP(), x_inputs)


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8])
def test_d_host_sync(cudagraph_verify):
    cudagraph_verify(HostSync(), x_inputs)


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8])
def test_e_out_of_memory(cudagraph_verify):
    cudagraph_verify(Huge(), x_inputs)


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8])
def test_f_correct(cudagraph_verify):
    cudagraph_verify(MLP(), x_inputs)
