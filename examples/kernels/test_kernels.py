"""Kernels outside torch's dispatcher get the verdicts a CUDA graph gives them, on both backends.

Correct models pass, whatever block their kernels pick at each shape; a kernel that lets padded
rows reach real ones, and an error on the padded sizes in torch code beside such kernels, fail.
Without a GPU the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernel examples need triton (pip install triton)")

from examples.kernels import extension
from examples.kernels.models import CORRECT, KERNEL_BUGS, KernelMLP, PaddedSizeError, inputs
from examples.kernels.triton_kernels import INTERPRETED

CONFIG = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "exhaustive": True}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bf16"}


@pytest.fixture
def device(cudagraph_device: torch.device) -> torch.device:
    if cudagraph_device.type == "cpu" and not INTERPRETED:
        pytest.skip(
            "triton compiled these kernels for the GPU; the emulator runs them on CPU tensors only "
            "in Triton's interpreter (set TRITON_INTERPRET=1 before triton is imported)"
        )
    return cudagraph_device


def _model(cls: type[KernelMLP], device: torch.device, dtype: torch.dtype, *args: object) -> KernelMLP:
    torch.manual_seed(0)
    return cls(*args).to(device=device, dtype=dtype)


CORRECT_CASES = [(name, dtype) for name, dtypes in CORRECT.items() for dtype in dtypes]


def _ids(cases: list[tuple[str, torch.dtype]]) -> list[str]:
    return [f"{name}-{DTYPES[dtype]}" for name, dtype in cases]


@pytest.mark.parametrize(("name", "dtype"), CORRECT_CASES, ids=_ids(CORRECT_CASES))
def test_correct_model_passes(cudagraph_verify, device, name, dtype):
    if name == "extension":
        why = extension.available(device)
        if why:
            pytest.skip(why)
        if device.type == "cpu":
            pytest.skip(
                "the emulator cannot record an extension's launch: test_an_extension_is_held_to_the_float32_reference names it"
            )
    report = cudagraph_verify(_model(KernelMLP, device, dtype, name), inputs(device, dtype), **CONFIG)
    assert report.ok


BUG_CASES = [(name, dtype) for name in KERNEL_BUGS for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("name", "dtype"), BUG_CASES, ids=_ids(BUG_CASES))
def test_statistic_over_every_launched_row_is_caught(cudagraph_verify, device, name, dtype):
    """Inside the kernel, padded rows reach real ones: caught where padded rows are set apart."""
    with pytest.raises(pytest.fail.Exception, match=r"(?s)FAIL (padding_isolation|padded_size) "):
        cudagraph_verify(_model(KernelMLP, device, dtype, name), inputs(device, dtype), **CONFIG)


#: The error beside the kernels, relative: 1% in a bf16 model, 0.1% in a float32 one.
ERRORS = {torch.bfloat16: 1e-2, torch.float32: 1e-3}
BESIDE_CASES = [
    (name, dtype)
    for name in ("triton_autotune", "triton_heuristic", "custom_op_lowp")
    for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize(("name", "dtype"), BESIDE_CASES, ids=_ids(BESIDE_CASES))
def test_error_on_padded_sizes_beside_kernels_is_caught(cudagraph_verify, device, name, dtype):
    model = _model(PaddedSizeError, device, dtype, name, ERRORS[dtype])
    with pytest.raises(
        pytest.fail.Exception, match=r"(?s)FAIL padded_size .*a computation depends on the padded batch size"
    ):
        cudagraph_verify(model, inputs(device, dtype), **CONFIG)


def test_the_report_names_each_kernel_with_the_precision_it_holds(cudagraph_verify, device):
    report = cudagraph_verify(
        _model(KernelMLP, device, torch.float32, "triton_heuristic"), inputs(device, torch.float32), **CONFIG
    )
    assert report.ok
    assert (
        "padded_size's reference: float64, except where it holds less (Triton kernel '_rms_norm_rows': "
        "float32's precision)" in report.notes
    )


def test_a_kernel_for_bf16_alone_says_no_reference_runs_and_which_floor_holds(cudagraph_verify, device):
    report = cudagraph_verify(
        _model(KernelMLP, device, torch.bfloat16, "custom_op_bf16_only"),
        inputs(device, torch.bfloat16),
        **CONFIG,
    )
    assert report.ok
    skipped = [o for o in report.outcomes if o.check == "padded_size"]
    assert skipped and all(o.skipped for o in skipped)
    # The reason one line; the kernel and the floor that holds in its detail (-v, the JSON report).
    assert all(
        o.message == "the module cannot run in float64 nor in float32"
        and "cudagraph_examples::rms_norm_bf16_only" in o.detail
        and "within the floor it measured in the module's own precision" in o.detail
        for o in skipped
    )


def test_an_extension_is_held_to_the_float32_reference(cudagraph_verify, device):
    """It takes float32 alone (its weight is not raised with its input), so the reference runs in
    float32 with TF32 off; on the emulator its launch cannot be recorded, which capture names."""
    why = extension.available(device)
    if why:
        pytest.skip(why)
    model = _model(KernelMLP, device, torch.float32, "extension")
    if device.type == "cuda":
        report = cudagraph_verify(model, inputs(device, torch.float32), **CONFIG)
        assert report.ok
        assert any("its reference runs in float32 with TF32 off" in n for n in report.notes)
        return
    with pytest.raises(pytest.fail.Exception) as failed:
        cudagraph_verify(model, inputs(device, torch.float32), **CONFIG)
    text = str(failed.value)
    assert "FAIL capture_safety" in text and "launched outside torch" in text
    # Named, never told as graph memory gone stale.
    for stale in ("FAIL replay_matches_eager", "FAIL fresh_inputs", "FAIL real_batches", "FAIL determinism"):
        assert stale not in text
