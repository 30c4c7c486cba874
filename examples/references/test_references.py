"""Kernels that run only in bf16, with the plain-torch references that keep the float64 question alive.

A serving engineer's model: attention through a custom op for half precision alone (FlashAttention's
contract, ``cgref::attention``), RMSNorm through a Triton kernel behind a Python function
(``kernels.rms_norm``). Without references ``padded_size`` cannot run it in float64, and a 0.1 %
error on the padded sizes passes; with ``references={attention: attention_reference, rms_norm:
rms_norm_reference}`` the same error is caught and the correct twin passes. Each reference is held
against its kernel first: a wrong one fails, named.

Without a GPU the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by the
repository's conftest before triton is imported).
"""

from __future__ import annotations

import pytest
import torch

from examples.references.kernels import (
    ATTENTION_OP,
    HAS_TRITON,
    INTERPRETED,
    attention,
    attention_reference,
    rms_norm,
    rms_norm_reference,
)
from examples.references.model import CAPTURE_SIZES, MAX_NUM_REQS, build, inputs
from pytest_cudagraph import verify

PLAN = {"capture_sizes": CAPTURE_SIZES, "max_num_reqs": MAX_NUM_REQS}
#: The kernels each case runs: the bf16-only attention op with torch's norms, or with the Triton norm too.
CASES = {"attention-op": "torch", "attention-op+triton-norm": "triton"}


def references(norm: str) -> dict[object, object]:
    """Each kernel the model runs (the op, the Python function) with the plain-torch function that
    stands in for it."""
    refs: dict[object, object] = {attention: attention_reference}
    if norm == "triton":
        refs[rms_norm] = rms_norm_reference
    return refs


@pytest.fixture(params=list(CASES))
def norm(request: pytest.FixtureRequest, cudagraph_device: torch.device) -> str:
    norm = CASES[request.param]
    if norm == "triton" and not HAS_TRITON:
        pytest.skip("the Triton norm needs triton (pip install triton)")
    if norm == "triton" and cudagraph_device.type == "cpu" and not INTERPRETED:
        pytest.skip("without a GPU the Triton kernel runs only in Triton's interpreter (TRITON_INTERPRET=1)")
    return norm


def test_correct_model_passes_with_the_references_standing_in(cudagraph_verify, cudagraph_device, norm):
    report = cudagraph_verify(
        build(device=cudagraph_device, norm=norm),
        inputs(cudagraph_device),
        references=references(norm),
        **PLAN,
    )
    assert report.ok
    stood_in = {r["op"]: r["stood_in"] for r in report.references}
    assert stood_in[ATTENTION_OP] is True
    assert any(op.endswith("rms_norm") and stood for op, stood in stood_in.items()) == (norm == "triton")
    assert any(o.check == "padded_size" and not o.skipped for o in report.outcomes)


@pytest.mark.parametrize("error", ["logit_error", "mlp_error"])
def test_a_tenth_of_a_percent_on_the_padded_sizes_is_caught(cudagraph_verify, cudagraph_device, norm, error):
    """0.1 % on the logits, or on the last layer's MLP, at token counts that are multiples of 8."""
    model = build(device=cudagraph_device, norm=norm, **{error: 1e-3})
    with pytest.raises(
        pytest.fail.Exception,
        match=r"(?s)FAIL padded_size .*references standing in for [^\n]*cgref::attention",
    ):
        cudagraph_verify(model, inputs(cudagraph_device), references=references(norm), **PLAN)


def test_without_a_reference_the_report_says_how_to_add_one(cudagraph_verify, cudagraph_device):
    """The same 0.1 % error, no references: padded_size cannot run (said, with the sentence that adds
    a reference), and bf16's own floor lets the error through. A Triton wrapper left without its
    reference is named too."""
    report = cudagraph_verify(
        build(device=cudagraph_device, norm="torch", logit_error=1e-3), inputs(cudagraph_device), **PLAN
    )
    skipped = [o for o in report.outcomes if o.check == "padded_size"]
    assert skipped and all(o.skipped for o in skipped)
    assert skipped[0].message == "the module cannot run in float64 nor in float32"  # one line (#66)
    assert f"references={{'{ATTENTION_OP}': fn}}" in skipped[0].detail
    if HAS_TRITON and (cudagraph_device.type == "cuda" or INTERPRETED):
        # The Triton norm's wrapper refuses float64 in Python (a dtype check): the skip names the
        # function where the float64 forward raised, with the key to give.
        report = verify(
            build(device=cudagraph_device, norm="triton"),
            inputs(cudagraph_device),
            references={attention: attention_reference},
            checks=["padded_size"],
            progress=False,
            **PLAN,
        )
        (why,) = {o.detail for o in report.outcomes if o.check == "padded_size" and o.skipped}
        assert "for the Python function examples.references.kernels.rms_norm" in why
        assert "references={rms_norm: fn}" in why


def test_a_reference_that_is_not_causal_is_named(cudagraph_verify, cudagraph_device):
    def bidirectional(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    with pytest.raises(
        pytest.fail.Exception,
        match=r"FAIL references .*\n.*the reference for cgref::attention .* disagrees with the kernel",
    ):
        cudagraph_verify(
            build(device=cudagraph_device, norm="torch"),
            inputs(cudagraph_device),
            references={attention: bidirectional},
            **PLAN,
        )
