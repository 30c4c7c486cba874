"""Benchmarks: what each graph buys over eager, and what it costs in memory."""

from __future__ import annotations

from .measure import DescriptorBench, measure_manager
from .memory import MemoryEstimate, estimate_full_graph_memory, estimate_pool_replica, extrapolate
from .timing import Timing, time_interleaved, time_rounds

__all__ = [
    "DescriptorBench",
    "MemoryEstimate",
    "Timing",
    "estimate_full_graph_memory",
    "estimate_pool_replica",
    "extrapolate",
    "measure_manager",
    "time_interleaved",
    "time_rounds",
]
