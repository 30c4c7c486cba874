"""--cudagraph-compare's comparison, on documents made by hand (the plugin's runs: tests/test_plugin.py)."""

from __future__ import annotations

from typing import Any

from pytest_cudagraph.plugin.compare_report import MOVED, compare


def _doc(status: str, capture_s: float, peak: int, outcome: str = "passed") -> dict[str, Any]:
    check = {"check": "state", "descriptor": {"label": "FULL-T2-R2"}, "status": status, "rank": None}
    report = {
        "module": "Tiny",
        "outcomes": [check],
        "capture_seconds": capture_s,
        "check_seconds": 1.0,
        "peak_memory_bytes": peak,
        "graph_memory_bytes": {"FULL-T2-R2": 4 << 20},
    }
    return {
        "version": 3,
        "tests": {"t.py::test": {"outcome": outcome, "verifications": [{"report": report}]}},
    }


def test_figures_that_moved_beyond_the_threshold_and_the_noise_floor_are_named() -> None:
    base = _doc("passed", 2.0, 1 << 30)
    same = compare(base, _doc("passed", 2.0 * (1 + MOVED / 2), 1 << 30), "b.json")
    assert (same.new_failures, same.new_passes, same.moved) == ([], [], [])
    slower = compare(base, _doc("passed", 3.0, 2 << 30), "b.json")
    assert [m.split(": ", 1)[1] for m in slower.moved] == [
        "verification 1 capture_seconds: 2.00 s -> 3.00 s (x1.50)",
        "verification 1 peak_memory_bytes: 1.0 GiB -> 2.0 GiB (x2.00)",
    ]
    tiny = compare(_doc("passed", 0.002, 1000), _doc("passed", 0.004, 3000), "b.json")
    assert tiny.moved == []  # twice a few milliseconds or a few KiB is noise


def test_new_failures_new_passes_and_missing_tests() -> None:
    broken = compare(_doc("passed", 1.0, 1), _doc("failed", 1.0, 1, "failed"), "b.json")
    assert broken.new_failures == [
        "t.py::test: verification 1 (Tiny) state FULL-T2-R2 (was passed)",
        "t.py::test: the test failed (was passed)",
    ]
    fixed = compare(_doc("failed", 1.0, 1, "failed"), _doc("passed", 1.0, 1), "b.json")
    assert fixed.new_passes == [
        "t.py::test: verification 1 (Tiny) state FULL-T2-R2",
        "t.py::test: the test passed (was failed)",
    ]
    assert compare(
        _doc("skipped", 1.0, 1), _doc("failed", 1.0, 1), "b.json"
    ).new_failures  # skipped, now failing
    gone = compare(_doc("passed", 1.0, 1), {"tests": {}}, "b.json")
    assert gone.missing == ["t.py::test"] and "1 test(s) of the baseline not run" in gone.lines()[0]
