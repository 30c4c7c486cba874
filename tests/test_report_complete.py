"""The reports lose nothing: atomic writes, exit status, every test that used the plugin, xdist merging."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pytest_cudagraph.plugin import report as pytest_report
from pytest_cudagraph.plugin.settings import Settings
from tests.test_bench import BENCH_TEST
from tests.test_plugin import CONFTEST, MODULES, inner  # noqa: F401  (the pytester fixture)

REPO = Path(__file__).resolve().parent.parent

TESTS = """
import os
import pytest
from cgmods import Tiny, make_inputs


def broken_inputs(num_tokens, num_reqs):
    raise RuntimeError("make_inputs is broken")


def test_good(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1, 2))


def test_inputs_raise(cudagraph_verify):
    cudagraph_verify(Tiny(), broken_inputs, capture_sizes=(1, 2))


@pytest.mark.cudagraph(capture_sizes=(1,))
def test_marked_fails():
    assert False


def test_plain():
    pass
"""


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_report_is_written_atomically_with_exit_status_and_complete(inner: pytest.Pytester) -> None:  # noqa: F811
    inner.makepyfile(
        test_ok="""
from cgmods import Tiny, make_inputs


def test_good(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1, 2))
"""
    )
    out = inner.path / "out"
    inner.runpytest("--cudagraph-report=out/report.json").assert_outcomes(passed=1)
    data = _load(out / "report.json")
    assert data["version"] == pytest_report.REPORT_VERSION == 3
    assert (data["complete"], data["exitstatus"], data["passed"]) == (True, 0, True)
    assert data["outcomes"] == {"passed": 1}
    assert list(data["tests"]) == ["test_ok.py::test_good"]
    assert _temp_files(out) == []
    assert oct((out / "report.json").stat().st_mode & 0o777) != oct(0o600)  # as a plain write makes it


def test_every_test_that_used_the_plugin_is_listed_with_its_outcome(inner: pytest.Pytester) -> None:  # noqa: F811
    inner.makepyfile(test_mixed=TESTS)
    result = inner.runpytest("--cudagraph-report=report.json")
    result.assert_outcomes(passed=2, failed=2)
    data = _load(inner.path / "report.json")
    tests = data["tests"]
    # test_plain used nothing of the plugin; the others are listed whatever happened to them
    assert set(tests) == {
        "test_mixed.py::test_good",
        "test_mixed.py::test_inputs_raise",
        "test_mixed.py::test_marked_fails",
    }
    assert tests["test_mixed.py::test_inputs_raise"] == {"outcome": "failed", "verifications": []}
    assert tests["test_mixed.py::test_marked_fails"] == {"outcome": "failed", "verifications": []}
    assert tests["test_mixed.py::test_good"]["outcome"] == "passed"
    assert (data["complete"], data["exitstatus"], data["passed"]) == (True, 1, False)
    assert data["outcomes"] == {"passed": 1, "failed": 2}
    result.stdout.fnmatch_lines(["test_mixed.py::test_inputs_raise: no verification finished [[]failed]"])


def test_report_says_incomplete_while_the_session_runs(inner: pytest.Pytester) -> None:  # noqa: F811
    (inner.path / "report.json").write_text(
        json.dumps(
            {"version": 2, "complete": True, "exitstatus": 0, "passed": True, "tests": {"old.py::test": {}}}
        )
    )
    inner.makepyfile(
        test_peek="""
import json


def test_peek(cudagraph_manager):
    data = json.loads(open("report.json").read())
    assert data["complete"] is False and data["exitstatus"] is None and data["passed"] is False
    assert data["tests"] == {}
"""
    )
    inner.runpytest("--cudagraph-report=report.json").assert_outcomes(passed=1)
    assert _load(inner.path / "report.json")["complete"] is True


def test_a_killed_run_leaves_no_report_looking_current(
    inner: pytest.Pytester,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As SIGTERM or the OOM killer would: the process ends before pytest_sessionfinish.
    (inner.path / "report.json").write_text(
        json.dumps(
            {"version": 2, "complete": True, "exitstatus": 0, "passed": True, "tests": {"old.py::test": {}}}
        )
    )
    inner.makepyfile(
        test_killed="""
import os


def test_killed(cudagraph_manager):
    os._exit(3)
"""
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(inner.path)]))
    result = inner.runpytest_subprocess("-p", "no:cacheprovider", "--cudagraph-report=report.json")
    assert result.ret == 3
    data = _load(inner.path / "report.json")
    assert data["complete"] is False and data["passed"] is False and data["tests"] == {}
    assert "has not finished" in data["note"]


@pytest.mark.parametrize("how", ["raise KeyboardInterrupt", "pytest.exit('stop here')"])
def test_an_interrupted_run_is_marked_incomplete(inner: pytest.Pytester, how: str) -> None:  # noqa: F811
    inner.makepyfile(
        test_stop=f"""
import pytest
from cgmods import Tiny, make_inputs


def test_a(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1,))


def test_b(cudagraph_manager):
    {how}


def test_c(cudagraph_manager):
    pass
"""
    )
    result = inner.runpytest_inprocess("--cudagraph-report=report.json", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    data = _load(inner.path / "report.json")
    assert (data["complete"], data["exitstatus"], data["passed"]) == (False, 2, False)
    assert data["tests"]["test_stop.py::test_a"]["outcome"] == "passed"
    assert "test_stop.py::test_c" not in data["tests"]


def test_stopping_at_the_first_failure_is_incomplete(inner: pytest.Pytester) -> None:  # noqa: F811
    inner.makepyfile(test_mixed=TESTS)
    result = inner.runpytest("-x", "--cudagraph-report=report.json")
    result.assert_outcomes(passed=1, failed=1)
    data = _load(inner.path / "report.json")
    assert (data["complete"], data["exitstatus"], data["passed"]) == (False, 1, False)


def test_a_crashed_xdist_worker_is_listed_and_nothing_claims_all_passed(inner: pytest.Pytester) -> None:  # noqa: F811
    pytest.importorskip("xdist")
    inner.makepyfile(
        test_crash="""
import os
from cgmods import Tiny, make_inputs


def test_good(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1, 2))


def test_crash(cudagraph_verify):
    os._exit(1)


def test_crash_outside_the_plugin():
    os._exit(1)
"""
    )
    result = inner.runpytest("-p", "xdist.plugin", "-n", "1", "--cudagraph-report=report.json")
    result.assert_outcomes(passed=1, failed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    data = _load(inner.path / "report.json")
    tests = data["tests"]
    assert tests["test_crash.py::test_good"]["outcome"] == "passed"
    # a worker crash is listed whether or not the test used the plugin (it cannot say, and it may be ours)
    for name in ("test_crash", "test_crash_outside_the_plugin"):
        entry = tests[f"test_crash.py::{name}"]
        assert entry["outcome"] == "crashed" and "crashed while running" in entry["crash"]
    assert (data["complete"], data["exitstatus"], data["passed"]) == (True, 1, False)
    assert data["outcomes"] == {"passed": 1, "crashed": 2}
    result.stdout.fnmatch_lines(["test_crash.py::test_crash: no verification finished [[]crashed]"])


def test_failures_before_verifying_are_listed_under_xdist(inner: pytest.Pytester) -> None:  # noqa: F811
    pytest.importorskip("xdist")
    inner.makepyfile(test_mixed=TESTS)
    alone = inner.runpytest("-p", "no:xdist", "--cudagraph-report=alone.json")
    two = inner.runpytest("-p", "xdist.plugin", "-n", "2", "--cudagraph-report=two.json")
    for result in (alone, two):
        result.assert_outcomes(passed=2, failed=2)
    a, b = _load(inner.path / "alone.json"), _load(inner.path / "two.json")
    assert {k: v["outcome"] for k, v in a["tests"].items()} == {
        k: v["outcome"] for k, v in b["tests"].items()
    }
    assert a["outcomes"] == b["outcomes"] and a["exitstatus"] == b["exitstatus"] == 1


# -- the Markdown benchmark report ----------------------------------------------
@pytest.fixture
def bench_pytester(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None
) -> pytest.Pytester:
    pytest.importorskip("pytest_benchmark")
    pytest.importorskip("xdist")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "pytest_cudagraph.plugin,pytest_benchmark.plugin,xdist.plugin")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makepyfile(test_bench_inner=BENCH_TEST)
    return pytester


def test_bench_report_is_merged_from_xdist_workers(bench_pytester: pytest.Pytester) -> None:
    bench_pytester.makepyfile(test_bench_other=BENCH_TEST.replace("def test_mlp", "def test_mlp_again"))
    result = bench_pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--cudagraph-backend=emulate",
        "--cudagraph-bench-report=bench.md",
    )
    result.assert_outcomes(passed=2)
    table = (bench_pytester.path / "bench.md").read_text()
    for test in ("test_bench_inner.py::test_mlp", "test_bench_other.py::test_mlp_again"):
        for descriptor in ("FULL-T8-R8", "FULL-T1-R1"):
            assert f"| {test} | MLP | emulate | {descriptor} |" in table
    assert "| not timed | not timed | not timed | not timed |" in table
    assert "each graph ran once, untimed" in table
    assert _temp_files(bench_pytester.path) == []
    result.stdout.fnmatch_lines(["*cudagraph: benchmark report written to*bench.md"])


def test_a_bench_report_not_written_is_warned_about(bench_pytester: pytest.Pytester) -> None:
    result = bench_pytester.runpytest(
        "-p", "no:cacheprovider", "-k", "nothing_matches", "--cudagraph-bench-report=bench.md", "-W", "always"
    )
    assert not (bench_pytester.path / "bench.md").exists()
    result.stdout.fnmatch_lines(["*the benchmark report */bench.md was not written: no cudagraph_benchmark*"])


# -- the writer ------------------------------------------------------------------
def test_atomic_write_keeps_the_old_file_when_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")

    def fail(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        pytest_report.atomic_write_text(path, "new")
    assert path.read_text() == "old" and _temp_files(tmp_path) == []
    monkeypatch.undo()
    pytest_report.atomic_write_text(path, "new")
    assert path.read_text() == "new" and _temp_files(tmp_path) == []


def test_a_crash_report_from_xdist_is_collected_as_crashed() -> None:
    state = pytest_report.RunState(Settings())
    setup = pytest.TestReport("t.py::test", ("t.py", 0, "test"), {}, "passed", None, "setup")
    setattr(setup, pytest_report.USED_ATTR, True)
    crash = pytest.TestReport(
        "t.py::test",
        ("t.py", None, "t.py"),
        {},
        "failed",
        "worker 'gw0' crashed while running 't.py::test'",
        "???",
    )  # type: ignore[arg-type]
    for report in (setup, crash):
        state.collect(report)
    document = pytest_report.report_document(state, 1)
    assert document["tests"] == {
        "t.py::test": {
            "outcome": "crashed",
            "verifications": [],
            "crash": "worker 'gw0' crashed while running 't.py::test'",
        }
    }
    assert document["passed"] is False


# -- the packages that took part -------------------------------------------------
_USES_KERNELS = """
def test_uses_a_kernel_library(cudagraph_manager):
    import cgfake_kernels  # imported by the test only: on an xdist worker, never on the controller

    assert cgfake_kernels.VERSION
"""


def _fake_distribution(folder: Path, name: str, version: str) -> None:
    """An installed distribution ``name`` whose one top-level module is ``name`` with '-' as '_'."""
    module = name.replace("-", "_")
    (folder / module).mkdir()
    (folder / module / "__init__.py").write_text(f"VERSION = {version!r}\n")
    info = folder / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(module + "\n")


@pytest.mark.parametrize("workers", [None, "1"], ids=["alone", "xdist"])
def test_the_report_names_every_package_a_test_imported(inner: pytest.Pytester, workers: str | None) -> None:  # noqa: F811
    """machine.packages: what the run's processes imported (an xdist worker's too), not a fixed list."""
    _fake_distribution(inner.path, "cgfake-kernels", "1.2.3")
    _fake_distribution(inner.path, "cgfake-unused", "4.5.6")  # installed, imported by no one
    inner.makepyfile(test_kernels=_USES_KERNELS)
    args = ["-p", "xdist.plugin", "-n", workers] if workers else ["-p", "no:xdist"]
    if workers:
        pytest.importorskip("xdist")
    inner.runpytest(*args, "--cudagraph-report=report.json").assert_outcomes(passed=1)
    packages = _load(inner.path / "report.json")["machine"]["packages"]
    assert packages["cgfake-kernels"] == "1.2.3"
    assert "cgfake-unused" not in packages
    assert packages["pytest-cudagraph"] and packages["torch"]  # the fixed ones, always named
    assert list(packages) == sorted(packages)
