from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=["emulate", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request: pytest.FixtureRequest) -> str:
    """Each manager test runs on the emulator and, where there is a GPU, on CUDA."""
    return str(request.param)


@pytest.fixture
def device(backend: str) -> torch.device:
    return torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
