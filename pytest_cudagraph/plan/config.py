"""What to capture: the user's graph configuration, validated once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from itertools import islice
from typing import Any

from .modes import GraphMode
from .validate import UsageError, is_int, short, text_items

__all__ = ["MAX_CAPTURE_TOKENS", "MAX_GRAPHS", "MAX_LORA_CASE", "CaptureConfig"]

#: The largest token (or request) count a graph may be captured for: 2**20.
#: vLLM's largest capture sizes are 512 by default and 8192-65536 at most
#: (bounded by max_num_batched_tokens); one activation of a 2**20-token batch
#: at hidden size 4096 in bf16 is 8 GiB, per layer output kept alive. Beyond it
#: a size is a typo (2**40), not a device.
MAX_CAPTURE_TOKENS = 1 << 20
#: The largest LoRA case (adapters active in one batch): 2**16, thousands of
#: times vLLM's usual max_loras; every adapter of a case is resident on the
#: device.
MAX_LORA_CASE = 1 << 16
#: The most (capture size, LoRA case) pairs a plan may hold, each one graph or
#: more: 2**14. vLLM captures about 70 sizes times a few LoRA cases.
MAX_GRAPHS = 1 << 14


def _int_tuple(
    name: str, values: Iterable[int] | int | str, *, minimum: int, maximum: int
) -> tuple[int, ...]:
    given: Any = values
    if is_int(given):
        given = (given,)
    elif isinstance(given, str):
        given = text_items(given)  # "1,2,4", as the options and the marker take it
    elif isinstance(given, (bytes, bytearray, Mapping)):
        # bytes iterate as their character codes (b"1,2" would be sizes 49, 44, 50)
        raise UsageError(f"{name} must be a list of integers such as [1, 2, 4, 8]; got {short(values)}")
    try:
        # At most MAX_GRAPHS + 1 items are read: range(2**40) is an error, not a wait.
        items: tuple[Any, ...] = tuple(islice(given, MAX_GRAPHS + 1))
    except TypeError:
        raise UsageError(
            f"{name} must be a list of integers such as [1, 2, 4, 8]; got {short(values)}"
        ) from None
    if len(items) > MAX_GRAPHS:
        raise UsageError(
            f"{name} holds more than {MAX_GRAPHS} values: far more graphs than any engine "
            f"captures (vLLM: about 70 sizes); give fewer"
        )
    bad = [v for v in items if not is_int(v) or v < minimum]
    if bad:
        raise UsageError(f"{name} must hold integers >= {minimum}; got {bad[0]!r} in {_short(items)}")
    huge = [v for v in items if v > maximum]
    if huge:
        raise UsageError(
            f"{name} must hold integers <= {maximum}; got {huge[0]!r} in {_short(items)}: "
            f"far beyond any device (vLLM's largest capture sizes are 8192-65536 tokens)"
        )
    # Keep the order given (the capture order of LoRA cases follows it, as in
    # vLLM) but drop repeats, which would only capture the same graph twice.
    return tuple(dict.fromkeys(items))


def _short(items: tuple[int, ...]) -> str:
    return (
        repr(items) if len(items) <= 20 else f"({', '.join(map(str, items[:20]))}, ... {len(items)} in all)"
    )


def _check_at_most(name: str, value: int, maximum: int, what: str) -> None:
    if value > maximum:
        raise UsageError(f"{name} must be <= {maximum} ({what}); got {value!r}: far beyond any device")


@dataclass(frozen=True)
class CaptureConfig:
    """The graphs to capture, with vLLM's meaning for each field.

    Arguments are keyword-only. ``capture_sizes`` are the token counts graphs
    are captured for; ``max_num_reqs`` is the most requests a batch may hold;
    ``mode`` picks FULL / PIECEWISE / split decode-and-mixed routines;
    ``decode_query_len`` is the tokens per request of a uniform decode batch
    (1, or 1 + speculative tokens); ``lora_cases`` are the active-adapter
    counts graphs are captured for (0: no LoRA); ``varlen_decode`` captures
    decode graphs that take any mix of 1..``decode_query_len`` tokens per
    request instead of exactly ``decode_query_len``; ``max_capture_size``
    bounds uniform decode graphs (default: the largest capture size).
    ``decode_query_lens`` are the query lengths uniform decode graphs are
    captured for under dynamic speculative decoding (the scheduler picks fewer
    draft tokens for larger batches): each between 1 and ``decode_query_len``,
    default ``(decode_query_len,)``; graphs of one token count and several
    lengths share that count's dispatch range, and a batch is served by the
    graph of its own ``uniform_token_count``.
    ``num_ubatches`` > 1 adds, for each FULL graph of at least
    ``ubatch_min_tokens`` tokens whose tokens split evenly over its requests, a
    twin captured for a batch split into that many microbatches (vLLM's DBO).
    """

    capture_sizes: tuple[int, ...]
    max_num_reqs: int
    mode: GraphMode = GraphMode.FULL
    decode_query_len: int = 1
    lora_cases: tuple[int, ...] = (0,)
    varlen_decode: bool = False
    max_capture_size: int | None = None
    num_ubatches: int = 1
    ubatch_min_tokens: int = 1
    #: None as given means ``(decode_query_len,)``; stored resolved, smallest first.
    decode_query_lens: tuple[int, ...] | None = None
    _sorted_sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        *,
        capture_sizes: Iterable[int],
        max_num_reqs: int,
        mode: GraphMode | str = GraphMode.FULL,
        decode_query_len: int = 1,
        lora_cases: Iterable[int] = (0,),
        varlen_decode: bool = False,
        max_capture_size: int | None = None,
        num_ubatches: int = 1,
        ubatch_min_tokens: int = 1,
        decode_query_lens: Iterable[int] | None = None,
    ) -> None:
        sizes = _int_tuple("capture_sizes", capture_sizes, minimum=1, maximum=MAX_CAPTURE_TOKENS)
        if not sizes:
            raise UsageError("capture_sizes must name at least one token count, e.g. (1, 2, 4, 8)")
        if not is_int(max_num_reqs) or max_num_reqs < 1:
            raise UsageError(f"max_num_reqs must be an integer >= 1; got {max_num_reqs!r}")
        _check_at_most("max_num_reqs", max_num_reqs, MAX_CAPTURE_TOKENS, "requests in one batch")
        if not is_int(decode_query_len) or decode_query_len < 1:
            raise UsageError(
                f"decode_query_len must be an integer >= 1 (1 + speculative tokens); got {decode_query_len!r}"
            )
        _check_at_most("decode_query_len", decode_query_len, MAX_CAPTURE_TOKENS, "tokens per request")
        cases = _int_tuple("lora_cases", lora_cases, minimum=0, maximum=MAX_LORA_CASE)
        if not cases:
            raise UsageError("lora_cases must name at least one case; use (0,) for no LoRA")
        if len(sizes) * len(cases) > MAX_GRAPHS:
            raise UsageError(
                f"{len(sizes)} capture sizes times {len(cases)} LoRA cases is {len(sizes) * len(cases)} graphs "
                f"or more, above the bound of {MAX_GRAPHS}: far more than any engine captures; give fewer"
            )
        if not isinstance(varlen_decode, bool):
            raise UsageError(f"varlen_decode must be True or False; got {varlen_decode!r}")
        largest = max(sizes)
        if max_capture_size is None:
            max_capture_size = largest
        elif not is_int(max_capture_size) or max_capture_size < largest:
            raise UsageError(
                f"max_capture_size must be an integer >= the largest capture size "
                f"({largest}); got {max_capture_size!r}"
            )
        _check_at_most("max_capture_size", max_capture_size, MAX_CAPTURE_TOKENS, "tokens in one graph")
        if not is_int(num_ubatches) or num_ubatches < 1:
            raise UsageError(
                f"num_ubatches must be an integer >= 1 (1: no microbatching); got {num_ubatches!r}"
            )
        _check_at_most("num_ubatches", num_ubatches, MAX_CAPTURE_TOKENS, "microbatches of one batch")
        if not is_int(ubatch_min_tokens) or ubatch_min_tokens < 1:
            raise UsageError(f"ubatch_min_tokens must be an integer >= 1; got {ubatch_min_tokens!r}")
        _check_at_most("ubatch_min_tokens", ubatch_min_tokens, MAX_CAPTURE_TOKENS, "tokens in one graph")
        if decode_query_lens is None:
            lens: tuple[int, ...] = (decode_query_len,)
        else:
            lens = _int_tuple("decode_query_lens", decode_query_lens, minimum=1, maximum=MAX_CAPTURE_TOKENS)
            if not lens:
                raise UsageError(
                    f"decode_query_lens must name at least one query length, e.g. "
                    f"({decode_query_len},); leave it out for decode_query_len alone"
                )
            above = [q for q in lens if q > decode_query_len]
            if above:
                raise UsageError(
                    f"decode_query_lens must hold query lengths between 1 and decode_query_len ({decode_query_len}, "
                    f"the longest: 1 + the most speculative tokens); got {above[0]}. Raise decode_query_len to "
                    f"{max(lens)}, or drop {above[0]}"
                )
            lens = tuple(sorted(lens))
        set_ = object.__setattr__
        set_(self, "capture_sizes", sizes)
        set_(self, "max_num_reqs", max_num_reqs)
        set_(self, "mode", GraphMode.parse(mode))
        set_(self, "decode_query_len", decode_query_len)
        set_(self, "lora_cases", cases)
        set_(self, "varlen_decode", varlen_decode)
        set_(self, "max_capture_size", max_capture_size)
        set_(self, "num_ubatches", num_ubatches)
        set_(self, "ubatch_min_tokens", ubatch_min_tokens)
        set_(self, "decode_query_lens", lens)
        set_(self, "_sorted_sizes", tuple(sorted(sizes)))

    @property
    def sorted_capture_sizes(self) -> tuple[int, ...]:
        """Capture sizes, smallest first."""
        return self._sorted_sizes

    @property
    def query_lens(self) -> tuple[int, ...]:
        """``decode_query_lens`` as resolved: the uniform decode query lengths, smallest first."""
        return self.decode_query_lens or (self.decode_query_len,)

    @property
    def largest_capture_size(self) -> int:
        return self._sorted_sizes[-1]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The keywords, in declaration order: the one list every other place derives from."""
        return _FIELD_NAMES

    @classmethod
    def required_names(cls) -> tuple[str, ...]:
        """The keywords without a default."""
        return tuple(n for n in _FIELD_NAMES if n not in _DEFAULTS)

    @classmethod
    def defaults(cls) -> dict[str, object]:
        """Each keyword with a default, and that default (as declared: ``mode`` a ``GraphMode``)."""
        return dict(_DEFAULTS)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values: tuples as lists, ``mode`` as its name."""
        return {name: _jsonable(getattr(self, name)) for name in _FIELD_NAMES}

    def replace(self, **changes: object) -> CaptureConfig:
        """A copy with some fields changed (validated again)."""
        current: dict[str, object] = {name: getattr(self, name) for name in _FIELD_NAMES}
        unknown = set(changes) - set(current)
        if unknown:
            raise UsageError(f"unknown CaptureConfig field(s): {', '.join(sorted(unknown))}")
        if "capture_sizes" in changes and "max_capture_size" not in changes:
            # The bound followed the old sizes; let it follow the new ones.
            current["max_capture_size"] = None
        if (
            "decode_query_len" in changes
            and "decode_query_lens" not in changes
            and current["decode_query_lens"] == (self.decode_query_len,)
        ):
            # The lengths were the default, decode_query_len alone: they follow it.
            current["decode_query_lens"] = None
        current.update(changes)
        return CaptureConfig(**current)  # type: ignore[arg-type]


def _jsonable(value: object) -> object:
    if isinstance(value, GraphMode):
        return value.name
    if isinstance(value, tuple):
        return list(value)
    return value


# Derived once from the dataclass: adding a field is its declaration, its
# __init__ keyword and its validation, nothing elsewhere.
_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(CaptureConfig) if f.init)
_DEFAULTS: dict[str, object] = {
    f.name: f.default for f in fields(CaptureConfig) if f.init and f.default is not MISSING
}
