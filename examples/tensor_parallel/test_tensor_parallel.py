"""Tensor-parallel modules on 2 ranks (gloo on the CPU): each rank's graphs, and the ranks against each other.

``verify_distributed`` starts one process a rank, verifies every rank's
shard as ``verify`` does, and adds ``rank_agreement``: the ranks run the same
descriptors with the same padding, their replicated outputs are equal, and a
rank stuck in a collective is named with the collective it waits in.
"""

from __future__ import annotations

import functools
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pytest_cudagraph
from examples.tensor_parallel import buggy, llama, tp
from pytest_cudagraph.checks import VerifyReport
from pytest_cudagraph.checks.floor import across_shapes, given
from pytest_cudagraph.observe import unit_roundoff

WORLD_SIZE = 2
CONFIG: dict[str, Any] = {"world_size": WORLD_SIZE, "capture_sizes": [1, 2, 4], "backend": "emulate"}
#: A bug whose ranks stop talking is reported at this timeout: keep it short.
HANG_TIMEOUT = 20.0

# (build, make_inputs, reference) of the correct modules.
MODELS = {
    "mlp": (tp.build_tp_mlp, tp.make_inputs, tp.reference_mlp),
    "attention": (tp.build_tp_attention, tp.make_inputs, tp.reference_attention),
    "mlp-all-gather": (tp.build_tp_mlp_all_gather, tp.make_inputs, tp.reference_mlp),
}

# (build, make_inputs, a pattern the rank_agreement message must match). The
# twin of each is TPMLP with tp.make_inputs (test_tp_mlp_with_the_fixture).
BUGS = {
    # Rank 1 runs one more row: on gloo the all-reduce of mismatched sizes
    # would end a rank's process; on NCCL it would hang or read garbage. Named
    # with both shapes before either rank enters it.
    "RankDependentPadding": (
        buggy.build_rank_dependent_padding,
        buggy.make_inputs_rank_dependent,
        r"collectives differ between ranks.*all_reduce of \(\d+, \d+\).*another shape or dtype on one rank",
    ),
    # Rank 1 leaves a collective out: named at the all_reduce it skipped.
    "SkippedCollective": (
        buggy.build_skipped_collective,
        tp.make_inputs,
        r"collectives differ between ranks.*all_reduce.*rank 1 ended a forward without issuing",
    ),
    # Each rank is right on its own; the replicated outputs differ, on rank 1.
    "RankBranch": (buggy.build_rank_branch, tp.make_inputs, r"rank 1\b"),
}


#: The Llama shape: (build, make_inputs) of its small shard, for the CPU suite.
LLAMA = (llama.build, llama.make_inputs)


@pytest.mark.parametrize("name", ["attention", "mlp-all-gather", "llama"])
def test_tp_module_passes_on_every_rank(name: str) -> None:
    build, make_inputs = LLAMA if name == "llama" else MODELS[name][:2]
    report = pytest_cudagraph.verify_distributed(build, make_inputs, **CONFIG)
    assert report.ok, report.format()
    assert report.descriptors
    assert "rank_agreement" in report.checks
    # Each rank's peak, the largest the report's.
    assert sorted(report.rank_peak_memory) == list(range(WORLD_SIZE))
    assert report.peak_memory == max(report.rank_peak_memory.values()) > 0


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4])
def test_tp_mlp_with_the_fixture(cudagraph_verify_distributed: Callable[..., VerifyReport]) -> None:
    """TPMLP, the twin of every bug below, through the fixture (capture sizes from the marker)."""
    report = cudagraph_verify_distributed(
        tp.build_tp_mlp, tp.make_inputs, world_size=WORLD_SIZE, backend="emulate"
    )
    assert report.ok and "rank_agreement" in report.checks


#: Under torchrun (``python -m torch.distributed.run --nproc-per-node=2 -m pytest examples/tensor_parallel``)
#: the verifications run on its ranks, these cases included: each collective is held to the other
#: ranks' before any rank enters it, so a mismatch is named and no rank's process ends.
@pytest.mark.parametrize("name", list(BUGS))
def test_bug_fails_rank_agreement(name: str) -> None:
    build, make_inputs, pattern = BUGS[name]
    report = pytest_cudagraph.verify_distributed(build, make_inputs, timeout=HANG_TIMEOUT, **CONFIG)
    assert not report.ok
    agreement = [f for f in report.failures if f.check == "rank_agreement"]
    assert agreement, report.format()
    assert any(re.search(pattern, f.message, re.S) for f in agreement), report.format()
    if name == "RankBranch":
        # Each rank's graphs match its own eager forward: only the ranks
        # against each other see it, and rank 1 is the one that differs.
        assert {f.check for f in report.failures} == {"rank_agreement"}, report.format()
        assert [f.rank for f in report.failures] == [1]


# ---------------------------------------------------------------------------
# The sharded modules compute what the unsharded ones do (no graphs involved).


def _rank_runs(rank: int, world_size: int, init_file: str, folder: str, body: Callable[..., Any]) -> None:
    """One gloo rank: ``body(rank, world_size)`` from seed 1, without grad, saved for the parent."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(1)
        with torch.no_grad():
            torch.save(body(rank, world_size), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _on_every_rank(body: Callable[..., Any]) -> list[Any]:
    """What ``body`` (a top-level function, so that it pickles) returns on each of the gloo ranks."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank_runs, args=(WORLD_SIZE, str(Path(folder) / "init"), folder, body), nprocs=WORLD_SIZE)
        return [torch.load(Path(folder) / f"rank{r}.pt") for r in range(WORLD_SIZE)]


def _shard_outputs(rank: int, world_size: int) -> dict[str, Any]:
    x = tp.make_inputs(7, 3)["x"]
    return {"x": x, "outputs": {name: build(rank, world_size)(x) for name, (build, _, _) in MODELS.items()}}


def test_sharded_equals_unsharded() -> None:
    """Every rank's sharded output (eager, after its collective) equals the unsharded module's."""
    ranks = _on_every_rank(_shard_outputs)
    for name, (_, _, reference) in MODELS.items():
        module: nn.Module = reference()
        with torch.no_grad():
            expected = module(ranks[0]["x"])
        for rank, seen in enumerate(ranks):
            try:
                torch.testing.assert_close(seen["outputs"][name], expected)
            except AssertionError as exc:
                raise AssertionError(
                    f"{name} on rank {rank} differs from the unsharded module: {exc}"
                ) from None


# ---------------------------------------------------------------------------
# On GPUs: NCCL, one GPU a rank, the collectives captured into CUDA graphs.


#: World sizes tried on GPUs: each skips where fewer GPUs are visible.
GPU_WORLD_SIZES = (2, 4)
#: On NCCL a rank starts CUDA and NCCL before its first collective: more room than gloo.
GPU_HANG_TIMEOUT = 30.0
# On NCCL a mismatched all-reduce may hang (named by the timeout) or complete
# on wrong bytes, after which the ranks' descriptors differ: either is caught.
# NCCL returns before its collective completes, so a hang is named by the
# rank's last collective and the note that the GPU waits in it.
GPU_PATTERNS = {
    **{name: pattern for name, (_, _, pattern) in BUGS.items()},
    "RankDependentPadding": r"all_reduce[^;]*waits on the GPU|pad to different sizes",
    "SkippedCollective": r"rank [01]\b[^;]*\ball_reduce[^;]*waits on the GPU",
}


def _needs_gpus(world_size: int) -> None:
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices, one a rank; {torch.cuda.device_count()} visible")


@pytest.mark.cuda
@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_tp_module_passes_on_gpus(name: str, world_size: int) -> None:
    _needs_gpus(world_size)
    build, make_inputs, _ = MODELS[name]
    report = pytest_cudagraph.verify_distributed(
        build, make_inputs, **{**CONFIG, "world_size": world_size, "backend": "cuda"}
    )
    assert report.ok, report.format()
    assert {o.rank for o in report.outcomes if o.check != "rank_agreement"} == set(range(world_size))
    agreement = [o for o in report.outcomes if o.check == "rank_agreement"]
    assert len(agreement) == 1 and agreement[0].passed and not agreement[0].skipped, report.format()


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(BUGS))
def test_bug_fails_rank_agreement_on_gpus(name: str) -> None:
    """The gallery on NCCL with the collectives inside CUDA graphs: each bug is still named by rank_agreement."""
    _needs_gpus(WORLD_SIZE)
    build, make_inputs, _ = BUGS[name]
    report = pytest_cudagraph.verify_distributed(
        build, make_inputs, timeout=GPU_HANG_TIMEOUT, **{**CONFIG, "backend": "cuda"}
    )
    assert not report.ok
    agreement = [f for f in report.failures if f.check == "rank_agreement"]
    assert agreement, report.format()
    assert any(re.search(GPU_PATTERNS[name], f.message, re.S) for f in agreement), report.format()
    if name == "RankBranch":
        assert {f.check for f in report.failures} == {"rank_agreement"}, report.format()
        assert [f.rank for f in report.failures] == [1]


# ---------------------------------------------------------------------------
# The sharded Llama shape against its unsharded reference, within the measured floor.


def _llama_logits(rank: int, world_size: int) -> dict[str, Any]:
    ids = llama.make_inputs(11, 4)["input_ids"]
    return {
        "ids": ids,
        "out": llama.build(rank, world_size)(ids),
        "wrong": llama.build(rank, world_size, bug="residual_before_sum")(ids),
    }


def test_sharded_llama_equals_unsharded_within_the_floor() -> None:
    """Each rank's logits against the unsharded reference's. The two sum in another order, so not
    bit for bit: the floor is the reference's own rounding, measured against the same model in
    float64, and the sharded logits may be a small multiple of it from the reference
    (checks/floor.py). A residual summed on every rank (counted twice) fails, and so does a 0.1 %
    scale of the logits, far inside fp32's tolerance of a logit's size."""
    ranks = _on_every_rank(_llama_logits)
    ids = ranks[0]["ids"]
    with torch.no_grad():
        expected = llama.TPLlama(llama.SMALL, None, WORLD_SIZE)(ids)
        exact = llama.TPLlama(llama.SMALL, None, WORLD_SIZE, torch.float64)(ids).float()

    def held(got: torch.Tensor) -> Any:
        return across_shapes(
            got, expected, given(exact), rtol=None, atol=None, roundoff=unit_roundoff(torch.float32)
        )

    assert not torch.equal(ranks[0]["out"], expected)  # another order of sums: the floor is needed
    for rank, seen in enumerate(ranks):
        verdict = held(seen["out"])
        assert verdict.passed, f"rank {rank}: {verdict.why}"
        assert torch.equal(seen["out"], ranks[0]["out"])  # replicated after the all-reduce
    assert not held(ranks[0]["out"] * 1.001).passed
    assert not held(ranks[0]["wrong"]).passed


def test_a_rank_branch_in_the_llama_shape_fails_rank_agreement() -> None:
    report = pytest_cudagraph.verify_distributed(
        functools.partial(llama.build, bug="rank_branch"), llama.make_inputs, **CONFIG
    )
    agreement = [f for f in report.failures if f.check == "rank_agreement"]
    assert agreement and agreement[0].rank == 1, report.format()
    assert {f.check for f in report.failures} == {"rank_agreement"}, report.format()
