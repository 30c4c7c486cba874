"""Run state of the pytest plugin, the header line, the terminal summary and the JSON report.

Per-test results are plain JSON-able dicts ("records", one per
``cudagraph_verify`` call). They travel on the test report: the plugin moves
the records made during a phase onto that phase's ``TestReport`` as the
attribute ``REPORT_ATTR``, and collects them back from
``pytest_runtest_logreport``. pytest serialises a report's ``__dict__`` (so
pytest-xdist ships the records from workers to the controller, and
pytest-reportlog writes them) without any code of ours.

Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .settings import Settings
from .units import format_bytes, format_seconds

__all__ = [
    "REPORT_ATTR",
    "STATE_KEY",
    "RunState",
    "header_line",
    "make_record",
    "report_document",
    "summary_line",
    "write_report",
]

#: Attribute of a ``TestReport`` holding the records made in that phase.
REPORT_ATTR = "cudagraph_records"
#: Format version of the JSON report.
REPORT_VERSION = 1


@dataclass
class RunState:
    """What the plugin keeps for the run, in ``config.stash[STATE_KEY]``."""

    settings: Settings
    #: records made in the current phase, by nodeid, not yet on a report
    pending: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: records of every test that verified, by nodeid, in the order they ran
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: the test's outcome ('passed', 'failed', 'skipped', 'error'), by nodeid
    outcomes: dict[str, str] = field(default_factory=dict)
    #: where the JSON report was written, once it was
    written: Path | None = None
    #: cudagraph_benchmark rows (one per descriptor), for the Markdown report
    bench_rows: list[dict[str, Any]] = field(default_factory=list)
    #: where the benchmark report went
    bench_written: list[Path] = field(default_factory=list)

    def add_pending(self, nodeid: str, record: dict[str, Any]) -> None:
        self.pending.setdefault(nodeid, []).append(record)

    def take_pending(self, nodeid: str) -> list[dict[str, Any]]:
        return self.pending.pop(nodeid, [])

    def collect(self, report: pytest.TestReport) -> None:
        """Take the records and outcome of one phase's report (local or from an xdist worker)."""
        records = getattr(report, REPORT_ATTR, None)
        if records:
            self.results.setdefault(report.nodeid, []).extend(records)
        if report.when == "call":
            self.outcomes[report.nodeid] = report.outcome
        elif report.failed:
            self.outcomes[report.nodeid] = "error"
        elif report.skipped and report.when == "setup":
            self.outcomes[report.nodeid] = "skipped"


STATE_KEY = pytest.StashKey[RunState]()


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
    if settings.nonfinite_padding:
        line += ", padding=finite and non-finite"
    return line


def summary_line(nodeid: str, records: Iterable[Mapping[str, Any]], outcome: str | None = None) -> str:
    """One test's line: descriptors captured/planned, checks passed/failed, failures, capture time, graph memory."""
    captured = planned = passed = failed = skipped = 0
    seconds = 0.0
    memory = 0
    failures: list[str] = []
    devices: list[str] = []
    modes: list[str] = []
    calls = 0
    for record in records:
        calls += 1
        rep = record["report"]
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
        f"{captured}/{planned} descriptors captured",
        f"{passed} checks passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""),
        f"capture {format_seconds(seconds)}",
        f"graph memory {format_bytes(memory)}",
    ]
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


# -- the JSON report ---------------------------------------------------------
def report_document(state: RunState) -> dict[str, Any]:
    """The JSON report: the settings, and every verifying test's records keyed by nodeid."""
    return {
        "version": REPORT_VERSION,
        "settings": state.settings.to_dict(),
        "tests": {
            nodeid: {"outcome": state.outcomes.get(nodeid), "verifications": records}
            for nodeid, records in state.results.items()
        },
    }


def write_report(state: RunState, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_document(state), indent=2) + "\n", encoding="utf-8")
    state.written = path
    return path
