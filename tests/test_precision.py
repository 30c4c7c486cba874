"""``precision.raised``: a forward in float64 without a copy of the module, op by op."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph.launches import Launch, triton_launches
from pytest_cudagraph.precision import NoReference, convert, raised

ROOT = Path(__file__).resolve().parents[1]


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


# -- products with a large weight, a block of its columns at a time -------------------------------------


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], int]]:
    """Every tensor the block raises to float64, as (shape, bytes raised): every conversion goes
    through ``_to_float64`` (no threshold), which is wrapped."""
    seen: list[tuple[tuple[int, ...], int]] = []
    plain = convert._to_float64

    def recorded(t: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(t.shape), t.numel() * 8))
        return plain(t)

    monkeypatch.setattr(convert, "_FAST_MIN_NUMEL", 0)
    monkeypatch.setattr(convert, "_to_float64", recorded)
    return seen


def _linear(bias: bool, out_features: int = 37, in_features: int = 16) -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


# F.linear under a dispatch mode on the CPU: a 2-D input reaches addmm (with a bias) or mm; a
# contiguous 3-D one a view and addmm or mm; a non-contiguous 3-D one mm, then add for the bias.
LINEAR_INPUTS = {
    "2d": lambda: torch.randn(5, 16),
    "3d": lambda: torch.randn(2, 3, 16),
    "3d-transposed": lambda: torch.randn(3, 2, 16).transpose(0, 1),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", list(LINEAR_INPUTS))
def test_a_product_with_a_large_weight_is_raised_a_block_of_columns_at_a_time(
    monkeypatch: pytest.MonkeyPatch, conversions: list[tuple[tuple[int, ...], int]], bias: bool, shape: str
) -> None:
    lin = _linear(bias)
    x = LINEAR_INPUTS[shape]().to(torch.bfloat16)
    with raised() as whole_record:
        whole = lin(x)
    assert (lin.weight.shape[::-1], lin.weight.numel() * 8) in conversions, "unchunked: converted whole"
    # Blocks of 5 columns of the weight's 37 (W.t(), 16 x 37): 7 blocks of 5 and a last one of 2.
    chunk = 5 * 16 * 8
    monkeypatch.setattr(convert, "_CHUNK_BYTES", chunk)
    conversions.clear()
    with raised() as record:
        out = lin(x)
    assert out.dtype == torch.float64 and out.shape == whole.shape
    # The weight's blocks (16 rows) no larger than a block; nothing else near the weight's size.
    assert max(size for s, size in conversions if s[:1] == (16,)) <= chunk, conversions
    assert max(size for _, size in conversions) < lin.weight.numel() * 8 / 4, conversions
    assert [s for s, _ in conversions].count((16, 5)) == 7 and (16, 2) in [s for s, _ in conversions]
    assert _relative(out, whole) < 1e-13
    exact = x.double() @ lin.weight.detach().double().t() + (lin.bias.detach().double() if bias else 0.0)
    assert _relative(out, exact) < 1e-13
    assert record.roundoff == whole_record.roundoff == 2.0**-53 and record.precision == "float64"


@pytest.mark.parametrize("bias_shape", [(37,), (1, 37), (5, 1), (5, 37), ()])
def test_a_chunked_addmm_keeps_its_bias_beta_and_alpha(
    monkeypatch: pytest.MonkeyPatch,
    conversions: list[tuple[tuple[int, ...], int]],
    bias_shape: tuple[int, ...],
) -> None:
    torch.manual_seed(2)
    bias = torch.randn(bias_shape, dtype=torch.bfloat16)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    w = torch.randn(37, 16, dtype=torch.bfloat16)
    exact = 0.5 * bias.double() + 2.0 * (x.double() @ w.double().t())
    monkeypatch.setattr(convert, "_CHUNK_BYTES", 5 * 16 * 8)
    with raised():
        out = torch.addmm(bias, x, w.t(), beta=0.5, alpha=2.0)
    assert max(size for s, size in conversions if s[:1] == (16,)) <= 5 * 16 * 8
    assert out.dtype == torch.float64 and _relative(out, exact) < 1e-13


def test_a_chunked_product_puts_each_block_in_its_own_columns(
    monkeypatch: pytest.MonkeyPatch, conversions: list[tuple[tuple[int, ...], int]]
) -> None:
    """Blocks that do not divide the columns (37 in blocks of 8, 6 and 1), of a weight whose
    blocks are not dense (x @ w, w 16 x 37 contiguous): every column lands where it belongs."""
    torch.manual_seed(3)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(16, 37, dtype=torch.bfloat16)
    exact = x.double() @ w.double()
    for columns in (8, 6, 1, 36, 37):  # 37: the weight is one block, so it is not cut
        monkeypatch.setattr(convert, "_CHUNK_BYTES", columns * 16 * 8)
        conversions.clear()
        with raised(noise=1e-12, seed=1):
            noisy = x @ w
        with raised():
            out = x @ w
        blocks = [s for s, _ in conversions if s[:1] == (16,)]
        assert len(blocks) == 2 * -(-37 // columns) and max(s[1] for s in blocks) == columns
        for lo in range(0, 37, 5):  # column by column: a block in the wrong columns is found
            assert _relative(out[:, lo : lo + 5], exact[:, lo : lo + 5]) < 1e-13, (columns, lo)
        assert 1e-14 < _relative(noisy, exact) < 1e-10  # the noise after the product, as unchunked


# -- large tensors raised by a Triton kernel of our own -------------------------------------------------


def _triton_device() -> str:
    """Where the conversion kernel runs here: CUDA, or the CPU in Triton's interpreter (the root
    conftest sets TRITON_INTERPRET=1 without CUDA, before triton is imported)."""
    triton = pytest.importorskip("triton", reason="the conversion kernel is Triton's (pip install triton)")
    if torch.cuda.is_available():
        return "cuda"
    if type(triton.language.standard.zeros).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    return "cpu"


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[int]]:
    """The kernel on this machine's device at any size, loaded afresh: (device, the number of
    elements of each launch)."""
    device = _triton_device()
    monkeypatch.setattr(convert, "_FAST_DEVICES", {"cuda", device})
    monkeypatch.setattr(convert, "_FAST_MIN_NUMEL", 1)
    return device, _launches_counted(monkeypatch)


def _launches_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernel loaded afresh, and the number of elements of each of its launches from here on."""
    monkeypatch.setattr(convert, "_kernel", None)
    sizes: list[int] = []
    on_grid = convert._on_grid

    def counted(kernel: Any, src: torch.Tensor, dst: torch.Tensor, n: int) -> Any:
        sizes.append(n)
        return on_grid(kernel, src, dst, n)

    monkeypatch.setattr(convert, "_on_grid", counted)
    return sizes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64)


def _specials(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zeros of both signs, infinities, subnormals, the largest value and NaN in it."""
    flat = t.reshape(-1)
    tiny = torch.finfo(t.dtype).smallest_normal / 4
    values = [0.0, -0.0, float("inf"), float("-inf"), tiny, -tiny, torch.finfo(t.dtype).max]
    flat[: len(values)] = torch.tensor(values, dtype=t.dtype)
    flat[-1] = float("nan")
    return t


def _same_as_to(got: torch.Tensor, t: torch.Tensor) -> None:
    want = t.to(torch.float64)
    assert (got.dtype, got.shape, got.stride(), got.device) == (
        want.dtype,
        want.shape,
        want.stride(),
        want.device,
    )
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan]), "not bit for bit what .to() gives"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_conversion_kernel_is_bit_for_bit_what_to_gives(
    launched: tuple[str, list[int]], dtype: torch.dtype
) -> None:
    device, sizes = launched
    # Sizes that are no multiple of the kernel's block (2048), so the last block is cut short.
    x = _specials(torch.randn(37, 2051, generator=torch.Generator().manual_seed(0)).to(device, dtype))
    cases = [x, x.t(), x[3:], x[3:].t(), x.reshape(37, 7, 293), x.reshape(-1)[1:]]
    for t in cases:
        _same_as_to(convert._to_float64(t), t)
    assert sizes == [t.numel() for t in cases]
    w = nn.Parameter(x.clone())  # a weight as the forward hands it over
    _same_as_to(convert._to_float64(w), w)
    _same_as_to(convert._to_float64(w.t()), w.t())


def test_a_tensor_that_is_not_dense_is_converted_by_to(launched: tuple[str, list[int]]) -> None:
    device, sizes = launched
    x = torch.randn(37, 2051, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    for t in (x[:, 5:], x[:, ::2], x.t()[1:], x.reshape(37, 7, 293).permute(1, 0, 2), torch._neg_view(x)):
        _same_as_to(convert._to_float64(t), t)
    assert sizes == []


def test_the_conversion_kernel_is_no_launch_of_the_forward(launched: tuple[str, list[int]]) -> None:
    """The reference hands every top-level Triton launch to its own hook, which would take the
    conversion for a kernel of the module's: it is launched past the hooks."""
    device, sizes = launched
    convert._load_kernel()  # triton's kernel classes loaded, so that the hook patches them
    seen: list[str] = []

    def hook(launch: Launch) -> Any:
        seen.append(launch.name)
        return launch()

    x = torch.randn(300, 7, device=device, dtype=torch.bfloat16)
    with triton_launches(hook):
        _same_as_to(convert._to_float64(x), x)
    assert sizes == [x.numel()] and seen == []


def test_without_triton_the_conversion_is_to(
    monkeypatch: pytest.MonkeyPatch, launched: tuple[str, list[int]]
) -> None:
    device, sizes = launched
    x = torch.randn(300, 7, device=device, dtype=torch.bfloat16)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton: ImportError
    _same_as_to(convert._to_float64(x), x)
    assert convert._kernel is False and sizes == []
    monkeypatch.delitem(sys.modules, "triton")
    _same_as_to(convert._to_float64(x), x)
    assert sizes == [], "triton is not asked again"


def test_a_kernel_that_fails_at_its_first_launch_is_not_launched_again(
    monkeypatch: pytest.MonkeyPatch, launched: tuple[str, list[int]]
) -> None:
    device, sizes = launched
    x = torch.randn(300, 7, device=device, dtype=torch.bfloat16)
    on_grid = convert._on_grid

    def failing(kernel: Any, src: torch.Tensor, dst: torch.Tensor, n: int) -> Any:
        sizes.append(n)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(convert, "_on_grid", failing)
    _same_as_to(convert._to_float64(x), x)  # silently .to()
    _same_as_to(convert._to_float64(x), x)
    assert convert._kernel is False and sizes == [x.numel()]
    # Once it has run, a kernel that fails is an error like any other, not hidden.
    monkeypatch.setattr(convert, "_kernel", None)
    monkeypatch.setattr(convert, "_on_grid", on_grid)
    _same_as_to(convert._to_float64(x), x)
    monkeypatch.setattr(convert, "_on_grid", failing)
    with pytest.raises(RuntimeError, match="no compiler here"):
        convert._to_float64(x)


def test_a_forward_raised_with_the_conversion_kernel_is_the_same(
    monkeypatch: pytest.MonkeyPatch, launched: tuple[str, list[int]]
) -> None:
    """Two bf16 layers (one weight in blocks, its blocks through the kernel too) under ``raised()``:
    with the kernel, the same float64 output as with ``.to()``, bit for bit (the conversion is exact
    either way, and the products are the same)."""
    device, sizes = launched
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 37), nn.GELU(), nn.Linear(37, 11, bias=False)).to(
        device, torch.bfloat16
    )
    x = torch.randn(2, 3, 16, device=device, dtype=torch.bfloat16)
    monkeypatch.setattr(convert, "_CHUNK_BYTES", 5 * 16 * 8)  # the first weight in blocks of 5 columns
    with raised() as record:
        fast = model(x)
    assert sizes and max(sizes) < 37 * 16 and record.precision == "float64" and not record.outside
    launches = len(sizes)
    monkeypatch.setattr(convert, "_FAST_DEVICES", set())
    with raised():
        plain = model(x)
    assert len(sizes) == launches
    assert fast.dtype == torch.float64 and torch.equal(fast, plain)


def test_importing_the_reference_imports_no_triton() -> None:
    """triton is imported at the first large conversion of a fast device, not before (loading the
    plugin, importing precision, a forward on the CPU)."""
    code = (
        "import sys, torch\n"
        "from pytest_cudagraph.precision import raised\n"
        "with raised():\n"
        "    torch.nn.Linear(4, 4).bfloat16()(torch.ones(2, 4, dtype=torch.bfloat16))\n"
        "sys.exit(3 if 'triton' in sys.modules else 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:] or "triton was imported"


@pytest.mark.cuda
def test_the_conversion_kernel_and_the_blocks_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the sizes it is for (a Llama-8B MLP weight and larger), on the GPU: bit for bit what
    ``.to()`` gives, and a product with a weight larger than a block raised in blocks, using no
    more memory than a block and the output."""
    pytest.importorskip("triton")
    monkeypatch.setattr(convert, "_kernel", None)
    sizes: list[int] = []
    on_grid = convert._on_grid

    def counted(kernel: Any, src: torch.Tensor, dst: torch.Tensor, n: int) -> Any:
        sizes.append(n)
        return on_grid(kernel, src, dst, n)

    monkeypatch.setattr(convert, "_on_grid", counted)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = _specials(torch.randn(14336, 4096, device="cuda", generator=gen).to(torch.bfloat16))
    odd = _specials(torch.randn(8191, 4099, device="cuda", generator=gen))  # 33.6M: no multiple of the block
    for t in (w, w.t(), odd.half(), odd.half().t(), odd, odd.t()):
        _same_as_to(convert._to_float64(t), t)
    assert len(sizes) == 6
    del w, odd
    # A weight of 20000 x 4096 bf16 is 655 MB in float64: two blocks of columns (16384 and 3616).
    weight = torch.randn(20000, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(7, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    exact = x.double() @ weight.double().t()
    sizes.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with raised():
        out = torch.nn.functional.linear(x, weight)
    torch.cuda.synchronize()
    added = torch.cuda.max_memory_allocated() - before
    assert sizes == [16384 * 4096]  # the last block (3616 columns) is below _FAST_MIN_NUMEL: .to()
    assert added < convert._CHUNK_BYTES + 64 * 2**20, f"{added / 2**20:.0f} MiB"
    assert out.dtype == torch.float64 and _relative(out, exact) < 1e-13


def test_an_embedding_reads_its_rows_without_converting_the_table(
    conversions: list[tuple[tuple[int, ...], int]],
) -> None:
    """A selection (embedding, index_select, gather, indexing) runs on the table as it is and only what
    it selected is raised: the table is never converted whole (at 8B, 3.9 GiB a forward)."""
    torch.manual_seed(4)
    table = nn.Embedding(1000, 16).to(torch.bfloat16)
    ids = torch.tensor([[3, 999, 3, 0]])
    rows = torch.tensor([5, 7])
    with raised(noise=2.0**-53, seed=1) as record:
        out = table(ids)
        picked = table.weight.index_select(0, rows)
        indexed = table.weight[rows]
        gathered = table.weight.gather(0, rows[:, None].expand(2, 16))
    assert not [s for s, _ in conversions if s == (1000, 16)], conversions
    for got, want in ((out, table.weight[ids]), (picked, table.weight[rows]), (indexed, table.weight[rows])):
        assert got.dtype == torch.float64 and torch.equal(got, want.detach().double())
    assert torch.equal(gathered, table.weight[rows].detach().double())
    assert record.precision == "float64"
