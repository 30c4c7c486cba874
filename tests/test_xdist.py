"""Many workers: a device per worker, verifications split by descriptor, one merged report."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from pytest_cudagraph.plugin.option_table import parse_devices, parse_split
from pytest_cudagraph.plugin.settings import worker_device_index
from tests.test_plugin import CONFTEST, MODULES, inner  # noqa: F401  (the pytester fixture)

SPLIT_TESTS = """
import pytest
from cgmods import Tiny, ItemInForward, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8), mode="FULL_AND_PIECEWISE")
def test_big(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)


@pytest.mark.cudagraph(capture_sizes=(1, 2))
def test_buggy(cudagraph_verify):
    cudagraph_verify(ItemInForward(), make_inputs)


def test_sizes_in_the_call(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1, 4))
"""

# What differs between two runs of the same verification: timings and where.
_VOLATILE = {"capture_seconds", "check_seconds", "report", "seconds", "started", "finished"}


def _normalised(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _normalised(v) for k, v in data.items() if k not in _VOLATILE}
    if isinstance(data, list):
        return [_normalised(v) for v in data]
    return data


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    result = pytester.runpytest("--cudagraph-verify", "--cudagraph-report=report.json", *args)
    return result, json.loads((pytester.path / "report.json").read_text())


def _summary(result: pytest.RunResult) -> list[str]:
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "= cudagraph =" in line)
    # Timings and the process's peak memory are the machine's, not the verdict's.
    return sorted(
        re.sub(
            r"peak memory [\d.]+ \w+( \([\d.]+ \w+ before\))?",
            "peak memory <m>",
            re.sub(r"capture [\d.]+ [mµ]?s", "capture <t>", line),
        )
        for line in lines[start + 1 :]
        if "::" in line and ("descriptors captured" in line or "descriptors verified" in line)
    )


@pytest.mark.parametrize("split", ["test", "descriptor"])
def test_two_workers_and_no_xdist_give_the_same_merged_report(inner: pytest.Pytester, split: str) -> None:  # noqa: F811
    pytest.importorskip("xdist")
    inner.makepyfile(test_split=SPLIT_TESTS)
    alone, alone_data = _run(inner, "-p", "no:xdist", f"--cudagraph-split={split}")
    two, two_data = _run(inner, "-p", "xdist.plugin", "-n", "2", f"--cudagraph-split={split}")
    # test_big: 8 descriptors (4 PIECEWISE, 4 FULL) as 8 items when split.
    big = 8 if split == "descriptor" else 1
    buggy = 2 if split == "descriptor" else 1
    for result in (alone, two):
        result.assert_outcomes(passed=big + 1, failed=buggy)
    assert _normalised(alone_data) == _normalised(two_data)
    assert _summary(alone) == _summary(two)
    assert len(alone_data["tests"]) == big + buggy + 1


def test_split_by_descriptor_verifies_one_descriptor_an_item(inner: pytest.Pytester) -> None:  # noqa: F811
    inner.makepyfile(test_split=SPLIT_TESTS)
    result, data = _run(inner, "-p", "no:xdist", "--cudagraph-split=descriptor", "-k", "big or call")
    result.assert_outcomes(passed=9)
    result.stdout.fnmatch_lines(["cudagraph: *, split=descriptor*"])  # then ", threads ..." on some machines
    big = {k: v for k, v in data["tests"].items() if "test_big" in k}
    labels = sorted(k.split("[")[1].rstrip("]") for k in big)
    assert labels == sorted(
        [
            "FULL-T1-R1-U1",
            "FULL-T2-R2-U1",
            "FULL-T4-R4-U1",
            "FULL-T8-R8-U1",
            "PIECEWISE-T1",
            "PIECEWISE-T2",
            "PIECEWISE-T4",
            "PIECEWISE-T8",
        ]
    )
    dispatch_runs = 0
    for nodeid, test in big.items():
        (verification,) = test["verifications"]
        report = verification["report"]
        assert [d["label"] for d in report["descriptors"]] == [nodeid.split("[")[1].rstrip("]")]
        dispatch_runs += any(o["check"] == "dispatch" and not o["skipped"] for o in report["outcomes"])
    assert dispatch_runs == 1  # the plan-wide check runs with the first descriptor only
    # Sizes given only in the call: unknown at collection, so one item verifies all.
    (call,) = [v for k, v in data["tests"].items() if "test_sizes_in_the_call" in k]
    assert len(call["verifications"][0]["report"]["descriptors"]) == 2


def test_a_call_that_changes_a_split_plan_fails_clearly(inner: pytest.Pytester) -> None:  # noqa: F811
    inner.makepyfile(
        test_x="""
import pytest
from cgmods import Tiny, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2))
def test_x(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(4,))
"""
    )
    result = inner.runpytest("--cudagraph-split=descriptor")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*this item verifies descriptor FULL-T*--cudagraph-split=descriptor*"
            "Set the plan in the marker only, or run with --cudagraph-split=test*"
        ]
    )


def test_bad_device_and_split_options_are_usage_errors(inner: pytest.Pytester) -> None:  # noqa: F811
    inner.makepyfile(test_x="def test_x():\n    pass\n")
    result = inner.runpytest("--cudagraph-devices=0,x")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--cudagraph-devices: expected a comma-separated list of CUDA device indices*"]
    )
    result = inner.runpytest("--cudagraph-split=module")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cudagraph-split: expected one of test, descriptor; got 'module'*"])


def test_workers_take_devices_in_turn() -> None:
    # gw<N> -> the N-th device, round robin; every visible one by default.
    assert [worker_device_index(f"gw{n}", None, 2) for n in range(5)] == [0, 1, 0, 1, 0]
    assert [worker_device_index(f"gw{n}", (3, 1), 8) for n in range(3)] == [3, 1, 3]
    assert worker_device_index(None, None, 2) is None  # no xdist: the current device stays
    assert worker_device_index(None, (2, 3), 4) == 2
    assert worker_device_index("gw0", None, 0) is None  # no GPU
    assert parse_devices("0, 1 2", "x") == (0, 1, 2)
    for bad in ("", "a", "-1", "0,0"):
        with pytest.raises(pytest.UsageError):
            parse_devices(bad, "x")
    assert parse_split("Descriptor", "x") == "descriptor"


@pytest.mark.cuda
def test_each_worker_verifies_on_its_own_gpu(inner: pytest.Pytester) -> None:  # noqa: F811
    pytest.importorskip("xdist")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    inner.makepyfile(test_split=SPLIT_TESTS)
    result, data = _run(inner, "-p", "xdist.plugin", "-n", "2", "--cudagraph-split=descriptor", "-k", "big")
    result.assert_outcomes(passed=8)
    devices = {v["verifications"][0]["report"]["device"] for v in data["tests"].values()}
    assert devices == {"cuda:0", "cuda:1"}
    result.stdout.fnmatch_lines(["*test_big*: on cuda:1, *"])


def test_split_items_of_a_quick_run_each_verify_their_descriptor(inner: pytest.Pytester) -> None:  # noqa: F811
    # Without --cudagraph-verify the quick selection is split; an item named
    # in the marker's descriptors is verified even where quick mode skips it.
    inner.makepyfile(
        test_x="""
import pytest
from cgmods import Tiny, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8))
def test_quick(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8), descriptors=["FULL-T2-R2"])
def test_named(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)
"""
    )
    result = inner.runpytest("--cudagraph-split=descriptor", "--cudagraph-report=report.json")
    result.assert_outcomes(passed=3)
    data = json.loads((inner.path / "report.json").read_text())
    for nodeid, test in data["tests"].items():
        (verification,) = test["verifications"]
        labels = [d["label"] for d in verification["report"]["descriptors"]]
        assert labels == [nodeid.split("[")[1].rstrip("]")] and verification["report"]["outcomes"]
    assert sorted(data["tests"]) == [
        "test_x.py::test_named[FULL-T2-R2]",
        "test_x.py::test_quick[FULL-T1-R1]",
        "test_x.py::test_quick[FULL-T8-R8]",
    ]
