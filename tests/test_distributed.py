"""verify_distributed on two gloo ranks (the emulator): sharded modules, their agreement, a hang."""

from __future__ import annotations

import inspect
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pytest_cudagraph import verify_distributed
from pytest_cudagraph.launch_env import from_environment

#: Under torchrun (``python -m torch.distributed.run --nproc-per-node=2 -m pytest tests/test_distributed.py``)
#: the verifications run on its ranks; the cases that need spawned ranks of their own skip.
LAUNCHED = from_environment()
_SPAWN_ONLY = pytest.mark.skipif(
    LAUNCHED is not None, reason="spawns ranks of its own; under a launcher they are its"
)
D, HIDDEN = 8, 16
KW = {
    "capture_sizes": [1, 2, 4],
    "max_num_reqs": 4,
    "checks": ["replay_matches_eager", "real_batches", "state"],
}


class RowParallel(nn.Module):
    """Column-parallel then row-parallel, summed over the ranks: the full MLP on every rank."""

    def __init__(
        self, rank: int, world_size: int, *, skip_on: int | None = None, branch_on: int | None = None
    ):
        super().__init__()
        torch.manual_seed(0)
        up, down = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D, bias=False)
        shard = HIDDEN // world_size
        self.up = nn.Linear(D, shard)
        self.down = nn.Linear(shard, D, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(up.weight[rank * shard : (rank + 1) * shard])
            self.up.bias.copy_(up.bias[rank * shard : (rank + 1) * shard])
            self.down.weight.copy_(down.weight[:, rank * shard : (rank + 1) * shard])
        self.rank, self.skip_on, self.branch_on = rank, skip_on, branch_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        if not (self.rank == self.skip_on and x.shape[0] > 2):
            dist.all_reduce(y)
        if self.rank == self.branch_on:
            y = y * 1.5
        return y


def build(rank: int, world_size: int) -> nn.Module:
    return RowParallel(rank, world_size).eval()


def build_skips(rank: int, world_size: int) -> nn.Module:
    return RowParallel(rank, world_size, skip_on=1).eval()


class Stalls(RowParallel):
    """Rank 1 stops in a loop of its own (a host-side wait, a lock) before the collective of larger batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1 and x.shape[0] > 2:
            while True:
                time.sleep(0.05)
        return super().forward(x)


def build_stalls(rank: int, world_size: int) -> nn.Module:
    return Stalls(rank, world_size).eval()


class Sleeps(RowParallel):
    """Rank 1 sleeps in forward, past any timeout, before the collective of larger batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1 and x.shape[0] > 2:
            time.sleep(600)
        return super().forward(x)


def build_sleeps(rank: int, world_size: int) -> nn.Module:
    return Sleeps(rank, world_size).eval()


def build_branches(rank: int, world_size: int) -> nn.Module:
    return RowParallel(rank, world_size, branch_on=1).eval()


def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, D)}


def make_inputs_by_rank(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    # A rank that adds a token: it serves the batch with another graph than its peer.
    extra = 1 if dist.get_rank() == 1 and num_tokens in (1, 3) else 0
    return {"x": torch.randn(num_tokens + extra, D)}


def _failures(report):
    return {(o.check, o.rank) for o in report.failures}


def test_a_row_parallel_mlp_passes_on_every_rank_and_the_ranks_agree():
    report = verify_distributed(build, make_inputs, world_size=2, backend="emulate", **KW)
    assert report.ok, report.format()
    ranks = {o.rank for o in report.outcomes if o.check != "rank_agreement"}
    assert ranks == {0, 1}
    agree = [o for o in report.outcomes if o.check == "rank_agreement"]
    assert len(agree) == 1 and agree[0].passed and agree[0].figures["batches"] > 0


def test_a_python_branch_on_the_rank_breaks_replicated_outputs():
    report = verify_distributed(build_branches, make_inputs, world_size=2, backend="emulate", **KW)
    assert ("rank_agreement", 1) in _failures(report), report.format()
    assert "rank 1" in next(o.message for o in report.failures if o.check == "rank_agreement")


def _differ(report) -> str:
    """The message of the rank_agreement failure that names collectives that differ (every rank's)."""
    failed = [o.message for o in report.failures if o.check == "rank_agreement" and o.rank is not None]
    assert failed, report.format()
    said = [m for m in failed if "collectives differ between ranks" in m]
    assert said, failed
    return said[0]


def test_ranks_that_pad_differently_are_named_before_the_collective():
    # Rank 1's extra token makes its all-reduce larger than rank 0's: named with both shapes and the
    # user's line before either rank enters it (gloo would end a rank's process on the sizes).
    report = verify_distributed(build, make_inputs_by_rank, world_size=2, backend="emulate", timeout=60, **KW)
    said = _differ(report)
    assert re.search(
        r"rank [01] issues all_reduce of \(\d+, 8\) float32 at tests/test_distributed.py:\d+", said
    ), said
    assert "another shape or dtype on one rank" in said and "No rank entered it" in said, said


def test_a_collective_skipped_on_one_rank_is_named_at_the_one_it_skipped():
    report = verify_distributed(build_skips, make_inputs, world_size=2, backend="emulate", timeout=60, **KW)
    # Rank 1 skips the all-reduce of its larger batches: named there, not after a timeout.
    said = _differ(report)
    assert re.search(
        r"rank [01] issues all_reduce of \(4, 8\) float32 at tests/test_distributed.py:\d+ in forward", said
    ), said
    assert "rank 1 ended a forward without issuing what rank 0 issues there" in said, said


class Reordered(RowParallel):
    """Rank 1 broadcasts before it reduces; rank 0 the other way round."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        first, second = (
            (dist.all_reduce, dist.broadcast) if self.rank == 0 else (dist.broadcast, dist.all_reduce)
        )
        first(y) if first is dist.all_reduce else first(y, 0)
        second(y) if second is dist.all_reduce else second(y, 0)
        return y


def build_reordered(rank: int, world_size: int) -> nn.Module:
    return Reordered(rank, world_size).eval()


class OtherDtype(RowParallel):
    """Rank 1 reduces in float64."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        y = y.double() if self.rank == 1 else y
        dist.all_reduce(y)
        return y.float()


def build_other_dtype(rank: int, world_size: int) -> nn.Module:
    return OtherDtype(rank, world_size).eval()


def test_collectives_in_another_order_are_named():
    report = verify_distributed(
        build_reordered, make_inputs, world_size=2, backend="emulate", timeout=60, **KW
    )
    said = _differ(report)
    assert "issues all_reduce of" in said and "issues broadcast of" in said, said
    assert "in another order on one rank" in said, said


def test_a_collective_of_another_dtype_is_named():
    report = verify_distributed(
        build_other_dtype, make_inputs, world_size=2, backend="emulate", timeout=60, **KW
    )
    said = _differ(report)
    assert "float64" in said and "float32" in said and "another shape or dtype" in said, said


class Raises(RowParallel):
    """Rank 1 raises in forward, before its all-reduce, on larger batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1 and x.shape[0] > 2:
            raise RuntimeError("rank 1 gives up")
        return super().forward(x)


def build_raises(rank: int, world_size: int) -> nn.Module:
    return Raises(rank, world_size).eval()


def test_a_rank_that_raises_in_forward_is_named_and_no_rank_hangs():
    started = time.monotonic()
    report = verify_distributed(build_raises, make_inputs, world_size=2, backend="emulate", timeout=60, **KW)
    assert time.monotonic() - started < 45, "named by the timeout, not before it"
    said = _differ(report)
    assert re.search(
        r"rank 1 raised in its forward \d+ before issuing what rank 0 issues there: "
        r"RuntimeError: rank 1 gives up \(at tests/test_distributed.py:\d+ in forward\)",
        said,
    ), said


@_SPAWN_ONLY
def test_bad_arguments_say_what_was_expected():
    with pytest.raises(TypeError, match="picklable"):
        verify_distributed(lambda r, w: nn.Linear(2, 2), make_inputs, world_size=2, backend="emulate", **KW)
    with pytest.raises(ValueError, match="world_size"):
        verify_distributed(build, make_inputs, world_size=0, backend="emulate", **KW)
    with pytest.raises(ValueError, match="capture_sizes"):
        verify_distributed(build, make_inputs, world_size=2, backend="emulate")
    with pytest.raises(TypeError, match="device"):
        verify_distributed(build, make_inputs, world_size=2, backend="emulate", device="cpu", **KW)


def test_a_rank_that_never_comes_is_a_hang_naming_who_waits_in_what():
    started = time.monotonic()
    # Long enough for both ranks to start and reach the collective on a busy 2-core machine.
    report = verify_distributed(build_stalls, make_inputs, world_size=2, backend="emulate", timeout=20, **KW)
    assert time.monotonic() - started < 80
    failed = [o for o in report.failures if o.check == "rank_agreement"]
    assert failed and failed[0].message.startswith("hang:"), report.format()
    assert (
        "rank 0 still running after 20 s, waiting for its peers to issue all_reduce of (" in failed[0].message
    )
    assert "rank 1 still running" in failed[0].message


_FIXTURE_TESTS = """
import pytest
from tests.test_distributed import build, build_branches, make_inputs


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4], max_num_reqs=4, checks=["real_batches"])
def test_option_world_size(cudagraph_verify_distributed):
    report = cudagraph_verify_distributed(build, make_inputs)
    assert report.ok and "2 ranks" in report.device


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4], max_num_reqs=4, checks=["real_batches"])
def test_a_branch_on_the_rank_fails(cudagraph_verify_distributed):
    cudagraph_verify_distributed(build_branches, make_inputs, world_size=2)
"""


@_SPAWN_ONLY
def test_the_fixture_takes_world_size_from_the_call_or_the_option(pytester, monkeypatch, verify_imported):
    from pathlib import Path

    from tests.conftest import isolate_plugins

    isolate_plugins(monkeypatch)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    pytester.makepyfile(test_ranks=_FIXTURE_TESTS)
    result = pytester.runpytest_inprocess(
        "--cudagraph-world-size=2", "--cudagraph-backend=emulate", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, failed=1)
    assert "FAIL rank_agreement" in result.stdout.str()


# -- the agreement itself, on records as ranks write them ----------------------------------


def _results(*per_rank):
    from pytest_cudagraph.distributed.rank import RankResult, Seen

    return {r: RankResult(r, seen=[Seen(*s) for s in seen]) for r, seen in enumerate(per_rank)}


@pytest.mark.parametrize(
    ("rank1", "words"),
    [
        ([(3, 3, "FULL-T4-R4", torch.ones(3))], None),
        ([(3, 2, "FULL-T4-R4", torch.ones(3))], "batch shapes differ"),
        (
            [(3, 3, "FULL-T8-R8", torch.ones(3))],
            "rank 0 served it with FULL-T4-R4 and rank 1 with FULL-T8-R8",
        ),
        ([(3, 3, "FULL-T4-R4", torch.tensor([1.0, 1.0, 2.0]))], "outputs that must be replicated differ"),
        ([], "rank 1 ran 0 real batches and rank 0 1"),
    ],
)
def test_rank_agreement_names_what_differs(rank1, words):
    from pytest_cudagraph.distributed.merge import agreement as _agreement

    outcome = _agreement(_results([(3, 3, "FULL-T4-R4", torch.ones(3))], rank1), replicated=True)
    if words is None:
        assert outcome.passed and outcome.figures == {"ranks": 2, "batches": 1}
    else:
        assert not outcome.passed and outcome.rank == 1 and words in outcome.message, outcome.message


def test_sharded_outputs_are_not_compared_when_not_replicated():
    from pytest_cudagraph.distributed.merge import agreement as _agreement

    results = _results([(2, 2, "FULL-T2-R2", torch.zeros(2))], [(2, 2, "FULL-T2-R2", torch.ones(2))])
    assert _agreement(results, replicated=False).passed
    assert not _agreement(results, replicated=True).passed


@_SPAWN_ONLY
def test_four_ranks_agree():
    report = verify_distributed(
        build, make_inputs, world_size=4, backend="emulate", **{**KW, "checks": ["replay_matches_eager"]}
    )
    assert report.ok, report.format()
    assert {o.rank for o in report.outcomes if o.check == "replay_matches_eager"} == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("where", "backend", "noted"),
    [
        ("after all_reduce of (4, 16)", "cuda", True),  # NCCL returned; the GPU waits
        ("in all_reduce of (4, 16)", "cuda", False),  # the host itself is in the call
        ("after all_reduce of (4, 16)", "emulate", False),  # gloo blocks the host: "after" means after
        ("", "cuda", False),
    ],
)
def test_a_hang_on_nccl_says_the_gpu_waits(where, backend, noted):
    from pytest_cudagraph.distributed.merge import async_note as _async_note

    assert bool(_async_note(where, backend)) is noted
    if noted:
        assert "GPU" in _async_note(where, backend)


class SkipsOnce(RowParallel):
    """Rank 1 skips one all-reduce (its third call by its own count): the forward after it issues one
    of the same shape, which must not pass for the one skipped."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.down(torch.relu(self.up(x)))
        if not (self.rank == 1 and self.calls == 3):
            dist.all_reduce(y)
        return y


def build_skips_once(rank: int, world_size: int) -> nn.Module:
    return SkipsOnce(rank, world_size).eval()


def test_a_collective_skipped_once_is_named_there_not_paired_with_the_next_forwards():
    report = verify_distributed(
        build_skips_once, make_inputs, world_size=2, backend="emulate", timeout=60, **KW
    )
    said = _differ(report)
    # The harness puts the module's Python counter back between its runs: which forward it is shows
    # in the message. The two collectives have one shape; they differ in the forward they belong to.
    found = re.search(
        r"rank 0 issues all_reduce of \((\d+), 8\) float32 .*its forward (\d+)\); "
        r"rank 1 issues all_reduce of \((\d+), 8\) float32 .*its forward (\d+)\)",
        said,
    )
    assert found, said
    assert found[1] == found[3] and int(found[4]) == int(found[2]) + 1, said
    assert "rank 1 ended a forward without issuing what rank 0 issues there" in said, said


class TokenBranch(RowParallel):
    """Rank 1 scales its output on batches of 4 tokens, after the all-reduce: every rank issues the
    same collectives, and the bug is one rank's computation across shapes (issue #68's point 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        dist.all_reduce(y)
        if self.rank == 1 and x.shape[0] == 4:
            y = y * 1.001  # the bug
        return y


def build_token_branch(rank: int, world_size: int) -> nn.Module:
    return TokenBranch(rank, world_size).eval()


@pytest.mark.parametrize(
    ("checks", "named_by"),
    [
        # The float64 reference: the batch rank 1's fast route leaves open goes to float64 on both ranks.
        (["real_batches", "padded_size"], "padded_size"),
        # No reference: real_batches' floor, measured on both ranks where either asks for it.
        (["real_batches", "replay_matches_eager"], "real_batches"),
    ],
)
def test_a_bug_on_one_rank_is_named_by_the_check_that_sees_it_there(checks, named_by):
    started = time.monotonic()
    kw = {**KW, "checks": checks}
    report = verify_distributed(
        build_token_branch, make_inputs, world_size=2, backend="emulate", timeout=60, **kw
    )
    assert time.monotonic() - started < 45, "named by the timeout, not before it"
    failed = [o for o in report.failures if o.check == named_by]
    assert [(o.rank, o.descriptor.num_tokens) for o in failed] == [(1, 4)], report.format()
    # The diagnosis ran on rank 1 alone and still names the user's line.
    named = f"{failed[0].message} {failed[0].finding.describe() if failed[0].finding else ''}"
    assert re.search(r"tests/test_distributed.py:\d+ in forward", named), named
    said = report.format()
    assert "collectives differ" not in said and "hang:" not in said and "stopped:" not in said, said


class CountBranch(RowParallel):
    """Scales its output on batches of 4 tokens, a count read before the all-reduce and branched on two
    lines after it: every rank the same, so every rank diagnoses the failure alone (issue #69's point 6).
    The twin branches on a count every batch has (scaled at every size): correct."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        y = self.down(torch.relu(self.up(x)))
        dist.all_reduce(y)
        scale = 2.0
        if num_tokens == 4 or self.branch_on == 0:
            y = y * scale
        return y


def build_count_branch(rank: int, world_size: int) -> nn.Module:
    return CountBranch(rank, world_size).eval()


def build_count_branch_twin(rank: int, world_size: int) -> nn.Module:
    return CountBranch(rank, world_size, branch_on=0).eval()


def _line_of(text: str) -> int:
    """The line of ``CountBranch.forward`` that holds ``text``, read from this file."""
    lines, start = inspect.getsourcelines(CountBranch.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("bug", [True, False], ids=["bug", "twin"])
def test_a_branch_after_a_collective_is_placed_by_the_users_calls_as_in_one_process(bug):
    build_it = build_count_branch if bug else build_count_branch_twin
    kw = {**KW, "checks": ["real_batches"]}
    report = verify_distributed(build_it, make_inputs, world_size=2, backend="emulate", timeout=60, **kw)
    if not bug:
        assert report.ok, report.format()
        return
    failed = [o for o in report.failures if o.check == "real_batches"]
    assert {o.rank for o in failed} == {0, 1}, report.format()
    here = "tests/test_distributed.py"
    reduce, branch = _line_of("dist.all_reduce(y)"), _line_of("if num_tokens == 4")
    for outcome in failed:
        named = outcome.finding.describe() if outcome.finding else ""
        # The harness's own reads of the collective's tensor (answered on the rank alone) are no call
        # of the user's: nothing is said to be called at the all-reduce's line, which calls no torch
        # function, as one process (no collective there) says nothing of it.
        assert f"{here}:{reduce} in forward" not in named, named
        last = re.search(rf"after their last common call, \S+ at {here}:(\d+) in forward", named)
        calls = [int(n) for n in re.findall(rf"calls \S+ at {here}:(\d+) in forward", named)]
        assert last is not None and calls, named
        # As one process says it: after the user's last call before the branch (the MLP's line), and
        # before the lines that differ after it.
        assert int(last.group(1)) == _line_of("y = self.down(") and branch < min(calls), named


class Exits(RowParallel):
    """Rank 1's process ends in forward, before its all-reduce, on larger batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1 and x.shape[0] > 2:
            import os

            os._exit(3)
        return super().forward(x)


def build_exits(rank: int, world_size: int) -> nn.Module:
    return Exits(rank, world_size).eval()


@_SPAWN_ONLY
def test_a_rank_whose_process_ends_is_named_at_once_and_the_session_goes_on():
    started = time.monotonic()
    report = verify_distributed(build_exits, make_inputs, world_size=2, backend="emulate", timeout=60, **KW)
    assert time.monotonic() - started < 45, "named by the timeout, not before it"
    said = report.format()
    assert "rank 1 ended (exit code 3) without a report" in said, said
    assert re.search(
        r"rank 1 will never issue what rank 0 issues, all_reduce of \(4, 8\) float32 at "
        r"tests/test_distributed.py:\d+ in forward .*rank 1 ended \(exit code 3\)",
        said,
    ), said
    # The next verification runs on fresh ranks and passes.
    assert verify_distributed(build, make_inputs, world_size=2, backend="emulate", **KW).ok
