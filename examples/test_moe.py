"""The MoE layer's graphs: capture-safe routing, padding kept out of the experts."""

from __future__ import annotations

import functools

import pytest
import torch

from examples.moe import MoE, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8, 16, 32), max_num_reqs=16, mode="FULL_AND_PIECEWISE")
def test_moe_graphs(cudagraph_verify, cudagraph_device):
    torch.manual_seed(0)
    report = cudagraph_verify(
        MoE().to(cudagraph_device), functools.partial(make_inputs, device=cudagraph_device)
    )
    assert report.ok
