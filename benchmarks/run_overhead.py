"""The host cost of GraphManager.run() against a hand-written copy, replay and clone, on the CPU.

    python benchmarks/run_overhead.py [--against PATH] [--smoke]

Replay is made a no-op on both sides, so what is left is the Python and the
two tensor copies each call pays: the part of run() that, at small batches,
decides whether the GPU waits for the host. Medians of 7 rounds of 20,000 calls.

``--against PATH``: also the manager of another checkout (``PATH/pytest_cudagraph``, loaded
under another name), its rounds interleaved with this one's in the same process, so that a
change to the manager is measured as a ratio under the same load.

``--smoke``: 2 rounds of 200 calls, to prove the script runs (the figures mean little).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph import CaptureConfig, GraphManager

D = 256


def per_call_us(fn: Any, calls: int = 20_000) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _manager(manager_cls: Any, config_cls: Any) -> Any:
    module = torch.nn.Linear(D, D).eval()
    manager = manager_cls(
        module,
        lambda t, r: {"input": torch.randn(t, D)},
        config_cls(capture_sizes=[1, 2, 4, 8, 16, 32, 64], max_num_reqs=64),
        backend="emulate",
    )
    manager.capture()
    for desc in manager.captured_descriptors:
        manager.graph(desc).replay = lambda: None
    return manager


def _other_checkout(path: Path) -> tuple[Any, Any]:
    """GraphManager and CaptureConfig of the checkout at ``path``, as package ``pytest_cudagraph_other``."""
    init = path / "pytest_cudagraph" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "pytest_cudagraph_other", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["pytest_cudagraph_other"] = package
    spec.loader.exec_module(package)
    manager = importlib.import_module("pytest_cudagraph_other.manager.graph_manager")
    plan = importlib.import_module("pytest_cudagraph_other.plan")
    return manager.GraphManager, plan.CaptureConfig


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", type=Path, help="another checkout whose manager is timed alongside")
    parser.add_argument("--smoke", action="store_true", help="2 rounds of 200 calls: proves it runs")
    args = parser.parse_args()
    rounds, per_round = (2, 200) if args.smoke else (7, 20_000)
    x = torch.randn(1, D)
    static = torch.zeros(64, D)
    out = torch.zeros(64, D)

    def replay() -> None:
        return None

    def hand() -> torch.Tensor:
        static[:1].copy_(x)
        replay()
        return out[:1].clone()

    this = _manager(GraphManager, CaptureConfig)
    calls: dict[str, Any] = {"run()": lambda: this.run(input=x), "hand-written": hand}
    if args.against is not None:
        other = _manager(*_other_checkout(args.against))
        calls[f"run() of {args.against}"] = lambda: other.run(input=x)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():  # interleaved: every round sees the same load
            samples[name].append(per_call_us(fn, per_round))
    hand_us = statistics.median(samples["hand-written"])
    for name, values in samples.items():
        us = statistics.median(values)
        print(f"{name}: {us:.2f} us a call ({us / hand_us:.2f}x the hand-written loop)")


if __name__ == "__main__":
    main()
