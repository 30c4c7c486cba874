"""Where the capture time goes, phase by phase: the manager and the two hand-written loops.

    python benchmarks/capture_phases.py [--dims 256 1024] [--rounds 7] [--experiments]
    python benchmarks/capture_phases.py --smoke   # no GPU: every timer's and variant's target resolves

Each round captures bench_replay's 67 sizes of an fp16 4-layer MLP stack
once with each contender, in turn: the manager (``GraphManager`` default),
HandWritten (a warm-up on a side stream before each size's capture) and
WarmAll (issue #15's loop: every size warmed up once, then each captured).
The same timers wrap what all call (synchronize, empty_cache,
capture_begin, capture_end, the module's forward in warm-up and in
capture); the manager's own steps get timers of their own. Timers are
exclusive: a timed call inside another is charged to itself only. What no
timer covers is "rest". Per phase: the median over rounds of the total
milliseconds for 67 graphs.

``--experiments`` also captures with manager variants patched from here
(nothing in the package changes): each shows what one change to the
capture sequence would save, as the median over rounds of its time over
WarmAll's in the same round (timers off). For diagnosis only.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import os
import pkgutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import SIZES_67, HandWritten, Stack, WarmAll, inputs_for  # type: ignore[import-not-found]

import pytest_cudagraph.backends.cuda as cuda_mod
import pytest_cudagraph.manager as manager_pkg
from pytest_cudagraph import CaptureConfig, GraphManager
from pytest_cudagraph.manager import output_rows
from pytest_cudagraph.manager.runtime import Runtime
from pytest_cudagraph.manager.staging import Staging

Patch = tuple[Any, str, str]
#: Not a time: how many segments the allocator took from the driver (cudaMalloc calls) during the capture.
SEGMENTS = "cudaMalloc calls (a count, not ms)"


class Timers:
    """Exclusive wall time per name: a timed call inside another is charged to itself only."""

    def __init__(self) -> None:
        self.totals: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._children: list[float] = []

    def start(self) -> float:
        self._children.append(0.0)
        return time.perf_counter()

    def stop(self, name: str, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        self.totals[name] += elapsed - self._children.pop()
        if self._children:
            self._children[-1] += elapsed

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = self.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop(name, t0)

        return wrapper


@contextmanager
def patched(timers: Timers, targets: list[Patch]) -> Iterator[None]:
    # What the owner itself holds (None: it inherits the attribute), put back in reverse order.
    saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in targets]
    for owner, attr, name in targets:
        setattr(owner, attr, timers.wrap(name, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            if value is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


def common_targets() -> list[Patch]:
    return [
        (torch.cuda, "synchronize", "synchronize"),
        (torch._C, "_cuda_synchronize", "synchronize"),
        (torch.cuda, "empty_cache", "empty_cache"),
        (torch.cuda.CUDAGraph, "capture_begin", "capture_begin"),
        (torch.cuda.CUDAGraph, "capture_end", "capture_end"),
    ]


def loop_targets() -> list[Patch]:
    return [
        (torch.cuda.graph, "__enter__", "torch.cuda.graph enter/exit (own)"),
        (torch.cuda.graph, "__exit__", "torch.cuda.graph enter/exit (own)"),
    ]


def _manager_modules() -> list[Any]:
    """The manager package's modules (graph_manager.py, or the capture.py and
    runtime.py it is being split into): a helper is patched wherever it is."""
    found = [manager_pkg]
    for info in pkgutil.iter_modules(manager_pkg.__path__):
        found.append(importlib.import_module(f"{manager_pkg.__name__}.{info.name}"))
    return found


def manager_targets() -> list[Patch]:
    # The manager's steps where the capture calls them: its capture part's staging (Staging), its
    # runtime part (Runtime, whose copy-in staging uses) and output_rows (GraphManager only delegates).
    targets: list[Patch] = [
        (Staging, "stage_sample", "staging: the manager's own"),
        (Runtime, "batch_of", "staging: batch_of (validation)"),
        (Runtime, "load_inputs", "staging: load_inputs (copy-in)"),
        (Staging, "_load_sample", "staging: exact-shape copy-in"),
        (output_rows, "probe", "output-row probe"),
        (output_rows, "settle", "output-row settling"),
        (cuda_mod.CudaBackend, "warmup", "warm-up set-up (stream switch, events)"),
        (cuda_mod.CudaBackend, "begin", "backend.begin / finish (own)"),
        (cuda_mod.CudaBackend, "finish", "backend.begin / finish (own)"),
        (cuda_mod._CudaCapture, "__init__", "open/end capture (own)"),
        (cuda_mod._CudaCapture, "end", "open/end capture (own)"),
        (cuda_mod, "_reserved", "pool statistics"),
    ]
    meter = getattr(importlib.import_module(f"{manager_pkg.__name__}.estimate"), "WarmupMeter", None)
    if meter is not None:  # the fast CUDA capture's memory estimate, around the largest warm-up
        targets.append((meter, "run", "memory check from the warm-up"))
    helpers = {
        "_tensors_of": "module-tensor walk",
        "_tensor_holders": "sequence set-up (holders, pieces)",
        "resolve_eager_submodules": "sequence set-up (holders, pieces)",
        "check_capture_memory": "memory check before capture",
        "check_measured_memory": "memory check from the warm-up",
    }
    for module in _manager_modules():
        for attr, name in helpers.items():
            if attr in module.__dict__:
                targets.append((module, attr, name))
    return targets


@contextmanager
def timed_forward(module: torch.nn.Module, timers: Timers) -> Iterator[None]:
    """Time the module's forward, split by whether a capture is running."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build, outside an emulated capture (--smoke)
            capturing = False
        name = "forward (capture)" if capturing else "forward (eager)"
        t0 = timers.start()
        try:
            return original(*args, **kwargs)
        finally:
            timers.stop(name, t0)

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward


# -- manager variants, patched from here (--experiments) -------------------


@contextmanager
def no_memory_check(manager: GraphManager) -> Iterator[None]:
    """PYTEST_CUDAGRAPH_MEMORY_CHECK=0: no eager forward to estimate memory first."""
    saved = os.environ.get("PYTEST_CUDAGRAPH_MEMORY_CHECK")
    os.environ["PYTEST_CUDAGRAPH_MEMORY_CHECK"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTEST_CUDAGRAPH_MEMORY_CHECK"]
        else:
            os.environ["PYTEST_CUDAGRAPH_MEMORY_CHECK"] = saved


@contextmanager
def no_output_probe(manager: GraphManager) -> Iterator[None]:
    """No output-row probe (its two eager forwards); the rows are settled across descriptors."""
    saved = output_rows.probe
    output_rows.probe = lambda state, eager_kwargs: None
    try:
        yield
    finally:
        output_rows.probe = saved


@contextmanager
def no_pool_statistics(manager: GraphManager) -> Iterator[None]:
    """The two reads of the allocator's statistics per graph left out (graph memory reads 0)."""
    saved = cuda_mod._reserved
    cuda_mod._reserved = lambda index: 0
    try:
        yield
    finally:
        cuda_mod._reserved = saved


def warm_all_first(restage: bool) -> Callable[[GraphManager], Any]:
    """The sequence as WarmAll runs it: every descriptor staged (make_inputs,
    validated, copied into the static buffers) and warmed up once, back to
    back in one warm-up call (one stream switch), then each captured with no
    warm-up of its own, on the sample staged for its warm-up (make_inputs is
    not called again).

    The manager's fast capture (``Capture._warm_up``, the default off
    verification) now runs this sequence itself, so the variant patches only
    what it would change. ``restage``: copy that sample into the static
    buffers again before its capture (``Capture._reloads`` answering yes for
    every descriptor). Without it a descriptor captured whole on a backend
    whose capture does not execute (CUDA: the graph records addresses, not
    values) is captured on whatever the buffers hold; a PIECEWISE graph with
    eager pieces is still re-staged, as its segments are replayed during the
    capture for the pieces to run on real values.
    """

    @contextmanager
    def variant(manager: GraphManager) -> Iterator[None]:
        part = manager._capture
        if restage:
            part._reloads = lambda desc: True  # type: ignore[method-assign]
        try:
            yield
        finally:
            part.__dict__.pop("_reloads", None)

    return variant


@contextmanager
def walk_once(manager: GraphManager) -> Iterator[None]:
    """The module-tensor walk done once a sequence, its list held by every graph
    (a tensor a warm-up rebinds would no longer be held)."""
    saved: list[tuple[Any, Any]] = []
    for module in _manager_modules():
        walk = module.__dict__.get("_tensors_of")
        if walk is None:
            continue
        memo: dict[int, list[Any]] = {}

        def once(holders: Any, walk: Any = walk, memo: dict[int, list[Any]] = memo) -> list[Any]:
            if id(holders) not in memo:
                memo[id(holders)] = walk(holders)
            return memo[id(holders)]

        saved.append((module, walk))
        module._tensors_of = once
    try:
        yield
    finally:
        for module, walk in saved:
            module._tensors_of = walk


def backend_from(module_name: str) -> Callable[[GraphManager], Any]:
    """The manager with the CUDA backend of another module (an earlier cuda.py, say)."""

    @contextmanager
    def variant(manager: GraphManager) -> Iterator[None]:
        new: Any = manager.state.backend
        old: Any = importlib.import_module(module_name).CudaBackend(new.device)
        old.checked, old.measure_device_memory = new.checked, new.measure_device_memory
        manager.state.backend = old
        try:
            yield
        finally:
            manager.state.backend = new

    return variant


Variant = Callable[[GraphManager], Any]
#: The sequence change proposed for the manager (see docs/benchmarks.md), timed phase by phase too.
PROPOSED = "proposed: warm all first, whole graphs not re-staged"
EXPERIMENTS: dict[str, list[Variant]] = {
    PROPOSED: [warm_all_first(restage=False)],
    "warm all first, every sample re-staged": [warm_all_first(restage=True)],
    "proposed + no memory check": [warm_all_first(restage=False), no_memory_check],
    "proposed + no memory check + no output probe + walk once": [
        warm_all_first(restage=False),
        no_memory_check,
        no_output_probe,
        walk_once,
    ],
    "manager, no pool statistics": [no_pool_statistics],
}


def _record_wait(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    event.record(stream)
    event.wait(stream)


def _enter_exit(context: Any) -> None:
    with context:
        pass


def micro(device: torch.device, n: int = 2000) -> None:
    """What the host calls of a capture sequence cost, one at a time (us a call)."""
    index = device.index or 0
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    backend = cuda_mod.CudaBackend(device)
    calls: dict[str, Callable[[], Any]] = {
        "torch._C._cuda_memoryStats (a pool statistic)": lambda: torch._C._cuda_memoryStats(index),
        "torch.cuda.memory_reserved": lambda: torch.cuda.memory_reserved(index),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(index),
        "torch._C._cuda_getCurrentStream": lambda: torch._C._cuda_getCurrentStream(index),
        "Stream.wait_stream (a new event)": lambda: side.wait_stream(torch.cuda.current_stream(index)),
        "Event.record + wait (a kept event)": lambda: _record_wait(event, side),
        "with torch.cuda.device(index): pass": lambda: _enter_exit(torch.cuda.device(index)),
        "with cuda._OnDevice(index): pass": lambda: _enter_exit(cuda_mod._OnDevice(index)),
        "torch.cuda.synchronize(index)": lambda: torch.cuda.synchronize(index),
        "torch._C._cuda_synchronize": torch._C._cuda_synchronize,
        "backend.warmup(no-op)": lambda: backend.warmup(lambda: None),
        "torch.cuda.CUDAGraph()": torch.cuda.CUDAGraph,
    }
    print(f"\n## host calls, us a call (median of 5 x {n})")
    for name, call in calls.items():
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        print(f"{name:50s} {statistics.median(runs):8.2f}")


def profile(d: int, dtype: torch.dtype, device: torch.device) -> None:
    """cProfile of one manager capture, by own time."""
    import cProfile
    import io
    import pstats

    module = Stack(d).to(device=device, dtype=dtype).eval()
    one_round(module, d, dtype, device, "manager", timed=False)
    config = CaptureConfig(capture_sizes=SIZES_67, max_num_reqs=512)
    manager = GraphManager(
        module, inputs_for(d, device, dtype), config, backend="cuda", device=device, progress=False
    )
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    manager.capture()
    torch.cuda.synchronize()
    prof.disable()
    manager.release()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
    print(f"\n## cProfile of the manager's capture, d={d}\n" + buf.getvalue())


def one_round(
    module: torch.nn.Module,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
    which: str,
    *,
    timed: bool = True,
) -> dict[str, float]:
    timers = Timers()
    is_manager = which == "manager" or which in EXPERIMENTS
    targets = common_targets() + (manager_targets() if is_manager else loop_targets())
    config = CaptureConfig(capture_sizes=SIZES_67, max_num_reqs=512)
    target: Any
    if is_manager:
        make_inputs = inputs_for(d, device, dtype)
        if timed:
            make_inputs = timers.wrap("staging: make_inputs (the user's randn)", make_inputs)
        target = GraphManager(module, make_inputs, config, backend="cuda", device=device, progress=False)
    else:
        target = (WarmAll if which == "warm_all" else HandWritten)(module, d, SIZES_67, device, dtype=dtype)
    gc.collect()
    torch.cuda.synchronize()
    segments = torch.cuda.memory_stats(device).get("segment.all.allocated", 0)
    with ExitStack() as stack:
        for variant in EXPERIMENTS.get(which, []):
            stack.enter_context(variant(target))
        if timed:
            stack.enter_context(timed_forward(module, timers))
            stack.enter_context(patched(timers, targets))
        t0 = time.perf_counter()
        target.capture()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    segments = torch.cuda.memory_stats(device).get("segment.all.allocated", 0) - segments
    if isinstance(target, GraphManager):
        with torch.no_grad():
            for n in (1, 37, 512):  # each graph still replays what eager computes (37 runs padded to 40)
                x = torch.randn(n, d, device=device, dtype=dtype)
                try:
                    torch.testing.assert_close(target.run(x=x), module(x), rtol=1e-2, atol=1e-2)
                except AssertionError as exc:
                    print(f"REPLAY DIFFERS FROM EAGER: {which}, {n} rows: {exc}")
        target.release()
    del target
    torch.cuda.empty_cache()
    result = {k: v * 1e3 for k, v in timers.totals.items()}
    result["total"] = wall * 1e3
    result[SEGMENTS] = segments
    # The final synchronize of the timing itself is inside wall and the synchronize timer.
    result["rest"] = wall * 1e3 - sum(v for k, v in result.items() if k not in ("total", SEGMENTS))
    return result


def ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of a round's ratio a/b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def phases(d: int, dtype: torch.dtype, device: torch.device, rounds: int, experiments: bool) -> None:
    torch.manual_seed(0)
    module = Stack(d).to(device=device, dtype=dtype).eval()
    main = ["manager", "hand", "warm_all"]
    timed = [*main, PROPOSED] if experiments else main
    untimed = main + (list(EXPERIMENTS) if experiments else [])
    for which in untimed:  # one unmeasured round each: lazy initialisation, cuBLAS heuristics
        one_round(module, d, dtype, device, which, timed=False)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in timed}
    plain: dict[str, list[float]] = {k: [] for k in untimed}
    for r in range(rounds):
        for which in timed[r % len(timed) :] + timed[: r % len(timed)]:
            runs[which].append(one_round(module, d, dtype, device, which))
        # Totals without the timers, whose own cost is not the contenders'.
        for which in untimed[r % len(untimed) :] + untimed[: r % len(untimed)]:
            plain[which].append(one_round(module, d, dtype, device, which, timed=False)["total"])
    names = sorted(
        {k for which in timed for r in runs[which] for k in r}, key=lambda k: (k in ("rest", "total"), k)
    )
    print(
        f"\n## d={d}, {str(dtype).removeprefix('torch.')}, {len(SIZES_67)} graphs, "
        f"median of {rounds} rounds (ms for all graphs)"
    )
    proposed = "proposed" if experiments else ""
    print(
        f"{'phase':44s} {'hand':>8s} {'warm_all':>8s} {'manager':>8s} {'mgr-warm_all us/graph':>22s} {proposed:>9s}"
    )
    for phase in names:
        h, w, m, *p = (
            statistics.median(r.get(phase, 0.0) for r in runs[k]) for k in [*main[1:], *main[:1], *timed[3:]]
        )
        per_graph = "" if phase == SEGMENTS else f"{(m - w) / len(SIZES_67) * 1e3:.1f}"
        print(f"{phase:44s} {h:8.2f} {w:8.2f} {m:8.2f} {per_graph:>22s} {''.join(f'{v:9.2f}' for v in p)}")

    print(
        f"{'untimed total (ms), over hand and warm_all in the same round':60s} {'total':>8s} "
        f"{'/hand':>7s} {'/warm_all':>9s}"
    )
    for which in untimed:
        totals = plain[which]
        print(
            f"{which:60s} {statistics.median(totals):8.2f} {ratio(totals, plain['hand']):7.3f} "
            f"{ratio(totals, plain['warm_all']):9.3f}"
        )
    for which in main:
        print(f"rounds, {which}: {' '.join(f'{t:.1f}' for t in plain[which])}")


def smoke() -> None:
    """No GPU: every timer's target and every manager variant is applied (patched and put back)
    around a capture of a tiny stack on the CPU emulator, whose replay must still be eager's.
    What moved in the package (a helper renamed, a step moved to another part) fails here."""
    torch.manual_seed(0)
    d, device = 16, torch.device("cpu")
    module = Stack(d, layers=2).eval()
    config = CaptureConfig(capture_sizes=[1, 2, 4], max_num_reqs=4)
    # torch's own CUDA entry points are missing from a CPU-only build; the package's must all resolve.
    torch_targets = [t for t in common_targets() + loop_targets() if hasattr(t[0], t[1])]
    targets = torch_targets + manager_targets()
    for which, variants in [("manager", []), *EXPERIMENTS.items()]:
        timers = Timers()
        manager = GraphManager(module, inputs_for(d, device), config, backend="emulate", progress=False)
        with ExitStack() as stack:
            for variant in variants:
                stack.enter_context(variant(manager))
            stack.enter_context(timed_forward(module, timers))
            stack.enter_context(patched(timers, targets))
            manager.capture()
        with torch.no_grad():
            x = torch.randn(3, d)
            torch.testing.assert_close(manager.run(x=x), module(x))
        manager.release()
        print(f"smoke: {which}: {len(manager.plan.descriptors)} graphs, timed {sorted(timers.totals)}")
    print(f"smoke: {len(targets)} timer targets and {len(EXPERIMENTS)} variants resolve")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--experiments", action="store_true", help="also time manager variants patched from here"
    )
    parser.add_argument(
        "--before",
        metavar="MODULE",
        help="also time the manager with the CUDA backend of MODULE (an earlier cuda.py)",
    )
    parser.add_argument("--micro", action="store_true", help="also time single host calls")
    parser.add_argument("--profile", action="store_true", help="also cProfile one manager capture per size")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="no GPU: apply every timer and variant around a tiny capture on the CPU emulator, and exit",
    )
    args = parser.parse_args()
    if args.smoke:
        smoke()
        return
    device = torch.device("cuda", 0)
    if args.before:
        EXPERIMENTS[f"manager, backend of {args.before}"] = [backend_from(args.before)]
    dtype = getattr(torch, args.dtype)
    for d in args.dims:
        phases(d, dtype, device, args.rounds, args.experiments)
    if args.micro:
        micro(device)
    if args.profile:
        for d in args.dims:
            profile(d, dtype, device)


if __name__ == "__main__":
    main()
