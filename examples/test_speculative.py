"""A speculative-decoding target model: a uniform decode graph for each query length 1..4."""

from __future__ import annotations

import pytest
import torch

from examples.speculative import SpecDecoder, spec_inputs
from pytest_cudagraph import CaptureConfig, CapturePlan
from pytest_cudagraph.plan.selection import select_descriptors

SPEC = {
    "capture_sizes": (1, 2, 4, 8),
    "max_num_reqs": 4,
    "mode": "FULL_AND_PIECEWISE",
    "decode_query_len": 4,
    "decode_query_lens": (1, 2, 3, 4),
}


@pytest.mark.cudagraph(**SPEC)
def test_speculative_decoder_graphs(cudagraph_verify, cudagraph_device):
    torch.manual_seed(0)
    report = cudagraph_verify(SpecDecoder().to(cudagraph_device), spec_inputs(cudagraph_device))
    assert report.ok
    # A decode graph for every length the scheduler may use, each verified.
    verified = {d.uniform_token_count for d in report.descriptors if d.uniform_token_count is not None}
    if report.exhaustive:
        assert verified == {1, 2, 3, 4}
    else:  # quick: the smallest and largest graph of each mode, whatever their query lengths
        quick = select_descriptors(CapturePlan(CaptureConfig(**SPEC)).capture_order, exhaustive=False)
        assert verified == {d.uniform_token_count for d in quick if d.uniform_token_count is not None}
        assert len(verified) >= 2
    assert report.config["decode_query_lens"] == [1, 2, 3, 4]


def test_each_decode_batch_replays_the_graph_of_its_own_length():
    plan = CapturePlan(CaptureConfig(**SPEC))
    for q in (1, 2, 3, 4):
        for reqs in range(1, 5):
            desc = plan.dispatch(num_reqs=reqs, num_tokens=q * reqs, uniform_token_count=q, max_query_len=q)
            assert desc.uniform_token_count in (q, None), desc
            if desc.uniform_token_count is None:  # no graph of its length holds it: a mixed one, or eager
                assert desc.mode.name == ("NONE" if q * reqs > 8 else "PIECEWISE")
