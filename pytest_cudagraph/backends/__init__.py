"""Graph backends: real CUDA graphs, and a CPU emulation of their semantics."""

from __future__ import annotations

from .base import BACKEND_NAMES, Backend, CapturedGraph
from .factory import make_backend

__all__ = ["BACKEND_NAMES", "Backend", "CapturedGraph", "make_backend"]
