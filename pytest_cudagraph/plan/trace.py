"""Capture sizes from real traffic: read a trace of batch shapes, dispatch it, find the best ladder.

Pure Python, like the rest of ``plan``: a trace of a million batches is read,
dispatched through the real ``CapturePlan`` and optimised without torch.

- ``read_trace`` reads JSON Lines or CSV, one batch a line, and keeps the
  distinct shapes with their counts. A bad line is an error that names its
  line number (or, with ``skip_bad=True``, is left out and listed).
- ``analyse`` dispatches every distinct shape once and weighs it by its
  count: the batches each mode serves, the padded tokens, the batches that
  fall back to eager and why.
- ``best_ladder`` finds the capture sizes, at most ``max_graphs`` of them,
  that pad the fewest tokens over the trace while every batch a graph can
  serve stays served: exact, by dynamic programming over the observed sizes.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .batch import Batch
from .capture_plan import CapturePlan
from .config import MAX_CAPTURE_TOKENS, MAX_GRAPHS, MAX_LORA_CASE, CaptureConfig
from .descriptor import BatchDescriptor
from .modes import GraphMode

__all__ = [
    "OPTIONAL_FIELDS",
    "REQUIRED_FIELDS",
    "Analysis",
    "BadLine",
    "Ladder",
    "ModeStats",
    "Trace",
    "TraceError",
    "analyse",
    "best_ladder",
    "fallback_reason",
    "read_trace",
    "suggest",
]

REQUIRED_FIELDS = ("num_tokens", "num_reqs")
OPTIONAL_FIELDS = ("uniform_token_count", "max_query_len", "num_active_loras")
_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS

#: Bad lines named in a ``TraceError``'s message (all are in ``.bad``).
_SHOWN_BAD = 10


# -- reading -------------------------------------------------------------------


@dataclass(frozen=True)
class BadLine:
    line: int  # 1-based, as an editor shows it
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class TraceError(ValueError):
    """A trace that cannot be read: the file, or the lines that are wrong (``.bad``)."""

    def __init__(self, path: str, message: str, bad: Sequence[BadLine] = ()) -> None:
        self.path = path
        self.bad = tuple(bad)
        shown = "; ".join(str(b) for b in self.bad[:_SHOWN_BAD])
        more = f"; ... {len(self.bad) - _SHOWN_BAD} more" if len(self.bad) > _SHOWN_BAD else ""
        super().__init__(f"{path}: {message}{': ' + shown + more if self.bad else ''}")


@dataclass(frozen=True)
class Trace:
    """The distinct batch shapes of a trace and how often each occurred."""

    path: str
    counts: Mapping[Batch, int]
    skipped: tuple[BadLine, ...] = ()
    ignored_fields: tuple[str, ...] = ()  # columns or keys the trace has that a batch does not use
    missing_fields: tuple[str, ...] = ()  # optional fields no line of the trace has (their default assumed)

    @property
    def batches(self) -> int:
        return sum(self.counts.values())

    @property
    def real_tokens(self) -> int:
        return sum(b.num_tokens * n for b, n in self.counts.items())

    @property
    def shapes(self) -> list[Batch]:
        """The distinct shapes, by token count then request count (the order a suite verifies them in)."""
        return sorted(self.counts, key=_shape_key)


def _shape_key(b: Batch) -> tuple[Any, ...]:
    return (b.num_tokens, b.num_reqs, b.uniform_token_count or 0, b.max_query_len or 0, b.num_active_loras)


def _batch_reason(values: tuple[Any, ...]) -> str | None:
    """Why a line's values are not a real batch, or None."""
    t, r, u, q, loras = values
    if t < 1:
        return f"num_tokens must be >= 1; got {t}"
    if t > MAX_CAPTURE_TOKENS:
        return f"num_tokens must be <= {MAX_CAPTURE_TOKENS}; got {t}, far beyond any batch an engine runs"
    if r < 1:
        return f"num_reqs must be >= 1; got {r}"
    if r > t:
        return f"num_reqs ({r}) exceeds num_tokens ({t}): every request holds at least one token"
    if u is not None:
        if u < 1:
            return f"uniform_token_count must be >= 1 or empty; got {u}"
        if u * r != t:
            return (
                f"uniform_token_count {u} with {r} requests makes {u * r} tokens, not num_tokens {t}: "
                "a uniform batch holds exactly uniform_token_count tokens a request"
            )
    if q is not None:
        if q < 1:
            return f"max_query_len must be >= 1 or empty; got {q}"
        if q * r < t:
            return (
                f"max_query_len {q} with {r} requests holds at most {q * r} tokens, fewer than num_tokens {t}"
            )
        if q > t - r + 1:
            return (
                f"max_query_len {q} is more than num_tokens - num_reqs + 1 = {t - r + 1}: the other "
                "requests hold at least a token each"
            )
    if loras < 0:
        return f"num_active_loras must be >= 0; got {loras}"
    if loras > MAX_LORA_CASE:
        return f"num_active_loras must be <= {MAX_LORA_CASE}; got {loras}, far beyond any engine's adapters"
    return None


def _open(path: Path) -> IO[str]:
    # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first field's name.
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _format_of(path: Path) -> str:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".csv"):
        return "csv"
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    with _open(path) as f:  # anything else: a JSON object per line starts with "{"
        for line in f:
            if line.strip():
                return "jsonl" if line.lstrip().startswith("{") else "csv"
    return "jsonl"


def _int(value: Any, name: str, *, optional: bool) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        if optional:
            return None
        raise ValueError(f"{name} is missing")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"{name} must be an integer; got {value!r}")


def _rows_jsonl(f: IO[str]) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
    for number, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, f"not JSON ({exc.msg} at column {exc.colno})"
            continue
        yield (
            number,
            row if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object of fields",
        )


def _rows_csv(f: IO[str], path: str) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
    reader = csv.reader(f)
    header: list[str] | None = None
    for row in reader:
        number = reader.line_num
        if not row or not any(cell.strip() for cell in row):
            continue
        if header is None:
            header = [cell.strip() for cell in row]
            missing = [n for n in REQUIRED_FIELDS if n not in header]
            if missing:
                raise TraceError(
                    path,
                    f"the CSV header (line {number}) has no column {', '.join(missing)}; "
                    f"it needs {', '.join(REQUIRED_FIELDS)} and may have {', '.join(OPTIONAL_FIELDS)}",
                )
            continue
        if len(row) != len(header):
            yield number, f"{len(row)} cells for the header's {len(header)} columns"
            continue
        yield number, dict(zip(header, row, strict=True))


def read_trace(path: str | Path, *, skip_bad: bool = False) -> Trace:
    """The batches of a trace: JSON Lines (an object a line) or CSV (with a header).

    Each line is one batch: ``num_tokens`` and ``num_reqs``, and optionally
    ``uniform_token_count``, ``max_query_len`` (empty or null: unknown, so
    possibly a prefill) and ``num_active_loras`` (default 0). Other fields
    are ignored and listed in ``Trace.ignored_fields``; optional ones no line
    has are listed in ``Trace.missing_fields``. A ``.gz`` file is read
    through gzip. A line that is not a batch raises ``TraceError`` naming every
    such line; ``skip_bad=True`` leaves them out instead, in ``Trace.skipped``.
    """
    p = Path(path)
    name = str(path)
    if not p.is_file():
        what = (
            "is a directory"
            if p.is_dir()
            else "is not a regular file (a device, a FIFO or a socket)"
            if p.exists()
            else "no such file"
        )
        raise TraceError(name, f"{what} (a trace is a JSON Lines or CSV file, one batch a line)")
    counts: Counter[tuple[Any, ...]] = Counter()
    checked: dict[tuple[Any, ...], str | None] = {}
    bad: list[BadLine] = []
    ignored: set[str] = set()
    present: set[str] = set()
    known = set(_FIELDS)
    try:
        kind = _format_of(p)
        with _open(p) as f:
            rows = _rows_jsonl(f) if kind == "jsonl" else _rows_csv(f, name)
            for number, row in rows:
                if isinstance(row, str):
                    bad.append(BadLine(number, row))
                    continue
                try:
                    values = (
                        _int(row.get("num_tokens"), "num_tokens", optional=False),
                        _int(row.get("num_reqs"), "num_reqs", optional=False),
                        _int(row.get("uniform_token_count"), "uniform_token_count", optional=True),
                        _int(row.get("max_query_len"), "max_query_len", optional=True),
                        _int(row.get("num_active_loras"), "num_active_loras", optional=True) or 0,
                    )
                except ValueError as exc:
                    bad.append(BadLine(number, str(exc)))
                    continue
                if values not in checked:  # a trace repeats few shapes many times: check each once
                    checked[values] = _batch_reason(values)
                    ignored.update(k for k in row if k not in known)
                    present.update(k for k, v in row.items() if v not in (None, ""))
                reason = checked[values]
                if reason is not None:
                    bad.append(BadLine(number, reason))
                    continue
                counts[values] += 1
    except (OSError, UnicodeDecodeError, EOFError, csv.Error, zlib.error) as exc:
        raise TraceError(name, f"cannot be read: {type(exc).__name__}: {exc}") from None
    if bad and not skip_bad:
        raise TraceError(
            name, f"{len(bad)} line(s) are not batches (fix them, or skip them and have them listed)", bad
        )
    if not counts:
        raise TraceError(name, "holds no batch" + (" that could be read" if bad else ""), bad)
    shapes = {
        Batch(num_tokens=t, num_reqs=r, uniform_token_count=u, max_query_len=q, num_active_loras=loras): n
        for (t, r, u, q, loras), n in counts.items()
    }
    return Trace(
        name,
        shapes,
        tuple(bad),
        tuple(sorted(ignored)),
        tuple(f for f in OPTIONAL_FIELDS if f not in present),
    )


# -- dispatching a trace ----------------------------------------------------------


def assumed(config: CaptureConfig, missing: Iterable[str]) -> list[str]:
    """What a trace without some optional fields is taken to mean under ``config``, a line a field."""
    mode = config.mode
    separate = mode.separate_routine() and bool(mode.decode_mode())
    mixed = mode.mixed_mode()
    served = (
        f"{mixed.name} graphs serve them as mixed batches" if mixed else "they run eagerly (no mixed graphs)"
    )
    lines = []
    for name in missing:
        if name == "uniform_token_count":
            lines.append(
                "uniform_token_count: no batch is known to be a uniform decode batch; "
                + (
                    f"the {mode.decode_mode().name} uniform decode graphs serve none of them, and {served}"
                    if separate and not config.varlen_decode
                    else "this plan has no uniform decode graphs to miss"
                )
            )
        elif name == "max_query_len":
            lines.append(
                "max_query_len: every request may hold a prefill; "
                + (
                    f"the varlen decode graphs serve none of them, and {served}"
                    if separate and config.varlen_decode
                    else "this plan has no varlen decode graphs to miss"
                )
            )
        elif name == "num_active_loras":
            lines.append("num_active_loras: no adapter is active (0) in any batch")
    return lines


def fallback_reason(plan: CapturePlan, batch: Batch) -> str:
    """Why no graph of ``plan`` serves ``batch`` (which dispatch runs eagerly), in words that group batches."""
    cfg = plan.config
    if not cfg.mode:
        return "the plan captures no graphs (mode NONE)"
    q = cfg.decode_query_len
    decode = (
        (batch.max_query_len is not None and batch.max_query_len <= q)
        if cfg.varlen_decode
        else batch.uniform_token_count in cfg.query_lens
    )
    if cfg.mode is GraphMode.FULL_DECODE_ONLY and not decode:
        if not cfg.varlen_decode and batch.uniform_token_count is not None:
            return (
                f"a uniform decode batch of {batch.uniform_token_count} tokens a request, a length the plan "
                f"captures no decode graph for (decode_query_lens {list(cfg.query_lens)})"
            )
        return "a mixed batch: FULL_DECODE_ONLY runs mixed batches eagerly"
    loras = plan.effective_loras(batch.num_active_loras)
    same_case = [d for d in plan.descriptors if d.num_active_loras == loras]
    if not same_case:
        return f"no graph for {loras} active LoRA adapters (lora_cases {list(cfg.lora_cases)})"
    candidates = plan.candidates(batch.num_tokens, batch.num_active_loras)
    if not candidates:
        largest = max(d.num_tokens for d in same_case)
        return f"more tokens than the largest graph ({largest})"
    reasons = []
    for desc in candidates:
        if desc.uniform_token_count is not None and desc.uniform_token_count != batch.uniform_token_count:
            lens = cfg.query_lens
            served = (
                (
                    f"{desc.uniform_token_count} tokens a request, which is all the {desc.mode.name} decode "
                    "graphs serve"
                )
                if len(lens) == 1
                else (
                    f"{' or '.join(map(str, lens))} tokens a request (decode_query_lens), which is all the "
                    f"{desc.mode.name} decode graphs serve, each the batches of its own length"
                )
            )
            reasons.append(f"not a uniform decode batch of {served}")
        elif desc.max_query_len is not None and (
            batch.max_query_len is None or batch.max_query_len > desc.max_query_len
        ):
            reasons.append(
                f"a request of more than {desc.max_query_len} tokens (or an unknown max_query_len: a "
                f"possible prefill), which the varlen decode graphs do not take"
            )
        elif desc.num_reqs is not None and batch.num_reqs > desc.num_reqs:
            reasons.append(
                f"more requests than the graph that holds its tokens (max_num_reqs {cfg.max_num_reqs})"
            )
        else:
            reasons.append("no compatible graph")
    return reasons[0]


@dataclass
class ModeStats:
    """The batches one runtime mode serves, and their tokens."""

    batches: int = 0
    real_tokens: int = 0
    graph_tokens: int = 0

    @property
    def padded_tokens(self) -> int:
        return self.graph_tokens - self.real_tokens

    @property
    def padding_waste(self) -> float:
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0


@dataclass
class Analysis:
    """A plan dispatching a trace: served batches by mode, padding, and the eager fallbacks with why."""

    capture_sizes: tuple[int, ...]
    batches: int
    real_tokens: int
    by_mode: dict[str, ModeStats] = field(default_factory=dict)
    eager: ModeStats = field(default_factory=ModeStats)
    fallbacks: Counter[str] = field(default_factory=Counter)
    #: (mode, real tokens, graph tokens) -> batches: where the padding goes.
    padding: Counter[tuple[str, int, int]] = field(default_factory=Counter)

    @property
    def served(self) -> ModeStats:
        total = ModeStats()
        for s in self.by_mode.values():
            total.batches += s.batches
            total.real_tokens += s.real_tokens
            total.graph_tokens += s.graph_tokens
        return total

    @property
    def coverage(self) -> float:
        """The fraction of batches a graph serves."""
        return self.served.batches / self.batches if self.batches else 0.0

    @property
    def padding_waste(self) -> float:
        """Padded tokens per real token, over the batches a graph serves."""
        return self.served.padding_waste

    def worst_padded(self, n: int = 5) -> list[tuple[str, int, int, int, int]]:
        """The ``n`` (mode, real tokens, graph tokens, batches, padded tokens) that pad the most in all."""
        rows = [(mode, t, g, count, (g - t) * count) for (mode, t, g), count in self.padding.items() if g > t]
        rows.sort(key=lambda row: (-row[4], row[1]))
        return rows[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "capture_sizes": list(self.capture_sizes),
            "batches": self.batches,
            "real_tokens": self.real_tokens,
            "coverage": self.coverage,
            "padding_waste": self.padding_waste,
            "padded_tokens": self.served.padded_tokens,
            "by_mode": {
                m: {
                    "batches": s.batches,
                    "real_tokens": s.real_tokens,
                    "padded_tokens": s.padded_tokens,
                    "padding_waste": s.padding_waste,
                }
                for m, s in self.by_mode.items()
            },
            "eager": {
                "batches": self.eager.batches,
                "real_tokens": self.eager.real_tokens,
                "reasons": dict(self.fallbacks.most_common()),
            },
        }


def analyse(plan: CapturePlan, trace: Trace | Mapping[Batch, int]) -> Analysis:
    """Dispatch every batch of ``trace`` with ``plan``: what each mode serves, the padding, the eager fallbacks."""
    counts = trace.counts if isinstance(trace, Trace) else trace
    result = Analysis(
        plan.config.sorted_capture_sizes,
        sum(counts.values()),
        sum(b.num_tokens * n for b, n in counts.items()),
    )
    for batch, count in counts.items():
        desc = plan.dispatch_batch(batch)
        if desc.is_graphed:
            stats = result.by_mode.setdefault(desc.mode.name, ModeStats())
            stats.batches += count
            stats.real_tokens += batch.num_tokens * count
            stats.graph_tokens += desc.num_tokens * count
            result.padding[(desc.mode.name, batch.num_tokens, desc.num_tokens)] += count
        else:
            result.eager.batches += count
            result.eager.real_tokens += batch.num_tokens * count
            result.fallbacks[fallback_reason(plan, batch)] += count
    return result


# -- the best ladder -----------------------------------------------------------------


def best_ladder(demand: Mapping[int, tuple[int, int]], max_graphs: int) -> tuple[tuple[int, ...], int]:
    """The sizes, at most ``max_graphs``, that minimise the padded tokens of ``demand``; and that padding.

    ``demand`` maps a size to (batches, real tokens) of the batches whose
    smallest serving size it is: each batch is served by the smallest chosen
    size at or above its own, and pays that size minus its tokens. The
    largest size is always chosen, so every batch stays served.

    Exact: f_k(j), the least padding of the sizes up to the j-th with k
    sizes the last of which is the j-th, is
    ``min_i f_{k-1}(i) + x_j (C_j - C_i) - (T_j - T_i)`` over i < j (C, T:
    prefix sums of batches and tokens). For a fixed i that is a line in x_j
    with slope -C_i, the slopes fall as i grows and x_j rises with j, so
    each layer is a lower envelope walked once (the convex hull trick):
    O(max_graphs * sizes) in exact integer arithmetic.
    """
    if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
        raise ValueError(f"max_graphs must be an integer >= 1; got {max_graphs!r}")
    xs = sorted(demand)
    if not xs:
        return (), 0
    m = len(xs)
    counts = [0] * (m + 1)
    tokens = [0] * (m + 1)
    for j, x in enumerate(xs, 1):
        c, t = demand[x]
        if c < 1:
            raise ValueError(f"demand at size {x} has {c} batches; every size in it needs at least one")
        counts[j] = counts[j - 1] + c
        tokens[j] = tokens[j - 1] + t
    if max_graphs >= m:  # every size its own graph
        return tuple(xs), sum(x * demand[x][0] - demand[x][1] for x in xs)
    inf = None
    prev: list[int | None] = [0] + [inf] * m  # f_0: nothing chosen covers nothing
    parents: list[array[int]] = []
    best_cost: int | None = None
    best_k = 0
    for k in range(1, max_graphs + 1):
        cur: list[int | None] = [inf] * (m + 1)
        parent = array("i", [0]) * (m + 1)
        # The lines of the i already seen: slope -C_i, intercept f_{k-1}(i) + T_i.
        slopes: list[int] = []
        inter: list[int] = []
        owner: list[int] = []
        head = 0
        for j in range(k, m + 1):
            i = j - 1
            if prev[i] is not None:
                a, b = -counts[i], prev[i] + tokens[i]  # type: ignore[operator]
                # Drop lines the new one makes useless (exact: cross-multiplied integers).
                while len(slopes) - head >= 2:
                    a1, b1, a2, b2 = slopes[-2], inter[-2], slopes[-1], inter[-1]
                    if (b - b1) * (a1 - a2) <= (b2 - b1) * (a1 - a):
                        slopes.pop()
                        inter.pop()
                        owner.pop()
                    else:
                        break
                slopes.append(a)
                inter.append(b)
                owner.append(i)
                head = min(head, len(slopes) - 1)
            if head >= len(slopes):
                continue
            x = xs[j - 1]
            while (
                head + 1 < len(slopes)
                and slopes[head + 1] * x + inter[head + 1] <= slopes[head] * x + inter[head]
            ):
                head += 1
            cur[j] = x * counts[j] - tokens[j] + slopes[head] * x + inter[head]
            parent[j] = owner[head]
        parents.append(parent)
        if cur[m] is not None and (best_cost is None or cur[m] < best_cost):  # type: ignore[operator]
            best_cost, best_k = cur[m], k
        prev = cur
    assert best_cost is not None  # k = 1 always reaches the last size
    chosen: list[int] = []
    j = m
    for k in range(best_k, 0, -1):
        chosen.append(xs[j - 1])
        j = parents[k - 1][j]
    return tuple(sorted(chosen)), best_cost


@dataclass(frozen=True)
class Ladder:
    """A suggested ladder: its sizes, and the padding the model predicts for the batches it was chosen for."""

    capture_sizes: tuple[int, ...]
    padded_tokens: int
    batches: int  # the batches it was chosen for (those some graph of the mode can serve)
    real_tokens: int  # their tokens
    #: Set when the ladder is the best of a restricted set only: why.
    restricted: str | None = None

    @property
    def padding_waste(self) -> float:
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0


def _routine(desc: BatchDescriptor, cfg: CaptureConfig) -> str:
    """The routine whose ladder a served batch belongs to (the mode that captures separately)."""
    if cfg.mode.separate_routine() and (
        desc.uniform_token_count is not None or desc.max_query_len is not None
    ):
        return "decode"
    return "mixed"


def suggest(
    config: CaptureConfig, trace: Trace | Mapping[Batch, int], max_graphs: int
) -> tuple[Ladder, dict[str, Ladder]]:
    """The best ladder of at most ``max_graphs`` sizes for ``trace`` under ``config``'s other settings.

    Returns the one ladder a ``CaptureConfig`` takes, chosen for every batch
    together, and, where decode and mixed batches are captured separately
    (FULL_AND_PIECEWISE, FULL_DECODE_ONLY), the best ladder of each routine
    on its own, keyed by its mode name.

    The batches counted are those a graph can serve at all: the ones a plan
    with a graph at every observed size serves. Each of them, under a ladder,
    is served by the smallest size at or above its tokens, and pays the
    difference; that is exact when every decode graph has a ladder size,
    which holds unless uniform decode has ``decode_query_len`` q > 1. Then a
    size s makes a decode graph of s rounded up to a multiple of q, and the
    ladder is the best of those whose sizes are multiples of q (``restricted``
    says so).
    """
    counts = trace.counts if isinstance(trace, Trace) else trace
    if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
        raise ValueError(f"max_graphs must be an integer >= 1; got {max_graphs!r}")
    q = config.decode_query_len
    # With several query lengths no one step makes every decode graph exact: sizes stay as observed
    # (each uniform batch's token count is already a multiple of its own length).
    rounded = (
        config.mode.separate_routine()
        and bool(config.mode.decode_mode())
        and not config.varlen_decode
        and q > 1
        and config.query_lens == (q,)
    )
    step = q if rounded else 1

    def size_of(tokens: int) -> int:
        return -(-tokens // step) * step

    sizes = sorted({size_of(b.num_tokens) for b in counts})
    per_case = max(1, len(config.lora_cases))
    if len(sizes) * per_case > MAX_GRAPHS:
        raise ValueError(
            f"the trace holds {len(sizes)} distinct token counts, and a plan with a graph at each "
            f"(times {per_case} LoRA cases) is more than {MAX_GRAPHS} graphs: bucket the trace's sizes"
        )
    everywhere = CapturePlan(config.replace(capture_sizes=sizes, max_capture_size=None))
    demand: dict[str, dict[int, tuple[int, int]]] = {"all": {}, "decode": {}, "mixed": {}}
    for batch, count in counts.items():
        desc = everywhere.dispatch_batch(batch)
        if not desc.is_graphed:
            continue
        size = size_of(batch.num_tokens)
        for key in ("all", _routine(desc, config)):
            c, t = demand[key].get(size, (0, 0))
            demand[key][size] = (c + count, t + batch.num_tokens * count)
    restricted = (
        f"uniform decode of {q} tokens a request: the best ladder whose sizes are multiples of {q}"
        if rounded
        else None
    )

    def ladder(d: Mapping[int, tuple[int, int]]) -> Ladder:
        chosen, padded = best_ladder(d, max_graphs)
        return Ladder(
            chosen, padded, sum(c for c, _ in d.values()), sum(t for _, t in d.values()), restricted
        )

    joint = ladder(demand["all"])
    by_mode: dict[str, Ladder] = {}
    if config.mode.separate_routine():
        for key, mode in (("decode", config.mode.decode_mode()), ("mixed", config.mode.mixed_mode())):
            if mode and demand[key]:
                by_mode[mode.name] = ladder(demand[key])
    return joint, by_mode


def distinct(batches: Iterable[Batch]) -> list[Batch]:
    """``batches`` without repeats, in a stable order."""
    return sorted(set(batches), key=_shape_key)
