"""The decoder's graphs, in the modes an engine uses: `pytest --cudagraph-verify examples/`."""

from __future__ import annotations

import functools

import pytest
import torch

from examples.decoder import MAX_REQS, PAD_VALUES, SCRATCH_STATE, TinyDecoder, make_inputs

SIZES = (1, 2, 4, 8, 16, 32)
COMMON = {"capture_sizes": SIZES, "max_num_reqs": MAX_REQS, "pad_values": PAD_VALUES,
          "scratch_state": SCRATCH_STATE}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"mode": "FULL_AND_PIECEWISE", "decode_query_len": 1}, id="full-and-piecewise-q1"),
        pytest.param({"mode": "FULL_AND_PIECEWISE", "decode_query_len": 4}, id="full-and-piecewise-q4"),
        pytest.param({"mode": "FULL_DECODE_ONLY", "decode_query_len": 1}, id="full-decode-only-q1"),
        pytest.param({"mode": "FULL_AND_PIECEWISE", "decode_query_len": 4, "varlen_decode": True},
                     id="varlen-decode-q4"),
    ],
)
def test_decoder_graphs(cudagraph_verify, cudagraph_device, config):
    torch.manual_seed(0)
    module = TinyDecoder().to(cudagraph_device)
    report = cudagraph_verify(module, functools.partial(make_inputs, device=cudagraph_device), **COMMON, **config)
    assert report.ok
