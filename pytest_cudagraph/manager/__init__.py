"""Graph manager: static buffers, padding, capture, replay."""

from __future__ import annotations

from ..plan import Batch
from .graph_manager import GraphManager
from .layout import InputSpec

__all__ = ["Batch", "GraphManager", "InputSpec"]
