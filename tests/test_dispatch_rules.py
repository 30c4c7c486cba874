"""Dispatch and its property checks on small, fixed plans: each rule at its boundary.

The hypothesis tests (``test_dispatch_properties.py``) sample; these pin the
edges a sample can miss: a batch of exactly a captured size, one token, a
request count at a graph's bound, an invalid batch answered with the wrong
exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_cudagraph import Batch, BatchDescriptor, CaptureConfig, CapturePlan, GraphMode
from pytest_cudagraph.plan.properties import (
    DispatchPropertyError,
    check_dispatch,
    check_rejects,
    invalid_reason,
)

FULL, PIECEWISE, NONE = GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.NONE


def plan_of(**kwargs: Any) -> CapturePlan:
    kwargs.setdefault("capture_sizes", (1, 2, 4, 8))
    kwargs.setdefault("max_num_reqs", 4)
    kwargs.setdefault("mode", "FULL_AND_PIECEWISE")
    return CapturePlan(CaptureConfig(**kwargs))


def answer(plan: CapturePlan, **batch: Any) -> BatchDescriptor:
    return plan.dispatch(**batch)


# -- check_rejects: the specific error it claims ---------------------------------------------------------
INVALID = [
    Batch(num_tokens=2, num_reqs=3),
    Batch(num_tokens=-1, num_reqs=0),
    Batch(num_tokens=4, num_reqs=0),
    Batch(num_tokens=4, num_reqs=2, num_ubatches=0),
    Batch(num_tokens=4, num_reqs=2, num_active_loras=-1),
    Batch(num_tokens=4, num_reqs=2, uniform_token_count=0),
    Batch(num_tokens=4, num_reqs=2, max_query_len=0),
]


@pytest.mark.parametrize("batch", INVALID, ids=repr)
def test_invalid_batches_are_rejected_with_value_error(batch: Batch) -> None:
    plan = plan_of()
    assert invalid_reason(batch) is not None
    with pytest.raises(ValueError):
        plan.dispatch(**batch.dispatch_args())
    check_rejects(plan, batch)  # the plan's own dispatch raises ValueError: accepted, no error
    assert check_dispatch(plan, batch) is None


def _raising(error: type[Exception]) -> Callable[..., BatchDescriptor]:
    def dispatch(**kw: Any) -> BatchDescriptor:
        raise error("no")

    return dispatch


@pytest.mark.parametrize("error", [TypeError, KeyError, RuntimeError, IndexError, AssertionError])
def test_check_rejects_requires_value_error_not_any_exception(error: type[Exception]) -> None:
    plan = plan_of()
    batch = INVALID[0]
    with pytest.raises(DispatchPropertyError) as info:
        check_rejects(plan, batch, dispatch=_raising(error))
    assert info.value.property == "totality"
    assert f"must raise ValueError, not {error.__name__}" in str(info.value)
    with pytest.raises(DispatchPropertyError):
        check_dispatch(plan, batch, dispatch=_raising(error))


def test_check_rejects_accepts_a_value_error_subclass() -> None:
    class Refused(ValueError):
        pass

    asked: list[dict[str, Any]] = []

    def dispatch(**kw: Any) -> BatchDescriptor:
        asked.append(kw)
        raise Refused("no")

    check_rejects(plan_of(), INVALID[0], dispatch=dispatch)  # no DispatchPropertyError
    assert asked == [INVALID[0].dispatch_args()]


def test_check_rejects_refuses_an_answer_to_an_invalid_batch() -> None:
    plan = plan_of()
    with pytest.raises(DispatchPropertyError) as info:
        check_rejects(plan, INVALID[0], dispatch=lambda **kw: BatchDescriptor(mode=NONE, num_tokens=0))
    assert info.value.property == "totality"
    assert "must raise ValueError" in str(info.value)


# -- completeness at the smallest batches -----------------------------------------------------------------------
def _eager_below(plan: CapturePlan, tokens: int) -> Callable[..., BatchDescriptor]:
    """Runs batches of at most ``tokens`` tokens eagerly although a graph serves them."""

    def dispatch(**kw: Any) -> BatchDescriptor:
        if kw["num_tokens"] <= tokens:
            return BatchDescriptor(mode=NONE, num_tokens=kw["num_tokens"], num_reqs=kw["num_reqs"])
        return plan.dispatch(**kw)

    return dispatch


@pytest.mark.parametrize("tokens", [1, 2])
def test_completeness_is_checked_down_to_one_token(tokens: int) -> None:
    plan = plan_of()
    for n in range(1, tokens + 1):
        batch = Batch(num_tokens=n, num_reqs=1)
        assert check_dispatch(plan, batch) is not None
        with pytest.raises(DispatchPropertyError) as info:
            check_dispatch(plan, batch, dispatch=_eager_below(plan, tokens), properties=["completeness"])
        assert info.value.property == "completeness"


def test_an_empty_batch_may_run_eagerly() -> None:
    plan = plan_of()
    empty = Batch(num_tokens=0, num_reqs=0)
    assert plan.dispatch(**empty.dispatch_args()).mode is NONE
    assert check_dispatch(plan, empty) is not None


# -- the plan's dispatch at its boundaries ----------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "graph"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_a_batch_gets_the_smallest_graph_that_holds_it(tokens: int, graph: int) -> None:
    plan = plan_of(mode="FULL", max_num_reqs=8)
    got = answer(plan, num_tokens=tokens, num_reqs=1)
    assert (got.mode, got.num_tokens) == (FULL, graph)
    assert check_dispatch(plan, Batch(num_tokens=tokens, num_reqs=1)) == got


def test_a_batch_larger_than_every_graph_runs_eagerly() -> None:
    plan = plan_of(mode="FULL")
    assert answer(plan, num_tokens=9, num_reqs=1).mode is NONE


def test_full_graphs_come_before_piecewise_ones() -> None:
    plan = plan_of(mode="FULL_AND_PIECEWISE", decode_query_len=2)
    uniform = answer(plan, num_tokens=4, num_reqs=2, uniform_token_count=2)
    assert (uniform.mode, uniform.num_tokens, uniform.uniform_token_count) == (FULL, 4, 2)
    # A mixed batch is not served by the uniform decode graph: PIECEWISE.
    mixed = answer(plan, num_tokens=4, num_reqs=2)
    assert (mixed.mode, mixed.num_tokens) == (PIECEWISE, 4)
    for batch in (
        Batch(num_tokens=4, num_reqs=2, uniform_token_count=2, max_query_len=2),
        Batch(num_tokens=4, num_reqs=2),
    ):
        assert check_dispatch(plan, batch) is not None


def test_a_full_graph_holds_at_most_its_requests() -> None:
    plan = plan_of(mode="FULL", capture_sizes=(4,), max_num_reqs=2)
    [graph] = plan.descriptors
    assert graph.num_reqs == 2
    assert answer(plan, num_tokens=4, num_reqs=2) == graph
    assert answer(plan, num_tokens=4, num_reqs=3).mode is NONE


def test_varlen_decode_graphs_hold_requests_up_to_their_query_length() -> None:
    plan = plan_of(decode_query_len=2, varlen_decode=True)
    at_bound = answer(plan, num_tokens=4, num_reqs=2, max_query_len=2)
    assert (at_bound.mode, at_bound.max_query_len) == (FULL, 2)
    assert answer(plan, num_tokens=4, num_reqs=2, max_query_len=3).mode is PIECEWISE
    assert answer(plan, num_tokens=4, num_reqs=2).mode is PIECEWISE  # may hold a prefill
    assert check_dispatch(plan, Batch(num_tokens=4, num_reqs=2, max_query_len=2)) == at_bound


@pytest.mark.parametrize(("active", "case"), [(0, 0), (1, 1), (2, 4), (3, 4), (4, 4), (7, 4)])
def test_active_adapters_map_to_the_smallest_case_that_holds_them(active: int, case: int) -> None:
    plan = plan_of(lora_cases=(0, 1, 4))
    assert plan.effective_loras(active) == case
    got = answer(plan, num_tokens=4, num_reqs=2, num_active_loras=active)
    assert got.num_active_loras == case
    assert check_dispatch(plan, Batch(num_tokens=4, num_reqs=2, num_active_loras=active)) == got


def test_candidate_ranges_partition_the_token_counts() -> None:
    plan = plan_of(mode="FULL", max_num_reqs=8)
    ranges = {d.num_tokens: plan.candidate_range(d) for d in plan.descriptors}
    assert ranges == {1: range(1, 2), 2: range(2, 3), 4: range(3, 5), 8: range(5, 9)}


@pytest.mark.parametrize(
    "batch", [Batch(num_tokens=3, num_reqs=4), Batch(num_tokens=1, num_reqs=2)], ids=repr
)
def test_more_requests_than_tokens_is_invalid_on_every_path(batch: Batch) -> None:
    plan = plan_of()
    for _ in range(2):  # the second call may be answered from the memo
        with pytest.raises(ValueError):
            plan.dispatch(**batch.dispatch_args())
