"""Kernels launched outside torch's dispatcher, seen by the float64 reference and the emulator.

Without CUDA the Triton kernels of ``examples/kernels`` run in Triton's interpreter (the root
conftest sets ``TRITON_INTERPRET=1``); the extension is C called through ctypes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="these tests launch Triton kernels (pip install triton)")

from examples.kernels import extension
from examples.kernels.triton_kernels import INTERPRETED, rms_norm
from pytest_cudagraph.launches import Unwritten, kernel_name, triton_launches
from pytest_cudagraph.precision import NoReference, raised

FLOAT32 = 2.0**-24

if torch.cuda.is_available():
    DEVICE = "cuda"
elif INTERPRETED:
    DEVICE = "cpu"
else:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)


def _x(rows: int = 6, d: int = 128, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, d, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


def test_a_triton_launch_is_handed_to_the_innermost_hook_once():
    seen: list[str] = []

    def outer(launch):  # never reached while the inner hook is active
        seen.append("outer")
        return launch()

    def inner(launch):
        seen.append(launch.name)
        return launch()

    x, w = _x(), torch.ones(128, device=DEVICE)
    with triton_launches(outer), triton_launches(inner):
        y = rms_norm(x, w, how="autotune")  # an autotuner's benchmark launches are part of this one
    assert seen == ["_rms_norm_rows"]
    assert torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5)
    rms_norm(x, w)  # no hook: as Triton launches it
    assert seen == ["_rms_norm_rows"]


def test_kernel_name_walks_through_wrappers():
    from examples.kernels.triton_kernels import _rms_norm_autotuned, _rms_norm_heuristic

    assert kernel_name(_rms_norm_autotuned) == kernel_name(_rms_norm_heuristic) == "_rms_norm_rows"


def test_the_reference_names_a_triton_kernel_and_the_precision_it_holds():
    """A kernel computes in float32 whatever it is handed: the float64 reference records that
    precision there and puts float32's rounding on its output in the floor's run."""
    x, w = _x(), torch.ones(128, device=DEVICE)
    with raised() as exact_record:
        exact = rms_norm(x, w, how="heuristic") * 1.0
    with raised(noise=2.0**-53, seed=1) as noisy_record:
        noisy = rms_norm(x, w, how="heuristic") * 1.0
    assert exact.dtype == torch.float64
    for record in (exact_record, noisy_record):
        assert record.outside == {"Triton kernel '_rms_norm_rows'": "float32's precision"}
        assert record.roundoff == FLOAT32
        assert "Triton kernel '_rms_norm_rows': float32's precision" in record.precision
    # float32's rounding on the kernel's output, not float64's.
    assert 1e-9 < _relative(noisy, exact) < 1e-6
    # Without the kernel, float64's own: rounding of 1e-16.
    with raised() as record:
        plain = x * 2.0
    with raised(noise=2.0**-53, seed=1):
        jittered = x * 2.0
    assert not record.outside and record.roundoff == 0.0 and _relative(jittered, plain) < 1e-14


def test_a_triton_kernel_writing_in_place_is_found_where_it_wrote():
    x = _x()
    with raised() as record:
        h = x * 1.0  # float64, made by an op the reference saw
        rms_norm(h, torch.ones(128, device=DEVICE))  # writes a new tensor, not h
    assert list(record.outside) == ["Triton kernel '_rms_norm_rows'"]


def test_an_extension_write_is_found_when_read_and_when_returned():
    why = extension.available(DEVICE)
    if why:
        pytest.skip(why)
    x = _x()
    with raised() as record:
        y = extension.rms_norm_ext(x * 1.0, torch.ones(128, device=DEVICE, dtype=torch.float64))
        z = y + 1.0  # the read that finds it
    assert z.dtype == torch.float64
    (what,) = record.outside
    assert "written outside torch's dispatcher" in what and "read by aten::add" in what
    assert record.outside[what] == "float32's precision" and record.roundoff == FLOAT32
    with raised() as record:
        extension.rms_norm_ext(x * 1.0, torch.ones(128, device=DEVICE, dtype=torch.float64))
    assert any("returned" in what for what in record.outside)


def test_memory_nobody_wrote_is_not_taken_for_an_outside_write():
    """A read of torch.empty's memory that nothing wrote is determinism's subject, not a kernel."""
    with raised() as record:
        torch.empty(4, 8, device=DEVICE) + 1.0
    assert not record.outside


def test_unwritten_forgets_what_an_op_writes():
    fresh = Unwritten()
    t = torch.empty(4)
    fresh.allocated("aten.empty", t)
    assert fresh.is_fresh(t)
    fresh.written(t)
    assert not fresh.is_fresh(t) and fresh.written_outside(t) is None
    u = torch.empty(4)
    fresh.allocated("aten.empty", u)
    u.untyped_storage()  # untouched: the marker is there
    assert fresh.written_outside(u) is None
    v = torch.empty(4)
    fresh.allocated("aten.empty", v)
    v.copy_(torch.arange(4.0))  # outside any mode: nobody told it
    assert fresh.written_outside(v) is not None


@torch.library.custom_op("cudagraph_tests::scale_float32_only", mutates_args=())
def _scale_float32_only(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"takes float16, bfloat16 or float32, got {x.dtype}")
    return x * 3.0


@_scale_float32_only.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cudagraph_tests::add_one_float32_only_", mutates_args=("x",))
def _add_one_float32_only_(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"takes float32, got {x.dtype}")
    x.add_(1.0)


def test_an_op_without_a_float64_kernel_runs_in_float32_and_holds_its_precision():
    x = _x()
    with raised() as record:
        y = _scale_float32_only(x * 1.0)
    assert y.dtype == torch.float64
    assert list(record.fell_back) == ["cudagraph_tests::scale_float32_only"]
    assert record.roundoff == FLOAT32
    assert "cudagraph_tests::scale_float32_only ran in float32" in record.precision
    with raised() as exact:
        a = _scale_float32_only(x * 1.0) * 1.0
    with raised(noise=2.0**-53, seed=3):
        b = _scale_float32_only(x * 1.0) * 1.0
    assert exact.fell_back and 1e-9 < _relative(b, a) < 1e-6  # float32's noise at the op


def test_an_in_place_op_without_a_float64_kernel_writes_back_from_float32():
    x = _x()
    with raised() as record:
        h = x * 1.0
        _add_one_float32_only_(h)
    assert h.dtype == torch.float64 and torch.allclose(h, x.double() + 1.0, atol=1e-6)
    assert list(record.fell_back) == ["cudagraph_tests::add_one_float32_only_"]


def test_a_forward_that_refuses_float64_runs_in_the_float32_reference():
    """The float32 tier: bf16 raised to float32, float32 left; an op with no float32 kernel there
    has nowhere lower to go."""
    x = _x(dtype=torch.bfloat16)
    with raised(to=torch.float32) as record:
        y = x * 1.0
    assert y.dtype == torch.float32 and record.tier == "float32"
    assert record.precision == "float32 (TF32 off)"
    with pytest.raises(NoReference, match="bf16_only"), raised(to=torch.float32):
        from examples.kernels.ops import rms_norm_bf16_only

        rms_norm_bf16_only(x, torch.ones(128, device=DEVICE, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match=r"takes torch\.float64 or torch\.float32"), raised(to=torch.float16):
        pass
