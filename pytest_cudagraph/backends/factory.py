"""``make_backend``: the backend a name and a device ask for.

It sits above the backends it builds (``base.py`` defines the interface,
``cuda.py`` and ``emulate.py`` implement it), so none of them imports it back.
"""

from __future__ import annotations

import torch

from ..plan.validate import UsageError, did_you_mean, short
from .base import BACKEND_NAMES, Backend
from .cuda import CudaBackend
from .emulate import EmulateBackend

__all__ = ["as_device", "make_backend"]


def as_device(device: object) -> torch.device | None:
    """``device`` (a ``torch.device``, a string such as 'cuda:0', or None) as a ``torch.device``
    this torch has; a ``UsageError`` for anything else, before anything runs on it. A bare index
    is refused: it means a GPU to torch, which the backend then says whether it has."""
    if device is None or isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            dev = None
        if dev is None:
            raise UsageError(
                f"device {device!r} is not a device torch knows; give 'cpu', 'cuda' or 'cuda:N' (or None: "
                "the backend's)"
            )
    else:
        raise UsageError(
            f"device must be a torch.device or a string such as 'cpu' or 'cuda:0' (or None: the backend's); "
            f"got {short(device)}"
        )
    if dev is not None and dev.type not in ("cpu", "cuda", "meta"):
        raise UsageError(
            f"device {str(dev)!r}: pytest-cudagraph runs on 'cuda' (real graphs) or 'cpu' (the emulator); "
            f"got a {dev.type} device"
        )
    if dev is not None and dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"device {str(dev)!r} asks for a GPU, and torch.cuda.is_available() is False here (no GPU, or a CPU "
            "build of torch); use the CPU (backend='emulate') or mark the test @pytest.mark.cuda"
        )
    if (
        dev is not None
        and dev.type == "cuda"
        and dev.index is not None
        and dev.index >= torch.cuda.device_count()
    ):
        raise UsageError(f"device {str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def make_backend(name: str, device: torch.device | str | None) -> Backend:
    """Build the backend ``name`` ('auto', 'cuda' or 'emulate') for ``device``."""
    if name not in BACKEND_NAMES:
        hint = did_you_mean(name, BACKEND_NAMES)
        raise UsageError(f"backend must be one of {', '.join(BACKEND_NAMES)}; got {short(name)}{hint}")
    dev = as_device(device)
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
            raise UsageError(f"backend='cuda' needs a cuda device; got device={str(dev)!r}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaBackend(dev)
    if dev is None:
        dev = torch.device("cpu")
    if dev.type != "cpu":
        raise UsageError(
            f"backend='emulate' runs on the CPU; got device={str(dev)!r}. "
            "Use backend='cuda' for a GPU, or move the module to the CPU"
        )
    return EmulateBackend(dev)
