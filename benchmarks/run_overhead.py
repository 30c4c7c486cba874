"""The host cost of GraphManager.run() against a hand-written copy, replay and clone, on the CPU.

    python benchmarks/run_overhead.py

Replay is made a no-op on both sides, so what is left is the Python and the
two tensor copies each call pays: the part of run() that, at small batches,
decides whether the GPU waits for the host. Medians of 7 rounds of 20,000 calls.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph import CaptureConfig, GraphManager


def per_call_us(fn: Any, calls: int = 20_000, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    d = 256
    module = torch.nn.Linear(d, d).eval()
    manager = GraphManager(
        module,
        lambda t, r: {"input": torch.randn(t, d)},
        CaptureConfig(capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_num_reqs=64),
        backend="emulate",
    )
    manager.capture()
    for desc in manager.captured_descriptors:
        manager.graph(desc).replay = lambda: None  # type: ignore[method-assign]
    x = torch.randn(1, d)
    static = torch.zeros(64, d)
    out = torch.zeros(64, d)

    def replay() -> None:
        return None

    def hand() -> torch.Tensor:
        static[:1].copy_(x)
        replay()
        return out[:1].clone()

    for _ in range(2):
        run_us = per_call_us(lambda: manager.run(input=x))
        hand_us = per_call_us(hand)
        print(f"run() {run_us:.2f} us a call, hand-written {hand_us:.2f} us a call ({run_us / hand_us:.2f}x)")


if __name__ == "__main__":
    main()
