"""The benchmark targets, measured side by side in one process.

    python benchmarks/bench_replay.py [--out results.json] [--quick]

1. GraphManager.run() against a hand-written torch.cuda.CUDAGraph loop doing
   the same copy-in, replay and copy-out, for a 4-layer MLP stack at d=256,
   batch 1 and at d=1024, batch 64 (ratio of medians; rounds interleaved).
2. Capturing 67 sizes (1, 2, 4, 8..512 step 8) with the manager against a
   hand-written capture loop (warm-up on a side stream, one shared pool).
3. The speedup over eager that the benchmark fixture reports (measure_manager)
   against the speedup of the hand-written loop over the same eager call.
4. vLLM's memory estimate (two largest FULL graphs, extrapolated) against the
   measured device memory of all 67 FULL graphs.
5. On the CPU emulator: replay time over eager time for the same module.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph import CaptureConfig, GraphManager
from pytest_cudagraph.bench import (
    estimate_full_graph_memory,
    estimate_pool_replica,
    measure_manager,
    time_interleaved,
)
from pytest_cudagraph.plan import GraphMode

SIZES_67 = [1, 2, 4, *range(8, 513, 8)]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def inputs_for(d: int, device: torch.device):
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, d, device=device)}
    return make_inputs


class HandWritten:
    """What a user writes by hand: static input, one graph per size, copy in, replay, copy out."""

    def __init__(self, module: nn.Module, d: int, sizes: list[int], device: torch.device,
                 *, keep_cache: bool = False) -> None:
        self.static = torch.zeros(max(sizes), d, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.module, self.sizes, self.device = module, sizes, device
        #: Skip the allocator-cache emptying torch.cuda.graph does before every
        #: capture, as vLLM's capture loop does after its first graph.
        self.keep_cache = keep_cache

    def capture(self) -> None:
        if not self.keep_cache:
            self._capture()
            return
        empty_cache = torch.cuda.empty_cache
        torch.cuda.empty_cache = lambda: None
        try:
            self._capture()
        finally:
            torch.cuda.empty_cache = empty_cache

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        with torch.no_grad():
            for n in sorted(self.sizes, reverse=True):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.module(self.static[:n])
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.module(self.static[:n])
                self.graphs[n] = (graph, out)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        graph, out = self.graphs[n]
        self.static[:n].copy_(x)
        graph.replay()
        return out[:n].clone()


def timed_capture(capture: Any) -> float:
    """Wall seconds of ``capture()``, with the device idle before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    capture()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(a: Any, b: Any, device: torch.device, pairs: int = 60, **kw: Any) -> tuple[float, float, float]:
    """Medians of a and b, and the median ratio a/b, over rounds taken in strict turn.

    One round of a, then one of b, and so on: drift of the host or the clock
    hits both sides of each pair alike, so the ratio of a pair is the fair
    comparison and its median the figure reported.
    """
    timed = time_interleaved({"a": a, "b": b}, device=device, rounds=pairs, **kw)
    ta, tb = timed["a"].rounds, timed["b"].rounds
    return statistics.median(ta), statistics.median(tb), statistics.median(x / y for x, y in zip(ta, tb, strict=True))


def run_vs_hand(d: int, batch: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Stack(d).to(device).eval()
    sizes = [1, 2, 4, 8, 16, 32, 64]
    manager = GraphManager(module, inputs_for(d, device), CaptureConfig(capture_sizes=sizes, max_num_reqs=64),
                           backend="cuda", device=device)
    manager.capture()
    hand = HandWritten(module, d, sizes, device)
    hand.capture()
    x = torch.randn(batch, d, device=device)
    assert torch.equal(manager.run(x=x), hand.run(x))
    harness_s, hand_s, run_over_hand = interleaved(lambda: manager.run(x=x), lambda: hand.run(x), device,
                                                   calls_per_round=50)
    # Speedups side by side: what the benchmark fixture reports (measure_manager)
    # and what a hand-written measurement of eager and the loop gives, in turn.
    desc = manager.dispatch(num_reqs=batch, num_tokens=batch)
    fixture_speedups, hand_speedups = [], []
    bench = None
    # Many short pairs: eager is host-bound and the replay device-bound, so a
    # speedup moves with the host's speed; each pair's two measurements are
    # taken a fraction of a second apart, and the median pair ratio reported.
    for _ in range(25):
        bench = measure_manager(manager, descriptors=[desc], rounds=10, calls_per_round=50)[0]
        fixture_speedups.append(bench.speedup or 0.0)
        # The hand-written measurement takes its rounds in turn too, as the fixture does.
        hand_timed = time_interleaved({"eager": lambda: module(x), "hand": lambda: hand.run(x)}, device=device,
                                      rounds=10, calls_per_round=50)
        hand_speedups.append(hand_timed["eager"].median / hand_timed["hand"].median)
    assert bench is not None
    manager.release()
    return {
        "d": d, "batch": batch,
        "run_us": harness_s * 1e6, "hand_us": hand_s * 1e6, "run_over_hand": run_over_hand,
        "replay_us": bench.replay.median * 1e6, "eager_us": bench.eager.median * 1e6,
        "fixture_speedup": statistics.median(fixture_speedups), "hand_speedup": statistics.median(hand_speedups),
        "speedup_ratio": statistics.median(f / h for f, h in zip(fixture_speedups, hand_speedups, strict=True)),
    }


def capture_vs_hand(d: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Stack(d).to(device).eval()
    config = CaptureConfig(capture_sizes=SIZES_67, max_num_reqs=512)
    results: dict[str, list[float]] = {"checked": [], "fast": [], "hand": [], "hand_keep_cache": []}
    for _ in range(5):
        for kind in ("checked", "fast"):
            manager = GraphManager(module, inputs_for(d, device), config, backend="cuda", device=device,
                                   progress=False, checked_capture=kind == "checked")
            results[kind].append(timed_capture(manager.capture))
            manager.release()
            del manager
        for keep_cache in (False, True):
            hand = HandWritten(module, d, SIZES_67, device, keep_cache=keep_cache)
            results["hand_keep_cache" if keep_cache else "hand"].append(timed_capture(hand.capture))
            del hand
            torch.cuda.empty_cache()
    # Memory, in a capture of its own: measuring device memory per graph costs time.
    manager = GraphManager(module, inputs_for(d, device), config, backend="cuda", device=device, progress=False,
                           measure_device_memory=True)
    manager.capture()
    measured = sum(v for k, v in manager.device_memory.items() if k.mode is GraphMode.FULL)
    estimate = estimate_full_graph_memory(manager, measured=measured)
    sampled = estimate_full_graph_memory(manager, samples=16, floor=0, measured=measured)
    replica = estimate_pool_replica(manager, measured=measured)
    manager.release()
    hand_s = statistics.median(results["hand"])
    return {
        "graphs": len(SIZES_67),
        "checked_s": statistics.median(results["checked"]), "fast_s": statistics.median(results["fast"]),
        "hand_s": hand_s, "all_s": results,
        "capture_ratio_checked": statistics.median(results["checked"]) / hand_s,
        "capture_ratio_fast": statistics.median(results["fast"]) / hand_s,
        "hand_keep_cache_s": statistics.median(results["hand_keep_cache"]),
        "capture_ratio_fast_vs_keep_cache": statistics.median(results["fast"])
        / statistics.median(results["hand_keep_cache"]),
        "memory_replica_estimate_bytes": replica.estimate, "memory_replica_samples": list(replica.samples),
        "memory_replica_error": replica.error,
        "memory_measured_bytes": estimate.measured, "memory_estimate_bytes": estimate.estimate,
        "memory_samples_bytes": list(estimate.samples), "memory_error": estimate.error,
        "memory_sampled_estimate_bytes": sampled.estimate, "memory_sampled_samples": list(sampled.samples),
        "memory_sampled_error": sampled.error,
    }


def emulator_ratio(d: int, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    module = Stack(d).eval()
    manager = GraphManager(module, inputs_for(d, cpu), CaptureConfig(capture_sizes=[batch], max_num_reqs=batch),
                           backend="emulate")
    manager.capture()
    bench = measure_manager(manager, rounds=15, calls_per_round=10)[0]
    return {"d": d, "batch": batch, "eager_us": bench.eager.median * 1e6, "replay_us": bench.replay.median * 1e6,
            "run_us": bench.run.median * 1e6, "replay_over_eager": bench.replay.median / bench.eager.median,
            "run_over_eager": bench.run.median / bench.eager.median}


def profile_capture(device: torch.device) -> dict[str, list[str]]:
    """cProfile of the manager's capture of 67 sizes and of the hand-written loop, by own time."""
    import cProfile
    import io
    import pstats

    module = Stack(256).to(device).eval()
    out: dict[str, list[str]] = {}
    for name in ("manager", "hand", "manager-again", "hand-again"):
        if name.startswith("manager"):
            target: Any = GraphManager(module, inputs_for(256, device), CaptureConfig(capture_sizes=SIZES_67,
                                       max_num_reqs=512), backend="cuda", device=device, progress=False)
        else:
            target = HandWritten(module, 256, SIZES_67, device)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        target.capture()
        torch.cuda.synchronize()
        prof.disable()
        wall = time.perf_counter() - t0
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats("pytest_cudagraph|graphs.py", 25)
        out[name] = [f"wall {wall * 1e3:.1f} ms", *buf.getvalue().splitlines()]
        if isinstance(target, GraphManager):
            target.release()
        del target
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-cuda", action="store_true")
    parser.add_argument("--profile-capture", action="store_true")
    parser.add_argument("--capture-only", action="store_true", help="only the capture and memory targets")
    args = parser.parse_args()
    results: dict[str, Any] = {"date": str(datetime.date.today()), "torch": torch.__version__}
    if not args.capture_only:
        results["emulator"] = [emulator_ratio(256, 1), emulator_ratio(256, 64), emulator_ratio(1024, 64)]
    if torch.cuda.is_available() and not args.skip_cuda:
        device = torch.device("cuda", 0)
        results["device"] = torch.cuda.get_device_name(device)
        if not args.capture_only:
            results["run_vs_hand"] = [run_vs_hand(256, 1, device), run_vs_hand(1024, 64, device)]
        results["capture"] = capture_vs_hand(256, device)
        if args.profile_capture:
            results["capture_profile"] = profile_capture(device)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
