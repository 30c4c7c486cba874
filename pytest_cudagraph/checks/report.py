"""What verification found: one outcome per (check, descriptor), and the report."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..plan import BatchDescriptor
from ..units import format_bytes, format_seconds

__all__ = [
    "REASON_LIMIT",
    "TERMS",
    "Finding",
    "Outcome",
    "StepCost",
    "VerifyReport",
    "descriptor_dict",
    "fitted_reason",
]

#: The line a report ends with: where the words it uses (FULL-T8-R4, max ULP, floor, ...) are explained.
TERMS = (
    "terms (descriptor names like FULL-T8-R4, max ULP, floor, limit, relative rms, quick mode, skipped): "
    "docs/terms.md in the pytest-cudagraph repository"
)


#: The most characters a skip reason takes: the terminal summary prints each reason on one line.
REASON_LIMIT = 160

# Where a reason too long for one line is cut, outside parentheses: before a parenthesis, a colon,
# a semicolon or ", so" (the clause before each stands alone).
_CUTS = (" (", ": ", "; ", ", so ")


def fitted_reason(reason: str, detail: str = "") -> tuple[str, str]:
    """A skip's (reason, detail) as every report shows them: the reason one line of at most
    ``REASON_LIMIT`` characters, the detail whatever more there is to say (the JSON report and
    ``-v`` show it). A reason that fits is kept as it is. One that does not (a check of your own
    that says more, an exception's text) keeps its first line, cut where that is longer to its
    longest start that ends a clause (before a parenthesis, a colon, a semicolon or ", so" outside
    parentheses) or, failing one, at a word with "..."; its whole text then leads the detail, so
    nothing is lost."""
    if len(reason) <= REASON_LIMIT and len(reason.splitlines()) <= 1:
        return reason, detail
    lines = [" ".join(line.split()) for line in reason.splitlines()]
    lines = [line for line in lines if line]
    if not lines:  # blank lines: nothing to say (skipped() refuses a blank reason)
        return "", detail
    whole = "\n".join(lines)
    return _cut(lines[0]), f"{whole}\n{detail}" if detail else whole


def _cut(line: str) -> str:
    """``line`` itself where it fits; else its longest start that ends a clause, else at a word."""
    if len(line) <= REASON_LIMIT:
        return line
    depth, end = 0, 0
    for i, char in enumerate(line[:REASON_LIMIT]):
        if depth == 0 and i and line.startswith(_CUTS, i):
            end = i
        depth = max(depth + (char in "([{") - (char in ")]}"), 0)
    if not end:
        end = line.rfind(" ", 0, REASON_LIMIT - 2)
        return (line[:end] if end > 0 else line[: REASON_LIMIT - 3]).rstrip() + "..."
    return line[:end].rstrip()


def descriptor_dict(desc: BatchDescriptor | None) -> dict[str, Any] | None:
    if desc is None:
        return None
    data = {f.name: getattr(desc, f.name) for f in fields(desc) if not f.name.startswith("_")}
    data["mode"] = desc.mode.name
    data["label"] = desc.label()
    return data


@dataclass
class StepCost:
    """What one step of a verification cost, summed over its runs."""

    seconds: float = 0.0
    forwards: int = 0  # calls of the module's forward (eager runs, warm-ups, captures)
    replays: int = 0  # graph replays

    def to_dict(self) -> dict[str, float | int]:
        return {"seconds": self.seconds, "forwards": self.forwards, "replays": self.replays}


@dataclass
class Finding:
    """Where a check first saw the bug."""

    output: str | None = None  # path of the output leaf ("", "[0]", "['logits']") or state name
    index: tuple[int, ...] | None = None  # first differing element
    got: Any = None  # the graph's value there
    expected: Any = None  # eager's value there
    real_batch: dict[str, Any] | None = None  # the real batch's shape, when one was run
    submodule: str | None = None  # first divergent submodule ("" = top level)
    segment: str | None = None  # PIECEWISE in pieces: "graph segment 2 of 3" or "eager piece '...'"
    max_abs: float | None = None
    max_ulp: int | None = None
    ops: list[str] = field(default_factory=list)  # capture_safety: every offending op
    #: What ``got`` and ``expected`` are, where not the graph and eager (padded_size: two eager runs).
    sides: tuple[str, str] = ("graph", "eager")
    #: Where the graph's program and eager's part, when the first divergent place is the top-level
    #: module: the first op each calls differently, with its call site ("" when looked for and not
    #: found; None when not looked for).
    branch: str | None = None
    #: How to fix what the check found (None: the message says it, or no advice applies).
    fix: str | None = None
    #: Where the values of the two runs first differ beyond the floor: the call (a torch function, a
    #: kernel launch) in the user's code or the first divergent submodule's, with its line (None:
    #: not looked for, or not found). A report leads with it; a branch is then context.
    first_call: str | None = None

    def describe(self) -> str:
        parts: list[str] = []
        if self.first_call:
            parts.append(f"values first differ at {self.first_call}")
        if self.real_batch:
            shape = ", ".join(f"{k}={v}" for k, v in self.real_batch.items() if v is not None)
            parts.append(f"real batch ({shape})")
        if self.output is not None:
            where = f"output {self.output}" if self.output else "the output"
            if self.index is not None:
                where += f" at index {list(self.index)}"
            parts.append(where)
        if self.got is not None or self.expected is not None:
            parts.append(f"{self.sides[0]} gave {self.got!r}, {self.sides[1]} gave {self.expected!r}")
        if self.max_abs is not None:
            ulp = f", max ULP {self.max_ulp}" if self.max_ulp is not None else ""
            parts.append(f"max abs diff {self.max_abs:.3g}{ulp}")
        if self.submodule is not None and not self.ops:
            parts.append(
                f"first divergent submodule: '{self.submodule}'"
                if self.submodule
                else "first divergent submodule: the top-level module"
            )
            if self.branch and self.first_call:
                parts.append(f"context, not the cause: {self.branch}")
            elif self.branch:
                parts.append(self.branch)
            elif self.branch is not None and not self.first_call:
                parts.append(
                    "the line of a branch is not known: the graph's program and eager's call the same torch "
                    "functions from the same lines"
                )
        if self.segment is not None:
            parts.append(f"in {self.segment}")
        return "; ".join(parts)


@dataclass
class Outcome:
    """One check on one descriptor (descriptor None: the check ran once for the module)."""

    check: str
    descriptor: BatchDescriptor | None
    passed: bool
    message: str = ""
    finding: Finding | None = None
    skipped: bool = False
    figures: dict[str, Any] = field(default_factory=dict)
    #: The rank that saw it (``verify_distributed``; None: one process, or all ranks).
    rank: int | None = None
    #: A skip: what more there is to say than its reason (``message``, one line of at most
    #: ``REASON_LIMIT`` characters, which the terminal summary prints); the JSON report and ``-v``
    #: show it. "" where the reason says it all.
    detail: str = ""

    def __post_init__(self) -> None:
        # The one place a skip's reason is held to one line of REASON_LIMIT characters.
        if self.skipped:
            self.message, self.detail = fitted_reason(self.message, self.detail)

    def headline(self) -> str:
        where = self.descriptor.label() if self.descriptor is not None else "module"
        if self.rank is not None:
            where += f" rank {self.rank}"
        status = "SKIP" if self.skipped else ("ok" if self.passed else "FAIL")
        return f"{status:4} {self.check:<22} {where}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "descriptor": descriptor_dict(self.descriptor),
            # A skipped check neither passed nor failed: "passed" is null then, "status" says which.
            "status": "skipped" if self.skipped else "passed" if self.passed else "failed",
            "passed": None if self.skipped else self.passed,
            "skipped": self.skipped,
            "message": self.message,
            "detail": self.detail,
            "finding": _jsonable(asdict(self.finding)) if self.finding is not None else None,
            "figures": _jsonable(self.figures),
            "rank": self.rank,
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


@dataclass
class VerifyReport:
    """Everything ``verify`` did for one module, and whether the graphs are right."""

    module: str
    backend: str
    device: str
    mode: str
    exhaustive: bool
    checks: tuple[str, ...]
    descriptors: tuple[BatchDescriptor, ...] = ()  # verified (captured) descriptors
    planned: int = 0  # descriptors in the plan
    outcomes: list[Outcome] = field(default_factory=list)
    capture_seconds: float = 0.0
    graph_memory: dict[BatchDescriptor, int] = field(default_factory=dict)
    real_batches: int = 0  # real batches run through the graphs
    config: dict[str, Any] = field(default_factory=dict)  # the capture configuration verified
    check_seconds: float = 0.0  # time spent in the checks after capture
    #: The mode the module was verified in: 'eval', 'train' or 'mixed' (None: not known).
    training: str | None = None
    #: "manager" (our GraphManager's graphs) or "runner" (``verify_runner``: someone else's runner).
    kind: str = "manager"
    #: Per step (each check, "capture", "learn"): seconds, forwards and replays.
    costs: dict[str, StepCost] = field(default_factory=dict)
    #: The memory held at the peak of the verification and when it began (bytes), and what they count.
    peak_memory: int = 0
    #: A verification over ranks (verify_distributed): each rank's own peak; peak_memory is the largest.
    rank_peak_memory: dict[int, int] = field(default_factory=dict)
    memory_at_start: int = 0
    memory_kind: str = ""
    #: The stage after the graphs were released (``padded_size``'s float64 reference): the memory held
    #: when it began and at its peak (bytes; 0: no such stage ran).
    reference_memory_at_start: int = 0
    reference_peak_memory: int = 0
    #: What the verification could not do as usual, said once (not a failure of the module's graphs).
    notes: list[str] = field(default_factory=list)
    #: The references handed in for kernels (``references=``): each with how it held against its
    #: kernel and whether it stood in for it in the float64 reference.
    references: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.passed and not o.skipped]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def skips(self) -> list[Outcome]:
        """Checks that had nothing to do somewhere; each says why (``message``)."""
        return [o for o in self.outcomes if o.skipped]

    def skipped_reasons(self) -> list[tuple[str, str, list[str]]]:
        """(check, reason, where) for every skipped check, one entry per check and reason."""
        grouped: dict[tuple[str, str], list[str]] = {}
        for o in self.skips:
            where = o.descriptor.label() if o.descriptor is not None else "module"
            if o.rank is not None:
                where += f" rank {o.rank}"
            grouped.setdefault((o.check, o.message), []).append(where)
        return [(check, reason, where) for (check, reason), where in grouped.items()]

    def skipped_details(self) -> dict[tuple[str, str], list[str]]:
        """(check, reason) -> the distinct details of its skips, in order (none where the reason said it all)."""
        details: dict[tuple[str, str], list[str]] = {}
        for o in self.skips:
            told = details.setdefault((o.check, o.message), [])
            if o.detail and o.detail not in told:
                told.append(o.detail)
        return details

    @property
    def graph_memory_bytes(self) -> int:
        return sum(self.graph_memory.values())

    def add(self, outcomes: Iterable[Outcome]) -> None:
        self.outcomes.extend(outcomes)

    def summary(self) -> str:
        failed = self.failures
        checks = sorted({o.check for o in failed})
        status = "all checks passed" if not failed else f"{len(failed)} failure(s) in {', '.join(checks)}"
        if self.skips:
            status += f", {len(self.skips)} skipped"
        mode = f" in {self.training} mode" if self.training else ""
        if self.kind == "runner":
            sizes = sum(1 for d in self.descriptors if d.mode.name != "NONE")
            fallback = " and the eager fallback" if sizes < len(self.descriptors) else ""
            return (
                f"{self.module} on {self.device}{mode}: {sizes} capture sizes{fallback} verified, "
                f"{self.real_batches} runner calls, {status}{self._coverage()}; capture "
                f"{format_seconds(self.capture_seconds)}"
            )
        # Quick mode verifies two descriptors a mode by design: "2/67 captured" would read as failed captures.
        verified = (
            f"{len(self.descriptors)}/{self.planned} descriptors captured and verified (every descriptor)"
            if self.exhaustive
            else f"{len(self.descriptors)} of {self.planned} descriptors verified (quick mode: the smallest and "
            f"largest of each mode)"
        )
        return (
            f"{self.module} on {self.backend} ({self.device}){mode}: {verified}, "
            f"{self.real_batches} real batches, {status}; capture {format_seconds(self.capture_seconds)}, "
            f"graph memory {format_bytes(self.graph_memory_bytes)}{self._peak()}"
        )

    def _peak(self) -> str:
        if not self.peak_memory:
            return ""
        return (
            f", peak memory {format_bytes(self.peak_memory)} ({format_bytes(self.memory_at_start)} before)"
            f"{self._reference()}"
        )

    def _reference(self) -> str:
        """ "; float64 reference: floor ..., limit ..., peak ..." when padded_size ran its reference."""
        asked = [o.figures for o in self.outcomes if o.check == "padded_size" and not o.skipped]
        ran = [f for f in asked if "limit" in f]
        if not ran:
            return ""
        peak = f", peak {format_bytes(self.reference_peak_memory)}" if self.reference_peak_memory else ""
        anew = next((f["draws_anew"] for f in ran if f.get("draws_anew")), "")
        if anew:
            # A floor measured on a module that computes anew on every call is one call's: none is printed.
            return f"; {ran[0]['reference']} reference: no floor or limit ({anew}){peak}"
        stood = list(dict.fromkeys(name for f in ran for name in f.get("stood_in", ())))
        through = f" (references standing in for {', '.join(stood)})" if stood else ""
        # Which route the cross-shape verdicts took: batches settled bit for bit in the module's own
        # precision, and batches asked in float64 (the largest always, and any the first left open).
        fast = sum(int(f.get("bit_for_bit", 0)) for f in asked)
        deep = sum(int(f.get("float64", 0)) for f in asked)
        routes = (
            f" ({fast} of {fast + deep} batches settled bit for bit, {deep} asked in {ran[0]['reference']})"
            if fast
            else ""
        )
        return (
            f"; {ran[0]['reference']} reference{through}: floor {max(f['floor'] for f in ran):.2g}, limit "
            f"{max(f['limit'] for f in ran):.2g}{peak}{routes}"
        )

    def cost_lines(self) -> list[str]:
        """Where the time went: one line per step, the costliest first."""
        total = sum(c.seconds for c in self.costs.values()) or 1.0
        lines = []
        for name, cost in sorted(self.costs.items(), key=lambda kv: -kv[1].seconds):
            lines.append(
                f"  {name:<22} {format_seconds(cost.seconds):>9} {cost.seconds / total:5.0%}  "
                f"{cost.forwards:6d} forwards {cost.replays:6d} replays"
            )
        return lines

    def _coverage(self) -> str:
        """ ", graph coverage k/n calls" from the graph_coverage outcomes, when they counted."""
        counted = [o.figures for o in self.outcomes if o.check == "graph_coverage" and "calls" in o.figures]
        if not counted:
            return ""
        graphed = sum(f["graphed"] for f in counted)
        calls = sum(f["calls"] for f in counted)
        return f", {graphed}/{calls} real batches replayed a CUDA graph"

    def format(self, *, verbose: bool = False) -> str:
        """A readable report: the summary, each failure with where it shows, then every skipped check
        and its reason; ``verbose``: every outcome, a skip's detail under its reason."""
        lines = [self.summary()]
        lines.extend(f"NOTE {note}" for note in dict.fromkeys(self.notes))  # each note once
        # A message several outcomes share (a DynamicCache returned: every comparing check at every
        # descriptor says the same) is printed once, the later ones pointing back to it.
        told: dict[str, str] = {}
        fixes: set[str] = set()
        detailed: set[tuple[str, str]] = set()  # a skip's detail is printed once per reason
        # The op lists printed, each once (capture_safety at every descriptor): a list printed above
        # is pointed to (nothing at all under a message printed above), and a single op its own
        # message names is not listed.
        listed: dict[tuple[str, ...], str] = {}
        for outcome in self.outcomes if verbose else self.failures:
            lines.append(outcome.headline())
            name = " ".join(outcome.headline().split()[1:])  # "check descriptor"
            first = name
            if outcome.message:
                first = told.setdefault(outcome.message, name)
                lines.append(
                    f"     {outcome.message}" if first == name else f"     the same message as {first} above"
                )
            if outcome.detail and (outcome.message, outcome.detail) not in detailed:
                detailed.add((outcome.message, outcome.detail))
                lines.extend(f"     {line}" for line in outcome.detail.splitlines())
            if outcome.finding is not None and not outcome.passed:
                described = outcome.finding.describe()
                if described:
                    lines.append(f"     {described}")
                ops = tuple(outcome.finding.ops)
                if ops and ops in listed:
                    if first == name:  # its message is printed here: say where its list is
                        lines.append(f"     the same op(s) as {listed[ops]} above")
                elif ops and not all(op in outcome.message for op in ops):
                    lines.extend(f"       - {op}" for op in ops)
                if ops:
                    listed.setdefault(ops, name)
                fix = outcome.finding.fix
                if fix:
                    lines.append(f"     fix: {fix}" if fix not in fixes else "     fix: as above")
                    fixes.add(fix)
        if verbose and self.costs:
            lines.append("Where the time went (seconds, share, forwards of the module, graph replays):")
            lines.extend(self.cost_lines())
        if not verbose:
            for check, reason, where in self.skipped_reasons():
                shown = ", ".join(where[:3]) + (f", ... {len(where) - 3} more" if len(where) > 3 else "")
                lines.append(f"SKIP {check:<22} {shown}")
                lines.append(f"     {reason}")
        if self.failures or self.skips or verbose:
            lines.append(TERMS)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        details = self.skipped_details()
        return {
            "module": self.module,
            "backend": self.backend,
            "device": self.device,
            "mode": self.mode,
            "training": self.training,
            "kind": self.kind,
            "exhaustive": self.exhaustive,
            "checks": list(self.checks),
            "config": _jsonable(self.config),
            "planned_descriptors": self.planned,
            "descriptors": [descriptor_dict(d) for d in self.descriptors],
            "passed": self.ok,
            "skipped": [
                {"check": c, "reason": r, "details": details[c, r], "where": w}
                for c, r, w in self.skipped_reasons()
            ],
            "capture_seconds": self.capture_seconds,
            "check_seconds": self.check_seconds,
            "graph_memory_bytes": {d.label(): n for d, n in self.graph_memory.items()},
            "real_batches": self.real_batches,
            "costs": {name: cost.to_dict() for name, cost in self.costs.items()},
            "peak_memory_bytes": self.peak_memory,
            "rank_peak_memory_bytes": {str(rank): n for rank, n in sorted(self.rank_peak_memory.items())},
            "memory_at_start_bytes": self.memory_at_start,
            "memory_kind": self.memory_kind,
            "reference_peak_memory_bytes": self.reference_peak_memory,
            "reference_memory_at_start_bytes": self.reference_memory_at_start,
            "notes": list(self.notes),
            "references": [dict(r) for r in self.references],
            "outcomes": [o.to_dict() for o in self.outcomes],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return self.format()
