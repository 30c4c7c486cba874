# ruff: noqa: F811  (the imported pytester fixture ``inner``, used as an argument)
"""An error the harness raises is never put on the user's make_inputs, forward or loss_fn unless it
came from them (issue #46, point 5): a failure of the harness's own bookkeeping (reading a module
tensor's storage around make_inputs, observing an op of a forward) is an ``InternalError`` that
says so, with what the harness was doing and the tensor it was reading where known. Each bug has
its correct twin: the same run unpatched passes, and the user's own failures are still theirs."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytest_cudagraph.observe as observe
from pytest_cudagraph import verify, verify_training
from pytest_cudagraph.checks.registry import Check
from pytest_cudagraph.errors import EagerFailure, InternalError, UsageError
from pytest_cudagraph.manager.inputs import MakeInputsError, call_make_inputs
from pytest_cudagraph.observe import modes
from tests.test_plugin import inner  # noqa: F401  (the pytester fixture)

SIZES: dict[str, Any] = {"capture_sizes": [1, 2, 4]}
BLAMES_MAKE_INPUTS = "make_inputs(num_tokens="


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _make(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"input": torch.randn(num_tokens, 8)}


def _make_writing(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    """Builds its input with an in-place op: one the harness's make_inputs watch reads the storage of."""
    x = torch.empty(num_tokens, 8)
    x.normal_()
    return {"input": x}


def _called_from(frame_depth: int, mode: type) -> bool:
    """Whether the caller ``frame_depth`` frames up runs a method of a ``mode`` instance."""
    return isinstance(sys._getframe(frame_depth + 1).f_locals.get("self"), mode)


def _break_the_watch_of_make_inputs(monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """The bookkeeping that runs on each op of make_inputs (inside the user's call) fails with ``message``."""
    plain = modes._storage_key

    def storage_key(t: torch.Tensor) -> int | None:
        if _called_from(1, modes._WritesOutside):
            raise RuntimeError(message)
        return plain(t)

    monkeypatch.setattr(modes, "_storage_key", storage_key)


def _takes_a_sample(ctx: Any, desc: Any) -> None:
    """A check of the caller's that builds a sample at its descriptor, as the built-in ones do."""
    ctx.make(ctx.exact_batch(desc))


def _what_verify_said(module: nn.Module, make_inputs: Callable[..., Any], **keywords: Any) -> str:
    """What verify tells: the error it raised, or a failed report's text ("" when it passed)."""
    try:
        report = verify(module, make_inputs, **SIZES, **keywords)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "" if report.ok else report.format()


# -- the error itself ------------------------------------------------------------
def test_the_message_says_internal_with_the_step_the_tensor_and_the_cause() -> None:
    error = InternalError("observing make_inputs' writes", RuntimeError("bad\nmore"), "0.weight")
    text = str(error)
    assert text.startswith("pytest-cudagraph internal error while observing make_inputs' writes")
    assert "(reading '0.weight'): RuntimeError: bad;" in text
    assert "more" not in text  # the cause's first line only
    assert "this is a bug in pytest-cudagraph, not in your make_inputs, forward or loss_fn" in text
    assert not isinstance(error, UsageError)  # the fixtures show a traceback for it, not one line
    copy = pickle.loads(pickle.dumps(error))  # xdist and spawned ranks send it whole
    assert str(copy) == text and copy.tensor == "0.weight"


def test_found_in_follows_causes_and_contexts() -> None:
    internal = InternalError("reading", ValueError("x"))
    try:
        try:
            raise internal
        except InternalError as exc:
            raise KeyError("the user's") from exc
    except KeyError as outer:
        assert InternalError.found_in(outer) is internal
    assert InternalError.found_in(KeyError("alone")) is None


# -- (a) the bookkeeping around make_inputs --------------------------------------
def test_a_failing_read_after_make_inputs_is_internal_not_make_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The reported bug: outside_forward's read of the module's storages after make_inputs failed,
    # and it came out as "make_inputs(num_tokens=1, num_reqs=1) raised RuntimeError: ...".
    plain = observe.ForwardObserver.tensors
    calls = {"n": 0}

    def tensors(self: observe.ForwardObserver) -> list[tuple[str, torch.Tensor]]:
        if sys._getframe(1).f_code.co_name == "outside_forward":
            calls["n"] += 1
            if calls["n"] > 1:  # the read before the first make_inputs passes, the one after it fails
                raise RuntimeError("Attempted to access the data pointer on an invalid python storage")
        return plain(self)

    monkeypatch.setattr(observe.ForwardObserver, "tensors", tensors)
    said = _what_verify_said(_mlp(), _make)
    assert said.startswith("InternalError: pytest-cudagraph internal error while reading the module's")
    assert "after make_inputs" in said and "invalid python storage" in said
    assert BLAMES_MAKE_INPUTS not in said


def test_a_failing_watch_of_make_inputs_writes_is_internal_not_make_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _break_the_watch_of_make_inputs(
        monkeypatch, "Attempted to access the data pointer on an invalid python storage"
    )
    said = _what_verify_said(_mlp(), _make_writing)
    assert said.startswith("InternalError: pytest-cudagraph internal error while observing make_inputs'")
    assert "aten.normal_" in said
    assert BLAMES_MAKE_INPUTS not in said


def test_the_internal_error_names_the_module_tensor_it_was_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    # make_inputs syncs a weight in place (an RL engine's weight sync): the watch of that write fails.
    module = _mlp()
    weight = module.get_parameter("0.weight")

    def syncing(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            weight.mul_(1.0)
        return _make(num_tokens, num_reqs)

    assert _what_verify_said(module, syncing) == ""  # the twin: the sync is the user's right
    _break_the_watch_of_make_inputs(
        monkeypatch, "Attempted to access the data pointer on an invalid python storage"
    )
    said = _what_verify_said(module, syncing)
    assert said.startswith("InternalError: pytest-cudagraph internal error while observing make_inputs'")
    assert "(reading '0.weight')" in said and "aten.mul_" in said
    assert BLAMES_MAKE_INPUTS not in said


def test_an_internal_error_that_make_inputs_wrapped_is_still_internal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # make_inputs catches what its op raised and raises its own: the cause is still ours.
    def wrapping(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        try:
            return _make_writing(num_tokens, num_reqs)
        except RuntimeError as exc:
            raise ValueError("could not build the batch") from exc

    _break_the_watch_of_make_inputs(monkeypatch, "boom")
    said = _what_verify_said(_mlp(), wrapping)
    assert said.startswith("InternalError: pytest-cudagraph internal error")
    assert BLAMES_MAKE_INPUTS not in said and "could not build the batch" not in said


def test_an_internal_error_in_a_check_fails_that_check_saying_internal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A check that builds a sample while the harness's bookkeeping fails: that check could not run,
    # and its outcome says it was an internal error, not make_inputs.
    plain = observe.ForwardObserver.tensors
    armed = {"on": False}

    def tensors(self: observe.ForwardObserver) -> list[tuple[str, torch.Tensor]]:
        if armed["on"] and sys._getframe(1).f_code.co_name == "outside_forward":
            raise RuntimeError("boom")
        return plain(self)

    def sample(ctx: Any, desc: Any) -> None:
        armed["on"] = True
        try:
            _takes_a_sample(ctx, desc)
        finally:
            armed["on"] = False

    monkeypatch.setattr(observe.ForwardObserver, "tensors", tensors)
    check = Check("takes_a_sample", sample, compares="a sample of make_inputs")
    report = verify(_mlp(), _make, extra_checks=[check], **SIZES)
    failed = [o for o in report.outcomes if not o.passed and not o.skipped]
    assert failed and {o.check for o in failed} == {"takes_a_sample"}, report.format()
    for outcome in failed:
        assert "the check could not run: InternalError: pytest-cudagraph internal error" in outcome.message
        assert BLAMES_MAKE_INPUTS not in outcome.message


def test_the_twins_pass_unpatched() -> None:
    assert _what_verify_said(_mlp(), _make) == ""
    assert _what_verify_said(_mlp(), _make_writing) == ""
    check = Check("takes_a_sample", _takes_a_sample, compares="a sample of make_inputs")
    assert _what_verify_said(_mlp(), _make, extra_checks=[check]) == ""


# -- (b) make_inputs' own failures are still make_inputs' ------------------------
def test_a_make_inputs_that_raises_is_still_blamed() -> None:
    def broken(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        if num_tokens == 4:
            raise IndexError("no such row")
        return _make(num_tokens, num_reqs)

    with pytest.raises(MakeInputsError, match=r"make_inputs\(num_tokens=4, num_reqs=\d+\) raised IndexError"):
        verify(_mlp(), broken, **SIZES)


def test_call_make_inputs_passes_an_internal_error_unchanged() -> None:
    internal = InternalError("reading", RuntimeError("x"))

    def raising(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        raise internal

    with pytest.raises(InternalError) as info:
        call_make_inputs(raising, 1, 1)
    assert info.value is internal


# -- (c) and (d): the forward's own failures, and the bookkeeping inside it --------
def test_a_forward_that_raises_is_still_an_eager_failure() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("the module's own bug")

    with pytest.raises(EagerFailure, match="eager forward fails on make_inputs' batches") as info:
        verify(Broken(), _make, **SIZES)
    assert "internal error" not in str(info.value)


def test_a_failing_observer_inside_the_forward_is_internal_not_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = observe.ForwardObserver.observe

    def observe_op(self: observe.ForwardObserver, func: Any, args: Any, kwargs: Any) -> None:
        if _called_from(1, modes._Observing):
            raise RuntimeError("observer bug")
        plain(self, func, args, kwargs)

    monkeypatch.setattr(observe.ForwardObserver, "observe", observe_op)
    said = _what_verify_said(_mlp(), _make)
    assert said.startswith("InternalError: pytest-cudagraph internal error while observing the forward's op")
    assert "RuntimeError: observer bug" in said
    assert "eager forward fails" not in said and "capture" not in said


def test_a_failing_observer_after_an_op_is_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    def after(self: observe.ForwardObserver, func: Any, out: Any) -> None:
        raise RuntimeError("after bug")

    monkeypatch.setattr(observe.ForwardObserver, "after", after)
    said = _what_verify_said(_mlp(), _make)
    assert said.startswith(
        "InternalError: pytest-cudagraph internal error while observing what the forward's"
    )
    assert "eager forward fails" not in said


def test_the_forwards_own_error_under_the_observer_is_not_internal() -> None:
    # Inside _Observing, the op the forward runs raising is the forward's: it passes unwrapped.
    module = _mlp()
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as info:
        with observe.observing(observe.ForwardObserver(module)):
            module(torch.randn(2, 3))
    assert not isinstance(info.value, InternalError)


def test_a_failing_put_back_after_restoring_is_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    module = nn.BatchNorm1d(8)  # its forward writes its running statistics: restoring copies them
    assert module.running_mean is not None
    plain = observe.ForwardObserver.tensors

    def tensors(self: observe.ForwardObserver) -> list[tuple[str, torch.Tensor]]:
        if sys._getframe(1).f_code.co_name == "restoring":
            raise RuntimeError("boom")
        return plain(self)

    monkeypatch.setattr(observe.ForwardObserver, "tensors", tensors)
    with pytest.raises(InternalError, match="while putting back the module tensors the forwards wrote"):
        with observe.restoring(observe.ForwardObserver(module)):
            module(torch.randn(4, 8))
    monkeypatch.setattr(observe.ForwardObserver, "tensors", plain)
    before = module.running_mean.clone()
    with observe.restoring(observe.ForwardObserver(module)) as copies:
        module(torch.randn(4, 8))
    assert "running_mean" in copies and torch.equal(module.running_mean, before)


# -- training: loss_fn's own failures and ours -------------------------------------
def _training(loss_fn: Callable[..., torch.Tensor]) -> Any:
    from examples.training.gallery import Mlp, adamw, token_inputs

    torch.manual_seed(0)
    return verify_training(
        Mlp(), token_inputs(), loss_fn, optimizer=adamw(True), capture_sizes=(2, 4), max_num_reqs=4
    )


def test_training_an_internal_error_under_the_loss_is_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.training.gallery import masked_loss

    def observe_op(self: observe.ForwardObserver, func: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("observer bug")

    def observed_loss(out: torch.Tensor, inputs: Any) -> torch.Tensor:
        # The harness's observer around the loss (as its checks run eager steps under one).
        with observe.observing(observe.ForwardObserver(nn.Linear(1, 1))):
            return masked_loss(out, inputs)

    monkeypatch.setattr(observe.ForwardObserver, "observe", observe_op)
    with pytest.raises(InternalError, match="pytest-cudagraph internal error while observing"):
        _training(observed_loss)
    monkeypatch.undo()
    assert _training(observed_loss).ok  # the twin


def test_training_a_loss_that_raises_is_still_an_eager_failure() -> None:
    def broken(out: torch.Tensor, inputs: Any) -> torch.Tensor:
        raise KeyError("labels")

    with pytest.raises(EagerFailure, match="the training step fails eagerly"):
        _training(broken)


# -- the fixture: the first line says it is internal -------------------------------
def test_the_fixture_shows_an_internal_error_as_one(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import sys

        import pytest
        import pytest_cudagraph.observe as observe
        from cgmods import Tiny, make_inputs

        def _broken(self, func, args, kwargs):
            raise RuntimeError("observer bug")

        @pytest.mark.cudagraph(capture_sizes=(1, 2))
        def test_internal(cudagraph_verify, monkeypatch):
            monkeypatch.setattr(observe.ForwardObserver, "observe", _broken)
            cudagraph_verify(Tiny(), make_inputs)

        @pytest.mark.cudagraph(capture_sizes=(1, 2))
        def test_fine(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs)
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "E *.InternalError: pytest-cudagraph internal error while observing*this is a bug in pytest-cudagraph*"
        ]
    )
    result.stdout.no_fnmatch_line("*make_inputs(num_tokens=*")
    result.stdout.no_fnmatch_line("*eager forward fails*")


def test_the_capture_guards_bookkeeping_failing_is_internal_not_a_failed_capture(monkeypatch):
    """The observer fed by the capture guard raises: an internal error, not capture_safety."""
    import traceback

    original = observe.ForwardObserver.observe

    def fails_under_the_guard(self, func, args, kwargs):
        if any(f.filename.endswith(os.path.join("guard", "__init__.py")) for f in traceback.extract_stack()):
            raise RuntimeError("observer bug under the guard")
        return original(self, func, args, kwargs)

    monkeypatch.setattr(observe.ForwardObserver, "observe", fails_under_the_guard)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(InternalError, match=r"internal error while observing .* under the capture guard"):
        verify(
            model,
            lambda num_tokens, num_reqs: {"input": torch.randn(num_tokens, 8)},
            capture_sizes=[1, 2, 4],
            progress=False,
        )
