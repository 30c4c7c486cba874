"""Timing that means the same thing on a GPU and on the CPU.

On CUDA, a round is bracketed by CUDA events on the current stream, so it
measures device time of the work queued, not the Python call; rounds run
back to back after a warm-up. On the CPU, ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Timing", "time_rounds"]


@dataclass(frozen=True)
class Timing:
    """Per-call seconds of every round, and their median."""

    rounds: tuple[float, ...]
    per_round_calls: int

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @property
    def minimum(self) -> float:
        return min(self.rounds)


def time_rounds(
    fn: Callable[[], Any],
    *,
    device: torch.device,
    rounds: int = 30,
    calls_per_round: int = 20,
    warmup: int = 10,
) -> Timing:
    """Seconds per call of ``fn``: ``rounds`` rounds of ``calls_per_round`` calls each."""
    if rounds < 1 or calls_per_round < 1 or warmup < 0:
        raise ValueError("rounds and calls_per_round must be >= 1 and warmup >= 0")
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        samples: list[float] = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            stream = torch.cuda.current_stream(device)
            for _ in range(rounds):
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record(stream)
                for _ in range(calls_per_round):
                    fn()
                end.record(stream)
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1000.0 / calls_per_round)
        else:
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(calls_per_round):
                    fn()
                samples.append((time.perf_counter() - t0) / calls_per_round)
    return Timing(tuple(samples), calls_per_round)
