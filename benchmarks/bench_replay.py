"""The benchmark targets, measured side by side in one process.

    python benchmarks/bench_replay.py [--out results.json] [--quick]
    python benchmarks/bench_replay.py --smoke   # target 5 alone, tiny and short: seconds, on the CPU

1. GraphManager.run() against a hand-written torch.cuda.CUDAGraph loop doing
   the same copy-in, replay and copy-out, for a 4-layer MLP stack at d=256,
   batch 1 and at d=1024, batch 64 (ratio of medians; rounds interleaved).
2. Capturing 67 sizes (1, 2, 4, 8..512 step 8) of fp16 stacks (d=256 and
   d=1024) with the manager against two hand-written capture loops into one
   shared pool: a warm-up on a side stream before each size's capture
   (HandWritten), and every size warmed up once first, then each captured
   (WarmAll, issue #15's loop).
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
from collections.abc import Callable
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
        out: torch.Tensor = x + self.down(nn.functional.gelu(self.up(self.norm(x))))
        return out


class Stack(nn.Module):
    def __init__(self, d: int, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def inputs_for(
    d: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, d, device=device, dtype=dtype)}

    return make_inputs


class HandWritten:
    """What a user writes by hand: static input, one graph per size, copy in, replay, copy out."""

    def __init__(
        self,
        module: nn.Module,
        d: int,
        sizes: list[int],
        device: torch.device,
        *,
        keep_cache: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.static = torch.zeros(max(sizes), d, device=device, dtype=dtype)
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
        side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
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


class WarmAll(HandWritten):
    """The capture loop of issue #15: every size warmed up once on a side
    stream first, then each captured with ``torch.cuda.graph`` into one pool,
    largest first (the pattern of the ``torch.cuda.graph`` documentation).

    Its warm-ups run back to back on a warm allocator cache, and its
    ``torch.cuda.graph`` empties the cache before every capture but finds it
    empty after the first, so it pays neither a per-graph warm-up set-up nor
    the allocator churn of HandWritten's per-size loop.
    """

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        order = sorted(self.sizes, reverse=True)
        with torch.no_grad():
            side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for n in order:
                    self.module(self.static[:n])
            torch.cuda.current_stream().wait_stream(side)
            for n in order:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.module(self.static[:n])
                self.graphs[n] = (graph, out)


def timed_capture(capture: Any) -> float:
    """Wall seconds of ``capture()``, with the device idle before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    capture()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(
    a: Any, b: Any, device: torch.device, pairs: int = 60, **kw: Any
) -> tuple[float, float, float]:
    """Medians of a and b, and the median ratio a/b, over rounds taken in strict turn.

    One round of a, then one of b, and so on: drift of the host or the clock
    hits both sides of each pair alike, so the ratio of a pair is the fair
    comparison and its median the figure reported.
    """
    timed = time_interleaved({"a": a, "b": b}, device=device, rounds=pairs, **kw)
    ta, tb = timed["a"].rounds, timed["b"].rounds
    return (
        statistics.median(ta),
        statistics.median(tb),
        statistics.median(x / y for x, y in zip(ta, tb, strict=True)),
    )


def run_vs_hand(d: int, batch: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Stack(d).to(device).eval()
    sizes = [1, 2, 4, 8, 16, 32, 64]
    manager = GraphManager(
        module,
        inputs_for(d, device),
        CaptureConfig(capture_sizes=sizes, max_num_reqs=64),
        backend="cuda",
        device=device,
    )
    manager.capture()
    hand = HandWritten(module, d, sizes, device)
    hand.capture()
    x = torch.randn(batch, d, device=device)
    assert torch.equal(manager.run(x=x), hand.run(x))
    harness_s, hand_s, run_over_hand = interleaved(
        lambda: manager.run(x=x), lambda: hand.run(x), device, calls_per_round=50
    )
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
        hand_timed = time_interleaved(
            {"eager": lambda: module(x), "hand": lambda: hand.run(x)},
            device=device,
            rounds=10,
            calls_per_round=50,
        )
        hand_speedups.append(hand_timed["eager"].median / hand_timed["hand"].median)
    assert bench is not None
    manager.release()
    return {
        "d": d,
        "batch": batch,
        "run_us": harness_s * 1e6,
        "hand_us": hand_s * 1e6,
        "run_over_hand": run_over_hand,
        "replay_us": bench.replay.median * 1e6,
        "eager_us": bench.eager.median * 1e6,
        "fixture_speedup": statistics.median(fixture_speedups),
        "hand_speedup": statistics.median(hand_speedups),
        "speedup_ratio": statistics.median(
            f / h for f, h in zip(fixture_speedups, hand_speedups, strict=True)
        ),
    }


def capture_vs_hand(
    d: int, device: torch.device, dtype: torch.dtype = torch.float16, rounds: int = 7
) -> dict[str, Any]:
    """67 sizes captured by the manager and by the hand-written loops, in turn.

    Each round captures once with every contender, the order rotated from
    round to round; a ratio is the median over rounds of that round's ratio
    (its two captures taken well under a second apart), so that drift of the
    host hits both sides of each pair alike.
    """
    torch.manual_seed(0)
    module = Stack(d).to(device=device, dtype=dtype).eval()
    make_inputs = inputs_for(d, device, dtype)
    config = CaptureConfig(capture_sizes=SIZES_67, max_num_reqs=512)

    def manager_capture(checked: bool) -> float:
        manager = GraphManager(
            module,
            make_inputs,
            config,
            backend="cuda",
            device=device,
            progress=False,
            checked_capture=checked,
        )
        took = timed_capture(manager.capture)
        manager.release()
        return took

    def loop_capture(cls: type[HandWritten], keep_cache: bool = False) -> float:
        hand = cls(module, d, SIZES_67, device, keep_cache=keep_cache, dtype=dtype)
        took = timed_capture(hand.capture)
        del hand
        torch.cuda.empty_cache()
        return took

    contenders: dict[str, Any] = {
        "checked": lambda: manager_capture(True),
        "fast": lambda: manager_capture(False),
        "hand": lambda: loop_capture(HandWritten),
        "hand_keep_cache": lambda: loop_capture(HandWritten, keep_cache=True),
        "warm_all": lambda: loop_capture(WarmAll),
    }
    for run in contenders.values():  # one unmeasured round: lazy initialisation, cuBLAS heuristics
        run()
    results: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            results[name].append(contenders[name]())

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(results[a], results[b], strict=True))

    # Memory, in a capture of its own: measuring device memory per graph costs time.
    manager = GraphManager(
        module, make_inputs, config, backend="cuda", device=device, progress=False, measure_device_memory=True
    )
    manager.capture()
    measured = sum(v for k, v in manager.device_memory.items() if k.mode is GraphMode.FULL)
    estimate = estimate_full_graph_memory(manager, measured=measured)
    sampled = estimate_full_graph_memory(manager, samples=16, floor=0, measured=measured)
    replica = estimate_pool_replica(manager, measured=measured)
    manager.release()
    return {
        "d": d,
        "dtype": str(dtype).removeprefix("torch."),
        "graphs": len(SIZES_67),
        "rounds": rounds,
        "median_s": {name: statistics.median(v) for name, v in results.items()},
        "all_s": results,
        "capture_ratio_fast": ratio("fast", "hand"),
        "capture_ratio_fast_vs_warm_all": ratio("fast", "warm_all"),
        "capture_ratio_checked": ratio("checked", "hand"),
        "capture_ratio_checked_vs_warm_all": ratio("checked", "warm_all"),
        "capture_ratio_fast_vs_keep_cache": ratio("fast", "hand_keep_cache"),
        "capture_ratio_hand_vs_warm_all": ratio("hand", "warm_all"),
        "memory_replica_estimate_bytes": replica.estimate,
        "memory_replica_samples": list(replica.samples),
        "memory_replica_error": replica.error,
        "memory_measured_bytes": estimate.measured,
        "memory_estimate_bytes": estimate.estimate,
        "memory_samples_bytes": list(estimate.samples),
        "memory_error": estimate.error,
        "memory_sampled_estimate_bytes": sampled.estimate,
        "memory_sampled_samples": list(sampled.samples),
        "memory_sampled_error": sampled.error,
    }


def emulator_ratio(d: int, batch: int, rounds: int = 15, calls_per_round: int = 10) -> dict[str, Any]:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    module = Stack(d).eval()
    manager = GraphManager(
        module,
        inputs_for(d, cpu),
        CaptureConfig(capture_sizes=[batch], max_num_reqs=batch),
        backend="emulate",
    )
    manager.capture()
    bench = measure_manager(manager, rounds=rounds, calls_per_round=calls_per_round)[0]
    return {
        "d": d,
        "batch": batch,
        "eager_us": bench.eager.median * 1e6,
        "replay_us": bench.replay.median * 1e6,
        "run_us": bench.run.median * 1e6,
        "replay_over_eager": bench.replay.median / bench.eager.median,
        "run_over_eager": bench.run.median / bench.eager.median,
    }


def profile_capture(device: torch.device) -> dict[str, list[str]]:
    """cProfile of the manager's capture of 67 sizes and of the hand-written loop, by own time."""
    import cProfile
    import io
    import pstats

    module = Stack(256).to(device).eval()
    out: dict[str, list[str]] = {}
    for name in ("manager", "hand", "manager-again", "hand-again"):
        if name.startswith("manager"):
            target: Any = GraphManager(
                module,
                inputs_for(256, device),
                CaptureConfig(capture_sizes=SIZES_67, max_num_reqs=512),
                backend="cuda",
                device=device,
                progress=False,
            )
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
    parser.add_argument(
        "--capture-dims",
        type=int,
        nargs="+",
        default=[256, 1024],
        help="hidden sizes of the stacks the capture target is measured on",
    )
    parser.add_argument("--capture-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--capture-rounds", type=int, default=7)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="only the emulator target, at d=32 and 3 rounds, no CUDA: proves it runs, measures little",
    )
    args = parser.parse_args()
    results: dict[str, Any] = {"date": str(datetime.date.today()), "torch": torch.__version__}
    if args.smoke:
        results["emulator"] = [emulator_ratio(32, b, rounds=3, calls_per_round=2) for b in (1, 4)]
    elif not args.capture_only:
        results["emulator"] = [emulator_ratio(256, 1), emulator_ratio(256, 64), emulator_ratio(1024, 64)]
    if torch.cuda.is_available() and not (args.skip_cuda or args.smoke):
        device = torch.device("cuda", 0)
        results["device"] = torch.cuda.get_device_name(device)
        if not args.capture_only:
            results["run_vs_hand"] = [run_vs_hand(256, 1, device), run_vs_hand(1024, 64, device)]
        dtype = getattr(torch, args.capture_dtype)
        results["capture"] = [
            capture_vs_hand(d, device, dtype, rounds=args.capture_rounds) for d in args.capture_dims
        ]
        if args.profile_capture:
            results["capture_profile"] = profile_capture(device)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
