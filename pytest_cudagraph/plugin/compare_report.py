"""``--cudagraph-compare=BASELINE.json``: this run's JSON report against a kept one.

As pytest-benchmark's ``--benchmark-compare``: a CI job keeps the report of a
good run and holds later runs to it. What newly fails (a check that failed
now on a descriptor where it passed, was skipped or was not run before, or a
test that passed and now fails), what newly passes, and the figures that moved
(capture time, peak memory, graph memory, check time) by more than
``MOVED`` of their baseline. ``--cudagraph-compare-fail`` fails the run on a
new failure. Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..units import format_bytes, format_seconds

__all__ = ["MOVED", "Comparison", "compare", "load_baseline"]

#: A figure moved when it changed by at least this fraction of its baseline value.
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

    def lines(self, limit: int = 20) -> list[str]:
        head = (
            f"cudagraph: compared with {self.baseline}: {len(self.new_failures)} new failure(s), "
            f"{len(self.new_passes)} newly passing, {len(self.moved)} figure(s) moved by "
            f"{MOVED:.0%} or more, {len(self.missing)} test(s) of the baseline not run"
        )
        out = [head]
        for title, items in (
            ("new failure", self.new_failures),
            ("newly passing", self.new_passes),
            ("moved", self.moved),
            ("not run", self.missing),
        ):
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


def compare(baseline: Mapping[str, Any], current: Mapping[str, Any], name: str) -> Comparison:
    """``current`` (this run's report document) against ``baseline``."""
    result = Comparison(name)
    before_tests: Mapping[str, Any] = baseline.get("tests") or {}
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
        if old:
            before = {(label, figure): value for label, figure, value in _figures(old)}
            for label, figure, value in _figures(test):
                prior = before.get((label, figure))
                if prior is None or abs(value - prior) < _FLOORS[figure]:
                    continue
                if prior > 0 and abs(value / prior - 1) >= MOVED:
                    show = _FORMAT[figure]
                    result.moved.append(
                        f"{nodeid}: {label} {figure}: {show(prior)} -> {show(value)} (x{value / prior:.2f})"
                    )
    current_tests = current.get("tests") or {}
    result.missing = [n for n in before_tests if n not in current_tests]
    return result
