"""The capture plan: which descriptors to capture, and which one serves a batch.

Pure Python on purpose: a plan can be built, inspected and property-tested
without torch or a GPU. The behaviour follows vLLM's CUDA-graph manager
(``CudaGraphManager._init_candidates`` and ``dispatch``) so that a plan made
here for an engine's configuration answers as the engine would.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from itertools import groupby, product
from types import MappingProxyType

from .batch import Batch
from .config import CaptureConfig
from .descriptor import BatchDescriptor
from .modes import GraphMode

__all__ = ["CapturePlan"]

# Dispatch memoises answers. The key space of real batches is small (token
# counts up to the largest graph, a few LoRA and query-length values), but a
# caller sweeping huge counts must not grow the memo without bound.
_MEMO_LIMIT = 1 << 16

_OPTIONAL_INT = frozenset({int, type(None)})

_KeyT = tuple[int, int, "int | None", int, "int | None", int]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


class CapturePlan:
    """Descriptors to capture for a ``CaptureConfig``, and O(1) dispatch.

    ``capture_descriptors`` maps each runtime mode to its descriptors in
    capture order (largest first); ``capture_order`` lists every descriptor in
    the order a manager captures them (PIECEWISE before FULL: piecewise graphs
    hold larger activations, so FULL graphs fit in the pool they leave).
    """

    def __init__(self, config: CaptureConfig) -> None:
        if not isinstance(config, CaptureConfig):
            raise ValueError(
                f"CapturePlan takes a CaptureConfig; got {type(config).__name__}. "
                "Build one with CaptureConfig(capture_sizes=..., max_num_reqs=..., mode=...)"
            )
        self.config = config
        # Captured LoRA cases, ascending: an active-adapter count is served by
        # the smallest case that holds it (a bisection; dispatch memoises).
        self._lora_cases = tuple(sorted(c for c in config.lora_cases if c > 0))
        self._max_lora_case = self._lora_cases[-1] if self._lora_cases else 0

        by_mode = self._build_descriptors()
        self._capture: dict[GraphMode, tuple[BatchDescriptor, ...]] = {
            mode: tuple(descs) for mode, descs in by_mode.items()
        }
        # Built in time and memory that follow the descriptors, never the
        # token counts: a plan with a 2**20-token graph costs what one with a
        # 16-token graph does.
        self._tiers = self._build_tiers(by_mode)
        self._candidate_memo: dict[tuple[int, int], tuple[BatchDescriptor, ...]] = {}
        self._memo: dict[_KeyT, BatchDescriptor] = {}

    # -- building -------------------------------------------------------
    def _ubatch_twin(self, desc: BatchDescriptor) -> BatchDescriptor | None:
        """The microbatched twin of a FULL graph, when one can be captured.

        Only batches whose tokens split evenly over their requests keep the
        request split when cut into microbatches.
        """
        cfg = self.config
        if cfg.num_ubatches == 1 or desc.mode is not GraphMode.FULL or desc.num_reqs is None:
            return None
        per_req, rest = divmod(desc.num_tokens, desc.num_reqs)
        if rest or desc.uniform_token_count not in (None, per_req):
            return None
        if desc.num_tokens < cfg.num_ubatches or desc.num_tokens < cfg.ubatch_min_tokens:
            return None
        return BatchDescriptor(
            mode=desc.mode,
            num_tokens=desc.num_tokens,
            num_reqs=desc.num_reqs,
            uniform_token_count=per_req,
            max_query_len=desc.max_query_len,
            num_active_loras=desc.num_active_loras,
            num_ubatches=cfg.num_ubatches,
        )

    def _build_descriptors(self) -> dict[GraphMode, list[BatchDescriptor]]:
        cfg = self.config
        mode = cfg.mode
        by_mode: dict[GraphMode, list[BatchDescriptor]] = {}
        if not mode:
            return by_mode
        decode_mode, mixed_mode = mode.decode_mode(), mode.mixed_mode()
        separate = mode.separate_routine()
        max_decode_tokens = cfg.max_num_reqs * cfg.decode_query_len
        varlen = separate and bool(decode_mode) and cfg.varlen_decode
        uniform = separate and bool(decode_mode) and not cfg.varlen_decode

        def add(desc: BatchDescriptor, *, unique: bool) -> None:
            descs = by_mode.setdefault(desc.mode, [])
            if not unique or desc not in descs:
                descs.append(desc)

        for num_tokens, loras in product(cfg.sorted_capture_sizes, cfg.lora_cases):
            if varlen and num_tokens <= max_decode_tokens:
                # Varlen decode: any mix of 1..decode_query_len tokens per
                # request, so the worst case is one token per request.
                add(
                    BatchDescriptor(
                        mode=decode_mode,
                        num_tokens=num_tokens,
                        num_reqs=min(num_tokens, cfg.max_num_reqs),
                        max_query_len=cfg.decode_query_len,
                        num_active_loras=loras,
                    ),
                    unique=False,
                )
            elif uniform:
                # Uniform decode: every request has exactly q tokens, so the
                # size is rounded up to a whole number of them; one graph per
                # query length the scheduler may use (dynamic speculative
                # decoding), each bounded as the longest is.
                for q in cfg.query_lens:
                    tokens = _round_up(num_tokens, q)
                    reqs = tokens // q
                    if (
                        tokens > max_decode_tokens
                        or tokens > cfg.max_capture_size  # type: ignore[operator]
                        or reqs > cfg.max_num_reqs
                    ):
                        continue
                    desc = BatchDescriptor(
                        mode=decode_mode,
                        num_tokens=tokens,
                        num_reqs=reqs,
                        uniform_token_count=q,
                        num_active_loras=loras,
                    )
                    add(desc, unique=True)
                    twin = self._ubatch_twin(desc)
                    if twin is not None:
                        add(twin, unique=True)
            if mixed_mode:
                # PIECEWISE graphs pad tokens only; a FULL mixed graph also
                # fixes the request count it was captured with.
                reqs_or_none = min(num_tokens, cfg.max_num_reqs) if mixed_mode is GraphMode.FULL else None
                desc = BatchDescriptor(
                    mode=mixed_mode,
                    num_tokens=num_tokens,
                    num_reqs=reqs_or_none,
                    num_active_loras=loras,
                )
                add(desc, unique=False)
                twin = self._ubatch_twin(desc)
                if twin is not None:
                    add(twin, unique=False)

        # Largest first: later (smaller) graphs reuse the pool the first made.
        # The sort is stable, so equal sizes keep their insertion order.
        for descs in by_mode.values():
            descs.sort(key=lambda d: d.num_tokens, reverse=True)
        return by_mode

    def _build_tiers(
        self, by_mode: Mapping[GraphMode, list[BatchDescriptor]]
    ) -> dict[int, list[tuple[list[int], list[tuple[BatchDescriptor, ...]]]]]:
        """Per LoRA case, per mode (FULL, then PIECEWISE): the captured token
        counts ascending, and the descriptors of each count.

        FULL graphs come before PIECEWISE ones. Within a mode a token count only
        sees the graphs of the smallest captured size that holds it, so the
        padding is minimal; if none of those is compatible, the next mode is
        tried rather than a larger graph of the same mode.
        """
        tiers: dict[int, list[tuple[list[int], list[tuple[BatchDescriptor, ...]]]]] = {}
        for mode in (GraphMode.FULL, GraphMode.PIECEWISE):
            ascending = tuple(reversed(by_mode.get(mode, [])))
            for loras in self.config.lora_cases:
                same_case = (d for d in ascending if d.num_active_loras == loras)
                sizes: list[int] = []
                groups: list[tuple[BatchDescriptor, ...]] = []
                for num_tokens, group in groupby(same_case, key=lambda d: d.num_tokens):
                    sizes.append(num_tokens)
                    groups.append(tuple(group))
                if sizes:
                    tiers.setdefault(loras, []).append((sizes, groups))
        return tiers

    def _candidates_for(self, num_tokens: int, loras: int) -> tuple[BatchDescriptor, ...]:
        key = (num_tokens, loras)
        hit = self._candidate_memo.get(key)
        if hit is not None:
            return hit
        found: list[BatchDescriptor] = []
        if isinstance(num_tokens, int) and num_tokens >= 0:
            for sizes, groups in self._tiers.get(loras, ()):
                at = bisect_left(sizes, num_tokens)
                if at < len(sizes):
                    found.extend(groups[at])
        answer = tuple(found)
        if len(self._candidate_memo) >= _MEMO_LIMIT:
            self._candidate_memo.clear()
        self._candidate_memo[key] = answer
        return answer

    # -- inspection -----------------------------------------------------
    @property
    def capture_descriptors(self) -> Mapping[GraphMode, tuple[BatchDescriptor, ...]]:
        """Runtime mode -> descriptors, largest first."""
        return MappingProxyType(self._capture)

    @property
    def capture_order(self) -> tuple[BatchDescriptor, ...]:
        """Every descriptor, in the order they are captured: PIECEWISE, then FULL."""
        order: list[BatchDescriptor] = []
        for mode in (GraphMode.PIECEWISE, GraphMode.FULL):
            order.extend(self._capture.get(mode, ()))
        return tuple(order)

    @property
    def descriptors(self) -> tuple[BatchDescriptor, ...]:
        """All descriptors of the plan (same as ``capture_order``)."""
        return self.capture_order

    def candidates(self, num_tokens: int, num_active_loras: int = 0) -> tuple[BatchDescriptor, ...]:
        """The descriptors dispatch tries for a token count, in priority order."""
        return self._candidates_for(num_tokens, self.effective_loras(num_active_loras))

    def candidate_range(self, desc: BatchDescriptor) -> range:
        """Token counts for which ``desc`` is among the candidates."""
        for sizes, groups in self._tiers.get(desc.num_active_loras, ()):
            for at, group in enumerate(groups):
                if desc in group:
                    low = sizes[at - 1] + 1 if at else 1
                    return range(max(low, 1), sizes[at] + 1)
        return range(0)

    @property
    def max_lora_case(self) -> int:
        return self._max_lora_case

    def effective_loras(self, num_active_loras: int) -> int:
        """The captured LoRA case that serves ``num_active_loras`` adapters.

        Counts above the largest case clamp to it; 0 stays 0 (a batch without
        adapters never meets a LoRA graph).
        """
        cases = self._lora_cases
        if num_active_loras <= 0 or not cases:
            return num_active_loras
        if num_active_loras >= self._max_lora_case:
            return self._max_lora_case
        return cases[bisect_left(cases, num_active_loras)]

    # -- dispatch -------------------------------------------------------
    def dispatch(
        self,
        *,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> BatchDescriptor:
        """The descriptor whose graph serves this batch, or a ``NONE`` one.

        ``uniform_token_count``: tokens per request when all requests have the
        same count, else None. ``max_query_len``: the longest request's tokens,
        or None when the batch may hold a prefill. A batch no graph can serve
        (larger than every graph, say) gets ``GraphMode.NONE``: run it eagerly.
        Invalid batches raise ``ValueError``. ``dispatch_batch`` takes the same
        as a ``Batch``.
        """
        key = (num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len, num_ubatches)
        hit = self._memo.get(key)
        # True == 1 and 1.0 == 1 hash alike: only exact ints may take an
        # answer memoised for ints (None is fine for the two optional counts).
        if (
            hit is not None
            and type(num_reqs) is int
            and type(num_tokens) is int
            and type(num_active_loras) is int
            and type(num_ubatches) is int
            and type(uniform_token_count) in _OPTIONAL_INT
            and type(max_query_len) in _OPTIONAL_INT
        ):
            return hit
        # Fast check of the common, valid case; anything else gets the slow
        # validation, which raises with a message naming the field.
        if not (
            type(num_tokens) is int
            and type(num_reqs) is int
            and type(num_active_loras) is int
            and type(num_ubatches) is int
            and 0 <= num_reqs <= num_tokens
            and (num_reqs > 0 or num_tokens == 0)
            and num_active_loras >= 0
            and num_ubatches >= 1
            and (
                uniform_token_count is None or (type(uniform_token_count) is int and uniform_token_count >= 1)
            )
            and (max_query_len is None or (type(max_query_len) is int and max_query_len >= 1))
        ):
            self._validate_batch(*key)
        answer = self._lookup(*key)
        if len(self._memo) >= _MEMO_LIMIT:
            self._memo.clear()
        self._memo[key] = answer
        return answer

    def dispatch_batch(self, batch: Batch) -> BatchDescriptor:
        """``dispatch`` for a ``Batch``.

        The memo and the miss path work on the raw values (a tuple): making a
        ``Batch`` per new shape would double the cost of a first dispatch.
        """
        return self.dispatch(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            uniform_token_count=batch.uniform_token_count,
            num_active_loras=batch.num_active_loras,
            max_query_len=batch.max_query_len,
            num_ubatches=batch.num_ubatches,
        )

    @staticmethod
    def _validate_batch(
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int,
        max_query_len: int | None,
        num_ubatches: int,
    ) -> None:
        _check_count("num_tokens", num_tokens, 0)
        _check_count("num_reqs", num_reqs, 1 if num_tokens else 0)
        if num_reqs > num_tokens:
            raise ValueError(
                f"num_reqs ({num_reqs}) exceeds num_tokens ({num_tokens}): every request "
                "holds at least one token"
            )
        _check_count("num_active_loras", num_active_loras, 0)
        _check_count("num_ubatches", num_ubatches, 1)
        if uniform_token_count is not None:
            _check_count("uniform_token_count", uniform_token_count, 1)
        if max_query_len is not None:
            _check_count("max_query_len", max_query_len, 1)

    def _lookup(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int,
        max_query_len: int | None,
        num_ubatches: int,
    ) -> BatchDescriptor:
        loras = self.effective_loras(num_active_loras)
        if num_tokens > 0:
            for desc in self._candidates_for(num_tokens, loras):
                # BatchDescriptor.is_compatible, inlined: this is the miss path
                # of every new batch shape.
                if (
                    (desc.uniform_token_count is None or desc.uniform_token_count == uniform_token_count)
                    and (
                        desc.max_query_len is None
                        or (max_query_len is not None and max_query_len <= desc.max_query_len)
                    )
                    and (desc.num_reqs is None or num_reqs <= desc.num_reqs)
                    and num_tokens <= desc.num_tokens
                    and desc.num_ubatches == num_ubatches
                ):
                    return desc
        return BatchDescriptor(
            mode=GraphMode.NONE,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_active_loras=loras,
            num_ubatches=num_ubatches,
        )

    def __repr__(self) -> str:
        counts = ", ".join(f"{m.name}: {len(d)}" for m, d in self._capture.items())
        return f"CapturePlan({self.config!r}; {counts or 'no graphs'})"
