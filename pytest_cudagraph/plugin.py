"""pytest plugin: markers, options and fixtures of pytest-cudagraph.

Hooks, options and fixtures only; the work lives in the package's modules.
torch is imported lazily so that ``pytest --help`` stays fast.
"""

from __future__ import annotations

import pytest

_CUDA_MARKER = "cuda: the test needs a CUDA device; it is skipped cleanly where none is available"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _CUDA_MARKER)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not _cuda_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
