"""Capture planning and dispatch: pure Python, no torch."""

from __future__ import annotations

from .batch import Batch
from .capture_plan import CapturePlan
from .config import CaptureConfig
from .descriptor import BatchDescriptor
from .modes import GraphMode

__all__ = ["Batch", "BatchDescriptor", "CaptureConfig", "CapturePlan", "GraphMode"]
