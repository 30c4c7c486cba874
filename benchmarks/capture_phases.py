"""Where the capture time goes, phase by phase, in the manager and in the hand-written loop.

    python benchmarks/capture_phases.py [--rounds 5]

Both capture the 67 sizes of bench_replay's d=256 stack, in turn. The same
timers wrap what both call (synchronize, empty_cache, capture_begin,
capture_end, the module's forward in warm-up and in capture); the manager's
own steps (staging a sample, the pool statistics, the module-tensor walk)
get timers of their own. What no timer covers is reported as "rest". Per
phase: the median over rounds of the total milliseconds for 67 graphs.
For diagnosis only.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import SIZES_67, HandWritten, Stack, inputs_for

import pytest_cudagraph.backends.cuda as cuda_mod
import pytest_cudagraph.manager.graph_manager as gm
from pytest_cudagraph import CaptureConfig, GraphManager

Totals = collections.defaultdict[str, float]


def _timed(totals: Totals, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


@contextmanager
def patched(totals: Totals, targets: list[tuple[Any, str, str]]) -> Iterator[None]:
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
    for owner, attr, name in targets:
        setattr(owner, attr, _timed(totals, name, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


def common_targets() -> list[tuple[Any, str, str]]:
    return [
        (torch.cuda, "synchronize", "synchronize"),
        (torch.cuda, "empty_cache", "empty_cache"),
        (torch.cuda.CUDAGraph, "capture_begin", "capture_begin"),
        (torch.cuda.CUDAGraph, "capture_end", "capture_end"),
    ]


def manager_targets() -> list[tuple[Any, str, str]]:
    return [
        (GraphManager, "stage_sample", "stage_sample"),
        (cuda_mod.CudaBackend, "warmup", "warmup (with its forward)"),
        (cuda_mod, "_reserved", "reserved stat"),
        (gm, "_tensors_of", "module walk"),
        (GraphManager, "_probe_output_rows", "output-row probe"),
        (cuda_mod.CudaBackend, "begin", "backend.begin"),
    ]


def timed_forward(module: torch.nn.Module, totals: Totals) -> Callable[[], None]:
    """Time the module's forward, split by whether a capture is running."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        name = "forward (capture)" if torch.cuda.is_current_stream_capturing() else "forward (eager)"
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    module.forward = forward  # type: ignore[method-assign]

    def undo() -> None:
        del module.forward
    return undo


def one_round(module: torch.nn.Module, device: torch.device, which: str) -> dict[str, float]:
    totals: Totals = collections.defaultdict(float)
    undo = timed_forward(module, totals)
    targets = common_targets() + (manager_targets() if which == "manager" else [])
    config = CaptureConfig(capture_sizes=SIZES_67, max_num_reqs=512)
    try:
        if which == "manager":
            target: Any = GraphManager(module, inputs_for(256, device), config, backend="cuda", device=device,
                                       progress=False, checked_capture=False)
        else:
            target = HandWritten(module, 256, SIZES_67, device)
        torch.cuda.synchronize()
        with patched(totals, targets):
            t0 = time.perf_counter()
            target.capture()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        if isinstance(target, GraphManager):
            target.release()
        del target
        torch.cuda.empty_cache()
    finally:
        undo()
    result = {k: v * 1e3 for k, v in totals.items()}
    # warm-up's own timer contains its forward: report the wrapper's share apart.
    if "warmup (with its forward)" in result:
        result["warmup (with its forward)"] -= result.get("forward (eager)", 0.0)
    result["total"] = wall * 1e3
    # The final synchronize of the timing itself is inside wall and the synchronize timer.
    result["rest"] = wall * 1e3 - sum(v for k, v in result.items() if k != "total")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    module = Stack(256).to(device).eval()
    runs: dict[str, list[dict[str, float]]] = {"hand": [], "manager": []}
    for which in ("hand", "manager"):  # one unmeasured round each: lazy initialisation
        one_round(module, device, which)
    for _ in range(args.rounds):
        for which in ("hand", "manager"):
            runs[which].append(one_round(module, device, which))
    phases = sorted({k for r in runs["hand"] + runs["manager"] for k in r}, key=lambda k: (k in ("rest", "total"), k))
    print(f"{'phase (ms for 67 graphs, median)':34s} {'hand':>8s} {'manager':>8s} {'diff/graph us':>14s}")
    for phase in phases:
        h = statistics.median(r.get(phase, 0.0) for r in runs["hand"])
        m = statistics.median(r.get(phase, 0.0) for r in runs["manager"])
        print(f"{phase:34s} {h:8.2f} {m:8.2f} {(m - h) / len(SIZES_67) * 1e3:14.1f}")
    ratio = statistics.median(m["total"] / h["total"] for h, m in zip(runs["hand"], runs["manager"], strict=True))
    print(f"ratio manager/hand (median of pairs): {ratio:.3f}")


if __name__ == "__main__":
    main()
