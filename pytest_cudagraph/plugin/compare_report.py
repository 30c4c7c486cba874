"""``--cudagraph-compare=BASELINE.json[,MORE.json...]``: this run's JSON report against kept ones.

As pytest-benchmark's ``--benchmark-compare``: a CI job keeps the report of a
good run and holds later runs to it. The verdicts first: what newly fails (a
check that failed now on a descriptor where it passed, was skipped or was not
run in the first kept report, or a test that passed and now fails), what newly
passes, and the tests of the baseline not run. Then the figures (capture time,
check time, peak memory, graph memory) that moved beyond their noise: a
figure's own run-to-run spread where two or more kept reports give one (the
new value outside their 99 % prediction interval, ``noise_bound``), and
``--cudagraph-compare-threshold`` (a fraction of the kept value) where the
user sets one. A timing of one kept report has no spread: without a threshold
it is not judged, and the summary says so (a millisecond timing on a shared
machine moves by more than 10 % from run to run). Memory without a spread is
held to ``MOVED``. Changes under ``_FLOORS`` are noise whatever their fraction.
``--cudagraph-compare-fail`` fails the run on a new failure. Pure Python:
importing this module does not import torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..units import format_bytes, format_seconds

__all__ = ["MOVED", "T_995", "Comparison", "compare", "load_baseline", "noise_bound"]

#: Memory of one kept report moved when it changed by at least this fraction of its kept value.
MOVED = 0.10
# Below these a change is noise, whatever its fraction (a 2 ms capture that takes 3 ms).
_FLOORS = {
    "capture_seconds": 0.05,
    "check_seconds": 0.05,
    "peak_memory_bytes": 1 << 20,
    "graph_memory_bytes": 1 << 20,
}
_FORMAT: dict[str, Callable[[float], str]] = {
    "capture_seconds": format_seconds,
    "check_seconds": format_seconds,
    "peak_memory_bytes": lambda n: format_bytes(int(n)),
    "graph_memory_bytes": lambda n: format_bytes(int(n)),
}
#: The timings: without a spread (one kept report) or a threshold, they are not compared.
_TIMINGS = frozenset({"capture_seconds", "check_seconds"})
#: Student's t distribution's 0.995 quantile for 1 to 30 degrees of freedom (the last for more).
T_995 = (
    63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169,
    3.106, 3.055, 3.012, 2.977, 2.947, 2.921, 2.898, 2.878, 2.861, 2.845,
    2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763, 2.756, 2.750,
)  # fmt: skip


def load_baseline(path: Path, source: str) -> dict[str, Any]:
    """The baseline report at ``path``; UsageError naming ``source`` when it cannot be read as one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise pytest.UsageError(
            f"{source}: cannot read {path} ({exc.strerror or exc}); give the JSON report "
            "of an earlier run (--cudagraph-report=PATH)"
        ) from None
    except ValueError as exc:
        raise pytest.UsageError(
            f"{source}: {path} is not JSON ({exc}); give the JSON report of an earlier run "
            "(--cudagraph-report=PATH)"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("tests"), dict) or "version" not in data:
        raise pytest.UsageError(
            f"{source}: {path} is not a pytest-cudagraph JSON report (no 'version' and "
            "'tests'); give the report of an earlier run (--cudagraph-report=PATH)"
        )
    if data.get("complete") is False:
        raise pytest.UsageError(
            f'{source}: {path} is the report of a run that did not finish ("complete": '
            "false); compare with a finished run's"
        )
    return data


@dataclass
class Comparison:
    """What changed from the baseline: lines for the terminal, and whether anything newly fails."""

    baseline: str
    new_failures: list[str] = field(default_factory=list)
    new_passes: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    #: How many kept reports the figures' spread comes from.
    kept: int = 1
    #: ``--cudagraph-compare-threshold`` (None: not set).
    threshold: float | None = None
    #: Timings not compared: one kept report gives no spread and no threshold was set.
    unjudged: int = 0

    def lines(self, limit: int = 20) -> list[str]:
        """The verdict changes first (new failures, new passes, tests not run), then the figures."""
        out = [
            f"cudagraph: compared with {self.baseline}: {len(self.new_failures)} new failure(s), "
            f"{len(self.new_passes)} newly passing, {len(self.missing)} test(s) of the baseline not run"
        ]
        out += _listed((("new failure", self.new_failures), ("newly passing", self.new_passes)), limit)
        out += _listed((("not run", self.missing),), limit)
        bounds = []
        if self.kept > 1:
            bounds.append(
                f"their run-to-run spread over the {self.kept} kept reports (99 % prediction interval)"
            )
        if self.threshold is not None:
            bounds.append(f"{self.threshold:.0%} (--cudagraph-compare-threshold)")
        if self.kept == 1 and self.threshold is None:
            bounds.append(f"{MOVED:.0%} (memory)")
        out.append(f"cudagraph: {len(self.moved)} figure(s) moved beyond {' and '.join(bounds)}")
        out += _listed((("moved", self.moved),), limit)
        if self.unjudged:
            out.append(
                f"cudagraph: {self.unjudged} timing(s) changed, not judged: one kept report gives no "
                "run-to-run spread; keep two or more (--cudagraph-compare=a.json,b.json) or set a "
                "threshold (--cudagraph-compare-threshold=0.5)"
            )
        return out


def _listed(groups: Sequence[tuple[str, list[str]]], limit: int) -> list[str]:
    out = []
    for title, items in groups:
        out += [f"  {title}: {item}" for item in items[:limit]]
        if len(items) > limit:
            out.append(f"  {title}: ... and {len(items) - limit} more")
    return out


def _checks(test: Mapping[str, Any]) -> Iterator[tuple[tuple[int, str, str], str, str]]:
    """(key, shown, status) of every check outcome of a test. The key is the verification's number,
    the check and where it ran; ``shown`` names the module's class too, which is not matched (a test
    may verify a renamed or another module)."""
    for number, record in enumerate(test.get("verifications") or []):
        report = record.get("report") or {}
        for outcome in report.get("outcomes") or []:
            where = (outcome.get("descriptor") or {}).get("label") or "module"
            if outcome.get("rank") is not None:
                where += f" rank {outcome['rank']}"
            status = outcome.get("status") or (
                "skipped" if outcome.get("skipped") else "passed" if outcome.get("passed") else "failed"
            )
            check = str(outcome.get("check"))
            shown = f"verification {number + 1} ({report.get('module')}) {check} {where}"
            yield (number, check, where), shown, status


def _figures(test: Mapping[str, Any]) -> Iterator[tuple[str, str, float]]:
    for number, record in enumerate(test.get("verifications") or []):
        report = record.get("report") or {}
        label = f"verification {number + 1}"
        for name in ("capture_seconds", "check_seconds", "peak_memory_bytes"):
            value = report.get(name)
            if isinstance(value, (int, float)):
                yield label, name, float(value)
        graph = report.get("graph_memory_bytes")
        if isinstance(graph, dict) and graph:
            yield (
                label,
                "graph_memory_bytes",
                float(sum(v for v in graph.values() if isinstance(v, (int, float)))),
            )


def noise_bound(kept: Sequence[float]) -> float | None:
    """How far a new run of the code the ``kept`` values came from may lie from their mean by
    noise alone: the half-width of their 99 % prediction interval, ``t * s * sqrt(1 + 1/n)`` (``s``
    their standard deviation, ``t`` Student's 0.995 quantile with ``n - 1`` degrees of freedom).
    Few kept runs say little: two that differ by 0.02 s allow 1.1 s. None for one value."""
    n = len(kept)
    if n < 2:
        return None
    mean = sum(kept) / n
    deviation = math.sqrt(sum((v - mean) ** 2 for v in kept) / (n - 1))
    return T_995[min(n - 1, len(T_995)) - 1] * deviation * math.sqrt(1 + 1 / n)


def _moved(figure: str, kept: Sequence[float], value: float, threshold: float | None) -> bool | None:
    """Whether ``value`` moved from the ``kept`` values of ``figure`` beyond its noise: further from
    their mean than the figure's floor, than its own run-to-run spread allows (two or more kept
    values: ``noise_bound``), and than ``threshold`` of the mean (where set). None where a timing
    changed and nothing says what its noise is (one kept report, no threshold)."""
    mean = sum(kept) / len(kept)
    change = abs(value - mean)
    spread = noise_bound(kept)
    if change < _FLOORS[figure] or (spread is not None and change <= spread):
        return False
    bound = threshold
    if bound is None and spread is None:
        if figure in _TIMINGS:
            return None
        bound = MOVED
    return bound is None or change >= bound * mean


def compare(
    baseline: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    current: Mapping[str, Any],
    name: str,
    threshold: float | None = None,
) -> Comparison:
    """``current`` (this run's report document) against ``baseline``: one kept report, or several
    of the same code (the verdicts are held to the first; the figures to all, whose spread is
    their noise). ``threshold``: a figure moved only when it changed by this fraction or more."""
    kept: list[Mapping[str, Any]] = [baseline] if isinstance(baseline, Mapping) else list(baseline)
    result = Comparison(name, kept=len(kept), threshold=threshold)
    before_tests: Mapping[str, Any] = kept[0].get("tests") or {}
    for nodeid, test in (current.get("tests") or {}).items():
        old = before_tests.get(nodeid)
        old_checks = {key: status for key, _, status in _checks(old)} if old else {}
        for key, shown, status in _checks(test):
            was = old_checks.get(key)
            if status == "failed" and was != "failed":
                result.new_failures.append(f"{nodeid}: {shown} (was {was or 'not run'})")
            elif was == "failed" and status == "passed":
                result.new_passes.append(f"{nodeid}: {shown}")
        outcome, was_outcome = test.get("outcome"), (old or {}).get("outcome")
        if outcome in ("failed", "error", "crashed") and was_outcome == "passed":
            result.new_failures.append(f"{nodeid}: the test {outcome} (was passed)")
        elif outcome == "passed" and was_outcome in ("failed", "error", "crashed"):
            result.new_passes.append(f"{nodeid}: the test passed (was {was_outcome})")
        before: dict[tuple[str, str], list[float]] = {}
        for report in kept:
            old_test = (report.get("tests") or {}).get(nodeid)
            for label, figure, value in _figures(old_test) if old_test else ():
                before.setdefault((label, figure), []).append(value)
        for label, figure, value in _figures(test):
            values = before.get((label, figure))
            if not values:
                continue
            moved = _moved(figure, values, value, threshold)
            if moved is None:
                result.unjudged += 1
            elif moved:
                show = _FORMAT[figure]
                prior = sum(values) / len(values)
                ratio = f"x{value / prior:.2f}" if prior > 0 else "from 0"
                spread = f"; kept {show(min(values))} to {show(max(values))}" if len(values) > 1 else ""
                result.moved.append(
                    f"{nodeid}: {label} {figure}: {show(prior)} -> {show(value)} ({ratio}{spread})"
                )
    current_tests = current.get("tests") or {}
    result.missing = [n for n in before_tests if n not in current_tests]
    return result
