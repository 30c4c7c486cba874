"""Quantized models get the verdicts a CUDA graph gives them: weights that are tensor subclasses
are read through their inner tensors, quantization is the module's own computation in the float64
reference, and a scale over the whole batch is caught as padding that reaches real rows.

``Int8Weight`` (``int8.py``) is a wrapper subclass of our own, so these hold without torchao;
``test_torchao.py`` runs the same on torchao's configs where torchao is installed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.quantized.int8 import Int8Weight, quantize_linears

D, H = 64, 256
CONFIG = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "exhaustive": True}


def mlp(act: str | None, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.SiLU(), nn.Linear(H, D)).to(dtype)
    return quantize_linears(model, act)


def make(dtype: torch.dtype = torch.bfloat16):
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"input": torch.randn(num_tokens, D, dtype=dtype)}

    return make_inputs


@pytest.mark.parametrize("act", [None, "token"], ids=["weight_only", "dynamic_per_token"])
def test_a_quantized_mlp_passes_every_check(cudagraph_verify, act):
    report = cudagraph_verify(mlp(act), make(), **CONFIG)
    assert report.ok
    checked = {o.check for o in report.outcomes if not o.skipped}
    # Every check that reads module tensors ran on the subclass weights, none skipped for them.
    assert {"address_stability", "state", "padded_size", "real_batches", "padding_isolation"} <= checked


def test_the_reference_says_which_precision_the_quantization_holds(cudagraph_verify):
    report = cudagraph_verify(mlp("token"), make(), **CONFIG)
    note = next((n for n in report.notes if n.startswith("padded_size's reference")), "")
    assert "float64, with the module's own quantization kept (its casts to int8)" in note, report.notes
    # The floor is float64's rounding: noise at an exact value (a tie before the cast to int8)
    # would move a quantized value a whole step and lift the limit to the percent.
    floors = [
        o.figures["floor"] for o in report.outcomes if o.check == "padded_size" and "floor" in o.figures
    ]
    assert floors and max(floors) < 1e-12, floors


def test_a_scale_over_the_whole_batch_is_caught_and_told_to_quantize_per_token(cudagraph_verify):
    with pytest.raises(pytest.fail.Exception) as failed:
        cudagraph_verify(mlp("tensor"), make(), **CONFIG)
    text = str(failed.value)
    assert "FAIL padding_isolation" in text
    assert "per token" in text


class ScaleDrift(nn.Module):
    """The bug: forward rescales its quantized weight in place by a factor kept in Python (a
    calibration step counter), which a graph freezes at its capture: replays write other scales
    than eager does."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = mlp("token")
        self.calls = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.mlp[0].weight.scale.mul_(1.0 + 1e-3 * self.calls)
        return self.mlp(input)


class Requantized(nn.Module):
    """The bug: forward requantizes into new memory (``weight.qdata = ...``), so a graph captured
    before keeps reading the old int8 values."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = mlp(None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w = self.mlp[0].weight
        w.qdata = w.qdata.clone()
        return self.mlp(input)


def test_state_written_inside_a_quantized_weight_is_named_by_its_inner_tensor(cudagraph_verify):
    with pytest.raises(pytest.fail.Exception) as failed:
        cudagraph_verify(ScaleDrift(), make(), **CONFIG)
    text = str(failed.value)
    assert "FAIL state" in text and "'mlp.0.weight.scale'" in text


def test_an_inner_tensor_rebound_by_forward_is_caught(cudagraph_verify):
    with pytest.raises(pytest.fail.Exception) as failed:
        cudagraph_verify(Requantized(), make(), **CONFIG)
    text = str(failed.value)
    assert "FAIL address_stability" in text and "mlp.0.weight.qdata" in text


def test_a_quantized_weight_is_read_as_its_inner_tensors():
    from pytest_cudagraph.observe import module_tensors

    names = [name for name, _ in module_tensors(mlp(None))]
    assert names == [
        "0.weight.qdata",
        "0.weight.scale",
        "0.bias",
        "2.weight.qdata",
        "2.weight.scale",
        "2.bias",
    ]
    assert all(type(t) in (torch.Tensor, nn.Parameter) for _, t in module_tensors(mlp(None)))
    assert isinstance(mlp(None)[0].weight, Int8Weight)


def test_a_quantized_mlp_verifies_piecewise(cudagraph_verify):
    """PIECEWISE graphs around an eager submodule read the quantized weights' storages too."""
    report = cudagraph_verify(mlp("token"), make(), mode="PIECEWISE", eager_submodules=["1"], **CONFIG)
    assert report.ok


class ScaledOnPaddedSizes(nn.Module):
    """The per-token quantized MLP with its output scaled by ``1 + error`` where the batch has a
    multiple of 4 tokens: every captured size past 2, none of the real batches padded to them."""

    def __init__(self, error: float) -> None:
        super().__init__()
        self.mlp = mlp("token")
        self.error = error

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = self.mlp(input)
        return out * (1.0 + self.error) if input.shape[0] % 4 == 0 else out


#: padded_size asks its question of the real batches real_batches queues for it.
CROSS_SHAPE = ["real_batches", "padded_size"]


def test_an_error_just_above_the_quantized_references_limit_is_caught(cudagraph_verify):
    """The floor's noise goes only where rounding can differ between shapes: the limit it gives a
    quantized model is float64's, and an error of 4 times that limit on the padded sizes is caught,
    where one of a sixteenth of it passes."""
    report = cudagraph_verify(ScaledOnPaddedSizes(0.0), make(), checks=CROSS_SHAPE, **CONFIG)
    limits = [
        o.figures["limit"] for o in report.outcomes if o.check == "padded_size" and "limit" in o.figures
    ]
    limit = max(limits)
    assert limit < 1e-12, limit
    passes = cudagraph_verify(ScaledOnPaddedSizes(limit / 16), make(), checks=CROSS_SHAPE, **CONFIG)
    assert passes.ok
    with pytest.raises(
        pytest.fail.Exception, match=r"(?s)FAIL padded_size .*depends on the padded batch size"
    ):
        cudagraph_verify(ScaledOnPaddedSizes(4 * limit), make(), checks=CROSS_SHAPE, **CONFIG)
