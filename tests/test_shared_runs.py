"""Runs one check makes that another takes instead of making its own (issue #48), and what each
must still catch: ``determinism``'s two replays, under two seeds for a module that draws nothing,
answer ``rng``'s question there. CPU emulator, library API (``verify``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from examples.buggy.common import Base, token_inputs
from pytest_cudagraph import verify

SIZES = (1, 2, 4, 8)


def _verify(module: nn.Module, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return verify(
        module,
        token_inputs(),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend="emulate",
        progress=False,
        **kwargs,
    )


def _outcomes(report: Any, check: str) -> list[Any]:
    return [o for o in report.outcomes if o.check == check]


class Plain(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@torch.library.custom_op("cudagraph_tests::opaque_noise", mutates_args=())
def _opaque_noise(x: torch.Tensor) -> torch.Tensor:
    # A kernel that draws from torch's generator inside: the dispatcher sees this op whole, never
    # the draw, so the observer does not count the module as random.
    return x + torch.randn(x.shape, device=x.device, dtype=x.dtype)


class OpaqueNoise(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _opaque_noise(self.lin(x))


def test_rng_takes_determinisms_replays_for_a_module_that_draws_nothing() -> None:
    report = _verify(Plain())
    assert report.ok, report.format()
    rng = _outcomes(report, "rng")
    assert rng and all(o.passed and not o.skipped and o.figures.get("random") is False for o in rng)
    assert all(o.figures.get("replays") == "determinism's, under two seeds" for o in rng)
    assert report.costs["rng"].replays == 0
    assert report.costs["determinism"].replays == 2 * len(rng)  # two a descriptor, as before


def test_rng_replays_on_its_own_without_determinism() -> None:
    report = _verify(Plain(), checks=["rng"])
    rng = _outcomes(report, "rng")
    assert rng and all(o.passed and "replays" not in o.figures for o in rng), report.format()
    assert report.costs["rng"].replays == 2 * len(rng)


def test_a_graph_whose_result_follows_the_seed_unseen_is_left_to_rng_and_determinism_judges_one_seed() -> (
    None
):
    report = _verify(OpaqueNoise(), checks=["determinism", "rng"])
    determinism, rng = _outcomes(report, "determinism"), _outcomes(report, "rng")
    # Replays under one seed agree: determinism passes, judged as before.
    assert determinism and all(o.passed and not o.skipped for o in determinism), report.format()
    # Under two seeds they differ: rng does not take them as "draws nothing", and finds the draws.
    assert rng and all(o.passed and o.figures.get("random") is True for o in rng), report.format()
    assert all("replays" not in o.figures for o in rng)
    assert report.costs["determinism"].replays == 3 * len(determinism)  # the second again, one seed


# -- state: no run of its own where nothing can end otherwise -------------------------------------------
class CountsCalls(Base):
    """Writes a buffer in every forward: state compares run() with eager."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x)


def test_state_runs_nothing_where_no_forward_writes_state_and_eager_writes_no_input() -> None:
    report = _verify(Plain(), checks=["replay_matches_eager", "state"])
    state = _outcomes(report, "state")
    assert state and all(o.passed and o.figures.get("compared") for o in state), report.format()
    assert report.costs["state"].replays == 0 and report.costs["state"].forwards == 0
    # A module that writes state is compared as before: run() on every descriptor.
    report = _verify(CountsCalls(), checks=["replay_matches_eager", "state"])
    assert report.ok, report.format()
    state = _outcomes(report, "state")
    assert all("compared" not in o.figures for o in state)
    assert report.costs["state"].replays >= len(state)


def test_state_still_catches_state_and_inputs_after_replay_matches_eager() -> None:
    from tests.test_check_sensitivity import COLUMN, CountsIntoState, MutatesOneElement

    report = _verify(CountsIntoState(), checks=["replay_matches_eager", "state"])
    failed = [o for o in _outcomes(report, "state") if not o.passed]
    assert failed and "module state 'acc' ends differently" in failed[0].message, report.format()
    assert failed[0].finding is not None and failed[0].finding.index == (COLUMN,)
    report = _verify(MutatesOneElement(), checks=["replay_matches_eager", "state"])
    failed = [o for o in _outcomes(report, "state") if not o.passed]
    assert failed and "is mutated in place by eager but not by run()" in failed[0].message, report.format()


# -- padding_isolation: real_batches' run of the batch is its base -----------------------------------------
def test_padding_isolation_takes_real_batches_run_as_its_base_and_still_catches_a_leak() -> None:
    from examples.buggy.padding_leak import PoolsPaddedRows

    report = _verify(Plain())
    assert report.ok, report.format()
    padded = [o for o in _outcomes(report, "padding_isolation") if not o.skipped]
    assert padded and all(o.figures.get("base") == "real_batches' run" for o in padded)
    fills = {len(o.figures["fills"]) for o in padded}
    assert report.costs["padding_isolation"].replays == sum(len(o.figures["fills"]) - 1 for o in padded), (
        fills
    )
    # Deselecting real_batches, padding_isolation replays its base itself.
    alone = _verify(Plain(), checks=["padding_isolation"])
    assert all(
        o.figures.get("base") == "its own replay"
        for o in _outcomes(alone, "padding_isolation")
        if not o.skipped
    )
    leak = _verify(PoolsPaddedRows())
    assert any(o.check == "padding_isolation" for o in leak.failures), leak.format()
