"""Runs one check makes that another takes instead of making its own (issue #48), and what each
must still catch: ``determinism``'s two replays, under two seeds for a module that draws nothing,
answer ``rng``'s question there; ``fresh_inputs``' replay, the graphs' free memory poisoned the
first way before it, is ``determinism``'s first. CPU emulator, library API (``verify``).
"""

from __future__ import annotations

from typing import Any

import pytest
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
    # two a descriptor, the first fresh_inputs' (below)
    assert report.costs["determinism"].replays == len(rng)


def test_determinism_takes_fresh_inputs_replay_made_with_the_first_poison(monkeypatch: Any) -> None:
    from pytest_cudagraph.manager.graph_manager import GraphManager

    events: list[tuple[str, Any]] = []
    poison, replay = GraphManager.poison_free, GraphManager.replay

    def poison_free(self: GraphManager, which: int) -> bool:
        events.append(("poison", which))
        return poison(self, which)

    def replayed(self: GraphManager, desc: Any) -> Any:
        out = replay(self, desc)
        events.append(("replay", desc))
        return out

    monkeypatch.setattr(GraphManager, "poison_free", poison_free)
    monkeypatch.setattr(GraphManager, "replay", replayed)
    report = _verify(Plain(), checks=["fresh_inputs", "determinism"])
    assert report.ok, report.format()
    determinism = _outcomes(report, "determinism")
    assert determinism and report.costs["determinism"].replays == len(determinism)
    # Per descriptor: fresh_inputs' replay right after the first poison, then determinism's one
    # replay right after the second: the two replays it compares, one poison each.
    assert [e for e in events if e[0] == "poison"] == [("poison", 0), ("poison", 1)] * len(determinism)
    for i, event in enumerate(events):
        if event[0] == "poison":
            assert events[i + 1][0] == "replay"
    # Alone, determinism makes both its replays (both poisons) itself.
    events.clear()
    report = _verify(Plain(), checks=["determinism"])
    assert report.costs["determinism"].replays == 2 * len(_outcomes(report, "determinism"))


def test_determinism_still_names_a_read_of_graph_memory_nobody_wrote_after_fresh_inputs(
    monkeypatch: Any,
) -> None:
    from examples.buggy.uninitialized import SplitKIntoEmpty, SplitKIntoWritten
    from pytest_cudagraph.observe import modes, observer

    # Blind to torch.empty, as to an extension's own buffer (tests/test_diagnoses.py).
    monkeypatch.setattr(observer, "_ALLOCATES", frozenset())
    monkeypatch.setattr(modes, "_ALLOCATES", frozenset())
    monkeypatch.setattr(observer, "_OBSERVED", {})
    report = _verify(SplitKIntoEmpty(), checks=["fresh_inputs", "determinism"])
    told = _outcomes(report, "determinism")
    assert told and not any(o.passed for o in told), report.format()
    assert all(o.message.startswith("a replay reads graph memory nobody wrote") for o in told)
    report = _verify(SplitKIntoWritten(), checks=["fresh_inputs", "determinism"])
    assert report.ok, report.format()
    assert report.costs["determinism"].replays == len(_outcomes(report, "determinism"))


def test_rng_replays_on_its_own_without_determinism() -> None:
    report = _verify(Plain(), checks=["rng"])
    rng = _outcomes(report, "rng")
    assert rng and all(o.passed and "replays" not in o.figures for o in rng), report.format()
    assert report.costs["rng"].replays == 2 * len(rng)


@pytest.mark.parametrize("after_fresh", [False, True], ids=["alone", "after-fresh_inputs"])
def test_a_graph_whose_result_follows_the_seed_unseen_is_left_to_rng_and_determinism_judges_one_seed(
    after_fresh: bool,
) -> None:
    checks = ["fresh_inputs", "determinism", "rng"] if after_fresh else ["determinism", "rng"]
    report = _verify(OpaqueNoise(), checks=checks)
    determinism, rng = _outcomes(report, "determinism"), _outcomes(report, "rng")
    # Replays under one seed agree: determinism passes, judged as before.
    assert determinism and all(o.passed and not o.skipped for o in determinism), report.format()
    # Under two seeds they differ: rng does not take them as "draws nothing", and finds the draws.
    assert rng and all(o.passed and o.figures.get("random") is True for o in rng), report.format()
    assert all("replays" not in o.figures for o in rng)
    # The second again, under one seed; after fresh_inputs, first the replay whose print differed
    # from fresh_inputs' (under the next seed), then all three of its own.
    assert report.costs["determinism"].replays == (4 if after_fresh else 3) * len(determinism)


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


# -- replay_matches_eager: the capture's warm-up as its eager run ----------------------------------------
class BranchesOnCapturing(Base):
    """Takes another branch while a graph is captured (as transformers builds its attention mask
    another way): a warm-up off the capture's path would not be the graph's program."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        try:  # as transformers asks: a CPU-only build raises outside a capture
            capturing = bool(torch.cuda.is_current_stream_capturing())
        except Exception:
            capturing = False
        return y * 2 if capturing else y


@pytest.mark.parametrize("module", [Plain, BranchesOnCapturing], ids=["plain", "branches-on-capturing"])
def test_replay_matches_eager_takes_the_capture_warm_up_as_its_eager_run(module: type[nn.Module]) -> None:
    # A module that branches on capturing passes too: the warm-up runs on the path a capture takes.
    report = _verify(module(), checks=["replay_matches_eager"])
    told = _outcomes(report, "replay_matches_eager")
    assert told and all(o.passed for o in told), report.format()
    assert all(o.figures.get("eager") == "the capture's warm-up, by its print" for o in told)
    assert report.costs["replay_matches_eager"].forwards == 0
    assert report.costs["replay_matches_eager"].replays == len(told)


def test_a_replay_unlike_the_warm_up_is_compared_with_eager_and_told(monkeypatch: Any) -> None:
    from pytest_cudagraph.manager.graph_manager import GraphManager

    replay = GraphManager.replay

    def off_by_one_place(self: GraphManager, desc: Any) -> Any:
        # A graph that gets one element wrong by one unit in the last place.
        out = replay(self, desc)
        out.view(-1)[3] = torch.nextafter(out.view(-1)[3], torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(GraphManager, "replay", off_by_one_place)
    report = _verify(Plain(), checks=["replay_matches_eager"])
    told = _outcomes(report, "replay_matches_eager")
    assert told and not any(o.passed for o in told), report.format()
    assert all(
        o.message.startswith("replay differs from eager on the inputs the graph was captured with")
        for o in told
    )
    assert all(o.finding is not None and o.finding.index == (0, 3) for o in told), told[0].finding


def test_a_warm_up_that_writes_its_input_is_not_taken_for_eager() -> None:
    from tests.test_check_sensitivity import MutatesOneElement

    report = _verify(MutatesOneElement(), checks=["replay_matches_eager"])
    told = _outcomes(report, "replay_matches_eager")
    assert told and all("eager" not in o.figures for o in told), report.format()
