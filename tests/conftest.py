from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=["emulate", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request: pytest.FixtureRequest) -> str:
    """Each manager test runs on the emulator and, where there is a GPU, on CUDA."""
    return str(request.param)


@pytest.fixture
def device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


pytest_plugins = ["pytester"]


def isolate_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner pytester runs load only this plugin (xdist workers too, through the
    environment): other installed plugins would be imported afresh by every
    in-process run, which costs ~0.7 s a run."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "pytest_cudagraph.plugin")


@pytest.fixture(scope="session")
def verify_imported() -> None:
    """Run verify once before pytester snapshots ``sys.modules``.

    verify imports a few hundred torch modules lazily (torch._inductor among
    them). In-process pytester runs drop the modules a run imported, and a
    second import of ``torch._inductor.test_operators`` fails (its
    TORCH_LIBRARY is registered once per process), so they must be imported
    before the first inner run.
    """
    from pytest_cudagraph.checks import verify

    lin = torch.nn.Linear(2, 2)
    verify(lin, lambda t, r: {"input": torch.randn(t, 2)}, capture_sizes=(1,), checks=["capture_safety"])
