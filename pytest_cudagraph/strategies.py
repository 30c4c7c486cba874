"""Hypothesis strategies for capture configurations, real batches and descriptors.

A downstream suite property-tests dispatch for its own engine in a few lines::

    from hypothesis import given
    from pytest_cudagraph import CaptureConfig, CapturePlan
    from pytest_cudagraph.strategies import batches

    PLAN = CapturePlan(CaptureConfig(capture_sizes=[1, 2, 4, 8, 16], max_num_reqs=8,
                                     mode="FULL_AND_PIECEWISE"))

    @given(batch=batches(PLAN))
    def test_dispatch(cudagraph_dispatch_properties, batch):
        cudagraph_dispatch_properties(PLAN, batch)

Pure Python (no torch). ``BatchDescriptor``, ``CaptureConfig`` and ``Batch``
are registered with ``st.register_type_strategy``, so ``st.from_type`` works.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hypothesis import strategies as st

from .plan import Batch, BatchDescriptor, CaptureConfig, CapturePlan, GraphMode
from .plan.validate import check_int

__all__ = ["BATCH_KINDS", "batches", "capture_configs", "descriptors", "invalid_batches"]

#: The kinds of real batch ``batches`` draws.
BATCH_KINDS = ("uniform_decode", "varlen_decode", "mixed", "oversize")


def _check_bounds(low_name: str, low: int, high_name: str, high: int) -> None:
    if low > high:
        raise ValueError(f"{low_name} ({low}) must not exceed {high_name} ({high})")


# Hypothesis shrinks towards the first element: put the richest modes first and
# NONE (no graphs at all) last, so that most drawn plans have graphs to test.
_DEFAULT_MODES = [
    GraphMode.FULL_AND_PIECEWISE,
    GraphMode.FULL_DECODE_ONLY,
    GraphMode.FULL,
    GraphMode.PIECEWISE,
    GraphMode.NONE,
]


def _modes(modes: Iterable[GraphMode | str] | None) -> list[GraphMode]:
    if modes is None:
        return list(_DEFAULT_MODES)
    chosen = [GraphMode.parse(m) for m in modes]
    if not chosen:
        raise ValueError("modes must name at least one GraphMode")
    return chosen


def capture_configs(
    *,
    min_sizes: int = 1,
    max_sizes: int = 8,
    max_size: int = 64,
    modes: Iterable[GraphMode | str] | None = None,
    min_num_reqs: int = 1,
    max_num_reqs: int = 16,
    max_decode_query_len: int = 4,
    lora: bool | None = None,
    max_lora_case: int = 8,
    varlen: bool | None = None,
    ubatches: bool = True,
    speculative: bool | None = None,
) -> st.SearchStrategy[CaptureConfig]:
    """Valid ``CaptureConfig``s: ``min_sizes``..``max_sizes`` distinct capture sizes up to
    ``max_size``, any of ``modes``, ``min_num_reqs``..``max_num_reqs`` requests, decode query
    length up to ``max_decode_query_len``; LoRA cases up to ``max_lora_case`` (``lora``: None
    draws whether to have them, True always has a case above 0, False never); varlen decode
    likewise by ``varlen``; microbatch twins drawn when ``ubatches``; several uniform decode query
    lengths (dynamic speculative decoding: ``decode_query_lens``) likewise by ``speculative``."""
    check_int("min_sizes", min_sizes, 1)
    check_int("max_sizes", max_sizes, 1)
    _check_bounds("min_sizes", min_sizes, "max_sizes", max_sizes)
    check_int("max_size", max_size, 1)
    _check_bounds("max_sizes", max_sizes, "max_size", max_size)
    check_int("min_num_reqs", min_num_reqs, 1)
    check_int("max_num_reqs", max_num_reqs, 1)
    _check_bounds("min_num_reqs", min_num_reqs, "max_num_reqs", max_num_reqs)
    check_int("max_decode_query_len", max_decode_query_len, 1)
    check_int("max_lora_case", max_lora_case, 1)
    if varlen is not None and not isinstance(varlen, bool):
        raise ValueError(f"varlen must be True, False or None (draw it); got {varlen!r}")
    if lora is not None and not isinstance(lora, bool):
        raise ValueError(f"lora must be True, False or None (draw it); got {lora!r}")
    if speculative is not None and not isinstance(speculative, bool):
        raise ValueError(f"speculative must be True, False or None (draw it); got {speculative!r}")
    mode_list = _modes(modes)

    @st.composite
    def draw_config(draw: Any) -> CaptureConfig:
        sizes = draw(st.lists(st.integers(1, max_size), min_size=min_sizes, max_size=max_sizes, unique=True))
        lora_cases: tuple[int, ...] = (0,)
        if lora or (lora is None and draw(st.booleans())):
            positive = draw(st.lists(st.integers(1, max_lora_case), min_size=1, max_size=3, unique=True))
            lora_cases = tuple(([0] if draw(st.booleans()) else []) + positive)
        num_ubatches = draw(st.sampled_from([1, 2, 3])) if ubatches else 1
        q = draw(st.integers(1, max_decode_query_len))
        lens = None
        if speculative or (speculative is None and draw(st.booleans())):
            # The longest is always among them, as with a scheduler that may use every draft token.
            lens = (*draw(st.lists(st.integers(1, q), max_size=q, unique=True)), q)
        return CaptureConfig(
            capture_sizes=sizes,
            max_num_reqs=draw(st.integers(min_num_reqs, max_num_reqs)),
            mode=draw(st.sampled_from(mode_list)),
            decode_query_len=q,
            decode_query_lens=lens,
            lora_cases=lora_cases,
            varlen_decode=draw(st.booleans()) if varlen is None else varlen,
            num_ubatches=num_ubatches,
            ubatch_min_tokens=draw(st.integers(1, max_size)) if num_ubatches > 1 else 1,
        )

    return draw_config()


def batches(
    plan: CapturePlan,
    *,
    kinds: Iterable[str] = BATCH_KINDS,
    max_extra_tokens: int = 8,
    max_extra_loras: int = 2,
) -> st.SearchStrategy[Batch]:
    """Valid real batches ``plan`` may see: uniform decode (every request
    one of ``decode_query_lens`` tokens, or another length up to ``decode_query_len``), varlen decode (1..``decode_query_len`` each),
    mixed prefill/decode, and oversize (more tokens than the largest graph, by
    up to ``max_extra_tokens``); LoRA counts up to ``max_extra_loras`` past the
    largest case; microbatch counts the plan captures."""
    if not isinstance(plan, CapturePlan):
        raise ValueError(f"batches needs a CapturePlan; got {type(plan).__name__}")
    chosen = tuple(kinds)
    unknown = [k for k in chosen if k not in BATCH_KINDS]
    if unknown or not chosen:
        raise ValueError(f"kinds must be a non-empty subset of {BATCH_KINDS}; got {chosen!r}")
    check_int("max_extra_tokens", max_extra_tokens, 1)
    check_int("max_extra_loras", max_extra_loras, 0)
    cfg = plan.config
    q = cfg.decode_query_len
    query_lens = cfg.query_lens
    largest = cfg.largest_capture_size
    max_loras = max(max(cfg.lora_cases), 1) + max_extra_loras
    ubatch_counts = sorted({1, cfg.num_ubatches})

    @st.composite
    def draw_batch(draw: Any) -> Batch:
        kind = draw(st.sampled_from(chosen))
        loras = draw(st.integers(0, max_loras))
        ubatch = draw(st.sampled_from(ubatch_counts))
        if kind == "uniform_decode":
            # Any length up to q: one the plan captures, or one it does not (served elsewhere or eagerly).
            length = draw(st.sampled_from(query_lens) if draw(st.booleans()) else st.integers(1, q))
            reqs = draw(st.integers(1, cfg.max_num_reqs))
            return Batch(
                num_tokens=reqs * length,
                num_reqs=reqs,
                uniform_token_count=length,
                num_active_loras=loras,
                max_query_len=length,
                num_ubatches=ubatch,
            )
        if kind == "varlen_decode":
            lens = draw(st.lists(st.integers(1, q), min_size=1, max_size=cfg.max_num_reqs))
            uniform = lens[0] if len(set(lens)) == 1 else None
            return Batch(
                num_tokens=sum(lens),
                num_reqs=len(lens),
                uniform_token_count=uniform,
                num_active_loras=loras,
                max_query_len=max(lens),
                num_ubatches=ubatch,
            )
        if kind == "mixed":
            reqs = draw(st.integers(1, cfg.max_num_reqs))
            tokens = draw(st.integers(reqs, max(reqs, largest + max_extra_tokens)))
            return Batch(num_tokens=tokens, num_reqs=reqs, num_active_loras=loras, num_ubatches=ubatch)
        tokens = draw(st.integers(largest + 1, largest + max_extra_tokens))
        reqs = draw(st.integers(1, min(tokens, cfg.max_num_reqs)))
        return Batch(num_tokens=tokens, num_reqs=reqs, num_active_loras=loras, num_ubatches=ubatch)

    return draw_batch()


def invalid_batches(*, max_tokens: int = 64) -> st.SearchStrategy[Batch]:
    """Batches dispatch must reject with ``ValueError``: more requests than tokens,
    negative counts, requests without tokens, zero microbatches, non-integers."""
    check_int("max_tokens", max_tokens, 1)

    @st.composite
    def draw_invalid(draw: Any) -> Batch:
        n = draw(st.integers(0, max_tokens))
        flaw = draw(
            st.sampled_from(["reqs_above_tokens", "negative", "no_reqs", "ubatches", "uniform", "type"])
        )
        if flaw == "reqs_above_tokens":
            return Batch(num_tokens=n, num_reqs=n + draw(st.integers(1, 4)))
        if flaw == "negative":
            field = draw(st.sampled_from(["num_tokens", "num_active_loras"]))
            value = -draw(st.integers(1, 4))
            return Batch(
                num_tokens=value if field == "num_tokens" else n,
                num_reqs=0 if field == "num_tokens" else min(n, 1),
                num_active_loras=value if field == "num_active_loras" else 0,
            )
        if flaw == "no_reqs":
            return Batch(num_tokens=max(n, 1), num_reqs=0)
        if flaw == "ubatches":
            return Batch(num_tokens=max(n, 1), num_reqs=1, num_ubatches=0)
        if flaw == "uniform":
            return Batch(num_tokens=max(n, 1), num_reqs=1, uniform_token_count=0)
        return Batch(num_tokens=float(max(n, 1)), num_reqs=1)  # type: ignore[arg-type]

    return draw_invalid()


def descriptors(
    plan: CapturePlan | None = None,
    *,
    max_tokens: int = 64,
    max_loras: int = 8,
) -> st.SearchStrategy[BatchDescriptor]:
    """A descriptor of ``plan``, or (without a plan) any well-formed descriptor with
    at most ``max_tokens`` tokens and ``max_loras`` adapters."""
    if plan is not None:
        if not isinstance(plan, CapturePlan):
            raise ValueError(f"descriptors takes a CapturePlan or None; got {type(plan).__name__}")
        if not plan.descriptors:
            raise ValueError("the plan captures no descriptor (mode NONE?), so there is none to draw")
        return st.sampled_from(plan.descriptors)
    check_int("max_tokens", max_tokens, 1)
    check_int("max_loras", max_loras, 0)

    @st.composite
    def draw_desc(draw: Any) -> BatchDescriptor:
        mode = draw(st.sampled_from([GraphMode.FULL, GraphMode.PIECEWISE]))
        tokens = draw(st.integers(1, max_tokens))
        reqs = draw(st.integers(1, tokens)) if mode is GraphMode.FULL else None
        uniform = None
        if reqs is not None and tokens % reqs == 0 and draw(st.booleans()):
            uniform = tokens // reqs
        return BatchDescriptor(
            mode=mode,
            num_tokens=tokens,
            num_reqs=reqs,
            uniform_token_count=uniform,
            num_active_loras=draw(st.integers(0, max_loras)),
        )

    return draw_desc()


st.register_type_strategy(CaptureConfig, capture_configs())
st.register_type_strategy(BatchDescriptor, descriptors())
st.register_type_strategy(Batch, capture_configs().flatmap(lambda cfg: batches(CapturePlan(cfg))))
