"""Dispatch is provably right: properties over generated configurations, a
differential test against a brute-force dispatcher, and a broken dispatcher
for every property, which its check must catch with a shrunk counterexample."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_cudagraph import Batch, BatchDescriptor, CaptureConfig, CapturePlan, GraphMode
from pytest_cudagraph.plan.properties import (
    PROPERTIES,
    DispatchPropertyError,
    check_dispatch,
    check_reachability,
    invalid_reason,
)
from pytest_cudagraph.plugin.profiles import CI_PROFILE, THOROUGH_PROFILE
from pytest_cudagraph.strategies import batches, capture_configs, descriptors, invalid_batches

FULL, PIECEWISE, NONE = GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.NONE


# -- a slow dispatcher, written plainly from the rule --------------------------------------
def brute_force(plan: CapturePlan, batch: Batch) -> BatchDescriptor:
    """No precomputed candidates, no memo: scan every descriptor."""
    reason = invalid_reason(batch)
    if reason is not None:
        raise ValueError(reason)
    cases = sorted(c for c in plan.config.lora_cases if c > 0)
    count = batch.num_active_loras
    loras = count if count <= 0 or not cases else next((c for c in cases if c >= count), cases[-1])
    if batch.num_tokens > 0:
        for mode in (FULL, PIECEWISE):
            holding = [
                d
                for d in plan.descriptors
                if d.mode is mode and d.num_active_loras == loras and d.num_tokens >= batch.num_tokens
            ]
            if not holding:
                continue
            smallest = min(d.num_tokens for d in holding)
            for d in holding:
                if d.num_tokens != smallest:
                    continue
                if d.uniform_token_count is not None and d.uniform_token_count != batch.uniform_token_count:
                    continue
                if d.max_query_len is not None and (
                    batch.max_query_len is None or batch.max_query_len > d.max_query_len
                ):
                    continue
                if d.num_reqs is not None and batch.num_reqs > d.num_reqs:
                    continue
                if d.num_ubatches != batch.num_ubatches:
                    continue
                return d
    return BatchDescriptor(
        mode=NONE,
        num_tokens=batch.num_tokens,
        num_reqs=batch.num_reqs,
        num_active_loras=loras,
        num_ubatches=batch.num_ubatches,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=capture_configs(), data=st.data())
def test_every_property_holds_and_dispatch_equals_brute_force(
    config: CaptureConfig, data: st.DataObject
) -> None:
    plan = CapturePlan(config)
    check_reachability(plan)
    for _ in range(10):
        batch = data.draw(batches(plan), label="batch")
        assert check_dispatch(plan, batch) == brute_force(plan, batch)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=capture_configs(modes=["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"], varlen=False, speculative=True),
    data=st.data(),
)
def test_a_speculative_decode_batch_is_served_by_the_graph_of_its_own_length_or_says_why_not(
    config: CaptureConfig, data: st.DataObject
) -> None:
    from pytest_cudagraph.plan.trace import fallback_reason

    plan = CapturePlan(config)
    for _ in range(10):
        batch = data.draw(batches(plan, kinds=("uniform_decode",)), label="batch")
        desc = plan.dispatch_batch(batch)
        if desc.uniform_token_count is not None:
            assert desc.uniform_token_count == batch.uniform_token_count
            continue
        # Not its own length's graph: none of the graphs dispatch may try for its tokens serves it.
        loras = plan.effective_loras(batch.num_active_loras)
        assert not any(
            d.uniform_token_count == batch.uniform_token_count
            and d.is_compatible(
                num_reqs=batch.num_reqs,
                num_tokens=batch.num_tokens,
                uniform_token_count=batch.uniform_token_count,
                num_active_loras=loras,
                max_query_len=batch.max_query_len,
                num_ubatches=batch.num_ubatches,
            )
            for d in plan.candidates(batch.num_tokens, batch.num_active_loras)
        )
        if desc.mode is NONE:
            assert fallback_reason(plan, batch)


@given(config=capture_configs(max_sizes=4, max_size=16), batch=invalid_batches(max_tokens=16))
def test_invalid_batches_raise_value_error(config: CaptureConfig, batch: Batch) -> None:
    plan = CapturePlan(config)
    with pytest.raises(ValueError):
        plan.dispatch(**batch.dispatch_args())
    assert check_dispatch(plan, batch) is None  # totality: checked as a rejection


def test_a_larger_graph_of_the_same_mode_is_never_used() -> None:
    # The reference's rule, shown on the one case where it leaves a compatible
    # graph unused: a microbatched batch whose smallest holding size has no
    # microbatched twin runs eagerly, though a larger twin could serve it.
    plan = CapturePlan(CaptureConfig(capture_sizes=(6, 8), max_num_reqs=4, mode="FULL", num_ubatches=2))
    twin = BatchDescriptor(FULL, 8, num_reqs=4, uniform_token_count=2, num_ubatches=2)
    assert twin in plan.descriptors
    batch = Batch(num_tokens=6, num_reqs=3, uniform_token_count=2, max_query_len=2, num_ubatches=2)
    assert plan.dispatch(**batch.dispatch_args()).mode is NONE
    assert twin.is_compatible(**batch.dispatch_args())
    assert check_dispatch(plan, batch) is not None  # completeness is stated over the candidates


# -- broken dispatchers -----------------------------------------------------------------------
class OffByOne(CapturePlan):
    """Looks up candidates one token count too low: a graph of T tokens serves T + 1."""

    def _lookup(self, num_reqs: int, num_tokens: int, *rest: Any) -> BatchDescriptor:
        answer = super()._lookup(num_reqs, max(num_tokens - 1, 1), *rest)
        if answer.mode is NONE:
            return super()._lookup(num_reqs, num_tokens, *rest)
        return answer


class NoLoraClamp(CapturePlan):
    """Counts above the largest LoRA case are not clamped to it."""

    def effective_loras(self, num_active_loras: int) -> int:
        if num_active_loras > self.max_lora_case:
            return num_active_loras
        return super().effective_loras(num_active_loras)


def _first(
    plan: CapturePlan,
    batch_args: dict[str, Any],
    skip: Callable[[BatchDescriptor], bool],
    order: tuple[GraphMode, ...] = (FULL, PIECEWISE),
    pick_largest: bool = False,
) -> BatchDescriptor:
    """A dispatcher with one rule bent: ``skip`` says which compatibility test to ignore."""
    n = batch_args["num_tokens"]
    loras = plan.effective_loras(batch_args["num_active_loras"])
    for mode in order:
        holding = sorted(
            (
                d
                for d in plan.descriptors
                if d.mode is mode and d.num_active_loras == loras and d.num_tokens >= n
            ),
            key=lambda d: d.num_tokens,
            reverse=pick_largest,
        )
        for d in holding:
            if not pick_largest and d.num_tokens != holding[0].num_tokens:
                break
            relaxed = dict(batch_args, num_active_loras=loras)
            if skip(d):
                relaxed["uniform_token_count"] = d.uniform_token_count
                relaxed["max_query_len"] = d.max_query_len
            if d.is_compatible(**relaxed):
                return d
    return BatchDescriptor(mode=NONE, num_tokens=n, num_reqs=batch_args["num_reqs"], num_active_loras=loras)


def uniform_to_mixed(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    """Serves uniform decode graphs to any batch."""

    def dispatch(**kw: Any) -> BatchDescriptor:
        plan.dispatch(**kw)  # keep the validation
        return _first(plan, kw, lambda d: d.uniform_token_count is not None)

    return dispatch


def varlen_to_prefill(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    """Serves varlen decode graphs to batches with a prefill."""

    def dispatch(**kw: Any) -> BatchDescriptor:
        plan.dispatch(**kw)
        return _first(plan, kw, lambda d: d.max_query_len is not None and d.uniform_token_count is None)

    return dispatch


def piecewise_first(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    def dispatch(**kw: Any) -> BatchDescriptor:
        plan.dispatch(**kw)
        return _first(plan, kw, lambda d: False, order=(PIECEWISE, FULL))

    return dispatch


def over_pads_odd(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    """Odd token counts get the largest compatible graph of the mode."""

    def dispatch(**kw: Any) -> BatchDescriptor:
        plan.dispatch(**kw)
        return _first(plan, kw, lambda d: False, pick_largest=kw["num_tokens"] % 2 == 1)

    return dispatch


def over_pads(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    """Every batch gets the largest compatible graph of the mode."""

    def dispatch(**kw: Any) -> BatchDescriptor:
        plan.dispatch(**kw)
        return _first(plan, kw, lambda d: False, pick_largest=True)

    return dispatch


def drops_odd(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    """Runs odd token counts eagerly."""

    def dispatch(**kw: Any) -> BatchDescriptor:
        answer = plan.dispatch(**kw)
        if kw["num_tokens"] % 2:
            return BatchDescriptor(mode=NONE, num_tokens=kw["num_tokens"], num_reqs=kw["num_reqs"])
        return answer

    return dispatch


def raises_on_oversize(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    def dispatch(**kw: Any) -> BatchDescriptor:
        if kw["num_tokens"] > plan.config.largest_capture_size:
            raise KeyError(kw["num_tokens"])
        return plan.dispatch(**kw)

    return dispatch


def accepts_invalid(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    def dispatch(**kw: Any) -> BatchDescriptor:
        try:
            return plan.dispatch(**kw)
        except ValueError:
            return BatchDescriptor(mode=NONE, num_tokens=0)

    return dispatch


def hides_largest(plan: CapturePlan) -> Callable[..., BatchDescriptor]:
    """Never returns the largest graph."""
    largest = max(plan.descriptors, key=lambda d: d.num_tokens)

    def dispatch(**kw: Any) -> BatchDescriptor:
        answer = plan.dispatch(**kw)
        return (
            BatchDescriptor(mode=NONE, num_tokens=kw["num_tokens"], num_reqs=kw["num_reqs"])
            if answer == largest
            else answer
        )

    return dispatch


BROKEN: list[tuple[str, str, Any, dict[str, Any]]] = [
    # (name, property that must catch it, plan class or dispatch factory, config bounds)
    ("off_by_one", "soundness", OffByOne, {}),
    ("lora_clamp_removed", "lora", NoLoraClamp, {"lora": True}),
    ("uniform_decode_served_to_mixed", "uniform_decode", uniform_to_mixed, {"varlen": False}),
    # Query lengths are no part of varlen decode (a varlen graph takes 1..q a request): not drawn.
    (
        "varlen_decode_served_to_prefill",
        "varlen_decode",
        varlen_to_prefill,
        {"varlen": True, "speculative": False},
    ),
    ("piecewise_before_full", "minimal_padding", piecewise_first, {}),
    ("over_pads", "minimal_padding", over_pads, {}),
    ("over_pads_odd_counts", "monotonicity", over_pads_odd, {}),
    ("drops_odd_counts", "completeness", drops_odd, {}),
    ("raises_on_oversize", "totality", raises_on_oversize, {}),
    ("accepts_invalid", "totality", accepts_invalid, {}),
]


def _broken_run(
    factory: Any, bounds: dict[str, Any], prop: str | None, seen: list[Batch] | None = None
) -> Callable[[], None]:
    @settings(
        max_examples=400,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(config=capture_configs(max_sizes=6, max_size=24, max_num_reqs=8, **bounds), data=st.data())
    def run(config: CaptureConfig, data: st.DataObject) -> None:
        if isinstance(factory, type):
            plan = factory(config)
            dispatch = plan.dispatch
        else:
            plan = CapturePlan(config)
            dispatch = factory(plan)
        # Mostly valid batches; one in five is invalid (for totality).
        invalid = data.draw(st.integers(0, 4), label="invalid") == 0
        batch = data.draw(invalid_batches(max_tokens=24) if invalid else batches(plan), label="batch")
        if seen is not None:
            seen.append(batch)  # the last one is the example hypothesis raised on: the shrunk one
        # The property alone: each check must catch its bug by itself.
        check_dispatch(plan, batch, dispatch=dispatch, properties=None if prop is None else [prop])

    return run


@pytest.mark.parametrize(("name", "prop", "factory", "bounds"), BROKEN, ids=[b[0] for b in BROKEN])
def test_each_property_catches_its_broken_dispatcher(
    name: str, prop: str, factory: Any, bounds: dict[str, Any]
) -> None:
    seen: list[Batch] = []
    with pytest.raises(DispatchPropertyError) as info:
        _broken_run(factory, bounds, prop, seen)()
    err = info.value
    assert err.property == prop, str(err)
    assert f"dispatch property '{prop}' broken: Batch(" in str(err)  # the batch, the answer, the rule
    assert "; rule: " in str(err)
    # Hypothesis shrank the failure and attached the example it raised on (the last one run) to the
    # error's notes. Asserted on its values, not on how hypothesis words the report.
    assert seen, "the property test never ran"
    assert_example_in_notes(err, seen[-1])


def assert_example_in_notes(err: BaseException, batch: Batch) -> None:
    notes = "\n".join(getattr(err, "__notes__", []))
    assert notes, f"hypothesis attached no example to {type(err).__name__}"
    for field in dataclasses.fields(batch):
        value = repr(getattr(batch, field.name))
        assert re.search(rf"\b{field.name}={re.escape(value)}(?!\w)", notes), (field.name, value, notes)


def test_reachability_catches_a_graph_never_served() -> None:
    plan = CapturePlan(CaptureConfig(capture_sizes=(1, 2, 4, 8), max_num_reqs=4, mode="FULL_AND_PIECEWISE"))
    with pytest.raises(DispatchPropertyError, match="dispatch property 'reachability' broken") as info:
        check_reachability(plan, dispatch=hides_largest(plan))
    assert "PIECEWISE-T8" in str(info.value)


def test_every_property_has_a_broken_dispatcher() -> None:
    assert {b[1] for b in BROKEN} | {"reachability"} == set(PROPERTIES)


@pytest.mark.parametrize(("name", "prop", "factory", "bounds"), BROKEN, ids=[b[0] for b in BROKEN])
def test_all_properties_together_catch_every_broken_dispatcher(
    name: str, prop: str, factory: Any, bounds: dict[str, Any]
) -> None:
    with pytest.raises(DispatchPropertyError):
        _broken_run(factory, bounds, None)()


def test_unknown_property_names_are_rejected() -> None:
    plan = CapturePlan(CaptureConfig(capture_sizes=[1], max_num_reqs=1))
    with pytest.raises(ValueError, match="unknown dispatch properties"):
        check_dispatch(plan, Batch(num_tokens=1, num_reqs=1), properties=["speed"])


# -- strategies -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: capture_configs(min_sizes=0), r"min_sizes must be an integer >= 1; got 0"),
        (
            lambda: capture_configs(min_sizes=5, max_sizes=2),
            r"min_sizes \(5\) must not exceed max_sizes \(2\)",
        ),
        (
            lambda: capture_configs(max_sizes=10, max_size=4),
            r"max_sizes \(10\) must not exceed max_size \(4\)",
        ),
        (lambda: capture_configs(modes=["FAST"]), r"mode must be a GraphMode or one of"),
        (lambda: capture_configs(varlen="yes"), r"varlen must be True, False or None"),
        (lambda: capture_configs(lora=1), r"lora must be True, False or None"),
        (lambda: capture_configs(speculative="yes"), r"speculative must be True, False or None"),
        (lambda: batches("plan"), r"batches needs a CapturePlan; got str"),  # type: ignore[arg-type]
        (
            lambda: batches(CapturePlan(CaptureConfig(capture_sizes=[1], max_num_reqs=1)), kinds=["prefill"]),
            r"kinds must be a non-empty subset of",
        ),
        (lambda: descriptors(max_tokens=0), r"max_tokens must be an integer >= 1; got 0"),
        (lambda: invalid_batches(max_tokens=True), r"max_tokens must be an integer >= 1; got True"),
    ],
)
def test_strategy_arguments_are_validated(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@given(config=st.from_type(CaptureConfig), desc=st.from_type(BatchDescriptor), batch=st.from_type(Batch))
def test_types_are_registered(config: CaptureConfig, desc: BatchDescriptor, batch: Batch) -> None:
    assert (
        isinstance(config, CaptureConfig) and isinstance(desc, BatchDescriptor) and isinstance(batch, Batch)
    )
    assert invalid_reason(batch) is None


@given(data=st.data())
def test_batches_draw_every_kind_validly(data: st.DataObject) -> None:
    plan = CapturePlan(
        CaptureConfig(
            capture_sizes=[1, 2, 4, 8],
            max_num_reqs=4,
            decode_query_len=2,
            mode="FULL_AND_PIECEWISE",
            varlen_decode=True,
        )
    )
    for kind in ("uniform_decode", "varlen_decode", "mixed", "oversize"):
        batch = data.draw(batches(plan, kinds=[kind]))
        assert invalid_reason(batch) is None
        if kind == "uniform_decode":
            u = batch.uniform_token_count
            assert u is not None and 1 <= u <= 2 and batch.num_tokens == u * batch.num_reqs
        if kind == "varlen_decode":
            assert batch.max_query_len is not None and batch.max_query_len <= 2
        if kind == "oversize":
            assert batch.num_tokens > 8


@given(desc=descriptors(CapturePlan(CaptureConfig(capture_sizes=[2, 4], max_num_reqs=2, mode="PIECEWISE"))))
def test_descriptors_of_a_plan(desc: BatchDescriptor) -> None:
    assert desc.mode is PIECEWISE and desc.num_tokens in (2, 4)


# -- profiles ----------------------------------------------------------------------------------
def test_profiles_are_registered() -> None:
    ci = settings.get_profile(CI_PROFILE)
    assert ci.derandomize and ci.database is None and ci.max_examples <= 100
    assert settings.get_profile(THOROUGH_PROFILE).max_examples >= 1000


def test_the_root_conftest_loads_the_ci_profile_under_ci() -> None:
    code = "import conftest; from hypothesis import settings; print(settings.default.derandomize)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plain = {k: v for k, v in os.environ.items() if k != "CI"}  # hypothesis reads any CI variable
    for env, expected in (({**plain, "CI": "true"}, "True"), (plain, "False")):
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


# -- the fixture, as a downstream suite uses it -------------------------------------------------
DOWNSTREAM = """
from hypothesis import given, settings
from pytest_cudagraph import CaptureConfig, CapturePlan
from pytest_cudagraph.strategies import batches

PLAN = CapturePlan(CaptureConfig(capture_sizes=[1, 2, 4, 8, 16], max_num_reqs=8, mode="FULL_AND_PIECEWISE",
                                 decode_query_len=2, lora_cases=(0, 1, 4)))


class Broken(CapturePlan):
    def effective_loras(self, count):
        return count  # no mapping onto captured cases


BROKEN = Broken(PLAN.config)


@settings(max_examples=100, derandomize=True, database=None)
@given(batch=batches(PLAN))
def test_engine_dispatch(cudagraph_dispatch_properties, batch):
    cudagraph_dispatch_properties(PLAN, batch)


@settings(max_examples=300, derandomize=True, database=None)
@given(batch=batches(BROKEN))
def test_broken_dispatch(cudagraph_dispatch_properties, batch):
    cudagraph_dispatch_properties(BROKEN, batch)
"""


def test_downstream_suite_uses_the_fixture_with_given(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import isolate_plugins

    isolate_plugins(monkeypatch)
    monkeypatch.setenv("PYTEST_PLUGINS", "pytest_cudagraph.plugin,hypothesis.extra.pytestplugin")
    pytester.makepyfile(test_downstream=DOWNSTREAM)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.re_match_lines([r".*dispatch property 'lora' broken: Batch\(.*loras=[23].*\).*rule: .*"])
    # Hypothesis reports the shrunk example it raised on: its batch argument carries the values of the
    # batch the error names (asserted on values, not on hypothesis's wording).
    out = result.stdout.str()
    match = re.search(
        r"DispatchPropertyError: dispatch property 'lora' broken: "
        r"Batch\(tokens=(\d+), reqs=(\d+), .*?loras=(\d+)\)",
        out,
    )
    assert match, out
    tokens, reqs, loras = match.groups()
    assert loras in {"2", "3"}  # shrunk: the smallest counts that fall between captured cases
    assert re.search(r"\bbatch=Batch\(", out), out
    for field, value in (("num_tokens", tokens), ("num_reqs", reqs), ("num_active_loras", loras)):
        assert re.search(rf"\b{field}={value}(?!\w)", out), (field, value)
