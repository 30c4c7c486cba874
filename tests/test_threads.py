"""Torch's intra-op threads per test process (pytest_cudagraph.plugin.threads)."""

from __future__ import annotations

import pytest
import torch

from pytest_cudagraph.plugin import threads
from pytest_cudagraph.plugin.threads import apply_threads, plan_threads, worker_count


@pytest.mark.parametrize(
    ("cores", "workers", "want"),
    [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 4, 4), (16, 3, 5), (1, 1, 1), (0, 0, 1)],
)
def test_cores_are_divided_among_workers_at_least_one_each(cores, workers, want):
    assert plan_threads(cores=cores, workers=workers, env={}) == want


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_a_thread_count_the_user_set_is_left_alone(name):
    assert plan_threads(cores=8, workers=2, env={name: "3"}) is None
    # Set but empty is not a choice.
    assert plan_threads(cores=8, workers=2, env={name: " "}) == 4


def test_the_plugins_own_variable_wins_and_zero_leaves_torch_alone():
    env = {"OMP_NUM_THREADS": "8", "PYTEST_CUDAGRAPH_THREADS": "3"}
    assert plan_threads(cores=2, workers=2, env=env) == 3
    assert plan_threads(cores=2, workers=2, env={"PYTEST_CUDAGRAPH_THREADS": "0"}) is None
    for bad in ("-1", "two"):
        with pytest.raises(ValueError, match="PYTEST_CUDAGRAPH_THREADS"):
            plan_threads(cores=2, workers=1, env={"PYTEST_CUDAGRAPH_THREADS": bad})


def test_workers_come_from_xdist():
    assert worker_count(None, {"PYTEST_XDIST_WORKER_COUNT": "4"}) == 4
    assert worker_count(None, {}) == 1

    class Option:
        numprocesses = 3

    class Config:
        option = Option()

    assert worker_count(Config(), {}) == 3  # xdist's controller: -n 3
    assert worker_count(Config(), {"PYTEST_XDIST_WORKER_COUNT": "2"}) == 2


def test_apply_sets_torchs_threads_and_says_so(monkeypatch):
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTEST_CUDAGRAPH_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    try:
        torch.set_num_threads(2)
        assert apply_threads(None) == "threads=1 (2 cores, 2 workers)"
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert apply_threads(None) is None
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_available_cores_is_at_least_one():
    assert threads.available_cores() >= 1


@pytest.mark.parametrize(
    ("env", "workers", "want"),
    [
        ({}, 2, "threads=1 (2 cores, 2 workers)"),
        ({"OMP_NUM_THREADS": "1"}, 1, "threads=1 (OMP_NUM_THREADS)"),
        ({"MKL_NUM_THREADS": "2"}, 1, "threads=2 (MKL_NUM_THREADS)"),
        (
            {"PYTEST_CUDAGRAPH_THREADS": "1", "OMP_NUM_THREADS": "8"},
            2,
            "threads=1 (PYTEST_CUDAGRAPH_THREADS)",
        ),
    ],
)
def test_the_header_always_names_the_threads_and_where_the_number_came_from(env, workers, want):
    assert threads.describe_threads(cores=2, workers=workers, env=env) == want


def test_the_header_warns_when_the_threads_exceed_the_cores():
    line = threads.describe_threads(cores=2, workers=1, env={"OMP_NUM_THREADS": "8"})
    assert line.startswith("threads=8 (OMP_NUM_THREADS) WARNING: 8 threads in all on 2 cores"), line
    assert "unset OMP_NUM_THREADS or set it to 2" in line
    # Per process: two xdist workers of 2 threads each are 4 threads on 2 cores.
    assert "WARNING: 4 threads in all" in threads.describe_threads(
        cores=2, workers=2, env={"OMP_NUM_THREADS": "2"}
    )
    zero = threads.describe_threads(cores=2, workers=2, env={"PYTEST_CUDAGRAPH_THREADS": "0"})
    assert zero.startswith("threads=torch's default, 2 a process (PYTEST_CUDAGRAPH_THREADS=0) WARNING"), zero
