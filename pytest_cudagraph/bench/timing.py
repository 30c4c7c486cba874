"""Timing that means the same thing on a GPU and on the CPU.

On CUDA, a round is bracketed by CUDA events on the current stream, so it
measures device time of the work queued, not the Python call; rounds run
after a warm-up. On the CPU, ``time.perf_counter``. Functions compared with
each other are timed in turn (``time_interleaved``), not one after another.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Timing", "time_interleaved", "time_rounds"]


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
    return time_interleaved(
        {"fn": fn}, device=device, rounds=rounds, calls_per_round=calls_per_round, warmup=warmup
    )["fn"]


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    device: torch.device,
    rounds: int = 30,
    calls_per_round: int = 20,
    warmup: int = 10,
) -> dict[str, Timing]:
    """``time_rounds`` for several functions at once, their rounds taken in turn.

    A ratio of two timings (a speedup) is only as good as the conditions
    they share: a host whose clock or load drifts over a second would give
    functions timed one after the other different conditions. Taken in turn,
    a round of each at a time (the first of each turn rotating), every
    function sees the same drift.
    """
    if rounds < 1 or calls_per_round < 1 or warmup < 0:
        raise ValueError(
            f"rounds and calls_per_round must be >= 1 and warmup >= 0; got rounds={rounds}, "
            f"calls_per_round={calls_per_round}, warmup={warmup}"
        )
    if not fns:
        raise ValueError("fns must name at least one function to time")
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for name in names:
            for _ in range(warmup):
                fns[name]()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for r in range(rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                samples[name].append(_one_round(fns[name], device, calls_per_round))
    return {name: Timing(tuple(samples[name]), calls_per_round) for name in names}


def _one_round(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Seconds per call over ``calls`` calls: device time between CUDA events on a GPU."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        for _ in range(calls):
            fn()
        end.record(stream)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls
