"""Diagnoses that name the true cause (issue #26): Python state is not randomness, a module whose
eager forward cannot run is one error, every check starts from the state after make_inputs, and
the messages say what they mean. CPU emulator, library API (``verify``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from examples.buggy.common import D, token_inputs
from examples.buggy.python_state import PythonCounter
from pytest_cudagraph import verify
from pytest_cudagraph.errors import EagerFailure

SIZES = (1, 2, 4, 8)


def _verify(module: nn.Module, make_inputs: Any = None, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return verify(
        module,
        make_inputs or token_inputs(),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend="emulate",
        **kwargs,
    )


def _outcomes(report: Any, check: str) -> list[Any]:
    return [o for o in report.outcomes if o.check == check]


class StreamingPositions(nn.Module):
    """Keeps the stream's position in a Python int: each forward continues where the last one ended."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.offset = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[0], device=x.device) + self.offset
        self.offset += x.shape[0]
        return self.lin(x) + positions[:, None] * 0.01


@pytest.mark.parametrize("module_cls", [StreamingPositions, PythonCounter], ids=lambda c: c.__name__)
def test_python_state_is_named_as_such_never_as_randomness(module_cls: type[nn.Module]) -> None:
    report = _verify(module_cls())
    python = [o for o in report.failures if "Python state changes on every forward" in o.message]
    assert python, report.format()
    assert all(o.passed and not o.skipped for o in _outcomes(report, "rng")), report.format()
    assert all(o.message == "the module draws no random numbers" for o in _outcomes(report, "rng"))
    # real_batches runs on it (it used to be skipped as "the module draws random numbers")
    assert not any(o.skipped and "random" in o.message for o in _outcomes(report, "real_batches"))
    assert any(not o.skipped for o in _outcomes(report, "real_batches"))
    for o in _outcomes(report, "real_batches"):
        assert o.passed or "Forward changes Python state" in o.message, o.message


def test_a_module_that_draws_random_numbers_is_still_random() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + torch.randn_like(x)

    report = _verify(Noisy())
    assert report.ok, report.format()
    rng = _outcomes(report, "rng")
    assert rng and all(o.figures.get("random") is True for o in rng)
    assert all(o.skipped and "draws random numbers" in o.message for o in _outcomes(report, "real_batches"))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_make_inputs_drawing_random_numbers_does_not_make_the_module_random() -> None:
    report = _verify(Plain())  # token_inputs draws torch.randn on every call
    assert report.ok
    assert all(o.figures.get("random") is False for o in _outcomes(report, "rng"))


def test_a_module_whose_eager_forward_fails_everywhere_is_one_error_with_eagers_exception() -> None:
    class Refuses(nn.Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            raise TypeError("this forward refuses its inputs")

    def inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"input": torch.randn(num_tokens, D)}

    with pytest.raises(
        EagerFailure,
        match=r"Refuses's eager forward fails on make_inputs' batches at "
        r"\(num_tokens=1, num_reqs=1\), \(num_tokens=8, num_reqs=4\), before "
        r"anything is captured: TypeError: .*inputs",
    ) as info:
        _verify(Refuses(D, D), inputs)
    assert isinstance(info.value.__cause__, TypeError)


def test_a_module_that_fails_at_one_shape_only_is_that_descriptors_failure() -> None:
    class FailsAtFour(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 4:
                raise RuntimeError("four is not served")
            return super().forward(x)

    report = _verify(FailsAtFour(D, D))
    assert [(o.check, o.descriptor.num_tokens) for o in report.failures] == [("capture_safety", 4)]
    assert "four is not served" in report.failures[0].message
    assert report.failures[0].finding.ops == []  # eager's own failure: no op a graph cannot hold is named


class SyncedWeights(nn.Module):
    """A layer whose scale make_inputs updates between batches (an RL weight sync), and which its
    forward writes too: the state every check starts from is the one after make_inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(1.0)  # written by forward, so it is snapshot and restored
        return self.lin(x) * self.scale


def test_every_check_starts_from_the_state_after_make_inputs() -> None:
    module = SyncedWeights()

    def syncing(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        with torch.no_grad():
            module.scale.add_(0.5)  # the weight sync
        return {"x": torch.randn(num_tokens, D)}

    report = _verify(module, syncing)
    assert report.ok, report.format()


def test_messages_say_the_output_and_no_ulps_across_a_sign_change() -> None:
    class Flips(nn.Linear):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            type(self).calls += 1  # a class attribute: no Python state of the module
            return super().forward(x) * (-1.0 if type(self).calls % 2 else 1.0)

    report = _verify(Flips(D, D), checks=["replay_matches_eager"])
    (failure, *_) = report.failures
    described = failure.finding.describe()
    assert "the output at index [" in described and "<the output>" not in described
    assert not re.search(r"max ULP \d{6,}", described), described


def test_python_state_is_put_back_after_verification() -> None:
    module = PythonCounter()
    _verify(module)
    assert module.calls == 0  # every forward verification ran was undone, the Python counter too


class FullIndexCopy(nn.Module):
    """Fills ``torch.empty`` row by row through an in-place op that reads nothing it did not write."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        out.index_copy_(0, torch.arange(x.shape[0], device=x.device), self.lin(x))
        return out


def test_memory_an_in_place_op_writes_whole_is_no_finding_once_poison_shows_no_effect() -> None:
    report = _verify(FullIndexCopy())
    assert report.ok, report.format()


def test_every_failure_of_a_module_reading_unwritten_memory_names_it_first() -> None:
    from examples.buggy.uninitialized import SplitKIntoEmpty

    report = _verify(SplitKIntoEmpty())
    assert {o.check for o in report.failures} >= {"determinism", "replay_matches_eager"}
    assert all(
        o.message.startswith("forward reads memory nobody wrote: aten.add_.Tensor") for o in report.failures
    )


def test_rng_of_a_module_reading_unwritten_memory_is_skipped_every_time() -> None:
    # Whether eager repeats itself over memory nobody wrote is the allocator's chance: rng once
    # failed in 1 of 48 descriptors and skipped in the rest, which made CI's gallery output drift.
    from examples.buggy.uninitialized import SplitKIntoEmpty

    for _ in range(3):
        rngs = [o for o in _verify(SplitKIntoEmpty()).outcomes if o.check == "rng"]
        assert rngs and all(o.skipped and "memory nobody wrote" in o.message for o in rngs)


def test_state_after_a_padded_batch_names_a_count_of_the_pad_id() -> None:
    from examples.buggy.expert_load import HashRoutedLoad, MaskedHashRoutedLoad, id_inputs

    report = _verify(HashRoutedLoad(), id_inputs(), checks=["state"])
    assert report.failures and all(o.check == "state" for o in report.failures)
    assert all(
        o.message.startswith(
            "after a padded batch, module state 'load' differs from what eager leaves on its real rows"
        )
        for o in report.failures
    )
    assert all(o.finding is not None and o.finding.output == "load" for o in report.failures)
    assert _verify(MaskedHashRoutedLoad(), id_inputs(), checks=["state"]).ok


class FailsOnAHostValue(nn.Linear):
    """Reads a value back to the host, then fails on it at every shape: eager fails because of an op a
    graph cannot hold, as a CPU tensor used as a device op's operand fails eagerly on a GPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum().item() >= 0:  # .item(): a host sync
            raise ValueError("the host value says no")
        return super().forward(x)


def test_a_forward_that_fails_everywhere_at_an_op_a_graph_cannot_hold_is_capture_safetys_to_tell() -> None:
    report = _verify(FailsOnAHostValue(D, D))  # no EagerFailure: the failure has a capture bug's name
    told = [o for o in _outcomes(report, "capture_safety") if not o.passed]
    assert told and len(told) == len(_outcomes(report, "capture_safety"))
    for outcome in told:
        assert "the host value says no" in outcome.message
        assert len(outcome.finding.ops) == 1 and "item" in outcome.finding.ops[0]
        assert outcome.finding.ops[0] in outcome.message


def test_a_replay_reading_graph_memory_nobody_wrote_is_named_though_no_op_is_seen_reading_it(
    backend: str, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples.buggy.uninitialized import SplitKIntoEmpty, SplitKIntoWritten
    from pytest_cudagraph.observe import modes, observer

    # Blind to torch.empty, as to an extension's own buffer: neither seen read nor poisoned eagerly.
    monkeypatch.setattr(observer, "_ALLOCATES", frozenset())
    monkeypatch.setattr(modes, "_ALLOCATES", frozenset())
    monkeypatch.setattr(observer, "_OBSERVED", {})  # what the observer decided of each op, with it
    torch.manual_seed(0)
    report = verify(
        SplitKIntoEmpty().to(device),
        token_inputs(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        checks=["determinism"],
    )
    told = _outcomes(report, "determinism")
    assert told and not any(o.passed for o in told)
    for outcome in told:
        assert outcome.message.startswith(
            "a replay reads graph memory nobody wrote: with the graph's free memory poisoned one way"
        ), outcome.message
    torch.manual_seed(0)
    assert verify(
        SplitKIntoWritten().to(device),
        token_inputs(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        checks=["determinism"],
    ).ok


def test_a_replay_of_a_module_reading_unwritten_memory_is_shown_reading_it_too(
    backend: str, device: torch.device
) -> None:
    from examples.buggy.uninitialized import SplitKIntoEmpty

    torch.manual_seed(0)
    report = verify(
        SplitKIntoEmpty().to(device),
        token_inputs(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        checks=["determinism"],
    )
    for outcome in _outcomes(report, "determinism"):
        assert outcome.message.startswith(
            "forward reads memory nobody wrote: aten.add_.Tensor reads what "
            "aten.empty.memory_format handed back"
        ), outcome.message
        assert "; a replay reads it too: with the graph's free memory poisoned one way" in outcome.message


@torch.library.custom_op("cudagraph_tests::split_k_into_empty", mutates_args=())
def _split_k_into_empty(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # An extension's own buffer: the dispatcher sees this op whole, never the torch.empty inside it.
    half = x.shape[1] // 2
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    out += x[:, :half] @ w[:, :half].T
    out += x[:, half:] @ w[:, half:].T
    return out


class SplitKInsideAnOp(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _split_k_into_empty(x, self.weight) + self.bias


@pytest.mark.cuda
def test_a_cuda_replay_reading_an_extension_buffer_nobody_wrote_is_named() -> None:
    # The emulator replays the op's own allocation from the host heap, outside its pool: CUDA only.
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    report = verify(
        SplitKInsideAnOp(D, D).to(device),
        token_inputs(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend="cuda",
        checks=["determinism"],
    )
    told = _outcomes(report, "determinism")
    assert told and not any(o.passed for o in told)
    assert all(o.message.startswith("a replay reads graph memory nobody wrote") for o in told), told[
        0
    ].message
