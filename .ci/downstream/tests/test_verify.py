"""Verify the project's own MLP with the plugin's fixture and marker; a buggy MLP must fail."""

from __future__ import annotations

import functools

import pytest
import pytest_cudagraph

from downstream_models import CountingMLP, TwoLayerMLP, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8), max_num_reqs=4, mode="FULL_AND_PIECEWISE")
def test_mlp_graphs_match_eager(cudagraph_verify, cudagraph_device, cudagraph_backend):
    assert cudagraph_backend == "emulate"  # the ini option of pyproject.toml
    module = TwoLayerMLP().to(cudagraph_device)
    report = cudagraph_verify(module, functools.partial(make_inputs, device=cudagraph_device))
    assert report.ok and report.descriptors
    assert report.config["capture_sizes"] == [1, 2, 4, 8]


def test_ini_capture_sizes(cudagraph_verify):
    # No marker: the capture sizes come from ini cudagraph_sizes.
    report = cudagraph_verify(TwoLayerMLP(), make_inputs)
    assert report.ok
    assert report.config["capture_sizes"] == [1, 2, 4]


def test_python_state_in_forward_fails_verification():
    report = pytest_cudagraph.verify(
        CountingMLP(), make_inputs, capture_sizes=[1, 2, 4], max_num_reqs=2, backend="emulate"
    )
    assert not report.ok
    assert "replay_matches_eager" in {outcome.check for outcome in report.failures}
    assert "replay_matches_eager" in report.format()
