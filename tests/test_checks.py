"""Every check catches its buggy module and passes its correct twin (library API)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_cudagraph.checks import CHECKS, verify
from tests.bugs import PAIRS, Pair, token_inputs

SIZES = (1, 2, 4, 8)


def run(module_cls: type, backend: str, device: torch.device, inputs: Any = token_inputs, **kwargs):
    torch.manual_seed(0)
    module = module_cls().to(device)
    return verify(
        module, inputs(device), capture_sizes=SIZES, max_num_reqs=4, backend=backend, device=device, **kwargs
    )


def test_every_check_has_a_pair():
    assert {p.check for p in PAIRS} == set(CHECKS)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.buggy.__name__)
def test_buggy_module_fails_its_check(pair: Pair, backend, device):
    report = run(pair.buggy, backend, device, pair.make_inputs, **pair.kwargs)
    failed = [o for o in report.failures if o.check == pair.check]
    assert failed, f"{pair.check} did not catch {pair.buggy.__name__}:\n{report.format(verbose=True)}"
    assert any(__import__("re").search(pair.message, o.message) for o in failed), report.format()


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.correct.__name__)
def test_correct_twin_passes_every_check(pair: Pair, backend, device):
    report = run(pair.correct, backend, device, pair.make_inputs, **pair.kwargs)
    assert report.ok, report.format()
    assert {o.check for o in report.outcomes} == {*CHECKS, "dispatch"}


class _Stack(torch.nn.Module):
    """A correct layer, a layer with the identity-memo bug, and a correct head."""

    def __init__(self) -> None:
        super().__init__()
        from tests.bugs import IdentityMemo

        self.first = torch.nn.Linear(8, 8)
        self.second = IdentityMemo()
        self.third = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(self.first(x) + self.second(x))


def test_report_names_check_descriptor_batch_output_index_and_first_divergent_submodule(backend, device):
    report = run(_Stack, backend, device, checks=["fresh_inputs"])
    failure = report.failures[0]
    assert failure.check == "fresh_inputs"
    assert failure.descriptor is not None and failure.descriptor.num_tokens in SIZES
    assert failure.finding is not None
    # The stale feature first shows in the output of second's own Linear.
    assert failure.finding.submodule == "second.lin"
    assert failure.finding.index is not None and failure.finding.real_batch is not None
    text = report.format()
    assert "FAIL fresh_inputs" in text and failure.descriptor.label() in text
    assert "first divergent submodule: 'second.lin'" in text
    assert "graph gave" in text and "eager gave" in text


def test_python_state_message_names_the_attribute(backend, device):
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            from tests.bugs import PythonCounter

            self.inner = PythonCounter()

        def forward(self, x):
            return self.inner(x)

    report = run(Wrapper, backend, device, checks=["replay_matches_eager"])
    assert not report.ok
    assert "inner.calls" in report.failures[0].message


def test_quick_mode_verifies_smallest_and_largest_per_mode(backend, device):
    from tests.bugs import NoMemo

    full = run(NoMemo, backend, device, mode="FULL_AND_PIECEWISE", checks=["replay_matches_eager"])
    quick = run(
        NoMemo, backend, device, mode="FULL_AND_PIECEWISE", checks=["replay_matches_eager"], exhaustive=False
    )
    # Uniform decode stops at max_num_reqs * decode_query_len = 4 tokens.
    assert len(full.descriptors) == full.planned == 7
    assert sorted((d.mode.name, d.num_tokens) for d in quick.descriptors) == [
        ("FULL", 1),
        ("FULL", 4),
        ("PIECEWISE", 1),
        ("PIECEWISE", 8),
    ]


def test_bad_arguments_are_value_errors(device, backend):
    from tests.bugs import NoMemo

    with pytest.raises(ValueError, match="unknown check"):
        run(NoMemo, backend, device, checks=["replay"])
    with pytest.raises(ValueError, match="rtol must be a finite number"):
        run(NoMemo, backend, device, rtol=-1)
    with pytest.raises(ValueError, match="scratch_state names"):
        run(NoMemo, backend, device, scratch_state={"kv": 0})


def test_json_report_holds_every_descriptor_and_check(backend, device):
    import json

    from tests.bugs import NoMemo

    report = run(NoMemo, backend, device)
    data = json.loads(report.to_json())
    assert data["passed"] is True
    assert len(data["descriptors"]) == 4
    assert {o["check"] for o in data["outcomes"]} == {*CHECKS, "dispatch"}
    assert all("figures" in o for o in data["outcomes"])


def test_exhaustive_verification_property_tests_the_managers_dispatch(backend, device, monkeypatch):
    from pytest_cudagraph import GraphManager, GraphMode
    from tests.bugs import NoMemo

    report = run(
        NoMemo, backend, device, checks=["replay_matches_eager", "dispatch"], mode="FULL_AND_PIECEWISE"
    )
    (outcome,) = [o for o in report.outcomes if o.check == "dispatch"]
    assert outcome.passed and not outcome.skipped and outcome.figures["examples"] == 200

    quick = run(NoMemo, backend, device, checks=["replay_matches_eager", "dispatch"], exhaustive=False)
    (outcome,) = [o for o in quick.outcomes if o.check == "dispatch"]
    # Quick mode captures a subset: dispatch is not property-tested, and the report says so.
    assert outcome.skipped and "exhaustive=False" in outcome.message
    assert any(check == "dispatch" for check, _, _ in quick.skipped_reasons())

    honest = GraphManager.dispatch

    def drops_odd(self, **kw):  # a dispatcher that runs odd token counts eagerly
        answer = honest(self, **kw)
        if kw["num_tokens"] % 2 and answer.mode is not GraphMode.NONE:
            return type(answer)(mode=GraphMode.NONE, num_tokens=kw["num_tokens"], num_reqs=kw["num_reqs"])
        return answer

    monkeypatch.setattr(GraphManager, "dispatch", drops_odd)
    broken = run(
        NoMemo, backend, device, checks=["replay_matches_eager", "dispatch"], mode="FULL_AND_PIECEWISE"
    )
    assert not [
        o
        for o in run(NoMemo, backend, device, checks=["replay_matches_eager"]).outcomes
        if o.check == "dispatch"
    ]  # not selected, not run
    (outcome,) = [o for o in broken.outcomes if o.check == "dispatch"]
    assert not outcome.passed
    assert "dispatch property" in outcome.message and (
        "completeness" in outcome.message or "reachability" in outcome.message
    )


def test_rng_catches_a_graph_that_never_advances_the_generator(monkeypatch):
    from pytest_cudagraph.backends.emulate import EmulatedGraph
    from tests.bugs import DrawsNoise

    honest = EmulatedGraph.replay

    def frozen(self):  # reads the seed but puts the generator back: every replay draws the same
        with torch.random.fork_rng(devices=[]):
            honest(self)

    monkeypatch.setattr(EmulatedGraph, "replay", frozen)
    report = run(DrawsNoise, "emulate", torch.device("cpu"), checks=["rng"])
    assert any(
        o.check == "rng" and "two successive replays drew the same random values" in o.message
        for o in report.failures
    ), report.format()


def test_verify_puts_module_state_and_the_generator_back(backend, device):
    from tests.bugs import RegisteredState

    torch.manual_seed(123)
    module = RegisteredState().to(device)
    before = module.acc.clone()
    rng_before = torch.random.get_rng_state()
    report = verify(
        module, token_inputs(device), capture_sizes=SIZES, max_num_reqs=4, backend=backend, device=device
    )
    assert report.ok
    assert torch.equal(module.acc, before)  # the counter buffer ran hundreds of times, then was put back
    assert torch.equal(torch.random.get_rng_state(), rng_before)
