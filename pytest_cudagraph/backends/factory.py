"""``make_backend``: the backend a name and a device ask for.

It sits above the backends it builds (``base.py`` defines the interface,
``cuda.py`` and ``emulate.py`` implement it), so none of them imports it back.
"""

from __future__ import annotations

import torch

from ..plan.validate import UsageError
from .base import BACKEND_NAMES, Backend
from .cuda import CudaBackend
from .emulate import EmulateBackend

__all__ = ["make_backend"]


def make_backend(name: str, device: torch.device | str | None) -> Backend:
    """Build the backend ``name`` ('auto', 'cuda' or 'emulate') for ``device``."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    dev = torch.device(device) if device is not None else None
    if name == "auto":
        if dev is not None:
            name = "cuda" if dev.type == "cuda" else "emulate"
        else:
            name = "cuda" if torch.cuda.is_available() else "emulate"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "backend='cuda' needs a CUDA device, and torch.cuda.is_available() is False "
                "here; use backend='emulate' (CPU) or 'auto'"
            )
        if dev is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"backend='cuda' needs a cuda device; got device={str(dev)!r}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaBackend(dev)
    if dev is None:
        dev = torch.device("cpu")
    if dev.type != "cpu":
        raise ValueError(
            f"backend='emulate' runs on the CPU; got device={str(dev)!r}. "
            "Use backend='cuda' for a GPU, or move the module to the CPU"
        )
    return EmulateBackend(dev)
