"""Where the manager's capture time goes beyond a hand-written loop: switch parts off, one at a time.

    python benchmarks/capture_ablation.py

Each variant captures the 67 sizes of bench_replay's d=256 stack with the
fast capture; the hand-written loop runs between them. Medians of 5 rounds.
For diagnosis only: the variants break what the manager promises.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import SIZES_67, HandWritten, Stack, inputs_for, timed_capture

import pytest_cudagraph.backends.cuda as cuda_mod
import pytest_cudagraph.manager.graph_manager as gm
from pytest_cudagraph import CaptureConfig, GraphManager


def main() -> None:
    device = torch.device("cuda", 0)
    module = Stack(256).to(device).eval()
    config = CaptureConfig(capture_sizes=SIZES_67, max_num_reqs=512)
    cached: dict[tuple[int, int], Any] = {}
    real_make = gm.call_make_inputs

    def cached_make(fn: Any, t: int, r: int) -> Any:
        if (t, r) not in cached:
            cached[(t, r)] = real_make(fn, t, r)
        return cached[(t, r)]

    variants = {
        "full": {},
        "no make_inputs": {"call_make_inputs": cached_make},
        "no reserved stat": {"_reserved": lambda device: 0},
        "no module walk": {"_tensors_of": lambda holders: []},
        "no probe": {"probe": True},
    }
    times: dict[str, list[float]] = {k: [] for k in [*variants, "hand"]}
    for _ in range(5):
        for name, patch in variants.items():
            saved = {}
            for attr, value in patch.items():
                if attr == "probe":
                    continue
                owner = cuda_mod if attr == "_reserved" else gm
                saved[(owner, attr)] = getattr(owner, attr)
                setattr(owner, attr, value)
            manager = GraphManager(module, inputs_for(256, device), config, backend="cuda", device=device,
                                   progress=False, checked_capture=False)
            if "probe" in patch:
                manager._probed_rows = ["tokens"]
            times[name].append(timed_capture(manager.capture))
            manager.release()
            for (owner, attr), value in saved.items():
                setattr(owner, attr, value)
        hand = HandWritten(module, 256, SIZES_67, device)
        times["hand"].append(timed_capture(hand.capture))
        del hand
        torch.cuda.empty_cache()
    hand = statistics.median(times["hand"])
    for name, values in times.items():
        m = statistics.median(values)
        print(f"{name:18s} {m * 1e3:7.1f} ms  {m / hand:5.2f}x hand")


if __name__ == "__main__":
    main()
