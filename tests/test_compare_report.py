"""--cudagraph-compare's comparison, on documents made by hand (the plugin's runs: tests/test_plugin.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pytest_cudagraph.plugin.compare_report import MOVED, T_995, compare, noise_bound


def _doc(
    status: str, capture_s: float, peak: int, outcome: str = "passed", check_s: float = 1.0
) -> dict[str, Any]:
    check = {"check": "state", "descriptor": {"label": "FULL-T2-R2"}, "status": status, "rank": None}
    report = {
        "module": "Tiny",
        "outcomes": [check],
        "capture_seconds": capture_s,
        "check_seconds": check_s,
        "peak_memory_bytes": peak,
        "graph_memory_bytes": {"FULL-T2-R2": 4 << 20},
    }
    return {
        "version": 3,
        "tests": {"t.py::test": {"outcome": outcome, "verifications": [{"report": report}]}},
    }


def _figures(moved: list[str]) -> list[str]:
    return [m.split(": ", 1)[1] for m in moved]


def test_memory_of_one_kept_report_moves_beyond_ten_percent_and_its_timings_are_not_judged() -> None:
    base = _doc("passed", 2.0, 1 << 30)
    same = compare(base, _doc("passed", 2.0, int((1 << 30) * (1 + MOVED / 2))), "b.json")
    assert (same.new_failures, same.new_passes, same.moved, same.unjudged) == ([], [], [], 0)
    larger = compare(base, _doc("passed", 3.0, 2 << 30), "b.json")
    assert _figures(larger.moved) == ["verification 1 peak_memory_bytes: 1.0 GiB -> 2.0 GiB (x2.00)"]
    # One run's timing has no spread: a capture 1 s slower is not called moved, and the summary says so.
    assert larger.unjudged == 1
    assert "1 timing(s) changed, not judged" in larger.lines()[-1]
    tiny = compare(_doc("passed", 0.002, 1000), _doc("passed", 0.004, 3000), "b.json")
    assert tiny.moved == [] and tiny.unjudged == 0  # twice a few milliseconds or a few KiB is noise


def test_a_timing_moves_only_beyond_its_own_run_to_run_spread() -> None:
    """A kept pair of reports of the same code gives each figure its spread: checks of 1.00 s and
    1.02 s allow 1.1 s from their mean (two runs say little), a capture of 2.0 s and 2.6 s far more.
    Checks of 1.5 s (x1.49, "moved by 10 % or more" before) are noise; checks of 3.0 s moved.
    Verdict changes are listed before any figure."""
    kept = [_doc("passed", 2.0, 1 << 30, check_s=1.00), _doc("passed", 2.6, 1 << 30, check_s=1.02)]
    noise = compare(kept, _doc("passed", 3.0, 1 << 30, check_s=1.5), "a.json, b.json")
    assert (noise.moved, noise.unjudged) == ([], 0)
    real = compare(kept, _doc("failed", 3.0, 1 << 30, "failed", check_s=3.0), "a.json, b.json")
    assert _figures(real.moved) == [
        "verification 1 check_seconds: 1.01 s -> 3.00 s (x2.97; kept 1.00 s to 1.02 s)"
    ]
    lines = real.lines()
    assert lines[0].startswith("cudagraph: compared with a.json, b.json: 2 new failure(s)")
    first_figure = next(i for i, line in enumerate(lines) if "figure(s) moved" in line)
    assert first_figure == 3 and all("new failure" in line for line in lines[1:first_figure])
    assert "beyond their run-to-run spread over the 2 kept reports" in lines[first_figure]
    assert lines[first_figure + 1].startswith("  moved: t.py::test: verification 1 check_seconds")
    # Graph memory the same in both kept reports has no spread: 2 MiB more moved.
    more = _doc("passed", 2.3, 1 << 30)
    more["tests"]["t.py::test"]["verifications"][0]["report"]["graph_memory_bytes"] = {"FULL-T2-R2": 6 << 20}
    assert _figures(compare(kept, more, "k").moved) == [
        "verification 1 graph_memory_bytes: 4.0 MiB -> 6.0 MiB (x1.50; kept 4.0 MiB to 4.0 MiB)"
    ]


def test_the_spread_is_a_99_percent_prediction_interval() -> None:
    """noise_bound: t(0.995, n-1) * s * sqrt(1 + 1/n); the table of t is Student's own."""
    mpmath = pytest.importorskip("mpmath")
    for df, t in enumerate(T_995, start=1):
        tail = mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True) / 2
        assert abs(float(tail) - 0.005) < 2e-5, (df, t, tail)
    assert noise_bound([1.0]) is None
    assert noise_bound([1.0, 1.0, 1.0]) == 0.0
    bound = noise_bound([1.0, 1.02])
    assert bound is not None and abs(bound - 63.657 * 0.02 / math.sqrt(2) * math.sqrt(1.5)) < 1e-9
    # More kept runs, a tighter bound for the same spread.
    five = noise_bound([1.0, 1.02, 1.0, 1.02, 1.01])
    assert five is not None and five < bound / 10


def test_a_threshold_the_user_sets_judges_every_figure() -> None:
    base = _doc("passed", 2.0, 1 << 30)
    loose = compare(base, _doc("passed", 2.9, int(1.2 * (1 << 30))), "b.json", threshold=0.5)
    assert (loose.moved, loose.unjudged) == ([], 0)  # 45 % and 20 %: under 50 %
    tight = compare(base, _doc("passed", 3.2, int(1.2 * (1 << 30))), "b.json", threshold=0.5)
    assert _figures(tight.moved) == ["verification 1 capture_seconds: 2.00 s -> 3.20 s (x1.60)"]
    assert "beyond 50% (--cudagraph-compare-threshold)" in tight.lines()[1]
    # With kept reports too, a figure moves beyond both its spread and the threshold.
    kept = [_doc("passed", 2.0, 1 << 30) for _ in range(5)] + [_doc("passed", 2.1, 1 << 30)]
    assert compare(kept, _doc("passed", 2.6, 1 << 30), "k").moved  # beyond the spread of six runs
    assert not compare(kept, _doc("passed", 2.6, 1 << 30), "k", threshold=0.5).moved  # not 50 %


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
