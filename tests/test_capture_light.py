"""The checked capture (``verify()``'s) on CUDA holds its sequence's first graph to the guard's rules
op by op; each later capture goes through the guard without them (every op observed, what it reads
kept alive), an op the device refuses failing that capture, then named (issue #48: the rules on
every op of every capture cost more than the captures). What that still catches and names is held
here on a GPU; on the emulator every capture is still held to the rules op by op.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph import verify
from pytest_cudagraph.checks.engine import LIGHT_CAPTURE
from pytest_cudagraph.manager import GraphManager

D = 16
SIZES = [1, 2, 4, 8, 16]
#: A later capture of the sequence (captured largest first): neither the first nor the smallest.
MIDDLE = 8


def rows(device: torch.device | str) -> Any:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, D, device=device)}

    return make_inputs


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class NonzeroAtOneSize(Plain):
    """A data-dependent shape (a host sync) at one later size only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if x.shape[0] == MIDDLE:
            y = y + torch.nonzero(y > 0).shape[0]
        return y


@torch.library.custom_op("cudagraph_tests::syncs_inside", mutates_args=())
def _syncs_inside(x: torch.Tensor) -> torch.Tensor:
    # An extension that waits for the device inside its own code: the dispatcher sees one op, no
    # rule and no learned verdict knows it, and only a capture refuses it.
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return x.clone()


@_syncs_inside.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class SyncsInAnOp(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _syncs_inside(super().forward(x))


class DropoutAtOneSize(Plain):
    """Draws random numbers at one later size only (torch's generator, which a graph advances)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return nn.functional.dropout(y, 0.5, training=True) if x.shape[0] == MIDDLE else y


def _outcomes(report: Any, check: str) -> dict[int, Any]:
    return {o.descriptor.num_tokens: o for o in report.outcomes if o.check == check and o.descriptor}


def test_every_capture_of_the_emulator_goes_through_the_guard_op_by_op() -> None:
    torch.manual_seed(0)
    manager = GraphManager(
        Plain(), rows("cpu"), {"capture_sizes": SIZES, "max_num_reqs": max(SIZES)}, backend="emulate"
    )
    manager.capture()
    assert manager.guarded_every_op == frozenset(manager.captured_descriptors)
    report = verify(Plain(), rows("cpu"), capture_sizes=SIZES, backend="emulate", checks=["capture_safety"])
    assert report.ok
    assert {o.figures["guarded"] for o in _outcomes(report, "capture_safety").values()} == {
        "every op of its capture"
    }


@pytest.mark.cuda
def test_the_checked_cuda_sequence_holds_its_first_capture_to_the_rules_and_observes_every_one() -> None:
    torch.manual_seed(0)
    module = Plain().cuda()
    manager = GraphManager(
        module,
        rows("cuda"),
        {"capture_sizes": SIZES, "max_num_reqs": max(SIZES)},
        backend="cuda",
        checked_capture=True,
    )
    manager.capture()
    first = manager.captured_descriptors[0]
    assert first.num_tokens == max(SIZES)
    assert manager.guarded_every_op == frozenset({first})
    report = verify(module, rows("cuda"), capture_sizes=SIZES, backend="cuda")
    assert report.ok, report.format()
    guarded = {n: o.figures["guarded"] for n, o in _outcomes(report, "capture_safety").items()}
    assert guarded.pop(max(SIZES)) == "every op of its capture"
    assert set(guarded.values()) == {LIGHT_CAPTURE}


@pytest.mark.cuda
def test_a_data_dependent_op_in_a_later_capture_is_named_there_and_the_others_pass() -> None:
    torch.manual_seed(0)
    report = verify(NonzeroAtOneSize().cuda(), rows("cuda"), capture_sizes=SIZES, backend="cuda")
    safety = _outcomes(report, "capture_safety")
    assert not safety[MIDDLE].passed
    assert "aten.nonzero" in safety[MIDDLE].message, safety[MIDDLE].message
    assert all(o.passed for n, o in safety.items() if n != MIDDLE)


@pytest.mark.cuda
def test_an_op_only_the_device_refuses_is_named_in_every_capture_by_its_failure() -> None:
    torch.manual_seed(0)
    report = verify(SyncsInAnOp().cuda(), rows("cuda"), capture_sizes=SIZES, backend="cuda")
    safety = _outcomes(report, "capture_safety")
    assert set(safety) == set(SIZES)
    for n, outcome in safety.items():
        assert not outcome.passed, n
        assert "cudagraph_tests.syncs_inside" in outcome.message or "cudagraph_tests::syncs_inside" in (
            outcome.message
        ), (n, outcome.message)
        assert "a CUDA graph capture refuses it" in outcome.message, (n, outcome.message)


@pytest.mark.cuda
def test_what_a_later_capture_draws_is_seen_by_the_observer() -> None:
    torch.manual_seed(0)
    module = DropoutAtOneSize().cuda()
    manager = GraphManager(
        module,
        rows("cuda"),
        {"capture_sizes": SIZES, "max_num_reqs": max(SIZES)},
        backend="cuda",
        checked_capture=True,
    )
    assert not manager.observer.random_ops
    manager.capture()
    assert manager.observer.random_ops, "the capture at the size that draws was not observed"
    # Held as random, the module passes: nothing compares its draws across shapes.
    report = verify(module, rows("cuda"), capture_sizes=SIZES, backend="cuda")
    assert report.ok, report.format()
    assert _outcomes(report, "rng")[MIDDLE].figures.get("random") is True
