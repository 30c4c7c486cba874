"""Each check is sharp enough: a bug that touches one column, one element, the
first padded row only, or a buffer rebound to an alias of itself is caught.

These modules are the smallest bugs the checks claim to find; each test also
runs a correct control, so a check that fails everything cannot pass here
either. CPU emulator, library API (``verify``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph import verify
from pytest_cudagraph.checks.report import Outcome

D = 8
SIZES = (1, 2, 4, 8)
COLUMN = 3


def token_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, D)}


def run(module: nn.Module, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return verify(module, token_inputs, capture_sizes=SIZES, max_num_reqs=4, backend="emulate", **kwargs)


def failed(report: Any, check: str) -> list[Outcome]:
    return [o for o in report.failures if o.check == check]


class Linear(nn.Module):
    lin: nn.Linear
    column: torch.Tensor  # one-hot: column 3

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("column", torch.nn.functional.one_hot(torch.tensor(COLUMN), D).float())

    def forward(self, x: torch.Tensor) -> Any:
        return self.lin(x)


# -- capture safety ----------------------------------------------------------------------------------------
class TwoHostSyncs(Linear):
    """Two ops a graph cannot hold, on two lines: both must be listed, at every descriptor."""

    def forward(self, x: torch.Tensor) -> Any:
        scale = self.lin.weight.abs().max().item()
        shift = int(x.abs().argmax())
        return self.lin(x) / scale + shift


def test_capture_safety_lists_every_op_at_every_descriptor_before_capture() -> None:
    report = run(TwoHostSyncs(), checks=["capture_safety"])
    outcomes = failed(report, "capture_safety")
    assert {o.descriptor.num_tokens for o in outcomes if o.descriptor is not None} == set(SIZES)
    for outcome in outcomes:
        assert outcome.message.startswith("2 op(s) cannot be captured in a graph"), outcome.message
        assert outcome.finding is not None and len(outcome.finding.ops) == 2
    assert run(Linear(), checks=["capture_safety"]).ok


# -- a bug in one column, one element -----------------------------------------------------------------
class CountsInOneColumn(Linear):
    """Python state frozen at capture, and only column 3 reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        return self.lin(x) + self.column * self.calls


class CountsInOneElement(CountsInOneColumn):
    """The same bug in one element ([0, 3]) of the second of two outputs."""

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        y = self.lin(x)
        bump = torch.zeros_like(y)
        bump[0].copy_(self.column * self.calls)
        return y, y + bump


@pytest.mark.parametrize("module_cls", [CountsInOneColumn, CountsInOneElement])
def test_a_bug_in_one_column_or_one_element_fails_replay_and_fresh_inputs(
    module_cls: type[nn.Module],
) -> None:
    report = run(module_cls(), checks=["replay_matches_eager", "fresh_inputs"])
    assert not report.ok
    for check in ("replay_matches_eager", "fresh_inputs"):
        outcomes = failed(report, check)
        assert outcomes, report.format(verbose=True)
        finding = outcomes[0].finding
        assert finding is not None
        assert finding.index == (0, COLUMN)
        if module_cls is CountsInOneElement:
            assert finding.output == "[1]"


def test_the_correct_module_passes_the_same_checks() -> None:
    report = run(Linear(), checks=["replay_matches_eager", "fresh_inputs", "real_batches", "determinism"])
    assert report.ok, report.format(verbose=True)
    assert {o.check for o in report.outcomes} >= {"replay_matches_eager", "fresh_inputs"}


class NoisyColumn(Linear):
    """State kept outside registered buffers, read by one column: replays differ."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.zeros(D)  # a plain attribute: the graph holds its capture-time tensor

    def forward(self, x: torch.Tensor) -> Any:
        self.hidden.add_(1)
        return self.lin(x) + self.column * self.hidden


def test_determinism_catches_a_difference_in_one_column() -> None:
    report = run(NoisyColumn(), checks=["determinism"])
    outcomes = failed(report, "determinism")
    assert outcomes, report.format(verbose=True)
    assert outcomes[0].finding is not None and outcomes[0].finding.index == (0, COLUMN)


class MutatesOneElement(Linear):
    """Writes into one element of its input: eager changes the caller's tensor, a graph does not."""

    def forward(self, x: torch.Tensor) -> Any:
        x[0].mul_(1 - self.column)  # x[0, 3] = 0
        return self.lin(x)


class ScalesOneColumnState(Linear):
    """Correct in-place buffer update in one column; a twin that must pass state."""

    acc: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> Any:
        self.acc.add_(self.column * x[0])
        return self.lin(x) + self.acc


def test_state_catches_an_input_mutated_in_one_element() -> None:
    report = run(MutatesOneElement(), checks=["state"])
    outcomes = failed(report, "state")
    assert outcomes, report.format(verbose=True)
    assert outcomes[0].finding is not None and outcomes[0].finding.index == (0, COLUMN)
    assert run(ScalesOneColumnState(), checks=["state"]).ok


class CountsIntoState(CountsInOneColumn):
    """Python state frozen at capture, written into one column of a buffer: the graph adds
    the capture-time count, eager the current one."""

    acc: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        self.acc.add_(self.column * self.calls)
        return self.lin(x)


def test_state_catches_a_buffer_that_ends_differently_in_one_element() -> None:
    report = run(CountsIntoState(), checks=["state"])
    outcomes = failed(report, "state")
    assert outcomes, report.format(verbose=True)
    assert "module state 'acc' ends differently" in outcomes[0].message
    assert outcomes[0].finding is not None and outcomes[0].finding.index == (COLUMN,)


# -- padding ------------------------------------------------------------------------------------------------
class ReadsNextRow(Linear):
    """Each row adds the next one: the last real row reads the first padded row, and no other."""

    def forward(self, x: torch.Tensor) -> Any:
        return self.lin(x + x.roll(-1, 0))


def test_padding_isolation_fills_the_first_padded_row() -> None:
    report = run(ReadsNextRow(), checks=["padding_isolation"])
    outcomes = failed(report, "padding_isolation")
    assert outcomes, report.format(verbose=True)
    finding = outcomes[0].finding
    assert finding is not None and finding.real_batch is not None
    # The leak shows in the last real row, which only the first padded row reaches.
    assert finding.index is not None and finding.index[0] == finding.real_batch["num_tokens"] - 1
    assert "padding leaks into real rows" in outcomes[0].message


def test_padding_isolation_passes_a_module_that_reads_its_own_row() -> None:
    report = run(Linear(), checks=["padding_isolation"])
    assert report.ok, report.format(verbose=True)
    assert any(o.check == "padding_isolation" and not o.skipped for o in report.outcomes)


class PoolsIntoState(Linear):
    """Real rows are right, but every row, padded ones included, is summed into a buffer."""

    total: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> Any:
        self.total.copy_(x.sum(0))
        return self.lin(x)


def test_padding_isolation_catches_padded_rows_written_into_state() -> None:
    report = run(PoolsIntoState(), checks=["padding_isolation"])
    outcomes = failed(report, "padding_isolation")
    assert outcomes, report.format(verbose=True)
    assert "module state 'total' changes" in outcomes[0].message
    # Named as scratch state, the same writes pass.
    assert run(PoolsIntoState(), checks=["padding_isolation"], scratch_state={"total": slice(None)}).ok


# -- output lifetime ---------------------------------------------------------------------------------------
class ReturnsItsBuffer(Linear):
    """Returns a view of a buffer it rewrites on every call: the caller's output changes later."""

    out: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("out", torch.zeros(64, D))

    def forward(self, x: torch.Tensor) -> Any:
        n = x.shape[0]
        self.out[:n].copy_(self.lin(x))
        return self.out[:n]


class ReturnsACopy(ReturnsItsBuffer):
    def forward(self, x: torch.Tensor) -> Any:
        return super().forward(x).clone()


class ReturnsItsWorkspace(Linear):
    """Returns a view of a workspace it rewrites on every call, kept in a plain attribute: no
    state snapshot puts it back, so only a later run shows the caller's output changing."""

    def __init__(self) -> None:
        super().__init__()
        self.workspace = torch.zeros(64, D)

    def forward(self, x: torch.Tensor) -> Any:
        n = x.shape[0]
        self.workspace[:n].copy_(self.lin(x))
        return self.workspace[:n]


@pytest.mark.parametrize("module_cls", [ReturnsItsBuffer, ReturnsItsWorkspace])
def test_output_lifetime_runs_later_batches(module_cls: type[nn.Module]) -> None:
    report = run(module_cls(), checks=["output_lifetime"])
    outcomes = failed(report, "output_lifetime")
    assert outcomes, report.format(verbose=True)
    assert "on the eager (NONE) path changed when later batches ran" in outcomes[0].message
    assert run(ReturnsACopy(), checks=["output_lifetime"]).ok


# -- address stability ---------------------------------------------------------------------------------------
class RebindsToAlias(Linear):
    """Updates its buffer in place, then rebinds the attribute to a view of it: a new tensor
    object at the very same address."""

    running: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> Any:
        self.running.mul_(0.5).add_(x[0])
        self.running = self.running.view(D)
        return self.lin(x) + self.running


class KeepsItsBuffer(RebindsToAlias):
    def forward(self, x: torch.Tensor) -> Any:
        self.running.mul_(0.5).add_(x[0])
        return self.lin(x) + self.running


def test_address_stability_checks_identity_not_only_the_address() -> None:
    module = RebindsToAlias()
    original = module.running
    report = run(module, checks=["address_stability"])
    assert module.running is not original
    assert module.running.data_ptr() == original.data_ptr()  # the same address: only identity tells
    outcomes = failed(report, "address_stability")
    assert outcomes, report.format(verbose=True)
    assert "module tensor 'running' moved: it was rebound to another tensor" in outcomes[0].message
    assert run(KeepsItsBuffer(), checks=["address_stability"]).ok


# -- state put back between comparisons -------------------------------------------------------------------------
class CountsInBuffer(Linear):
    """A graph-safe counter: a registered buffer updated in place. Passes only if every
    check puts the state back before comparing."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> Any:
        self.calls.add_(1)
        return self.lin(x) * self.calls


def test_a_counter_buffer_passes_every_check_and_is_put_back() -> None:
    module = CountsInBuffer()
    module.calls.fill_(5)
    report = run(module)
    assert report.ok, report.format(verbose=True)
    assert module.calls.item() == 5
