"""Verify every CUDA graph of the MLP block: `pytest --cudagraph-verify examples/`."""

from __future__ import annotations

import functools

import pytest

from examples.mlp import MLPBlock, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8, 16, 32, 64), max_num_reqs=16, mode="FULL_AND_PIECEWISE")
def test_mlp_graphs_match_eager(cudagraph_verify, cudagraph_device):
    module = MLPBlock().to(cudagraph_device)
    report = cudagraph_verify(module, functools.partial(make_inputs, device=cudagraph_device))
    # Every descriptor of the plan, or under --cudagraph-split=descriptor the
    # one this item verifies.
    assert report.ok and report.descriptors
