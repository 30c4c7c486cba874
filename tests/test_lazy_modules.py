# ruff: noqa: F811  (the imported pytester fixture ``inner``, used as an argument)
"""A lazy module (``nn.LazyLinear`` before its first forward) is materialised by one eager forward
on ``make_inputs(1, 1)`` before anything reads it, or told in one line how to materialise it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph import GraphManager, verify
from pytest_cudagraph.errors import UsageError
from pytest_cudagraph.manager.inputs import MakeInputsError
from tests.test_plugin import inner  # noqa: F401  (the pytester fixture)

SIZES = [1, 2, 4, 8]
CONFIG = {"capture_sizes": SIZES, "max_num_reqs": 8}
is_lazy = torch.nn.parameter.is_lazy


def _make(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"input": torch.randn(num_tokens, 32)}


def _lazy_mlp() -> nn.Sequential:
    return nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 32))


def _broken_lazy() -> nn.Module:
    """A lazy layer whose output the next layer cannot take (64 features into 32)."""
    return nn.Sequential(nn.LazyLinear(64), nn.Linear(32, 32))


class _UnusedLazy(nn.Module):
    """A lazy layer its forward never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(32, 32)
        self.spare = nn.LazyLinear(8)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(input)
        return out


def _verify(module: nn.Module, make_inputs: Callable[[int, int], dict[str, Any]]) -> Any:
    return verify(module, make_inputs, backend="emulate", capture_sizes=SIZES)


def _manager(module: nn.Module, make_inputs: Callable[[int, int], dict[str, Any]]) -> Any:
    return GraphManager(module, make_inputs, CONFIG, backend="emulate")


WAYS = {"verify": _verify, "GraphManager": _manager}


# -- a lazy module verifies ---------------------------------------------------------------------
def test_a_lazy_mlp_verifies_and_is_left_materialised() -> None:
    torch.manual_seed(0)
    module = _lazy_mlp()
    report = _verify(module, _make)
    assert report.ok and report.descriptors, str(report)
    # Initialisation's random draws belong to the materialising forward, not to the verified module.
    assert "draws random numbers" not in str(report)
    weight, bias = module[0].weight, module[0].bias
    assert isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)
    assert not is_lazy(weight) and not is_lazy(bias)
    assert weight.shape == (64, 32) and bias.shape == (64,)
    # As nn.Linear initialises them (bound 1/sqrt(in_features)), not memory torch.empty left.
    bound = 1 / math.sqrt(32)
    for t in (weight, bias):
        assert torch.isfinite(t).all() and t.abs().max() <= bound and t.abs().max() > 0


def test_the_manager_materialises_a_lazy_module_before_reading_it() -> None:
    module = _lazy_mlp()
    manager = _manager(module, _make)
    assert not any(is_lazy(t) for t in module.parameters())
    assert manager.module[0].weight.shape == (64, 32)


LAZY_FIXTURE_TESTS = """
import torch
from torch import nn


def make_inputs(num_tokens, num_reqs):
    return {"input": torch.randn(num_tokens, 32)}


def test_lazy_mlp(cudagraph_verify):
    module = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 32))
    report = cudagraph_verify(module, make_inputs, capture_sizes=[1, 2, 4, 8])
    assert report.ok
    assert module[0].weight.shape == (64, 32)


def test_lazy_broken(cudagraph_verify):
    cudagraph_verify(nn.Sequential(nn.LazyLinear(64), nn.Linear(32, 32)), make_inputs, capture_sizes=[1, 2])
"""


def test_the_fixture_verifies_a_lazy_module_and_tells_a_broken_one_in_one_line(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(test_lazy=LAZY_FIXTURE_TESTS)
    result = inner.runpytest("--cudagraph-backend=emulate")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "cudagraph_verify: module tensor(s) '0.weight', '0.bias' were lazy *a first eager forward "
            "on make_inputs(1, 1) to materialise them raised RuntimeError: *run one forward on a real "
            "batch (module(**make_inputs(n, r))) before handing the module over"
        ]
    )
    # The message alone: no frame of the package, no blame on make_inputs.
    assert "pytest_cudagraph/" not in result.stdout.str()
    assert "make_inputs(num_tokens=1, num_reqs=1) raised" not in result.stdout.str()


# -- a lazy module that cannot be materialised is told ------------------------------------------
@pytest.mark.parametrize("way", list(WAYS))
def test_a_lazy_module_whose_forward_fails_is_one_usage_error(way: str) -> None:
    with pytest.raises(UsageError) as raised:
        WAYS[way](_broken_lazy(), _make)
    said = str(raised.value)
    assert "\n" not in said
    assert "'0.weight'" in said and "forward" in said
    assert "make_inputs(1, 1)" in said and "raised RuntimeError: " in said
    assert "module(**make_inputs(n, r))" in said
    assert "make_inputs(num_tokens=1, num_reqs=1) raised" not in said
    assert not isinstance(raised.value, MakeInputsError)
    # The forward's own error stays attached, for a traceback outside the fixtures.
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_the_fixture_fails_a_broken_lazy_module_plainly() -> None:
    from pytest_cudagraph.plugin.harness import _usage

    with pytest.raises(pytest.fail.Exception) as raised:
        _usage("cudagraph_verify", lambda: _verify(_broken_lazy(), _make))
    said = str(raised.value)
    assert said.startswith("cudagraph_verify: module tensor(s) '0.weight'")
    assert "\n" not in said and "Traceback" not in said


def test_a_lazy_tensor_the_forward_does_not_reach_is_named() -> None:
    with pytest.raises(
        UsageError, match=r"'spare\.weight', 'spare\.bias' are still lazy .*forward"
    ) as raised:
        _manager(_UnusedLazy(), _make)
    assert "\n" not in str(raised.value)


def test_a_broken_make_inputs_keeps_its_own_message() -> None:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        raise KeyError("no such shape")

    with pytest.raises(MakeInputsError, match=r"make_inputs\(num_tokens=1, num_reqs=1\) raised KeyError"):
        _manager(_lazy_mlp(), make_inputs)


# -- what the materialising forward writes is put back ------------------------------------------
def _make_3d(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    # Channels second, four values a channel per token: a training batch norm takes one token.
    return {"input": torch.randn(num_tokens, 8, 4)}


@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Sequential(nn.LazyBatchNorm1d()),
        # A batch norm that was there before writes first: its statistics are put back too.
        lambda: nn.Sequential(nn.BatchNorm1d(8), nn.LazyBatchNorm1d()),
        lambda: nn.Sequential(nn.LazyConv1d(8, 1), nn.LazyBatchNorm1d()),
    ],
    ids=["lazy-only", "after-a-batch-norm", "after-a-lazy-conv"],
)
def test_a_lazy_batch_norms_statistics_stay_as_initialised(build: Callable[[], nn.Module]) -> None:
    module = build().train()
    _manager(module, _make_3d)
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm1d)]
    assert norms
    for norm in norms:
        assert not any(is_lazy(t) for t in [*norm.parameters(), *norm.buffers()])
        assert norm.num_batches_tracked is not None and norm.running_mean is not None
        assert norm.running_var is not None
        assert norm.num_batches_tracked.item() == 0
        assert torch.equal(norm.running_mean, torch.zeros(8))
        assert torch.equal(norm.running_var, torch.ones(8))
        assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))
        assert norm.training


def test_a_training_batch_norm_on_one_token_rows_is_told() -> None:
    """nn.BatchNorm1d in training needs more than one value a channel: over (num_tokens, C)
    inputs, make_inputs(1, 1) cannot materialise it, and the message says so."""
    module = nn.Sequential(nn.LazyLinear(16), nn.LazyBatchNorm1d()).train()
    with pytest.raises(UsageError, match=r"raised ValueError: Expected more than 1 value per channel"):
        _manager(module, _make)
