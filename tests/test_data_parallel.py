"""verify_data_parallel: a DDP training step on two gloo ranks (the emulator), its bugs and their twins.

The launcher's runs (torchrun, two nodes) of the same cases are in tests/test_launcher.py.
"""

from __future__ import annotations

import pytest
import torch

from pytest_cudagraph import verify_data_parallel
from pytest_cudagraph.distributed.data_parallel import SYNC_CHECK, _Copy, _Ledger
from pytest_cudagraph.distributed.merge import agreement
from pytest_cudagraph.distributed.rank import RankResult, Seen
from pytest_cudagraph.launch_env import from_environment
from pytest_cudagraph.plan import BatchDescriptor, GraphMode
from tests import data_parallel_models as m

LAUNCHED = from_environment()
#: Three warm-ups: the accumulating loops (two micro-steps a step) are captured at a synced micro-step.
KW = {"capture_sizes": [2], "steps": 3, "warmup_steps": 3, "pad_values": {"weight": 0}, "timeout": 90}


def _on_two_ranks(step):
    """The regressor's accumulating loop ``step`` on two spawned gloo ranks (two under torchrun)."""
    world_size = None if LAUNCHED is not None else 2
    return verify_data_parallel(
        m.build_regressor,
        m.make_inputs,
        m.masked_loss,
        optimizer=m.sgd,
        step=step,
        world_size=world_size,
        backend="emulate",
        **KW,
    )


def _failed(report) -> set[tuple[str, int | None]]:
    return {(o.check, o.rank) for o in report.failures}


def test_a_graph_captured_with_sync_on_and_replayed_under_no_sync_is_named_on_every_rank():
    report = _on_two_ranks(m.synced_capture_under_no_sync)
    assert {(SYNC_CHECK, 0), (SYNC_CHECK, 1)} <= _failed(report), report.format()
    # The graph against eager on each rank: its gradients were all-reduced where eager's were not.
    assert {("training_replay_matches_eager", 0), ("training_replay_matches_eager", 1)} <= _failed(report)
    message = next(o.message for o in report.failures if o.check == SYNC_CHECK)
    assert "captured with gradient sync on" in message and "under no_sync()" in message, message


def test_its_twin_all_reducing_outside_the_graph_passes():
    report = _on_two_ranks(m.no_sync_capture_synced_outside)
    assert report.ok, report.format()
    assert {o.rank for o in report.outcomes if o.check == SYNC_CHECK} == {0, 1}
    agree = next(o for o in report.outcomes if o.check == "rank_agreement")
    assert (
        agree.passed and agree.figures["batches"] >= KW["steps"]
    )  # at least the replays of replay_matches_eager


# -- the sync check and the ranks' agreement, on records as a rank makes them -----------------------
def _copy(*forwards: tuple[bool, bool]) -> _Copy:
    copy = _Copy(torch.nn.Linear(1, 1))
    copy.forwards.extend(forwards)
    return copy


SIZE = BatchDescriptor(mode=GraphMode.FULL, num_tokens=2, num_reqs=2)


@pytest.mark.parametrize(
    ("held", "eager", "words"),
    [
        (True, [True, True], None),
        (False, [False, False], None),
        (True, [True, False], "captured with gradient sync on, and eager ran its step 2 under no_sync()"),
        (
            False,
            [False, True],
            "captured under no_sync() (require_backward_grad_sync False), and eager ran its step 2",
        ),
    ],
)
def test_the_sync_the_graph_holds_is_held_to_each_eager_step(held, eager, words):
    ledger = _Ledger()
    warm = (not held, False)  # a warm-up forward that syncs otherwise: not a step after the capture
    ledger.copies = [_copy(warm, (held, True)), _copy(warm, *((s, False) for s in eager)), _copy()]
    (outcome,) = ledger.outcomes([SIZE], warmups=1)
    assert outcome.check == SYNC_CHECK and outcome.descriptor == SIZE
    if words is None:
        assert outcome.passed, outcome.message
    else:
        assert not outcome.passed and words in outcome.message, outcome.message


def test_ranks_whose_weights_differ_after_a_step_are_named_with_why():
    def seen(value: float) -> list[Seen]:
        at = "the graph's step 1 at FULL-T2-R2"
        return [
            Seen(2, 2, at, {"weights": {"w": torch.tensor([value])}}, at, "ranks step on the same gradients")
        ]

    same = agreement({0: RankResult(0, seen=seen(1.0)), 1: RankResult(1, seen=seen(1.0))}, replicated=True)
    assert same.passed
    apart = agreement({0: RankResult(0, seen=seen(1.0)), 1: RankResult(1, seen=seen(2.0))}, replicated=True)
    assert not apart.passed and apart.rank == 1
    assert "at the graph's step 1 at FULL-T2-R2: values that must be replicated differ" in apart.message
    assert "ranks step on the same gradients" in apart.message, apart.message
