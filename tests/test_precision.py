"""``precision.raised``: a forward in float64 without a copy of the module, op by op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pytest_cudagraph.precision import NoReference, raised


class Cached(nn.Module):
    """A bf16 layer that writes its keys into a cache through a slice, then reads the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8).to(torch.bfloat16)
        self.register_buffer("cache", torch.zeros(16, 8, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.lin(x)
        self.cache[: x.shape[0]].copy_(k)  # a write through a view of the module's own state
        # and by index (an op that takes its values in the written tensor's dtype only)
        self.cache.index_copy_(0, torch.arange(8, 8 + x.shape[0]), k)
        return self.cache[: x.shape[0]] * 2 + self.cache[8 : 8 + x.shape[0]] + k.float().mean()


def test_every_floating_op_runs_in_float64_and_the_result_is_float64() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with raised() as record:
        out = lin(x)
    assert out.dtype == torch.float64
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert torch.allclose(out, exact, rtol=1e-12, atol=1e-12)
    assert record.precision == "float64" and record.roundoff == 2.0**-53
    assert lin.weight.dtype == torch.bfloat16, "the module is not converted"


def test_requests_for_lower_dtypes_are_raised_too() -> None:
    x = torch.randn(3, dtype=torch.bfloat16)
    with raised():
        assert x.to(torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.bfloat16).dtype == torch.float64
        assert torch.arange(4).float().dtype == torch.float64
        assert torch.softmax(x.half(), 0, dtype=torch.float32).dtype == torch.float64
        assert x.to(torch.int64).dtype == torch.int64  # integers stay


def test_a_write_through_a_view_reaches_the_module_state_in_its_own_dtype() -> None:
    torch.manual_seed(0)
    module = Cached()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with raised() as record:
        out = module(x)
    assert module.cache.dtype == torch.bfloat16
    assert bool(module.cache[:3].ne(0).any()), "the write through the slice was lost"
    assert bool(module.cache[8:11].ne(0).any())
    assert bool(module.cache[3:8].eq(0).all()) and bool(module.cache[11:].eq(0).all())
    assert out.dtype == torch.float64
    assert record.lower_writes  # said: the values written there are rounded to bf16, as the module does


def test_an_op_without_a_float64_kernel_runs_in_float32_and_is_said() -> None:
    lib = torch.library.Library("cgtest_f32", "DEF")
    lib.define("double_it(Tensor x) -> Tensor")

    def impl(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError("double_it: no float64 kernel")
        return x * 2

    lib.impl("double_it", impl, "CPU")
    x = torch.randn(4, dtype=torch.bfloat16)
    with raised() as record:
        out = torch.ops.cgtest_f32.double_it(x)
    assert out.dtype == torch.float64
    assert "cgtest_f32::double_it" in record.fell_back
    with raised() as record:
        product = torch.ones(2, 2, dtype=torch.bfloat16) @ torch.ones(2, 2, dtype=torch.bfloat16)
        torch.ops.cgtest_f32.double_it(product)
    # The product ran in float64; the op that fell back holds float32's precision, and the record
    # says so (the floor takes float32's rounding there, the limit at least 64 times it).
    assert record.roundoff == 2.0**-24
    assert (
        record.precision
        == "float64, except where it holds less (cgtest_f32::double_it ran in float32 (no float64 kernel))"
    )


def test_an_op_that_runs_in_neither_is_no_reference() -> None:
    lib = torch.library.Library("cgtest_bf16", "DEF")
    lib.define("only_bf16(Tensor x) -> Tensor")

    def impl(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise RuntimeError("only_bf16: bfloat16 only")
        return x + 1

    lib.impl("only_bf16", impl, "CPU")
    with pytest.raises(NoReference, match=r"cgtest_bf16::only_bf16 runs neither in float64 nor in float32"):
        with raised():
            torch.ops.cgtest_bf16.only_bf16(torch.randn(3, dtype=torch.bfloat16))


def test_noise_moves_the_result_by_about_its_size_and_is_seeded() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with raised():
        exact = lin(x)
    with raised(noise=1e-10, seed=3):
        a = lin(x)
    with raised(noise=1e-10, seed=3):
        b = lin(x)
    relative = float((a - exact).norm() / exact.norm())
    assert 1e-11 < relative < 1e-8
    assert torch.equal(a, b)
