"""Invalid configurations and batches raise ValueError naming the field; valid
edge cases are accepted."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from pytest_cudagraph.plan import BatchDescriptor, CaptureConfig, CapturePlan, GraphMode

BASE: dict[str, Any] = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4}


def field_pattern(name: str) -> str:
    # The field name as a whole word, so "num_reqs" does not match "max_num_reqs".
    return rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])"


# ---------------------------------------------------------------------------
# CaptureConfig
# ---------------------------------------------------------------------------
INVALID_CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    # (id, field named in the message, overrides)
    ("sizes-empty", "capture_sizes", {"capture_sizes": ()}),
    ("sizes-empty-list", "capture_sizes", {"capture_sizes": []}),
    ("sizes-zero", "capture_sizes", {"capture_sizes": (0, 1, 2)}),
    ("sizes-negative", "capture_sizes", {"capture_sizes": (1, -4)}),
    ("sizes-float", "capture_sizes", {"capture_sizes": (1, 2.0)}),
    ("sizes-str-item", "capture_sizes", {"capture_sizes": (1, "4")}),
    ("sizes-bool", "capture_sizes", {"capture_sizes": (True, 2)}),
    ("sizes-bool-scalar", "capture_sizes", {"capture_sizes": True}),
    ("sizes-none", "capture_sizes", {"capture_sizes": None}),
    ("sizes-not-iterable", "capture_sizes", {"capture_sizes": 2.5}),
    ("max-reqs-zero", "max_num_reqs", {"max_num_reqs": 0}),
    ("max-reqs-negative", "max_num_reqs", {"max_num_reqs": -1}),
    ("max-reqs-bool", "max_num_reqs", {"max_num_reqs": True}),
    ("max-reqs-float", "max_num_reqs", {"max_num_reqs": 4.0}),
    ("max-reqs-none", "max_num_reqs", {"max_num_reqs": None}),
    ("dql-zero", "decode_query_len", {"decode_query_len": 0}),
    ("dql-negative", "decode_query_len", {"decode_query_len": -2}),
    ("dql-bool", "decode_query_len", {"decode_query_len": True}),
    ("dql-float", "decode_query_len", {"decode_query_len": 2.0}),
    ("lora-negative", "lora_cases", {"lora_cases": (0, -1)}),
    ("lora-empty", "lora_cases", {"lora_cases": ()}),
    ("lora-bool", "lora_cases", {"lora_cases": (False, 1)}),
    ("lora-float", "lora_cases", {"lora_cases": (0, 1.0)}),
    ("lora-none", "lora_cases", {"lora_cases": None}),
    ("varlen-int", "varlen_decode", {"varlen_decode": 1}),
    ("varlen-str", "varlen_decode", {"varlen_decode": "yes"}),
    ("varlen-none", "varlen_decode", {"varlen_decode": None}),
    ("max-capture-below-largest", "max_capture_size", {"max_capture_size": 4}),
    ("max-capture-zero", "max_capture_size", {"max_capture_size": 0}),
    ("max-capture-bool", "max_capture_size", {"capture_sizes": (1,), "max_capture_size": True}),
    ("max-capture-float", "max_capture_size", {"max_capture_size": 16.0}),
    ("mode-bad-string", "mode", {"mode": "fullish"}),
    ("mode-empty-string", "mode", {"mode": ""}),
    ("mode-none", "mode", {"mode": None}),
    ("mode-int", "mode", {"mode": 2}),
    ("mode-tuple", "mode", {"mode": (2, 1)}),
    ("ubatches-zero", "num_ubatches", {"num_ubatches": 0}),
    ("ubatches-negative", "num_ubatches", {"num_ubatches": -2}),
    ("ubatches-bool", "num_ubatches", {"num_ubatches": True}),
    ("ubatch-min-zero", "ubatch_min_tokens", {"ubatch_min_tokens": 0}),
    ("ubatch-min-bool", "ubatch_min_tokens", {"ubatch_min_tokens": True}),
    ("ubatch-min-float", "ubatch_min_tokens", {"ubatch_min_tokens": 1.5}),
    ("dqls-empty", "decode_query_lens", {"decode_query_lens": ()}),
    ("dqls-zero", "decode_query_lens", {"decode_query_lens": (0, 1)}),
    ("dqls-above-dql", "decode_query_lens", {"decode_query_len": 2, "decode_query_lens": (1, 3)}),
    ("dqls-float", "decode_query_lens", {"decode_query_lens": (1.0,)}),
    ("dqls-str", "decode_query_lens", {"decode_query_lens": "12"}),
]


@pytest.mark.parametrize(("field", "overrides"), [pytest.param(f, o, id=i) for i, f, o in INVALID_CONFIGS])
def test_invalid_config_raises_naming_field(field: str, overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=field_pattern(field)):
        CaptureConfig(**{**BASE, **overrides})


@pytest.mark.parametrize(("field", "overrides"), [pytest.param(f, o, id=i) for i, f, o in INVALID_CONFIGS])
def test_invalid_replace_raises_naming_field(field: str, overrides: dict[str, Any]) -> None:
    # replace validates the new values the same way the constructor does.
    cfg = CaptureConfig(**BASE)
    with pytest.raises(ValueError, match=field_pattern(field)):
        cfg.replace(**overrides)


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        CaptureConfig((1, 2), 4)  # type: ignore[call-arg]


def test_config_missing_required_field() -> None:
    with pytest.raises(TypeError):
        CaptureConfig(capture_sizes=(1, 2))  # type: ignore[call-arg]


def test_replace_unknown_field() -> None:
    cfg = CaptureConfig(**BASE)
    with pytest.raises(ValueError, match="bogus"):
        cfg.replace(bogus=1)


def test_plan_rejects_non_config() -> None:
    with pytest.raises(ValueError, match="CaptureConfig"):
        CapturePlan(BASE)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Valid edge cases
# ---------------------------------------------------------------------------
def test_duplicate_sizes_deduped() -> None:
    cfg = CaptureConfig(capture_sizes=(4, 1, 4, 2, 1, 8), max_num_reqs=4, mode="FULL")
    assert cfg.capture_sizes == (4, 1, 2, 8)
    assert cfg.sorted_capture_sizes == (1, 2, 4, 8)
    assert cfg.largest_capture_size == 8
    plan = CapturePlan(cfg)
    clean = CapturePlan(CaptureConfig(capture_sizes=(1, 2, 4, 8), max_num_reqs=4, mode="FULL"))
    assert plan.capture_order == clean.capture_order
    assert len(set(plan.capture_order)) == len(plan.capture_order)


def test_duplicate_lora_cases_deduped_in_order() -> None:
    cfg = CaptureConfig(**BASE, lora_cases=[4, 0, 4, 1, 0])
    assert cfg.lora_cases == (4, 0, 1)
    plan = CapturePlan(cfg)
    assert len(set(plan.capture_order)) == len(plan.capture_order)


def test_sizes_accept_any_iterable_and_single_int() -> None:
    assert CaptureConfig(capture_sizes=[2, 1], max_num_reqs=1).capture_sizes == (2, 1)
    assert CaptureConfig(capture_sizes=iter((3, 5)), max_num_reqs=1).capture_sizes == (3, 5)
    assert CaptureConfig(capture_sizes=8, max_num_reqs=1).capture_sizes == (8,)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("NONE", GraphMode.NONE),
        ("piecewise", GraphMode.PIECEWISE),
        ("Full", GraphMode.FULL),
        ("full_decode_only", GraphMode.FULL_DECODE_ONLY),
        (" FULL_AND_PIECEWISE ", GraphMode.FULL_AND_PIECEWISE),
    ],
)
def test_mode_given_as_string(text: str, mode: GraphMode) -> None:
    cfg = CaptureConfig(**BASE, mode=text)
    assert cfg.mode is mode
    assert CapturePlan(cfg).capture_order == CapturePlan(CaptureConfig(**BASE, mode=mode)).capture_order


def test_default_mode_and_fields() -> None:
    cfg = CaptureConfig(**BASE)
    assert cfg.mode is GraphMode.FULL
    assert cfg.decode_query_len == 1
    assert cfg.lora_cases == (0,)
    assert cfg.varlen_decode is False
    assert cfg.max_capture_size == 8  # the largest capture size
    assert cfg.num_ubatches == 1
    assert cfg.ubatch_min_tokens == 1


def test_max_capture_size_equal_or_above_largest() -> None:
    assert CaptureConfig(**BASE, max_capture_size=8).max_capture_size == 8
    assert CaptureConfig(**BASE, max_capture_size=64).max_capture_size == 64


def test_lora_case_zero_only_and_without_zero() -> None:
    assert CaptureConfig(**BASE, lora_cases=(0,)).lora_cases == (0,)
    assert CaptureConfig(**BASE, lora_cases=(1, 2)).lora_cases == (1, 2)


def test_config_frozen() -> None:
    cfg = CaptureConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_reqs = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mode = GraphMode.NONE  # type: ignore[misc]


def test_config_hashable_and_equal_by_value() -> None:
    a = CaptureConfig(**BASE, mode="full_and_piecewise", lora_cases=[0, 1])
    b = CaptureConfig(**BASE, mode=GraphMode.FULL_AND_PIECEWISE, lora_cases=(0, 1))
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert {a: "x"}[b] == "x"
    assert a != CaptureConfig(**BASE, mode="full")


def test_replace() -> None:
    cfg = CaptureConfig(**BASE, mode="FULL")
    pw = cfg.replace(mode="piecewise")
    assert pw.mode is GraphMode.PIECEWISE
    assert cfg.mode is GraphMode.FULL  # unchanged
    assert pw.capture_sizes == cfg.capture_sizes and pw.max_num_reqs == cfg.max_num_reqs
    assert cfg.replace() == cfg
    # New sizes: the default bound follows them.
    bigger = cfg.replace(capture_sizes=(1, 2, 16))
    assert bigger.max_capture_size == 16
    smaller = CaptureConfig(**BASE, max_capture_size=32).replace(capture_sizes=(1, 2))
    assert smaller.max_capture_size == 2
    both = cfg.replace(capture_sizes=(1, 2), max_capture_size=4)
    assert both.max_capture_size == 4
    # Without new sizes an explicit bound is kept.
    kept = CaptureConfig(**BASE, max_capture_size=32).replace(max_num_reqs=2)
    assert kept.max_capture_size == 32


def test_descriptor_frozen_hashable_replace() -> None:
    d = BatchDescriptor(GraphMode.FULL, 4, num_reqs=4, uniform_token_count=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.num_tokens = 8  # type: ignore[misc]
    same = BatchDescriptor(mode=GraphMode.FULL, num_tokens=4, num_reqs=4, uniform_token_count=1)
    assert d == same and hash(d) == hash(same)
    assert len({d, same}) == 1
    twin = dataclasses.replace(d, num_ubatches=2)
    assert twin != d
    assert twin.num_ubatches == 2 and twin.num_tokens == 4 and d.num_ubatches == 1
    assert BatchDescriptor(GraphMode.PIECEWISE, 4) == BatchDescriptor(
        GraphMode.PIECEWISE, 4, None, None, None, 0, 1
    )


def test_none_mode_plan_is_empty_but_valid() -> None:
    plan = CapturePlan(CaptureConfig(**BASE, mode="NONE"))
    assert dict(plan.capture_descriptors) == {}
    assert plan.capture_order == ()
    assert plan.candidates(1) == ()


def test_single_request_single_token_config() -> None:
    plan = CapturePlan(CaptureConfig(capture_sizes=(1,), max_num_reqs=1, mode="FULL_AND_PIECEWISE"))
    assert plan.capture_order == (
        BatchDescriptor(GraphMode.PIECEWISE, 1),
        BatchDescriptor(GraphMode.FULL, 1, num_reqs=1, uniform_token_count=1),
    )


# ---------------------------------------------------------------------------
# Batches given to dispatch
# ---------------------------------------------------------------------------
INVALID_BATCHES: list[tuple[str, str, dict[str, Any]]] = [
    ("reqs-above-tokens", "num_reqs", {"num_reqs": 5, "num_tokens": 4}),
    ("reqs-on-empty-batch", "num_reqs", {"num_reqs": 1, "num_tokens": 0}),
    ("reqs-zero-with-tokens", "num_reqs", {"num_reqs": 0, "num_tokens": 3}),
    ("reqs-negative", "num_reqs", {"num_reqs": -1, "num_tokens": 3}),
    ("reqs-bool", "num_reqs", {"num_reqs": True, "num_tokens": 3}),
    ("reqs-float", "num_reqs", {"num_reqs": 1.0, "num_tokens": 3}),
    ("reqs-none", "num_reqs", {"num_reqs": None, "num_tokens": 3}),
    ("tokens-negative", "num_tokens", {"num_reqs": 0, "num_tokens": -1}),
    ("tokens-bool", "num_tokens", {"num_reqs": 1, "num_tokens": True}),
    ("tokens-float", "num_tokens", {"num_reqs": 1, "num_tokens": 2.0}),
    ("tokens-none", "num_tokens", {"num_reqs": 1, "num_tokens": None}),
    ("loras-negative", "num_active_loras", {"num_reqs": 1, "num_tokens": 2, "num_active_loras": -1}),
    ("loras-bool", "num_active_loras", {"num_reqs": 1, "num_tokens": 2, "num_active_loras": True}),
    ("loras-none", "num_active_loras", {"num_reqs": 1, "num_tokens": 2, "num_active_loras": None}),
    ("ubatches-zero", "num_ubatches", {"num_reqs": 1, "num_tokens": 2, "num_ubatches": 0}),
    ("ubatches-negative", "num_ubatches", {"num_reqs": 1, "num_tokens": 2, "num_ubatches": -1}),
    ("ubatches-bool", "num_ubatches", {"num_reqs": 1, "num_tokens": 2, "num_ubatches": True}),
    ("uniform-zero", "uniform_token_count", {"num_reqs": 1, "num_tokens": 2, "uniform_token_count": 0}),
    ("uniform-negative", "uniform_token_count", {"num_reqs": 1, "num_tokens": 2, "uniform_token_count": -2}),
    ("uniform-bool", "uniform_token_count", {"num_reqs": 1, "num_tokens": 2, "uniform_token_count": True}),
    ("mql-zero", "max_query_len", {"num_reqs": 1, "num_tokens": 2, "max_query_len": 0}),
    ("mql-float", "max_query_len", {"num_reqs": 1, "num_tokens": 2, "max_query_len": 2.0}),
]

DISPATCH_MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.mark.parametrize("mode", DISPATCH_MODES)
@pytest.mark.parametrize(("field", "batch"), [pytest.param(f, bt, id=i) for i, f, bt in INVALID_BATCHES])
def test_invalid_batch_raises_naming_field(mode: str, field: str, batch: dict[str, Any]) -> None:
    plan = CapturePlan(CaptureConfig(**BASE, mode=mode, lora_cases=(0, 1)))
    with pytest.raises(ValueError, match=field_pattern(field)):
        plan.dispatch(**batch)


def test_invalid_batch_not_memoised() -> None:
    # A rejected batch must stay rejected: the memo only holds valid answers.
    plan = CapturePlan(CaptureConfig(**BASE))
    for _ in range(2):
        with pytest.raises(ValueError, match=field_pattern("num_reqs")):
            plan.dispatch(num_reqs=5, num_tokens=4)


def test_invalid_batch_rejected_after_equal_valid_batch() -> None:
    plan = CapturePlan(CaptureConfig(**BASE))
    plan.dispatch(num_reqs=1, num_tokens=2, uniform_token_count=2)
    # True and 1.0 hash like 1: the memoised answer must not serve them.
    with pytest.raises(ValueError, match=field_pattern("num_reqs")):
        plan.dispatch(num_reqs=True, num_tokens=2, uniform_token_count=2)
    with pytest.raises(ValueError, match=field_pattern("num_tokens")):
        plan.dispatch(num_reqs=1, num_tokens=2.0, uniform_token_count=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field_pattern("uniform_token_count")):
        plan.dispatch(num_reqs=1, num_tokens=2, uniform_token_count=2.0)  # type: ignore[arg-type]


def test_dispatch_is_keyword_only() -> None:
    plan = CapturePlan(CaptureConfig(**BASE))
    with pytest.raises(TypeError):
        plan.dispatch(1, 1)  # type: ignore[call-arg]


def test_valid_edge_batches() -> None:
    plan = CapturePlan(CaptureConfig(**BASE, mode="FULL_AND_PIECEWISE"))
    # Empty batch: eager, with zero requests.
    assert plan.dispatch(num_reqs=0, num_tokens=0) == BatchDescriptor(GraphMode.NONE, 0, num_reqs=0)
    # num_reqs == num_tokens is the tightest valid batch.
    assert plan.dispatch(num_reqs=8, num_tokens=8).mode is GraphMode.PIECEWISE
    # Huge counts are fine and run eagerly.
    assert plan.dispatch(num_reqs=1, num_tokens=10**9) == BatchDescriptor(GraphMode.NONE, 10**9, num_reqs=1)
    # A LoRA count far above every case with no LoRA graphs passes through.
    assert plan.dispatch(num_reqs=1, num_tokens=1, num_active_loras=1000).num_active_loras == 1000


def test_many_distinct_batches_stay_correct() -> None:
    # Sweep far more keys than a small memo would hold; answers stay right.
    plan = CapturePlan(CaptureConfig(**BASE, mode="FULL"))
    for n in range(1, 70000, 7):
        got = plan.dispatch(num_reqs=1, num_tokens=n)
        if n == 1:
            assert got == BatchDescriptor(GraphMode.FULL, 1, num_reqs=1)
        elif n <= 8:
            assert got.mode is GraphMode.FULL and got.num_tokens >= n
        else:
            assert got == BatchDescriptor(GraphMode.NONE, n, num_reqs=1)
    assert plan.dispatch(num_reqs=1, num_tokens=3) == BatchDescriptor(GraphMode.FULL, 4, num_reqs=4)


def test_query_lengths_default_to_decode_query_len_and_follow_it() -> None:
    config = CaptureConfig(**BASE, decode_query_len=3)
    assert config.decode_query_lens == (3,)
    assert config.replace(decode_query_len=5).decode_query_lens == (5,)
    spec = CaptureConfig(**BASE, decode_query_len=4, decode_query_lens=[4, 1, 2, 2])
    assert spec.decode_query_lens == (1, 2, 4)  # sorted, repeats dropped
    assert spec.replace(decode_query_len=6).decode_query_lens == (1, 2, 4)  # given lengths stay
    assert spec.to_dict()["decode_query_lens"] == [1, 2, 4]
    with pytest.raises(
        ValueError, match=r"between 1 and decode_query_len \(4, .*got 5\. Raise decode_query_len to 5"
    ):
        CaptureConfig(**BASE, decode_query_len=4, decode_query_lens=(1, 5))
