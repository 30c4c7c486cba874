"""Replay against eager for the MLP stack, as a pytest-benchmark suite CI can publish.

pytest benchmarks/ --benchmark-json=bench.json --cudagraph-bench-report=bench.md
"""

from __future__ import annotations

import functools

import pytest
import torch

from benchmarks.bench_replay import Stack, inputs_for


@pytest.mark.parametrize("d", [256, 1024])
def test_mlp_stack(cudagraph_benchmark, cudagraph_device, d):
    torch.manual_seed(0)
    module = Stack(d).to(cudagraph_device)
    results = cudagraph_benchmark(
        module,
        functools.partial(inputs_for(d, cudagraph_device)),
        capture_sizes=[1, 8, 64],
        mode="FULL",
        rounds=20,
        calls_per_round=20,
    )
    if results is not None:  # None: pytest-benchmark disabled (xdist)
        assert [r.descriptor.num_tokens for r in results] == [64, 8, 1]
