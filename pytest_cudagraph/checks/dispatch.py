"""The ``dispatch`` check: property-test the manager's dispatch over the graphs it captured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..manager import GraphManager
from ..plan import Batch, BatchDescriptor
from ..plan.properties import DispatchPropertyError, check_dispatch, check_reachability
from ..strategies import batches, invalid_batches
from .report import Finding, Outcome
from .verify_context import VerifyContext

__all__ = ["dispatch_check", "dispatch_properties"]


def dispatch_properties(
    manager: GraphManager, *, max_examples: int, plan_only: bool = False, trace_batches: Sequence[Batch] = ()
) -> Outcome:
    """Every dispatch property, for generated real batches, against ``manager.dispatch``.

    Runs only when every descriptor of the plan is captured: with a subset,
    a batch whose planned graph was not captured runs eagerly on purpose.
    ``plan_only`` (a verification split by descriptor, whose items each
    capture one) tests the plan's dispatch as if every graph were captured.
    ``trace_batches`` (a trace's shapes) are held to every property first.
    """
    plan = manager.plan
    captured = tuple(plan.descriptors) if plan_only else manager.captured_descriptors
    dispatch = plan.dispatch if plan_only else manager.dispatch
    if set(captured) != set(plan.descriptors):
        return Outcome(
            "dispatch",
            None,
            True,
            skipped=True,
            message="not every descriptor of the plan is captured (quick mode, or a capture failed), so "
            "dispatch is not property-tested",
        )
    try:
        check_reachability(plan, dispatch=dispatch, captured=captured)
        for batch in trace_batches:
            check_dispatch(plan, batch, dispatch=dispatch, captured=captured)

        @settings(
            max_examples=max_examples,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
        @given(batch=st.one_of(batches(plan), invalid_batches(max_tokens=plan.config.largest_capture_size)))
        def run(batch: Any) -> None:
            check_dispatch(plan, batch, dispatch=dispatch, captured=captured)

        run()
    except DispatchPropertyError as exc:
        return Outcome(
            "dispatch",
            None,
            False,
            str(exc),
            Finding(real_batch=exc.batch.shape() if exc.batch is not None else None),
        )
    figures = {"examples": max_examples, **({"trace_batches": len(trace_batches)} if trace_batches else {})}
    return Outcome("dispatch", None, True, figures=figures)


def dispatch_check(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> Outcome:
    """The ``dispatch`` check of a verification (exhaustive, once per plan)."""
    if not ctx.exhaustive:
        return Outcome(
            "dispatch",
            None,
            True,
            skipped=True,
            message="quick verification (exhaustive=False) does not property-test dispatch",
        )
    if not ctx.dispatch_here:
        return Outcome(
            "dispatch",
            None,
            True,
            skipped=True,
            message="a verification split by descriptor property-tests the plan's dispatch once, in "
            "the item of the plan's first descriptor",
        )
    return dispatch_properties(
        ctx.manager, max_examples=200, plan_only=ctx.plan_dispatch, trace_batches=ctx.given_batches or ()
    )
