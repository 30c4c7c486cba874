"""Property-test dispatch of drawn capture plans with the plugin's hypothesis strategies."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pytest_cudagraph import CaptureConfig, CapturePlan, GraphMode
from pytest_cudagraph.strategies import batches, capture_configs, descriptors, invalid_batches

PLAN = CapturePlan(CaptureConfig(capture_sizes=[1, 2, 4, 8, 16], max_num_reqs=8, mode="FULL_AND_PIECEWISE"))


@given(config=capture_configs(max_sizes=5, max_size=32, max_num_reqs=8), data=st.data())
def test_drawn_plans_dispatch(cudagraph_dispatch_properties, config, data):
    plan = CapturePlan(config)
    batch = data.draw(batches(plan), label="batch")
    cudagraph_dispatch_properties(plan, batch)


@given(batch=batches(PLAN))
def test_engine_plan_dispatch(cudagraph_dispatch_properties, batch):
    desc = cudagraph_dispatch_properties(PLAN, batch)
    if desc is not None and desc.mode != GraphMode.NONE:
        assert desc.num_tokens >= batch.num_tokens


@given(desc=descriptors(PLAN))
def test_drawn_descriptors_belong_to_the_plan(desc):
    assert desc in PLAN.descriptors


@given(batch=invalid_batches(max_tokens=32))
def test_invalid_batches_are_rejected(batch):
    with pytest.raises(ValueError):
        PLAN.dispatch_batch(batch)
