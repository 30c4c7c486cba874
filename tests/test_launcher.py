"""Ranks a launcher started: torchrun on one host and on two "nodes" (loopback), the plugin's one
verdict and one report, and the pieces underneath (the environment, the verdict, the collections).

The torchrun runs start real processes (gloo on the CPU, 127.0.0.1 only): each is one launch of a
small suite (RANKS_SUITE), every test of it a case of tests/test_distributed.py's or
tests/data_parallel_models.py's, its outcomes read from rank 0's JUnit XML.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pytest_cudagraph.distributed.launcher import Ranks, Verdict, _collection_difference
from pytest_cudagraph.launch_env import LaunchEnv, LaunchEnvError, from_environment

ROOT = Path(__file__).resolve().parents[1]
#: The launches below start torchrun themselves: not from a rank of one.
_NOT_NESTED = pytest.mark.skipif(
    from_environment() is not None, reason="starts torchrun itself; this is a rank of one"
)

# -- the launcher's environment ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500",
            },
            LaunchEnv(1, 2, 1, "torchrun", "127.0.0.1", 29500),
        ),
        (
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "MASTER_ADDR": "node7"},
            LaunchEnv(3, 4, 1, "srun", "node7", None),
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),  # an allocation running one process
        (  # torchrun inside a Slurm job: torchrun's own variables
            {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
            LaunchEnv(0, 2, 0, "torchrun", None, None),
        ),
    ],
)
def test_the_environment_says_which_rank_this_is(environ, expected):
    assert from_environment(environ) == expected


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({"RANK": "0"}, "RANK is set in the environment but WORLD_SIZE is not"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK and WORLD_SIZE say rank 2 of 2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' in the environment is not a whole number"),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID and SLURM_NTASKS say rank 4 of 4"),
    ],
)
def test_a_malformed_environment_is_one_line_saying_what_to_set(environ, words):
    with pytest.raises(LaunchEnvError, match="^" + words.replace("(", r"\(")):
        from_environment(environ)


# -- the verdict: every rank takes the first proposal --------------------------------------------


class _Store:
    """A store as torch's TCPStore answers (the keys the harness uses), in one dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: bytes) -> bytes:
        if key not in self.data and expected == "":
            self.data[key] = desired
        return self.data[key]


def _ranks(store: _Store, rank: int) -> Ranks:
    return Ranks(LaunchEnv(rank, 2, rank, "torchrun", "127.0.0.1", 1), store, "gloo", base=object())


def test_the_ranks_agree_on_the_first_verdict_proposed():
    store = _Store()
    zero, one = _ranks(store, 0), _ranks(store, 1)
    store.set("v#0/result/0", b"r0")
    store.set("v#0/where/1", "in all_reduce of (4, 8)")
    early = zero.propose("v#0", 8, "emulate")  # rank 0's time ran out: rank 1 still in its collective
    store.set("v#0/result/1", b"r1")  # rank 1 finished just after
    late = one.propose("v#0", 8, "emulate")
    assert early == late == Verdict((0,), {1: "rank 1 still running after 8 s, in all_reduce of (4, 8)"})
    # A verdict that names a rank has every rank rebuild the group the harness made, once.
    assert int(store.add("generation", 0)) == 1


def test_a_rank_that_never_reached_the_verification_is_named_with_what_it_is_doing():
    store = _Store()
    store.set("v#0/result/0", b"r0")
    store.set("now/1", "running test_x.py::test_other")
    verdict = _ranks(store, 0).propose("v#0", 8, "emulate")
    assert verdict.missing == {
        1: "rank 1 did not reach this verification within 8 s: it is running test_x.py::test_other"
    }


def test_every_rank_present_is_a_verdict_naming_none():
    store = _Store()
    for r in (0, 1):
        store.set(f"v#0/result/{r}", pickle.dumps(r))
    verdict = _ranks(store, 1).propose("v#0", 8, "emulate")
    assert verdict == Verdict((0, 1), {}) and int(store.add("generation", 0)) == 0


@pytest.mark.parametrize(
    ("mine", "theirs", "words"),
    [
        (
            ["a", "b"],
            ["a"],
            "ranks 0 and 1 collected different tests (2 and 1): rank 0 has b, which rank 1 did not",
        ),
        (["a"], ["a", "c"], "rank 1 has c, which rank 0 did not collect"),
        (["a", "b"], ["b", "a"], "ranks 0 and 1 collected the same tests in another order"),
    ],
)
def test_ranks_that_collected_other_tests_are_told_apart(mine, theirs, words):
    assert words in _collection_difference(0, mine, 1, theirs)


def test_a_rank_checks_the_tests_of_every_rank():
    store = _Store()
    store.set("collected/1", "a\nb")
    zero = _ranks(store, 0)
    found = zero.collections(["a", "b"], 5)
    assert found == {0: ["a", "b"], 1: ["a", "b"]} and zero.order_differs(found, ["a", "b"]) is None
    # A test one rank lacks is no difference of order (it fails on the ranks that have it) ...
    store.set("collected/1", "a")
    found = zero.collections(["a", "b"], 5)
    assert found[1] == ["a"] and zero.order_differs(found, ["a", "b"]) is None
    # ... tests they share, in another order, are.
    store.set("collected/1", "b\na")
    said = zero.order_differs(zero.collections(["a", "b"], 5), ["a", "b"])
    assert said == "ranks 0 and 1 collected the same tests in another order", said


# -- torchrun: one host, two ranks; two launches of one rank each ----------------------------------

RANKS_SUITE = """
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pytest_cudagraph import verify_data_parallel
from tests import data_parallel_models as m
from tests.test_distributed import (
    build,
    build_branches,
    build_other_dtype,
    build_raises,
    build_reordered,
    build_skips,
    build_sleeps,
    build_stalls,
    build_token_branch,
    make_inputs,
    make_inputs_by_rank,
)

TP = dict(capture_sizes=[1, 2, 4], max_num_reqs=4, checks=["real_batches", "replay_matches_eager"])
DDP = dict(capture_sizes=[2], steps=3, warmup_steps=3, pad_values={"weight": 0})


@pytest.mark.cudagraph(**TP)
def test_tp_passes(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_rank_branch(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_branches, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_collective_on_one_rank_only(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_stalls, make_inputs, timeout=8)


@pytest.mark.cudagraph(**TP)
def test_tp_passes_after_the_hang(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_sleeps_past_the_timeout(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_sleeps, make_inputs, timeout=8)


@pytest.mark.cudagraph(**TP)
def test_tp_passes_after_the_sleep(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_skips_a_collective(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_skips, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_pads_by_rank(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build, make_inputs_by_rank)


@pytest.mark.cudagraph(**TP)
def test_tp_reorders(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_reordered, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_other_dtype(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_other_dtype, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_raises(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_raises, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_token_branch_on_one_rank(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_token_branch, make_inputs)


@pytest.mark.cudagraph(**{**TP, "checks": ["real_batches", "padded_size"]})
def test_tp_token_branch_with_float64(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_token_branch, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_passes_after_the_mismatches(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_skipped_on_rank_1(cudagraph_verify_distributed):
    if os.environ["RANK"] == "1":
        pytest.skip("rank 1 holds no shard here")
    cudagraph_verify_distributed(build, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_skipped_on_rank_0(cudagraph_verify_distributed):
    if os.environ["RANK"] == "0":
        pytest.skip("rank 0 holds no shard here")
    cudagraph_verify_distributed(build, make_inputs)


if os.environ.get("RANK") == "0":  # a selection that depends on the rank: rank 1 does not collect it

    @pytest.mark.cudagraph(**TP)
    def test_tp_collected_on_rank_0_only(cudagraph_verify_distributed):
        cudagraph_verify_distributed(build, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_passes_after_the_skips(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build, make_inputs)


@pytest.mark.cudagraph(**TP)
def test_tp_four_ranks(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build, make_inputs, world_size=4)


@pytest.mark.cudagraph(capture_sizes=[1, 2])
def test_plain_module(cudagraph_verify):
    torch.manual_seed(0)
    cudagraph_verify(nn.Sequential(nn.Linear(8, 8)), lambda t, r: {"input": torch.randn(t, 8)})


def test_ddp_correct():
    report = verify_data_parallel(m.build_regressor, m.make_inputs, m.masked_loss, optimizer=m.sgd, **DDP)
    assert report.ok, report.format()


def test_ddp_padded_mean_loss():
    report = verify_data_parallel(m.build_regressor, m.make_inputs, m.padded_mean_loss, optimizer=m.sgd, **DDP)
    assert report.ok, report.format()


def test_ddp_synced_capture_under_no_sync(cudagraph_verify_training):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(m.Regressor())
    cudagraph_verify_training(ddp, m.make_inputs, m.masked_loss, optimizer=m.sgd, step=m.synced_capture_under_no_sync, **DDP)


def test_ddp_synced_outside(cudagraph_verify_training):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(m.Regressor())
    cudagraph_verify_training(ddp, m.make_inputs, m.masked_loss, optimizer=m.sgd, step=m.no_sync_capture_synced_outside, **DDP)
"""

#: A rank whose process ends in a verification (last: the launcher stops the run after it).
DIES = """
from tests.test_distributed import RowParallel


class _Exits(RowParallel):
    def forward(self, x):
        if self.rank == 1 and x.shape[0] > 2:
            os._exit(3)  # rank 1's process ends in the middle of the verification
        return super().forward(x)


def _exits(rank, world_size):
    return _Exits(rank, world_size).eval()


@pytest.mark.cudagraph(**TP)
def test_rank_dies(cudagraph_verify_distributed):
    cudagraph_verify_distributed(_exits, make_inputs)
"""

#: Each test's outcome (from rank 0's JUnit XML) and words its failure must hold.
EXPECTED = {
    "test_tp_passes": ("passed", ()),
    "test_tp_rank_branch": (
        "failed",
        ("FAIL rank_agreement", "rank 1 disagrees with rank 0", "replicated differ"),
    ),
    "test_tp_collective_on_one_rank_only": (
        "failed",
        (
            "hang: rank 0 still running after 8 s, waiting for its peers to issue all_reduce of (4, 8) float32 at ",
            "rank 1 still running after 8 s",
        ),
    ),
    "test_tp_passes_after_the_hang": ("passed", ()),
    # A rank asleep in its own code past the timeout: named there, woken (not ended), and the session
    # goes on with every rank.
    "test_tp_sleeps_past_the_timeout": (
        "failed",
        (
            "rank 1 still running after 8 s",
            "not at a collective: its own code runs or waits there",
            "rank 0 still running after 8 s, waiting for its peers to issue all_reduce of (4, 8) float32 at ",
        ),
    ),
    "test_tp_passes_after_the_sleep": ("passed", ()),
    # Named before any rank enters the collective: no process ends, and the next test passes.
    "test_tp_skips_a_collective": (
        "failed",
        (
            "collectives differ between ranks",
            "rank 1 ended a forward without issuing what rank 0 issues there",
        ),
    ),
    "test_tp_pads_by_rank": (
        "failed",
        ("collectives differ between ranks", "another shape or dtype on one rank"),
    ),
    "test_tp_reorders": ("failed", ("collectives differ between ranks", "in another order on one rank")),
    "test_tp_other_dtype": ("failed", ("collectives differ between ranks", "float64")),
    "test_tp_raises": ("failed", ("rank 1 gives up",)),
    # A bug on one rank behind the same collectives: named by the check that sees it there, each rank's
    # forwards in step (issue #68's point 3), not as a hang or a collective mismatch.
    "test_tp_token_branch_on_one_rank": (
        "failed",
        ("FAIL real_batches           FULL-T4-R4 rank 1", "tests/test_distributed.py:"),
    ),
    "test_tp_token_branch_with_float64": (
        "failed",
        ("FAIL padded_size            FULL-T4-R4 rank 1", "tests/test_distributed.py:"),
    ),
    "test_tp_passes_after_the_mismatches": ("passed", ()),
    # A test one rank skips or does not collect fails on every rank that has it, named, at once.
    "test_tp_skipped_on_rank_1": (
        "failed",
        ("rank 1 skipped this test (rank 1 holds no shard here at", "where its peers ran it"),
    ),
    "test_tp_skipped_on_rank_0": (
        "failed",
        ("rank 0 skipped this test (rank 0 holds no shard here at", "where rank(s) [1] ran it"),
    ),
    "test_tp_collected_on_rank_0_only": ("failed", ("rank(s) [1] did not collect this test",)),
    "test_tp_passes_after_the_skips": ("passed", ()),
    "test_tp_four_ranks": ("skipped", ()),
    "test_plain_module": ("passed", ()),
    "test_ddp_correct": ("passed", ()),
    "test_ddp_padded_mean_loss": (
        "failed",
        (
            "FAIL training_padding       FULL-T2-R2 rank 0",
            "FULL-T2-R2 rank 1",
            "padded rows reach the training step",
        ),
    ),
    "test_ddp_synced_capture_under_no_sync": (
        "failed",
        (
            "FAIL ddp_gradient_sync      FULL-T2-R2 rank 0",
            "FULL-T2-R2 rank 1",
            "captured with gradient sync on",
        ),
    ),
    "test_ddp_synced_outside": ("passed", ()),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(args: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """``python -m torch.distributed.run ARGS``: each rank's output in a file under ``log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))}
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_NTASKS",
        "SLURM_PROCID",
    ):
        env.pop(name, None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", f"--log-dir={log}", "--redirects=3", *args]
    return subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True)


def _wait(processes: list[subprocess.Popen[bytes]], seconds: float) -> None:
    """Every launch ended within ``seconds``; else each is killed with its process group."""
    try:
        for process in processes:
            process.wait(seconds)
    except subprocess.TimeoutExpired:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"a torchrun launch still ran after {seconds:g} s; killed")


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test name: (outcome, the failure's text)} from a JUnit XML file."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        outcome = "failed" if failure is not None else "skipped" if skipped is not None else "passed"
        found[case.get("name")] = (
            outcome,
            (failure.get("message", "") + (failure.text or "")) if failure is not None else "",
        )
    return found


#: ``examples/tensor_parallel``: run in the same launches, every bug of it caught under torchrun with no
#: case left to spawned ranks (issue #68).
EXAMPLE = str(ROOT / "examples" / "tensor_parallel")


def _example_passed(junit: Path) -> None:
    """Every test of ``EXAMPLE`` in rank 0's JUnit XML passed (those for GPUs skipped here), and some ran."""
    cases = [
        c
        for c in ET.parse(junit).getroot().iter("testcase")
        if "tensor_parallel" in (c.get("classname") or "")
    ]
    ran = [c.get("name") for c in cases if c.find("skipped") is None]
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    assert ran and not failed, f"ran {ran}, failed {failed}"


def _rank_output(log: Path, rank: int) -> str:
    files = sorted(log.glob(f"*/attempt_0/{rank}/stdout.log"))
    assert files, f"no output of local rank {rank} under {log}"
    return files[0].read_text()


def _check(outcomes: dict[str, tuple[str, str]], names: list[str]) -> None:
    for name in names:
        want, words = EXPECTED[name]
        got, text = outcomes[name]
        assert got == want, f"{name}: {got}, expected {want}\n{text}"
        for word in words:
            assert word in text, f"{name}: {word!r} not in\n{text}"


@_NOT_NESTED
def test_torchrun_runs_the_suite_once_a_rank_with_one_verdict_and_one_report(tmp_path: Path):
    (tmp_path / "test_ranks.py").write_text(RANKS_SUITE + DIES)
    log = tmp_path / "logs"
    process = _launch(
        [
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "pytest",
            "test_ranks.py",
            "-p",
            "no:cacheprovider",
            "--cudagraph-backend=emulate",
            "--junitxml=junit.xml",
            "--cudagraph-report=report.json",
        ],
        tmp_path,
        log,
    )
    _wait([process], 300)
    outcomes = _outcomes(tmp_path / "junit.xml")  # rank 0's: the other rank writes neither file
    _check(outcomes, list(EXPECTED))
    for name in ("test_tp_token_branch_on_one_rank", "test_tp_token_branch_with_float64"):
        text = outcomes[name][1]
        assert "collectives differ" not in text and "hang:" not in text and "stopped:" not in text, text
    # The rank that died is named by the one that lives, and the run stops there.
    died, text = outcomes["test_rank_dies"]
    assert died == "failed" and "rank 1 stopped answering" in text and "SIGTERM" in text, text
    assert process.returncode != 0
    zero, one = _rank_output(log, 0), _rank_output(log, 1)
    assert "test_ranks.py::test_tp_rank_branch" in zero and "rank 1 disagrees with rank 0" in zero
    assert "test_ranks.py" not in one and "FAIL" not in one, one  # quiet: rank 0 printed every rank's
    report = json.loads((tmp_path / "report.json").read_text())
    records = report["tests"]["test_ranks.py::test_tp_passes"]["verifications"]
    ranks = {o["rank"] for record in records for o in record["report"]["outcomes"]}
    assert {0, 1} <= ranks, ranks


@_NOT_NESTED
def test_two_nodes_give_the_verdicts_of_one(tmp_path: Path):
    (tmp_path / "test_ranks.py").write_text(RANKS_SUITE)
    port = _free_port()
    chosen = [
        "test_tp_passes",
        "test_tp_rank_branch",
        "test_tp_skips_a_collective",
        "test_tp_token_branch_on_one_rank",
        "test_tp_passes_after_the_mismatches",
        "test_tp_skipped_on_rank_1",
        "test_tp_skipped_on_rank_0",
        "test_tp_collected_on_rank_0_only",
        "test_tp_passes_after_the_skips",
        "test_ddp_synced_capture_under_no_sync",
        "test_ddp_synced_outside",
    ]
    launches = [
        _launch(
            [
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "pytest",
                "test_ranks.py",
                "-p",
                "no:cacheprovider",
                "-k",
                " or ".join(chosen),
                "--cudagraph-backend=emulate",
                f"--junitxml=node{node}.xml",
            ],
            tmp_path,
            tmp_path / f"logs{node}",
        )
        for node in (0, 1)
    ]
    _wait(launches, 300)
    _check(_outcomes(tmp_path / "node0.xml"), chosen)
    assert not (tmp_path / "node1.xml").exists()  # the node of rank 1 leaves the reports to rank 0


@pytest.mark.parametrize(("rank", "writes"), [(0, True), (1, False)])
def test_only_rank_0_writes_the_reports(pytester: pytest.Pytester, monkeypatch, rank, writes):
    from pytest_cudagraph.plugin import ranks

    for name, value in {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}.items():
        monkeypatch.setenv(name, value)
    config = pytester.parseconfig("--junitxml=junit.xml")
    ranks.configure(config)
    assert ranks.writes_reports(config) is writes
    assert (config.option.xmlpath is not None) is writes


@_NOT_NESTED
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_tensor_parallel_example_catches_every_bug_under_torchrun(tmp_path: Path, nodes: int):
    """``examples/tensor_parallel`` under torchrun, one node of two ranks and two nodes of one: every bug
    of it caught there, with no case left to spawned ranks (issue #68)."""
    common = ["-m", "pytest", "examples/tensor_parallel", "-p", "no:cacheprovider", "-q"]
    if nodes == 1:
        args = [["--standalone", "--nproc-per-node=2", *common, f"--junitxml={tmp_path / 'node0.xml'}"]]
    else:
        port = _free_port()
        args = [
            [
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *common,
                f"--junitxml={tmp_path / f'node{node}.xml'}",
            ]
            for node in range(2)
        ]
    _wait([_launch(a, ROOT, tmp_path / f"logs{i}") for i, a in enumerate(args)], 240)
    cases = list(ET.parse(tmp_path / "node0.xml").getroot().iter("testcase"))
    ran = [c.get("name") for c in cases if c.find("skipped") is None]
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    assert any(str(n).startswith("test_bug_fails_rank_agreement[") for n in ran) and not failed, (ran, failed)
