"""verify_training names the cause as it is (issue #57): input keys held to forward before anything
runs, each op a capture cannot hold listed once, and the padding's hint given only where it fits
(a learning rate frozen at capture named instead)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from examples.training.gallery import Mlp, masked_loss, over_padded_count, token_inputs
from pytest_cudagraph import TrainingStep, verify_training
from pytest_cudagraph.checks.report import Finding, Outcome, VerifyReport
from pytest_cudagraph.errors import UsageError
from pytest_cudagraph.plan import BatchDescriptor, GraphMode

SIZES = {"capture_sizes": (2, 4), "max_num_reqs": 4}
SHAPE_HINT = "look for a loss or a statistic over every row"
NOT_THE_PADDING = "the replayed step differs from eager's at the padded shape itself too"


def _inputs(key: str) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Hidden states under ``key`` and a per-token loss weight (padded rows: 0)."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {key: torch.randn(num_tokens, 16), "weight": torch.ones(num_tokens)}

    return make_inputs


def _counted(calls: list[int]) -> Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor]:
    def loss_fn(out: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        return masked_loss(out, inputs)

    return loss_fn


def _adamw(
    lr: float | torch.Tensor = 1e-2, capturable: bool = True
) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, lr=lr, capturable=capturable)


def _verify(module: nn.Module, make_inputs: Any, loss_fn: Any = masked_loss, **keywords: Any) -> VerifyReport:
    torch.manual_seed(0)
    return verify_training(module, make_inputs, loss_fn, **{"optimizer": _adamw(), **SIZES, **keywords})


# -- input keys against forward (seen 6) ---------------------------------------------------------
def test_a_key_forward_does_not_name_is_one_line_before_anything_runs() -> None:
    calls: list[int] = []
    with pytest.raises(UsageError) as raised:
        _verify(nn.Linear(16, 16), _inputs("x"), _counted(calls))
    said = str(raised.value)
    assert "\n" not in said and not isinstance(raised.value.__cause__, TypeError)
    assert re.search(
        r"Linear\.forward needs argument\(s\) \['input'\], which no key of make_inputs gives "
        r"\(its keys: \['x', 'weight'\]; forward's arguments: input\)",
        said,
    )
    assert calls == []  # no step ran: the loss was never called


def test_keys_named_after_forward_pass_and_the_others_go_to_the_loss() -> None:
    # The twin: the same module, its input keyed 'input'; 'weight' is the loss's alone.
    report = _verify(nn.Linear(16, 16), _inputs("input"))
    assert report.ok, report.format()


def _step(call: Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]) -> Any:
    def step(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> TrainingStep:
        def run(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=False)
            loss = loss_fn(call(module, inputs), inputs)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return TrainingStep(run)

    return step


def test_a_step_that_calls_forward_with_a_keyword_it_does_not_take_is_named() -> None:
    with pytest.raises(UsageError) as raised:
        _verify(nn.Linear(16, 16), _inputs("x"), step=_step(lambda m, inputs: m(x=inputs["x"])))
    said = str(raised.value)
    assert "\n" not in said
    assert re.search(
        r"the training step calls Linear\.forward with keyword\(s\) \['x'\]: it takes no keyword 'x'; "
        r"its argument\(s\) 'input' are not given \(forward's arguments: input\)",
        said,
    )


def test_a_step_that_passes_forward_its_input_by_position_passes() -> None:
    report = _verify(nn.Linear(16, 16), _inputs("x"), step=_step(lambda m, inputs: m(inputs["x"])))
    assert report.ok, report.format()


FIXTURE = """
import torch

def _inputs(key):
    return lambda n, r: {key: torch.randn(n, 16), "weight": torch.ones(n)}

def _loss(out, inputs):
    return ((out ** 2).mean(-1) * inputs["weight"]).sum() / inputs["weight"].sum()

def test_keyed_x(cudagraph_verify_training):
    cudagraph_verify_training(torch.nn.Linear(16, 16), _inputs("x"), _loss, capture_sizes=[2])

def test_keyed_input(cudagraph_verify_training):
    cudagraph_verify_training(torch.nn.Linear(16, 16), _inputs("input"), _loss, capture_sizes=[2])
"""


def test_the_training_fixture_says_the_key_mismatch_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_keys=FIXTURE)
    result = pytester.runpytest("--cudagraph-backend=emulate", "-p", "no:randomly")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        ["cudagraph_verify_training: Linear.forward needs argument(s) [[]'input'[]], which no key*"]
    )
    assert "TypeError" not in result.stdout.str() and "pytest_cudagraph/" not in result.stdout.str()


# -- each op once (seen 7) ---------------------------------------------------------------------
def test_a_host_step_count_is_listed_once_and_told_as_the_optimizers() -> None:
    report = _verify(Mlp(), token_inputs(), optimizer=_adamw(capturable=False))
    captures = [o for o in report.failures if o.check == "training_capture"]
    assert len(captures) == 2  # at both sizes
    for outcome in captures:
        assert outcome.finding is not None and len(outcome.finding.ops) == 1
        assert re.search(
            r"1 op\(s\) of the training step cannot be captured in a graph; the first is \S+ \(host sync\), "
            r"inside AdamW\.step: with capturable=False it reads its step count on the host",
            outcome.message,
        )
    printed = report.format()
    assert printed.count(captures[0].finding.ops[0]) == 1  # type: ignore[union-attr]
    assert printed.count("the same message as training_capture FULL-T4-R4 above") == 1


def _report(*outcomes: Outcome) -> VerifyReport:
    report = VerifyReport("M", "emulate", "cpu", "FULL", True, ("capture_safety",))
    report.add(outcomes)
    return report


def _failed(tokens: int, message: str, ops: list[str]) -> Outcome:
    desc = BatchDescriptor(mode=GraphMode.FULL, num_tokens=tokens, num_reqs=tokens)
    return Outcome("capture_safety", desc, False, message, Finding(ops=ops))


def test_a_report_lists_an_op_list_several_failures_share_once() -> None:
    ops = ["Tensor.item() (host sync) at a.py:1", "Tensor.tolist() (host sync) at a.py:2"]
    printed = _report(
        _failed(4, "2 op(s); the first is Tensor.item()", ops),
        _failed(2, "2 op(s); the first is Tensor.item()", ops),
        _failed(1, "2 op(s); the first is Tensor.item()", ops[:1]),
    ).format()
    assert printed.count("- Tensor.tolist() (host sync) at a.py:2") == 1
    # Another list is listed, though its message was told before.
    assert printed.count("- Tensor.item() (host sync) at a.py:1") == 2


def test_a_report_points_to_an_op_list_printed_under_another_message() -> None:
    ops = ["Tensor.item() (host sync) at a.py:1", "Tensor.tolist() (host sync) at a.py:2"]
    printed = _report(
        _failed(4, "2 op(s) at 4 tokens; the first is Tensor.item()", ops),
        _failed(2, "2 op(s) at 2 tokens; the first is Tensor.item()", ops),
    ).format()
    assert printed.count("- Tensor.tolist() (host sync) at a.py:2") == 1
    assert "the same op(s) as capture_safety FULL-T4-R4 above" in printed


def test_a_report_lists_no_single_op_its_message_names() -> None:
    op = "Tensor.item() (host sync) at a.py:1"
    printed = _report(_failed(4, f"1 op(s); the first is {op}", [op])).format()
    assert printed.count(op) == 1


# -- the padding's hint where it fits; a learning rate frozen at capture named (seen 5) ------------
class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _scheduled(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> TrainingStep:
    """The whole step captured, a StepLR halving the learning rate between steps."""
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return TrainingStep(
        _step(lambda m, inputs: m(inputs["x"]))(module, optimizer, loss_fn).run, schedule.step
    )


def test_a_float_learning_rate_under_a_scheduler_is_named_and_not_taken_for_padding() -> None:
    report = _verify(Linear(), token_inputs(), step=_scheduled)
    failed = {o.check for o in report.failures}
    assert failed == {"training_replay_matches_eager", "training_real_batches"}, report.format()
    named = (
        r"the optimizer's 'lr' was 0\.005 at capture and is [\d.e-]+ now: a graph keeps what the step read at "
        r"capture, so every replay runs with 0\.005; give the optimizer a tensor learning rate on the device "
        r"\(lr=torch\.tensor\(0\.01, device='cpu'\), with capturable=True\)"
    )
    for outcome in report.failures:
        assert re.search(named, outcome.message), outcome.message
        if outcome.check == "training_real_batches":
            assert SHAPE_HINT not in outcome.message
            assert NOT_THE_PADDING in outcome.message


def test_a_tensor_learning_rate_under_a_scheduler_passes() -> None:
    report = _verify(Linear(), token_inputs(), step=_scheduled, optimizer=_adamw(torch.tensor(1e-2)))
    assert report.ok, report.format()


def test_a_loss_over_the_padded_count_keeps_the_padding_hint() -> None:
    report = _verify(Mlp(), token_inputs(), over_padded_count)
    real = [o for o in report.failures if o.check == "training_real_batches"]
    assert real, report.format()
    for outcome in real:
        assert SHAPE_HINT in outcome.message and NOT_THE_PADDING not in outcome.message
        assert "at capture" not in outcome.message


class Scaled(Linear):
    """Its output scaled by a Python float the loop between steps changes: frozen at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class BufferScaled(Linear):
    """The same scale in a buffer the loop fills in place: the graph reads it on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _decaying(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> TrainingStep:
    def between() -> None:
        if isinstance(module.scale, torch.Tensor):
            module.scale.mul_(0.5)
        else:
            module.scale *= 0.5

    return TrainingStep(_step(lambda m, inputs: m(inputs["x"]))(module, optimizer, loss_fn).run, between)


def test_a_module_value_the_loop_changes_is_named_with_its_value_at_capture() -> None:
    report = _verify(Scaled(), token_inputs(), step=_decaying)
    replays = [o for o in report.failures if o.check == "training_replay_matches_eager"]
    assert replays, report.format()
    assert re.search(
        r"the module's 'scale' was 0\.5 at capture and is [\d.e-]+ now: a graph keeps what the step read at "
        r"capture, so where the step reads it, every replay runs with 0\.5; keep the value in a buffer",
        replays[0].message,
    )


def test_a_module_value_kept_in_a_buffer_passes() -> None:
    report = _verify(BufferScaled(), token_inputs(), step=_decaying)
    assert report.ok, report.format()
