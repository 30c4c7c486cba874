"""Graph manager: static buffers, padding, capture, replay."""

from __future__ import annotations

from .graph_manager import Batch, GraphManager
from .layout import InputSpec

__all__ = ["Batch", "GraphManager", "InputSpec"]
