"""--cudagraph-progress: a verification's stage and descriptor (k of n) on the terminal, past
pytest's output capture and from pytest-xdist workers; silent in CI logs unless asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_cudagraph.plugin.terminal_progress import on_ci, shown
from tests.test_plugin import inner  # noqa: F401  (the pytester fixture)

# Three captured sizes, every descriptor checked: steps "graph 1 of 3" to "descriptor 3 of 3".
TESTS = """
import time

from cgmods import Tiny, make_inputs
from pytest_cudagraph.progress import PROGRESS_DELAY


def test_quick(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=[1, 2, 4], exhaustive=True)


def test_quick_too(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=[1, 2, 4], exhaustive=True)


def test_slow(cudagraph_verify):
    time.sleep(PROGRESS_DELAY + 0.2)  # past auto's delay: every step after it is shown
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=[1, 2, 4], exhaustive=True)
"""

STEPS = [
    "cudagraph: Tiny (*): capture, graph 1 of 3",
    "cudagraph: Tiny (*): capture, graph 3 of 3",
    "cudagraph: Tiny (*): checks, descriptor 1 of 3",
    "cudagraph: Tiny (*): checks, descriptor 3 of 3",
]


def _without_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CI", "BUILD_NUMBER"):
        monkeypatch.delenv(name, raising=False)


def test_auto_shows_on_a_terminal_outside_ci_and_not_quiet() -> None:
    assert shown("auto", terminal=True, environ={}, quiet=False)
    assert not shown("auto", terminal=False, environ={}, quiet=False)  # a pipe, a file: a log
    assert not shown("auto", terminal=True, environ={"CI": "true"}, quiet=False)
    assert not shown("auto", terminal=True, environ={"BUILD_NUMBER": "7"}, quiet=False)
    assert not shown("auto", terminal=True, environ={}, quiet=True)  # -q
    assert shown("on", terminal=False, environ={"CI": "1"}, quiet=True)
    assert not shown("off", terminal=True, environ={}, quiet=False)
    assert on_ci({"CI": ""}) and not on_ci({"PATH": "/bin"})


@pytest.mark.parametrize(
    ("given", "steps"),
    [
        (["--cudagraph-progress=on"], True),
        (["-o", "cudagraph_progress=on"], True),  # the ini twin
        (["-o", "cudagraph_progress=on", "--cudagraph-progress=off"], False),  # the option beats it
        (["--cudagraph-progress=OFF", "-s"], False),  # not even the library's own bar, without capture
        (["--cudagraph-progress=auto"], False),  # auto: this run's output is no terminal
    ],
)
def test_the_option_and_its_ini_twin(
    inner: pytest.Pytester,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    given: list[str],
    steps: bool,
) -> None:
    _without_ci(monkeypatch)
    inner.makepyfile(test_steps=TESTS)
    result = inner.runpytest(*given, "-k", "test_quick and not too")
    result.assert_outcomes(passed=1)
    if steps:
        # The output is no terminal: a line a stage, its last step, and at most one every 10 s
        # between. (That the steps get past pytest's capture, this in-process run cannot show: the
        # run in a terminal below does, in a process of its own.)
        result.stdout.fnmatch_lines(STEPS)
        assert "graph 2 of 3" not in result.stdout.str()
    else:
        assert "cudagraph: Tiny" not in result.stdout.str() + result.stderr.str()


def test_a_bad_progress_value_is_a_usage_error(inner: pytest.Pytester) -> None:  # noqa: F811
    for given in (["--cudagraph-progress=sometimes"], ["-o", "cudagraph_progress=1"]):
        result = inner.runpytest(*given)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["ERROR: *cudagraph*progress: expected one of auto, on, off; got *"])


def _run_in_a_terminal(folder: Path, *args: str) -> str:
    """pytest in a pseudo-terminal of 100 columns (auto's terminal); what it showed, as bytes decoded."""
    import pty

    main, child = pty.openpty()
    os.set_blocking(main, True)
    env = dict(os.environ, COLUMNS="100", LINES="40", TERM="dumb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=folder,
        stdin=child,
        stdout=child,
        stderr=child,
        env=env,
    )
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child's end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    proc.wait(timeout=600)
    return b"".join(chunks).decode(errors="replace")


def _screen(shown: str) -> list[str]:
    """The lines a terminal shows for ``shown``: a backspace moves back, a character overwrites."""
    lines: list[list[str]] = [[]]
    column = 0
    for char in shown:
        if char == "\n":
            lines.append([])
            column = 0
        elif char == "\r":
            column = 0
        elif char == "\b":
            column = max(column - 1, 0)
        else:
            line = lines[-1]
            line.extend(" " * (column + 1 - len(line)))
            line[column] = char
            column += 1
    return ["".join(line).rstrip() for line in lines]


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="a pseudo-terminal (POSIX)")
def test_auto_shows_progress_on_a_terminal_in_place_and_not_in_ci(
    inner: pytest.Pytester,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a terminal, auto writes each step after pytest's text on the line and erases it: the
    screen ends as pytest left it. With CI set, nothing. Under xdist, each worker's lines reach the
    controller's terminal (a worker's stdout is not the terminal, its stderr is the controller's)."""
    _without_ci(monkeypatch)
    inner.makepyfile(test_steps=TESTS)
    shown_here = _run_in_a_terminal(inner.path, "-k", "test_slow")
    assert "cudagraph: Tiny (" in shown_here and ": checks, descriptor 3 of 3" in shown_here, shown_here
    screen = _screen(shown_here)
    (line,) = [ln for ln in screen if ln.split()[:1] == ["test_steps.py"]]
    assert line.split() == ["test_steps.py", ".", "[100%]"], screen  # the steps erased
    assert not any("cudagraph: Tiny (" in ln for ln in screen), screen

    monkeypatch.setenv("CI", "true")
    in_ci = _run_in_a_terminal(inner.path, "-k", "test_slow")
    assert "1 passed" in in_ci and "cudagraph: Tiny (" not in in_ci, in_ci

    pytest.importorskip("xdist")
    monkeypatch.delenv("CI")
    # A worker's own stdout is no terminal: it shows because its controller, on one, told it to.
    workers = _run_in_a_terminal(inner.path, "-p", "xdist.plugin", "-n", "1", "-k", "test_slow")
    assert "[gw0] cudagraph: Tiny (" in workers and "descriptor 3 of 3" in workers, workers
