"""--cudagraph-isolate: plugin tests run in a child process each, whose reports the parent logs.

The parent runs in-process (pytester), its children are real subprocesses (each
imports torch: ~3 s), so the file keeps their number small.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_cudagraph.plugin import isolate
from tests.conftest import isolate_plugins

INNER = """
import os
import signal

import pytest
import torch

from pytest_cudagraph.plugin.isolate import CHILD_ENV


def _note(name):
    with open(name, "w") as out:
        out.write(f"{os.getpid()} {os.environ.get(CHILD_ENV, '')}")


def test_plain():
    _note("plain.pid")


@pytest.mark.cudagraph
def test_used():
    _note("used.pid")


@pytest.mark.cudagraph
def test_fails(request):
    print("child says hello")
    assert request.config.getoption("cudagraph_sizes") == "9", "boom-from-the-child"


@pytest.mark.cudagraph
def test_skipped():
    pytest.skip("skipped-in-the-child")


@pytest.mark.cudagraph
def test_exits():
    os._exit(3)


@pytest.mark.cudagraph
def test_killed():
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.cudagraph
def test_after(request):
    assert request.config.getoption("cudagraph_sizes") == "1,2"
    assert not request.config.getoption("cudagraph_isolate")
    _note("after.pid")
"""

VERIFYING = """
import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def make_inputs(num_tokens, num_reqs):
    return {"x": torch.randn(num_tokens, 4)}


def test_verifies(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1, 2, 4))
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    isolate_plugins(monkeypatch)  # the children inherit the environment: they load this plugin only
    monkeypatch.delenv(isolate.CHILD_ENV, raising=False)
    return pytester


def _pid(path: Path) -> tuple[int, str]:
    pid, _, env = path.read_text().partition(" ")
    return int(pid), env


# -- the arguments the child gets -------------------------------------------------
def test_filter_args_drops_paths_and_unwanted_options(inner: pytest.Pytester) -> None:
    config = inner.parseconfig()
    arities = isolate.option_arities(config)
    assert arities["-p"] is None and arities["-x"] == 0 and arities["--cudagraph-isolate"] == 0
    given = [
        "tests/test_a.py::test_x[1-2]",
        "-n2",
        "-n",
        "3",
        "--dist=load",
        "--dist",
        "loadfile",
        "-vx",
        "--maxfail",
        "3",
        "--maxfail=4",
        "--cudagraph-report=r.json",
        "--cudagraph-report",
        "r2.json",
        "--junitxml",
        "j.xml",
        "--cudagraph-isolate",
        "--lf",
        "--sw",
        "--basetemp=/tmp/x",
        "-p",
        "no:cacheprovider",
        "-p",
        "xdist",
        "-pxdist",
        "-k",
        "not slow",
        "-o",
        "addopts=-n 4",
        "-o",
        "xfail_strict=true",
        "--cudagraph-sizes",
        "1,2",
        "--cudagraph-backend=emulate",
        "-rA",
        "tests",
        "-c",
        "pytest.ini",
        "--rootdir=.",
        "--",
        "other/test_b.py",
    ]
    assert isolate.filter_args(given, arities) == [
        "-v",
        "-p",
        "no:cacheprovider",
        "-k",
        "not slow",
        "-o",
        "xfail_strict=true",
        "--cudagraph-sizes",
        "1,2",
        "--cudagraph-backend=emulate",
        "-rA",
    ]
    # Without the parser's table, the dropped options' own arities still apply.
    assert isolate.filter_args(
        ["-n", "2", "-x", "--maxfail", "2", "--cudagraph-report", "r", "-q", "t.py"]
    ) == ["-q"]


def test_child_reporter_round_trips_the_plugin_attributes(inner: pytest.Pytester, tmp_path: Path) -> None:
    from pytest_cudagraph.plugin import report as pytest_report

    config = inner.parseconfig()
    report = pytest.TestReport("t.py::test", ("t.py", 1, "test"), {}, "passed", None, "call")
    records = [{"keywords": {"capture_sizes": [1, 2]}, "report": {"passed": True, "planned_descriptors": 2}}]
    setattr(report, pytest_report.REPORT_ATTR, records)
    setattr(report, pytest_report.USED_ATTR, True)
    path = tmp_path / "reports.jsonl"
    isolate.ChildReporter(config, path).pytest_runtest_logreport(report)
    (back,) = isolate._read_reports(config, path)
    assert (back.nodeid, back.when, back.outcome) == ("t.py::test", "call", "passed")
    assert getattr(back, pytest_report.REPORT_ATTR) == records
    assert getattr(back, pytest_report.USED_ATTR) is True


# -- runs ----------------------------------------------------------------------
def test_isolated_run_relays_outcomes_and_survives_dying_children(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_inner=INNER)
    result = inner.runpytest(
        "--cudagraph-isolate",
        "--cudagraph-backend=emulate",
        "--cudagraph-sizes=1,2",
        "-rA",
        "-p",
        "no:randomly",
    )
    result.assert_outcomes(passed=3, failed=3, skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    plain_pid, plain_env = _pid(inner.path / "plain.pid")
    used_pid, used_env = _pid(inner.path / "used.pid")
    after_pid, _ = _pid(inner.path / "after.pid")
    assert plain_env == ""  # a test not using the plugin runs in the parent
    assert used_env != "" and len({plain_pid, used_pid, after_pid}) == 3  # each plugin test: a child
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*AssertionError: boom-from-the-child*",
            "*child says hello*",  # the child's captured output, from its report's sections
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*the child process running the test ended with exit code 3 without a report of its call phase*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*the child process running the test was killed by signal 9 (SIGKILL) without a report of its call*",
        ]
    )
    for line in (
        "PASSED test_inner.py::test_plain",
        "PASSED test_inner.py::test_used",
        "PASSED test_inner.py::test_after",
        "SKIPPED [[]1[]] test_inner.py:*: skipped-in-the-child",
        "FAILED test_inner.py::test_fails - AssertionError: boom-from-the-child*",
        "FAILED test_inner.py::test_exits - *",
        "FAILED test_inner.py::test_killed - *",
    ):
        result.stdout.fnmatch_lines([line])
    assert (
        "--basetemp" not in out.split("command:")[1].split("--basetemp", 1)[0]
    )  # the parent's is not passed


def _records(data: dict[str, Any]) -> list[tuple[int, list[str]]]:
    (test,) = data["tests"].values()
    return [
        (v["report"]["planned_descriptors"], [d["label"] for d in v["report"]["descriptors"]])
        for v in test["verifications"]
    ]


def test_json_report_holds_the_childs_records(inner: pytest.Pytester, verify_imported: None) -> None:
    inner.makepyfile(test_verifying=VERIFYING)
    options = ["--cudagraph-backend=emulate", "--cudagraph-sizes=1,2", "-x", "-p", "no:randomly"]
    plain = inner.runpytest(*options, "--cudagraph-report=plain.json")
    plain.assert_outcomes(passed=1)
    isolated = inner.runpytest(*options, "--cudagraph-isolate", "--cudagraph-report=isolated.json")
    isolated.assert_outcomes(passed=1)
    isolated.stdout.fnmatch_lines(
        ["*test_verifying.py::test_verifies: *"]
    )  # the summary line, from the records
    data_plain = json.loads((inner.path / "plain.json").read_text())
    data_isolated = json.loads((inner.path / "isolated.json").read_text())
    assert (data_isolated["complete"], data_isolated["passed"]) == (True, True)
    assert data_isolated["settings"]["isolate"] is True
    assert _records(data_isolated) == _records(data_plain)
    assert [planned for planned, _ in _records(data_isolated)] == [
        2,
        3,
    ]  # --cudagraph-sizes=1,2 reached the child


def test_exitfirst_stops_the_parent_after_a_failed_child(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_x="""
        import pytest

        @pytest.mark.cudagraph
        def test_fails():
            assert False, "first-failure"

        def test_never():
            raise AssertionError("ran after -x")
    """
    )
    result = inner.runpytest("--cudagraph-isolate", "--cudagraph-backend=emulate", "-x", "-p", "no:randomly")
    result.assert_outcomes(failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*first-failure*"])
    result.stdout.no_fnmatch_line("*ran after -x*")


HANGS = """
import subprocess
import sys
import time

import pytest


@pytest.mark.cudagraph
def test_hangs():
    # A grandchild in the same process group (a rank), which the kill must take too.
    with open("grandchild.pid", "w") as out:
        out.write(str(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid))
    time.sleep(60)


@pytest.mark.cudagraph
@pytest.mark.timeout(0.5)
def test_marked():
    pass
"""


def test_a_hung_child_is_killed_with_its_group_and_named_with_its_phase(inner: pytest.Pytester) -> None:
    import os

    inner.makepyfile(test_hangs=HANGS)
    inner.makeini("[pytest]\nmarkers =\n    timeout: pytest-timeout's\n")
    result = inner.runpytest(
        "--cudagraph-isolate",
        "--cudagraph-isolate-timeout=4",
        "-p",
        "no:randomly",
        "test_hangs.py::test_hangs",
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the child process running the test was still running after 4 s*"
            "was killed, with its process group, hung in its call phase*"
        ]
    )
    grandchild = int((inner.path / "grandchild.pid").read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        import time

        time.sleep(0.1)
    else:
        raise AssertionError("the grandchild outlived the kill")


def test_the_child_timeout_follows_the_option_else_pytest_timeouts_marker(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_hangs=HANGS)
    inner.makeini("[pytest]\nmarkers =\n    timeout: pytest-timeout's\n")
    items, _ = inner.inline_genitems("-p", "no:randomly")
    marked = next(i for i in items if i.name == "test_marked")
    plain = next(i for i in items if i.name == "test_hangs")
    assert isolate.child_timeout(marked) == 0.5 + isolate._TIMEOUT_GRACE_S
    assert isolate.child_timeout(plain) is None
    items, _ = inner.inline_genitems("-p", "no:randomly", "--cudagraph-isolate-timeout=7")
    assert {isolate.child_timeout(i) for i in items} == {7.0}
    inner.makeini("[pytest]\ncudagraph_isolate_timeout = 9\nmarkers =\n    timeout: pytest-timeout's\n")
    items, _ = inner.inline_genitems("-p", "no:randomly")
    assert {isolate.child_timeout(i) for i in items} == {9.0}
    result = inner.runpytest("--cudagraph-isolate-timeout=soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--cudagraph-isolate-timeout: expected a positive number of seconds*'soon'*"]
    )
