"""Run state of the pytest plugin, the header line, the terminal summary and the JSON report.

Per-test results are plain JSON-able dicts ("records", one per
``cudagraph_verify`` call). They travel on the test report: the plugin moves
the records made during a phase onto that phase's ``TestReport`` as the
attribute ``REPORT_ATTR``, and collects them back from
``pytest_runtest_logreport``. pytest serialises a report's ``__dict__`` (so
pytest-xdist ships the records from workers to the controller, and
pytest-reportlog writes them) without any code of ours. The same way travel
the flag ``USED_ATTR`` (the test used the plugin: it is listed in the JSON
report whatever its outcome) and the ``cudagraph_benchmark`` rows
(``BENCH_ATTR``, for the Markdown benchmark report), and, where a JSON report is
written, the top-level modules the test's process imported since its last report
(``MODULES_ATTR``), from which the report names every package that took part.

The JSON report loses nothing: it is replaced by a document saying
``"complete": false`` when the session starts, and written at the end
atomically (a temporary file in the same folder, then ``os.replace``) with
the session's ``"exitstatus"``.

Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..files import atomic_write_text
from ..options import VerifyOptions
from ..units import format_bytes, format_seconds
from .run_info import commit_info, imported_modules, machine_info, now_utc
from .settings import Settings, option_name, session_settings

__all__ = [
    "BENCH_ATTR",
    "MODULES_ATTR",
    "REPORT_ATTR",
    "REPORT_SCHEMA",
    "REPORT_VERSION",
    "STATE_KEY",
    "USED_ATTR",
    "RunState",
    "atomic_write_text",
    "header_line",
    "incomplete_document",
    "junit_properties",
    "make_record",
    "report_document",
    "run_state",
    "summary_line",
    "write_incomplete_report",
    "write_report",
]

#: Attribute of a ``TestReport`` holding the records made in that phase.
REPORT_ATTR = "cudagraph_records"
#: Attribute of a ``TestReport`` saying that the test used the plugin (a fixture or the marker).
USED_ATTR = "cudagraph_used"
#: Attribute of a ``TestReport`` holding the ``cudagraph_benchmark`` rows made in that phase.
BENCH_ATTR = "cudagraph_bench_rows"
#: Attribute of a ``TestReport`` holding the top-level modules its process imported since the last one.
MODULES_ATTR = "cudagraph_modules"
#: Format version of the JSON report (2: ``complete``, ``exitstatus``, ``passed`` and
#: ``outcomes`` at the top level; every test that used the plugin is listed. 3: ``started``,
#: ``finished``, ``machine`` and ``commit``; a skipped check's ``passed`` is null and every
#: check has a ``status``). The schema: ``data/report.schema.json`` (``REPORT_SCHEMA``).
REPORT_VERSION = 3
REPORT_SCHEMA = Path(__file__).parents[1] / "data" / "report.schema.json"
#: Outcome of a test whose pytest-xdist worker crashed while running it.
CRASHED = "crashed"
_PHASES = ("setup", "call", "teardown")


@dataclass
class RunState:
    """What the plugin keeps for the run, in ``config.stash[STATE_KEY]``."""

    settings: Settings
    #: records made in the current phase, by nodeid, not yet on a report
    pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: records of every test that verified, by nodeid, in the order they ran
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: the test's outcome ('passed', 'failed', 'skipped', 'error', 'crashed'), by nodeid
    outcomes: dict[str, str] = field(default_factory=dict)
    #: tests the JSON report lists (used the plugin, or crashed), in the order first reported
    listed: dict[str, None] = field(default_factory=dict)
    #: what an xdist worker crash said, by nodeid
    crashes: dict[str, str] = field(default_factory=dict)
    #: where the JSON report was written, once it was
    written: Path | None = None
    #: cudagraph_benchmark rows made in this process and not yet on a report
    bench_rows: list[dict[str, Any]] = field(default_factory=list)
    #: cudagraph_benchmark rows (one per descriptor) of the run, for the Markdown report
    bench_results: list[dict[str, Any]] = field(default_factory=list)
    #: where the benchmark report went
    bench_written: list[Path] = field(default_factory=list)
    #: tests whose process lost its CUDA context (a sticky CUDA error), with what was said, by nodeid
    lost: dict[str, str] = field(default_factory=dict)
    #: the test that lost this process's CUDA context (None while the context is fine)
    lost_here: str | None = None
    #: tests not run in this process because its CUDA context was lost before them
    not_run: list[str] = field(default_factory=list)
    #: when the session started (UTC, ISO 8601)
    started: str = field(default_factory=now_utc)
    #: the reports --cudagraph-compare names, read at the start (None: no comparison)
    baseline: list[dict[str, Any]] | None = None
    #: what --cudagraph-compare found against it
    comparison: Any = None
    #: top-level modules imported in this run's processes (xdist workers, isolated children), from
    #: their reports: the JSON report's machine.packages names their distributions
    modules: set[str] = field(default_factory=set)
    #: the modules this process has put on a report already
    modules_sent: set[str] = field(default_factory=set)

    def add_pending(self, nodeid: str, record: dict[str, Any]) -> None:
        self.pending.setdefault(nodeid, []).append(record)

    def take_pending(self, nodeid: str) -> list[dict[str, Any]]:
        return self.pending.pop(nodeid, [])

    def take_bench_rows(self) -> list[dict[str, Any]]:
        rows = list(self.bench_rows)
        del self.bench_rows[:]  # in place: the fixture holds ``bench_rows.append``
        return rows

    def take_new_modules(self) -> list[str]:
        """The top-level modules imported in this process since the last call, sorted."""
        new = imported_modules() - self.modules_sent
        self.modules_sent |= new
        return sorted(new)

    def collect(self, report: pytest.TestReport) -> None:
        """Take the records, rows and outcome of one phase's report (local or from an xdist worker)."""
        nodeid = report.nodeid
        self.modules.update(getattr(report, MODULES_ATTR, None) or ())
        records = getattr(report, REPORT_ATTR, None)
        if records:
            self.results.setdefault(nodeid, []).extend(records)
        rows = getattr(report, BENCH_ATTR, None)
        if rows:
            self.bench_results.extend(rows)
        for key, value in getattr(report, "user_properties", ()):
            if key == LOST_PROPERTY:
                self.lost[nodeid] = str(value)
        crashed = report.failed and report.when not in _PHASES  # xdist: when="???", the worker died
        if records or crashed or getattr(report, USED_ATTR, False):
            self.listed.setdefault(nodeid, None)
        if crashed:
            self.outcomes[nodeid] = CRASHED
            self.crashes[nodeid] = str(report.longrepr)
        elif self.outcomes.get(nodeid) == CRASHED:
            pass
        elif report.when == "call":
            if self.outcomes.get(nodeid) != "error":
                self.outcomes[nodeid] = report.outcome
        elif report.failed:
            self.outcomes[nodeid] = "error"
        elif report.skipped and report.when == "setup":
            self.outcomes[nodeid] = "skipped"


STATE_KEY = pytest.StashKey[RunState]()


def run_state(config: pytest.Config) -> RunState:
    """The run's state, made from the settings if configure has not made it (a plugin manager that
    skipped the plugin's configure)."""
    state = config.stash.get(STATE_KEY, None)
    if state is None:
        state = RunState(session_settings(config))
        config.stash[STATE_KEY] = state
    return state


#: The user property a report carries when its test's process lost its CUDA context.
LOST_PROPERTY = "cudagraph_context_lost"


# -- records ---------------------------------------------------------------
def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    kind = type(value)
    if kind.__module__.startswith("torch") and kind.__name__ in ("device", "dtype"):
        return str(value)
    name = getattr(value, "name", None)  # enums such as GraphMode
    if isinstance(name, str) and kind.__module__.startswith("pytest_cudagraph"):
        return name
    return repr(value)


def junit_properties(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """A test's figures as user properties (junit XML writes them as ``<property>``): descriptors
    verified, checks passed, failed and skipped, and the peak memory, over its verifications."""
    verified = passed = failed = skipped = 0
    peak: int | None = None
    for record in records:
        report = record.get("report") or {}
        verified += len(report.get("descriptors") or ())
        for outcome in report.get("outcomes") or ():
            status = outcome.get("status")
            passed += status == "passed"
            failed += status == "failed"
            skipped += status == "skipped"
        value = report.get("peak_memory_bytes")
        if isinstance(value, int):
            peak = max(peak or 0, value)
    return [
        ("cudagraph_descriptors_verified", verified),
        ("cudagraph_checks_passed", passed),
        ("cudagraph_checks_failed", failed),
        ("cudagraph_checks_skipped", skipped),
        ("cudagraph_peak_memory_bytes", peak if peak is not None else ""),
    ]


def make_record(report_dict: Mapping[str, Any], keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-able record of one ``verify`` call: the keywords it got and ``VerifyReport.to_dict()``."""
    return {"keywords": _jsonable(keywords), "report": _jsonable(report_dict)}


# -- the header and the terminal summary ------------------------------------
def header_line(settings: Settings, resolved_backend: str | None = None) -> str:
    """``cudagraph: backend=..., verify=..., sizes=..., report=...``."""
    backend = settings.backend
    if settings.backend == "auto" and resolved_backend is not None:
        backend = f"{resolved_backend} (auto)"
    verify = (
        "every descriptor and every check"
        if settings.verify
        else "quick (smallest and largest descriptor per mode)"
    )
    sizes = ",".join(map(str, settings.sizes)) if settings.sizes is not None else "per test"
    report = str(settings.report) if settings.report is not None else "none"
    line = f"cudagraph: backend={backend}, verify={verify}, sizes={sizes}, report={report}"
    if settings.split != "test":
        line += f", split={settings.split}"
    if settings.devices is not None:
        line += f", devices={','.join(map(str, settings.devices))}"
    # Every other verify() keyword the run sets, as it was set ("nonfinite_padding", "checks=-determinism").
    for name, option, default in VerifyOptions.run_options():
        value = settings.options.get(name)
        if name in ("backend", "exhaustive") or value is None or value == default or value is False:
            continue
        shown = option_name(name, option)
        line += (
            f", {shown}"
            if value is True
            else f", {shown}={','.join(value) if isinstance(value, tuple) else value}"
        )
    if settings.isolate:
        line += ", isolate=a child process a test"
    if settings.trace is not None:
        shapes = len(settings.trace_shapes) if settings.trace_shapes is not None else 0
        line += f", trace={settings.trace} ({shapes} batch shapes)"
    return line


def backends_line(settings: Settings, results: Mapping[str, Iterable[Mapping[str, Any]]]) -> str:
    """``cudagraph: backend=auto ran emulate`` (what "auto" became in the verifications), or ``""``
    where the backend was named."""
    if settings.backend != "auto":
        return ""
    ran = sorted({str(r["report"].get("backend")) for records in results.values() for r in records})
    return f"cudagraph: backend=auto ran {' and '.join(ran)}" if ran else ""


def summary_line(nodeid: str, records: Iterable[Mapping[str, Any]], outcome: str | None = None) -> str:
    """One test's line: descriptors captured/planned, checks passed/failed, failures, capture time, graph
    memory, peak memory."""
    captured = planned = passed = failed = skipped = 0
    seconds = 0.0
    memory = 0
    peak = 0
    failures: list[str] = []
    devices: list[str] = []
    modes: list[str] = []
    calls = 0
    quick = True  # every verification of the test was quick: fewer descriptors than planned is the plan
    for record in records:
        calls += 1
        rep = record["report"]
        quick = quick and rep.get("exhaustive") is False
        device = str(rep.get("device", ""))
        if device.startswith("cuda") and device not in devices:
            devices.append(device)
        training = rep.get("training")
        if isinstance(training, str) and training not in modes:
            modes.append(training)
        captured += len(rep.get("descriptors", []))
        planned += int(rep.get("planned_descriptors", 0))
        seconds += float(rep.get("capture_seconds", 0.0))
        memory += sum(int(v) for v in rep.get("graph_memory_bytes", {}).values())
        peak = max(peak, int(rep.get("peak_memory_bytes", 0) or 0))
        for outcome_dict in rep.get("outcomes", []):
            if outcome_dict.get("skipped"):
                skipped += 1
            elif outcome_dict.get("passed"):
                passed += 1
            else:
                failed += 1
                desc = outcome_dict.get("descriptor")
                where = desc["label"] if isinstance(desc, Mapping) and "label" in desc else "module"
                failures.append(f"{outcome_dict.get('check')} ({where})")
    parts = [
        # Quick mode verifies two descriptors a mode by design: "2/3 captured" would read as a failure.
        f"{captured} of {planned} descriptors verified (quick mode)"
        if quick and calls
        else f"{captured}/{planned} descriptors captured",
        f"{passed} checks passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""),
        f"capture {format_seconds(seconds)}",
        f"graph memory {format_bytes(memory)}",
    ]
    if peak:  # the largest verification's peak (the allocator's reserved bytes on CUDA, RSS on the CPU)
        parts.append(f"peak memory {format_bytes(peak)}")
    if modes:  # the module is verified in the mode it is in: say which
        parts.append("/".join(modes) + " mode")
    if devices:  # which GPU did the work: under pytest-xdist each worker has its own
        parts.insert(0, "on " + ", ".join(devices))
    line = f"{nodeid}: " + ", ".join(parts)
    if calls > 1:
        line += f" ({calls} verify calls)"
    if failures:
        shown = ", ".join(failures[:4]) + (f", ... {len(failures) - 4} more" if len(failures) > 4 else "")
        line += f"; failures: {shown}"
    if outcome not in (None, "passed"):
        line += f" [{outcome}]"
    return line


#: The checks a reason of the terminal summary names on its line; more are counted (-v names them).
_CHECKS_NAMED = 3


def skipped_lines(results: Mapping[str, Iterable[Mapping[str, Any]]], *, verbose: bool = False) -> list[str]:
    """The terminal summary's count of skipped checks, then one line per reason (most first) with its
    checks: each reason one line of at most ``REASON_LIMIT`` characters. ``verbose`` (``-v``): under
    each reason the distinct details its skips carry (the JSON report holds them too)."""
    counts: dict[str, dict[str, int]] = {}
    details: dict[str, list[str]] = {}
    for records in results.values():
        for record in records:
            for outcome in record["report"].get("outcomes", []):
                if outcome.get("skipped"):
                    reason = str(outcome.get("message", ""))
                    checks = counts.setdefault(reason, {})
                    name = str(outcome.get("check"))
                    checks[name] = checks.get(name, 0) + 1
                    detail = str(outcome.get("detail") or "")
                    told = details.setdefault(reason, [])
                    if detail and detail not in told:
                        told.append(detail)
    if not counts:
        return []
    total = sum(sum(c.values()) for c in counts.values())
    hidden = any(details.values()) or any(len(checks) > _CHECKS_NAMED for checks in counts.values())
    more = " (-v: each with its checks and detail)" if hidden and not verbose else ""
    lines = [f"cudagraph: {total} check{'s' if total != 1 else ''} skipped, by reason{more}:"]
    for reason, checks in sorted(counts.items(), key=lambda item: (-sum(item[1].values()), item[0])):
        # Every check a reason stops (a failed capture stops them all) is named under -v alone.
        named = sorted(checks)
        shown = ", ".join(named) if len(named) <= _CHECKS_NAMED else f"{len(named)} checks"
        lines.append(f"  {sum(checks.values()):>4} x {reason} ({shown})")
        if verbose:
            if len(named) > _CHECKS_NAMED:
                lines.append(f"         checks: {', '.join(named)}")
            lines.extend(f"         {line}" for detail in details[reason] for line in detail.splitlines())
    return lines


# -- the JSON report ---------------------------------------------------------
def _tests(state: RunState) -> dict[str, dict[str, Any]]:
    tests: dict[str, dict[str, Any]] = {}
    for nodeid in [*state.listed, *(n for n in state.results if n not in state.listed)]:
        entry: dict[str, Any] = {
            "outcome": state.outcomes.get(nodeid),
            "verifications": state.results.get(nodeid, []),
        }
        if nodeid in state.crashes:
            entry["crash"] = state.crashes[nodeid]
        tests[nodeid] = entry
    return tests


def report_document(
    state: RunState, exitstatus: int, *, complete: bool = True, root: Path | None = None
) -> dict[str, Any]:
    """The JSON report at the end of the session.

    ``complete``: the session ran to its end (False when it was interrupted:
    Ctrl-C, ``pytest.exit``, ``-x``/``--maxfail``); ``exitstatus``: pytest's
    exit status; ``passed``: complete, exit status 0 and every listed test
    passed or skipped; ``outcomes``: how many listed tests had each outcome
    ('unfinished': no outcome);
    ``tests``: every test that used the plugin (one of its fixtures or the
    ``cudagraph`` marker) or whose xdist worker crashed, keyed by nodeid, with
    its outcome (None: it never finished) and its ``cudagraph_verify`` records;
    ``machine`` and ``commit`` (of ``root``, the rootdir): where the run happened.
    """
    tests = _tests(state)
    counts: dict[str, int] = {}
    for entry in tests.values():
        key = str(entry["outcome"] or "unfinished")
        counts[key] = counts.get(key, 0) + 1
    return {
        "version": REPORT_VERSION,
        "complete": complete,
        "exitstatus": int(exitstatus),
        "passed": complete
        and int(exitstatus) == 0
        and all(entry["outcome"] in ("passed", "skipped") for entry in tests.values()),
        "outcomes": counts,
        "started": state.started,
        "finished": now_utc(),
        "machine": machine_info(state.modules),
        "commit": commit_info(root or Path.cwd()),
        "settings": state.settings.to_dict(),
        "tests": tests,
    }


def incomplete_document(state: RunState) -> dict[str, Any]:
    """What the report path holds while the session runs: nothing in it claims a result."""
    return {
        "version": REPORT_VERSION,
        "complete": False,
        "exitstatus": None,
        "passed": False,
        "note": "a pytest-cudagraph run writing this report started and has not finished "
        f"(pid {os.getpid()}); if none is running, that run was killed",
        "started": state.started,
        "settings": state.settings.to_dict(),
        "tests": {},
    }


def write_incomplete_report(state: RunState, path: Path) -> Path:
    """At session start: the previous run's report must not look like this run's."""
    return atomic_write_text(path, json.dumps(incomplete_document(state), indent=2) + "\n")


def write_report(
    state: RunState,
    path: Path,
    exitstatus: int = 0,
    *,
    complete: bool = True,
    root: Path | None = None,
    document: dict[str, Any] | None = None,
) -> Path:
    document = (
        document if document is not None else report_document(state, exitstatus, complete=complete, root=root)
    )
    atomic_write_text(path, json.dumps(document, indent=2) + "\n")
    state.written = path
    return path
