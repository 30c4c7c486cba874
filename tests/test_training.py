"""verify_training: its keywords, what it leaves alone, and what each of its checks holds."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from examples.training.gallery import Mlp, adamw, masked_loss, token_inputs
from pytest_cudagraph import TRAINING_CHECKS, verify_training
from pytest_cudagraph.errors import EagerFailure

SIZES = {"capture_sizes": (2, 4), "max_num_reqs": 4}


def _run(module: torch.nn.Module | None = None, **keywords: Any) -> Any:
    torch.manual_seed(0)
    return verify_training(
        module if module is not None else Mlp(),
        token_inputs(),
        keywords.pop("loss_fn", masked_loss),
        **{"optimizer": adamw(True), **SIZES, **keywords},
    )


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"steps": 0}, "steps must be an integer >= 1; got 0"),
        ({"capture_sizes": []}, "capture_sizes must be a non-empty list of integers >= 1"),
        ({"capture_sizes": [2, -1]}, "capture_sizes must be a non-empty list of integers >= 1"),
        ({"warmup_steps": 0}, "warmup_steps must be an integer >= 1; got 0"),
        ({"step": "mine"}, "step must be a callable step(module, optimizer, loss_fn) -> TrainingStep"),
        ({"optimizer": "adam"}, "optimizer must build a torch.optim.Optimizer from the parameters"),
        ({"max_num_reqs": 0}, "max_num_reqs must be an integer >= 1"),
    ],
)
def test_bad_keywords_say_what_was_expected(keywords: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _run(**keywords)


def test_a_loss_that_is_not_a_scalar_is_told() -> None:
    with pytest.raises(
        ValueError, match="loss_fn must return the scalar loss as a 0-dim tensor; got Tensor of shape"
    ):
        _run(loss_fn=lambda out, inputs: out.sum(-1))


def test_a_step_that_fails_eagerly_is_one_error_with_its_cause() -> None:
    def broken(out: torch.Tensor, inputs: Any) -> torch.Tensor:
        raise KeyError("labels")

    with pytest.raises(
        EagerFailure, match="the training step fails eagerly at 4 tokens and 4 requests"
    ) as info:
        _run(loss_fn=broken)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_module_raising_value_error_eagerly_is_one_error_with_its_cause() -> None:
    # A ValueError of the module's own (BatchNorm over one row, say) is told as the eager step's
    # failure at that size, not passed on bare as if it were a bad keyword.
    class Refuses(Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("Expected more than 1 value per channel")

    with pytest.raises(EagerFailure, match="the training step fails eagerly at 4 tokens") as info:
        _run(Refuses())
    assert isinstance(info.value.__cause__, ValueError)


def test_the_callers_module_is_never_trained() -> None:
    module = Mlp()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    report = _run(module)
    assert report.ok, report.format()
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())


def test_every_check_runs_and_the_report_says_what_it_did() -> None:
    report = _run(steps=2)
    assert report.ok, report.format()
    assert report.checks == TRAINING_CHECKS
    ran = {o.check for o in report.outcomes if not o.skipped}
    assert ran == set(TRAINING_CHECKS)
    assert [d.num_tokens for d in report.descriptors] == [4, 2]
    assert report.real_batches == 4 and report.kind == "training" and report.training == "train"
    assert report.graph_memory and report.capture_seconds > 0


def test_without_an_optimizer_forward_and_backward_are_held_to_eager() -> None:
    report = _run(optimizer=None)
    assert report.ok, report.format()
    skipped = [o for o in report.outcomes if o.check == "optimizer_capturable"]
    assert skipped and skipped[0].skipped and "make_graphed_callables" in skipped[0].message


def _weighted_inputs(**extra: Any) -> Any:
    """Hidden states and a per-token weight in [0, 1) that forward receives too (padded rows: 0)."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        made = {"x": torch.randn(num_tokens, 16), "weight": torch.rand(num_tokens)}
        made.update({name: fill(num_tokens) for name, fill in extra.items()})
        return made

    return make_inputs


class Received(Mlp):
    """forward receives the loss's weight, as a model takes its attention mask."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.parametrize(
    "optimizer",
    [lambda p: torch.optim.SGD(p, lr=0.1), adamw(True), None],
    ids=["SGD", "AdamW(capturable=True)", "no optimizer"],
)
def test_a_weight_forward_receives_keeps_its_pad_value_and_is_said(optimizer: Any) -> None:
    # The weight's padded rows hold 0 because they mark padding: set to anything else, the rows
    # count, by design. It is taken as a marker because the padded rows of x, which change nothing
    # at its pad value, change the step once it lets them in.
    torch.manual_seed(0)
    report = verify_training(Received(), _weighted_inputs(), masked_loss, optimizer=optimizer, **SIZES)
    assert report.ok, report.format()
    held = [o for o in report.outcomes if o.check == "training_padding"]
    assert held and all(o.passed and not o.skipped for o in held)
    assert any("'weight' taken as marking rows: padded rows of 'x'" in n for n in report.notes), report.notes


class NormedReceived(Received):
    """Normalised over the batch in train mode: x's padded rows reach the step past the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x), weight)


def test_data_past_a_marker_is_named_without_advice_the_step_follows() -> None:
    torch.manual_seed(0)
    report = verify_training(NormedReceived(), _weighted_inputs(), masked_loss, optimizer=None, **SIZES)
    failed = [o for o in report.failures if o.check == "training_padding"]
    assert failed, report.format()
    message = failed[0].message
    # x's padded rows reach the step at every value of the weight: whether the weight marks rows
    # cannot be seen, and the advice to mask the loss by one is said as a condition only.
    assert "padded rows of 'x' at 10000.0" in message and "(so do those of" not in message
    assert "if 'weight' masks the loss's rows (0 on padded rows), these reach the step past it" in message
    assert "statistic over the batch (BatchNorm in train mode: 'norm')" in message


class ReadsExtra(Received):
    """Its output takes a non-negative input y on every row: y's padded rows reach the loss."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x, weight) + y[:, None]


class ReadsExtraOnly(Mlp):
    """The same, with the weight the loss's alone (forward does not receive it)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + y[:, None]


def _over_y_too(out: torch.Tensor, inputs: Any) -> torch.Tensor:
    return masked_loss(out, inputs) + inputs["y"].sum()


@pytest.mark.parametrize("module", [ReadsExtra, ReadsExtraOnly], ids=["weight received", "weight the loss's"])
def test_an_input_that_only_looks_like_a_marker_is_caught_and_told_how_to_declare_one(module: Any) -> None:
    # y is never negative and its padded rows hold 0, as a weight's do, and setting them changes the
    # step; but y marks nothing: x's padded rows count once the weight lets them in whether y's are
    # set or not, and never where y's alone are set. Whether it is data or a marker, the tool cannot
    # know for sure: it names y and says how to declare a marker.
    torch.manual_seed(0)
    report = verify_training(module(), _weighted_inputs(y=torch.rand), _over_y_too, optimizer=None, **SIZES)
    failed = [o for o in report.failures if o.check == "training_padding"]
    assert failed, report.format()
    message = failed[0].message
    assert "padded rows of 'y' at 10000.0" in message
    assert "if it marks rows, declare its pad value (pad_values={'y': 0})" in message
    # Declared, y keeps its pad value, and the weight is still taken as a marker.
    torch.manual_seed(0)
    declared = verify_training(
        module(),
        _weighted_inputs(y=torch.rand),
        _over_y_too,
        optimizer=None,
        pad_values={"y": 0},
        **SIZES,
    )
    assert not [o for o in declared.failures if o.check == "training_padding"], declared.format()


class GradsOnly(torch.nn.Module):
    """A module whose gradient in the graph is not eager's: its backward reads a Python float the
    capture froze (a scale set from outside between steps), while its loss stays the same."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale += 1.0
        y = self.lin(x)
        # The value is y's; only the gradient is scaled by the Python float.
        return y.detach() + (y - y.detach()) * self.scale


def test_a_gradient_that_differs_is_named_though_the_loss_agrees() -> None:
    report = _run(GradsOnly(), optimizer=None)
    failed = [o for o in report.failures if o.check == "training_replay_matches_eager"]
    assert failed, report.format()
    assert "grad of lin." in failed[0].message and "differs from eager" in failed[0].message
    assert "'scale'" in failed[0].message  # the Python value behind it, named


def test_bf16_autocast_trains_as_a_graph() -> None:
    report = _run(autocast=torch.bfloat16)
    assert report.ok, report.format()
    held = [o for o in report.outcomes if o.check == "training_replay_matches_eager"]
    assert held and all(o.passed and not o.skipped for o in held)


def test_autocast_must_be_a_floating_dtype() -> None:
    with pytest.raises(
        ValueError, match=r"autocast must be None or a floating dtype such as torch\.bfloat16"
    ):
        _run(autocast="bf16")


def test_bit_for_bit_where_eager_reproduces_itself_and_the_measured_floor_where_not() -> None:
    from pytest_cudagraph.training.verify import FLOOR_FACTOR, _held

    w = torch.linspace(-1, 1, 64)
    bump = torch.zeros(64)
    bump[5] = 1e-6
    # Eager reproduced itself: one ulp-sized difference is a difference.
    assert _held({"p": w + bump}, {"p": w}, {"p": w.clone()}) is not None
    assert _held({"p": w.clone()}, {"p": w}, {"p": w.clone()}) is None
    # Eager differs from itself by 1e-6 at one element: the graph may differ by up to FLOOR_FACTOR times that.
    again = {"p": w + bump, "q": w.clone()}
    assert _held({"p": w + (FLOOR_FACTOR - 0.5) * bump, "q": w.clone()}, {"p": w, "q": w}, again) is None
    found = _held({"p": w + (FLOOR_FACTOR + 2) * bump, "q": w.clone()}, {"p": w, "q": w}, again)
    assert found is not None and "eager differs from itself here by up to 1.0" in found[0]
    # A tensor that did not drift, in a step that did elsewhere: the dtype's tolerance, and no more.
    assert _held({"p": w, "q": w + 1e-9}, {"p": w, "q": w}, again) is None
    found = _held({"p": w, "q": w + 0.5}, {"p": w, "q": w}, again)
    assert found is not None and found[0].startswith("q:") and "dtype's tolerance" in found[0]


def test_a_step_the_caller_writes_is_captured_and_its_between_runs_after_every_step() -> None:
    from examples.training.gallery import optimizer_outside

    report = _run(step=optimizer_outside(False))
    assert report.ok, report.format()
    assert report.config["step"] == "step"
    held = [o for o in report.outcomes if o.check == "training_replay_matches_eager"]
    assert held and all(o.passed and not o.skipped for o in held)


def test_a_step_must_return_a_training_step_or_a_callable() -> None:
    with pytest.raises(ValueError, match=r"must return a TrainingStep or a callable run\(inputs\) -> loss"):
        _run(step=lambda module, optimizer, loss_fn: 3)


def test_autocast_is_the_default_steps_only() -> None:
    from examples.training.gallery import optimizer_outside

    with pytest.raises(ValueError, match="autocast applies to the default step only"):
        _run(step=optimizer_outside(False), autocast=torch.bfloat16)


def test_real_batches_skip_a_step_that_draws_random_numbers_and_say_so() -> None:
    from examples.training.gallery import DeviceSeededDropout

    report = _run(DeviceSeededDropout())
    assert report.ok, report.format()
    real = [o for o in report.outcomes if o.check == "training_real_batches"]
    assert real and all(o.skipped and "draws random numbers" in o.message for o in real)


def test_real_batches_are_held_to_the_floor_not_bit_for_bit() -> None:
    # The padded step and the unpadded one are other programs: a masked loss passes though they
    # differ in the last bits, and the floor is measured only where the tolerance does not settle it.
    report = _run(steps=1)
    real = [o for o in report.outcomes if o.check == "training_real_batches"]
    assert real and all(o.passed and not o.skipped for o in real), report.format()


@pytest.mark.parametrize("adapter", ["graphed_training", "compiled_training"])
def test_runner_steps_without_cuda_say_what_they_need(adapter: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    from pytest_cudagraph.training import adapters

    with pytest.raises(RuntimeError, match=rf"{adapter}\(\) needs a CUDA device"):
        _run(step=getattr(adapters, adapter)())


@pytest.mark.cuda
@pytest.mark.parametrize("adapter", ["graphed_training", "compiled_training"])
def test_runner_steps_are_held_to_eager_by_the_same_checks(adapter: str) -> None:
    """make_graphed_callables' and torch.compile's own graphs of forward and backward, the optimizer
    between them: a correct step passes every check, a loss over padded rows is caught."""
    from examples.training.gallery import mean_loss
    from pytest_cudagraph.training import adapters

    def run(loss_fn: Any) -> Any:
        torch.manual_seed(0)
        return verify_training(
            Mlp().cuda(),
            token_inputs("cuda"),
            loss_fn,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
            step=getattr(adapters, adapter)(),
            **SIZES,
        )

    report = run(masked_loss)
    assert report.ok, report.format()
    held = [o for o in report.outcomes if o.check == "training_replay_matches_eager"]
    assert len(held) == 2 and all(o.passed and not o.skipped for o in held)
    caught = run(mean_loss)
    assert {o.check for o in caught.failures} >= {"training_padding"}, caught.format()


class _EagerRunner:
    """A step that 'replays graphs of its own' (the protocol training/adapters.py's steps meet),
    here plain eager code, so that the path verify_training takes for such steps runs on the CPU:
    called rather than captured, held to the default step. ``zero``: whether it zeroes the
    gradients before each step; ``reason``: what its not_graphed says."""

    graphs_itself = True
    __name__ = "eager_runner"

    def __init__(self, zero: bool = True, reason: str = "") -> None:
        self.zero, self.reason = zero, reason

    def __call__(self, module: Any, optimizer: Any, loss_fn: Any) -> Any:
        from pytest_cudagraph import TrainingStep

        def run(inputs: Any) -> torch.Tensor:
            if self.zero:
                optimizer.zero_grad(set_to_none=False)
            loss = loss_fn(module(x=inputs["x"]), inputs)
            loss.backward()
            return loss.detach()

        return TrainingStep(run, optimizer.step, not_graphed=lambda: self.reason)


def test_a_step_with_graphs_of_its_own_is_called_and_held_to_the_default_step() -> None:
    report = _run(step=_EagerRunner())
    assert report.ok, report.format()
    ran = {o.check for o in report.outcomes if not o.skipped}
    assert ran == set(TRAINING_CHECKS) - {"optimizer_capturable"}
    skipped = [o for o in report.outcomes if o.check == "optimizer_capturable"]
    assert "outside them" in skipped[0].message


def test_a_runner_step_that_accumulates_gradients_is_caught() -> None:
    report = _run(step=_EagerRunner(zero=False))
    failed = [o for o in report.failures if o.check == "training_replay_matches_eager"]
    assert failed and "grad of " in failed[0].message, report.format()


def test_a_runner_step_that_ran_without_its_graphs_fails_its_capture_and_says_why() -> None:
    report = _run(step=_EagerRunner(reason="skipping cudagraphs due to cpu device"))
    failed = [o for o in report.failures if o.check == "training_capture"]
    assert len(failed) == 2, report.format()
    assert "ran without its CUDA graphs: skipping cudagraphs due to cpu device" in failed[0].message
