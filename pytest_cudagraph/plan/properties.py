"""The properties every dispatch must have, as checks with readable failures.

Pure Python: a downstream suite property-tests its own engine configuration
with these and ``pytest_cudagraph.strategies``, no GPU needed. The rule they
encode is vLLM's: for the batch's LoRA case, FULL graphs are tried before
PIECEWISE ones, and within a mode only the graphs of the smallest captured size
that holds the batch are candidates; the first compatible candidate serves,
and a batch no candidate serves runs eagerly (``NONE``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .batch import Batch
from .capture_plan import CapturePlan
from .descriptor import BatchDescriptor
from .modes import GraphMode

__all__ = [
    "PROPERTIES",
    "DispatchProperties",
    "DispatchPropertyError",
    "check_dispatch",
    "check_reachability",
    "check_rejects",
    "exact_batch",
    "invalid_reason",
]

#: The properties, in the order they are checked.
PROPERTIES = (
    "totality",
    "lora",
    "uniform_decode",
    "varlen_decode",
    "soundness",
    "monotonicity",
    "minimal_padding",
    "completeness",
    "reachability",
)

Dispatch = Callable[..., BatchDescriptor]


class DispatchPropertyError(AssertionError):
    """A dispatch broke a property; the message shows the batch, the answer and the rule."""

    def __init__(self, prop: str, batch: Batch | None, answer: BatchDescriptor | None, rule: str) -> None:
        self.property = prop
        self.batch = batch
        self.answer = answer
        answer_text = (
            "no answer"
            if answer is None
            else (answer.label() if answer.mode is not GraphMode.NONE else "NONE (eager)")
        )
        super().__init__(f"dispatch property '{prop}' broken: {batch} -> {answer_text}; rule: {rule}")


def invalid_reason(batch: Batch) -> str | None:
    """Why ``batch`` is not a batch dispatch must answer, or None if it is."""

    def bad_int(value: object, minimum: int) -> bool:
        return not isinstance(value, int) or isinstance(value, bool) or value < minimum

    if bad_int(batch.num_tokens, 0):
        return "num_tokens must be an integer >= 0"
    if bad_int(batch.num_reqs, 1 if batch.num_tokens else 0):
        return "num_reqs must be an integer >= 1 (0 only for an empty batch)"
    if batch.num_reqs > batch.num_tokens:
        return "num_reqs exceeds num_tokens"
    if bad_int(batch.num_active_loras, 0):
        return "num_active_loras must be an integer >= 0"
    if bad_int(batch.num_ubatches, 1):
        return "num_ubatches must be an integer >= 1"
    if batch.uniform_token_count is not None and bad_int(batch.uniform_token_count, 1):
        return "uniform_token_count must be an integer >= 1 or None"
    if batch.max_query_len is not None and bad_int(batch.max_query_len, 1):
        return "max_query_len must be an integer >= 1 or None"
    return None


def _lora_case(plan: CapturePlan, count: int) -> int:
    """The captured LoRA case for ``count`` adapters, from the configuration alone."""
    cases = sorted(c for c in plan.config.lora_cases if c > 0)
    if count <= 0 or not cases:
        return count
    fitting = [c for c in cases if c >= count]
    return fitting[0] if fitting else cases[-1]


def _compatible(desc: BatchDescriptor, batch: Batch, loras: int) -> bool:
    return desc.is_compatible(
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        uniform_token_count=batch.uniform_token_count,
        num_active_loras=loras,
        max_query_len=batch.max_query_len,
        num_ubatches=batch.num_ubatches,
    )


def _group(
    captured: Iterable[BatchDescriptor], mode: GraphMode, loras: int, num_tokens: int
) -> list[BatchDescriptor]:
    """The candidates of one mode: graphs of the smallest captured size holding the batch."""
    holding = [
        d for d in captured if d.mode is mode and d.num_active_loras == loras and d.num_tokens >= num_tokens
    ]
    if not holding:
        return []
    smallest = min(d.num_tokens for d in holding)
    return [d for d in holding if d.num_tokens == smallest]


def _answer(dispatch: Dispatch, batch: Batch) -> BatchDescriptor:
    try:
        return dispatch(**batch.dispatch_args())
    except Exception as exc:
        raise DispatchPropertyError(
            "totality",
            batch,
            None,
            f"a valid batch must get an answer, but dispatch raised {type(exc).__name__}: {exc}",
        ) from exc


def _next_batch(batch: Batch) -> Batch | None:
    """The same batch with more tokens (and, for a uniform batch, one more request)."""
    if batch.num_tokens == 0:
        return None
    if batch.uniform_token_count is not None:
        u = batch.uniform_token_count
        return Batch(
            num_tokens=batch.num_tokens + u,
            num_reqs=batch.num_reqs + 1,
            uniform_token_count=u,
            num_active_loras=batch.num_active_loras,
            max_query_len=batch.max_query_len,
            num_ubatches=batch.num_ubatches,
        )
    n = batch.num_tokens + 1
    mql = batch.max_query_len
    if mql is not None:
        mql = max(mql, -(-n // batch.num_reqs))
    return Batch(
        num_tokens=n,
        num_reqs=batch.num_reqs,
        num_active_loras=batch.num_active_loras,
        max_query_len=mql,
        num_ubatches=batch.num_ubatches,
    )


def check_dispatch(
    plan: CapturePlan,
    batch: Batch,
    *,
    dispatch: Dispatch | None = None,
    captured: Iterable[BatchDescriptor] | None = None,
    properties: Iterable[str] | None = None,
) -> BatchDescriptor | None:
    """Assert every per-batch property of ``dispatch`` (default: the plan's) for ``batch``.

    ``captured`` is the set of graphs that exist (default: the plan's
    descriptors); ``properties`` limits the check to some of ``PROPERTIES``.
    Returns the answer, or None for an invalid batch (which must raise
    ``ValueError``). Raises ``DispatchPropertyError`` naming the broken
    property, the batch, the answer and the rule.
    """
    dispatch = dispatch if dispatch is not None else plan.dispatch
    graphs = list(captured) if captured is not None else list(plan.descriptors)
    graph_set = set(graphs)
    wanted = set(PROPERTIES if properties is None else properties)
    unknown = wanted - set(PROPERTIES)
    if unknown:
        raise ValueError(f"unknown dispatch properties {sorted(unknown)}; they are {', '.join(PROPERTIES)}")
    if invalid_reason(batch) is not None:
        if "totality" in wanted:
            check_rejects(plan, batch, dispatch=dispatch)
        return None
    answer = _answer(dispatch, batch)

    def broken(prop: str, rule: str, shown: Batch = batch, answered: BatchDescriptor = answer) -> None:
        if prop in wanted:
            raise DispatchPropertyError(prop, shown, answered, rule)

    loras = _lora_case(plan, batch.num_active_loras)
    graphed = answer.mode is not GraphMode.NONE

    if graphed:
        if batch.num_active_loras == 0 and answer.num_active_loras != 0:
            broken("lora", "a batch without adapters never meets a LoRA graph")
        if answer.num_active_loras != loras:
            broken(
                "lora",
                f"{batch.num_active_loras} active adapters map to the smallest captured case that holds them, "
                f"clamped to the largest: case {loras}",
            )
        if answer.uniform_token_count is not None and answer.uniform_token_count != batch.uniform_token_count:
            broken(
                "uniform_decode",
                f"a uniform decode graph ({answer.uniform_token_count} tokens per request) serves only batches "
                "with exactly that many tokens in every request",
            )
        if answer.max_query_len is not None and (
            batch.max_query_len is None or batch.max_query_len > answer.max_query_len
        ):
            broken(
                "varlen_decode",
                f"a varlen decode graph (at most {answer.max_query_len} tokens per request) never serves a "
                "batch with a prefill or a longer request",
            )
        if answer not in graph_set or not _compatible(answer, batch, loras):
            broken(
                "soundness",
                "the answer must be a captured graph compatible with the batch (tokens and requests within "
                "its bounds, same uniform count, query-length bound, LoRA case and microbatches)",
            )
        # Checked before minimal padding: a dispatcher that over-pads only some
        # batches shows first as a larger batch getting a smaller graph.
        if "monotonicity" in wanted:
            _check_monotonic(dispatch, batch, answer)
        group = _group(graphs, answer.mode, loras, batch.num_tokens)
        if answer not in group:
            broken(
                "minimal_padding",
                f"within a mode the smallest captured size that holds the batch serves it: "
                f"{group[0].num_tokens if group else 'none'} tokens in {answer.mode.name}",
            )
        if answer.mode is GraphMode.PIECEWISE:
            full = [
                d
                for d in _group(graphs, GraphMode.FULL, loras, batch.num_tokens)
                if _compatible(d, batch, loras)
            ]
            if full:
                broken(
                    "minimal_padding",
                    f"FULL graphs come before PIECEWISE ones, and {full[0].label()} serves this batch",
                )
    else:
        for mode in (GraphMode.FULL, GraphMode.PIECEWISE):
            serving = [
                d for d in _group(graphs, mode, loras, batch.num_tokens) if _compatible(d, batch, loras)
            ]
            if serving and batch.num_tokens > 0:
                if loras != batch.num_active_loras:
                    broken(
                        "lora",
                        f"{batch.num_active_loras} active adapters map to captured case {loras} (the smallest "
                        f"that holds them, clamped to the largest), whose graph {serving[0].label()} serves it",
                    )
                broken(
                    "completeness",
                    f"a batch runs eagerly only when no candidate graph serves it, but {serving[0].label()} does",
                )
    return answer


def _check_monotonic(dispatch: Dispatch, batch: Batch, answer: BatchDescriptor) -> None:
    following = _next_batch(batch)
    if answer.mode is GraphMode.NONE or following is None or invalid_reason(following) is not None:
        return
    later = _answer(dispatch, following)
    if later.mode is answer.mode and later.num_tokens < answer.num_tokens:
        raise DispatchPropertyError(
            "monotonicity",
            following,
            later,
            f"more tokens never dispatch to a smaller graph: {batch} went to {answer.label()}",
        )


def exact_batch(plan: CapturePlan, desc: BatchDescriptor) -> Batch:
    """The real batch of exactly ``desc``'s shape."""
    reqs = desc.num_reqs if desc.num_reqs is not None else min(desc.num_tokens, plan.config.max_num_reqs)
    return Batch(
        num_tokens=desc.num_tokens,
        num_reqs=reqs,
        uniform_token_count=desc.uniform_token_count,
        num_active_loras=desc.num_active_loras,
        max_query_len=desc.max_query_len or desc.uniform_token_count,
        num_ubatches=desc.num_ubatches,
    )


def check_reachability(
    plan: CapturePlan,
    *,
    dispatch: Dispatch | None = None,
    captured: Iterable[BatchDescriptor] | None = None,
) -> None:
    """Every captured descriptor is the answer for its own exact shape."""
    dispatch = dispatch if dispatch is not None else plan.dispatch
    for desc in captured if captured is not None else plan.descriptors:
        batch = exact_batch(plan, desc)
        answer = _answer(dispatch, batch)
        if answer != desc:
            raise DispatchPropertyError(
                "reachability",
                batch,
                answer,
                f"every captured graph serves its own exact shape; {desc.label()} is never reached there",
            )


def check_rejects(plan: CapturePlan, batch: Batch, *, dispatch: Dispatch | None = None) -> None:
    """An invalid batch is rejected with ``ValueError``."""
    dispatch = dispatch if dispatch is not None else plan.dispatch
    reason = invalid_reason(batch)
    try:
        answer: Any = dispatch(**batch.dispatch_args())
    except ValueError:
        return
    except Exception as exc:
        raise DispatchPropertyError(
            "totality",
            batch,
            None,
            f"an invalid batch ({reason}) must raise ValueError, not {type(exc).__name__}: {exc}",
        ) from exc
    raise DispatchPropertyError(
        "totality",
        batch,
        answer if isinstance(answer, BatchDescriptor) else None,
        f"an invalid batch ({reason}) must raise ValueError",
    )


class DispatchProperties:
    """Callable form for suites: ``props(plan, batch)`` checks one batch, and the
    first call for each plan also checks that every descriptor is reachable."""

    def __init__(self) -> None:
        self._reached: list[tuple[CapturePlan, Dispatch | None]] = []

    def __call__(
        self,
        plan: CapturePlan,
        batch: Batch,
        *,
        dispatch: Dispatch | None = None,
        captured: Iterable[BatchDescriptor] | None = None,
    ) -> BatchDescriptor | None:
        graphs = list(captured) if captured is not None else None
        # Bound methods compare equal when they bind the same object.
        if not any(p is plan and d == dispatch for p, d in self._reached):
            check_reachability(plan, dispatch=dispatch, captured=graphs)
            self._reached.append((plan, dispatch))
        return check_dispatch(plan, batch, dispatch=dispatch, captured=graphs)

    reachability = staticmethod(check_reachability)
