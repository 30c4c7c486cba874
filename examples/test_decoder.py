"""The decoder's graphs, in the modes an engine uses: `pytest --cudagraph-verify examples/`."""

from __future__ import annotations

import functools

import pytest
import torch

from examples.decoder import EAGER_SUBMODULES, MAX_REQS, PAD_VALUES, SCRATCH_STATE, TinyDecoder, make_inputs
from pytest_cudagraph import GraphMode
from pytest_cudagraph.manager.pieces import SegmentedGraph

SIZES = (1, 2, 4, 8, 16, 32)
# PIECEWISE graphs run the attention eagerly between their segments.
COMMON = {
    "capture_sizes": SIZES,
    "max_num_reqs": MAX_REQS,
    "pad_values": PAD_VALUES,
    "scratch_state": SCRATCH_STATE,
    "eager_submodules": EAGER_SUBMODULES,
}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"mode": "FULL_AND_PIECEWISE", "decode_query_len": 1}, id="full-and-piecewise-q1"),
        pytest.param({"mode": "FULL_AND_PIECEWISE", "decode_query_len": 4}, id="full-and-piecewise-q4"),
        pytest.param({"mode": "FULL_DECODE_ONLY", "decode_query_len": 1}, id="full-decode-only-q1"),
        pytest.param(
            {"mode": "FULL_AND_PIECEWISE", "decode_query_len": 4, "varlen_decode": True},
            id="varlen-decode-q4",
        ),
    ],
)
def test_decoder_graphs(cudagraph_verify, cudagraph_device, config):
    torch.manual_seed(0)
    module = TinyDecoder().to(cudagraph_device)
    report = cudagraph_verify(
        module, functools.partial(make_inputs, device=cudagraph_device), **COMMON, **config
    )
    assert report.ok


def test_piecewise_graphs_run_attention_eagerly_between_three_segments(cudagraph_manager, cudagraph_device):
    # Two layers, so two attention pieces and three graph segments, at every
    # capture size; replay equals eager bit for bit on the graph's inputs.
    torch.manual_seed(0)
    module = TinyDecoder().to(cudagraph_device).eval()
    make = functools.partial(make_inputs, device=cudagraph_device)
    manager = cudagraph_manager(
        module,
        make,
        capture_sizes=SIZES,
        max_num_reqs=MAX_REQS,
        mode="FULL_AND_PIECEWISE",
        pad_values=PAD_VALUES,
        eager_submodules=EAGER_SUBMODULES,
    )
    manager.capture()
    piecewise = [d for d in manager.captured_descriptors if d.mode is GraphMode.PIECEWISE]
    assert sorted(d.num_tokens for d in piecewise) == list(SIZES)
    for desc in manager.captured_descriptors:
        graph = manager.graph(desc)
        if desc.mode is GraphMode.FULL:
            assert not isinstance(graph, SegmentedGraph)
            continue
        assert isinstance(graph, SegmentedGraph)
        assert graph.segments == 3 and graph.pieces == ["layers.0.attn", "layers.1.attn"]
        reqs = manager.capture_reqs(desc)
        inputs = make(desc.num_tokens, reqs)
        state = {n: b.clone() for n, b in module.named_buffers()}
        manager.load_inputs(desc, inputs, manager.batch_of(inputs, num_reqs=reqs))
        padded = {k: v.clone() for k, v in manager.forward_inputs(desc.num_tokens, reqs).items()}
        got = {k: v.clone() for k, v in manager.replay(desc).items()}
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(state[name])
            expected = module(**padded)
        assert all(torch.equal(got[k], expected[k]) for k in expected), desc
