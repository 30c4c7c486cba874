"""``invariant`` and ``padded_size``'s fast route (issue #67).

Under ``invariant`` every product, row-wise reduction and attention over queries and keys of one
length reaches its kernel with its rows padded to a multiple of 8, so eager at a graph's padded
size and eager on its real batch run one program: the real rows agree bit for bit wherever the
module computes alike. ``padded_size`` settles such batches without float64, asks float64 at the
largest batch always, and wherever the two forwards differ in a bit or in the ops they ran.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pytest_cudagraph import verify
from pytest_cudagraph.checks.builtin.padded_fast import bits_differ, traces_part
from pytest_cudagraph.invariant import ROWS, Invariance, invariant
from pytest_cudagraph.invariant.mode import _row_local
from pytest_cudagraph.observe import DispatchMode
from tests.models import bf16_llama

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten
SIZES = (4, 8, 16)
VOCAB = 512


def _stack(
    x: torch.Tensor, w: torch.Tensor, heads: int = 4, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """A decoder layer's arithmetic on (T, H) rows: a norm, a projection, causal attention, a softmax."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    q = (h @ w).view(1, x.shape[0], heads, -1).transpose(1, 2)
    if mask is None:
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    else:
        a = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    out = a.transpose(1, 2).reshape(x.shape[0], -1) @ w.t()
    return torch.log_softmax(F.layer_norm(out, out.shape[-1:]), -1)


def test_invariant_computes_what_each_op_computes() -> None:
    """Padding the rows changes no result: each op's output equals the plain op's (to rounding)."""
    torch.manual_seed(0)
    x, w = torch.randn(13, 64), torch.randn(64, 64) / 8
    causal = torch.ones(13, 13, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(13, 13).masked_fill(~causal[0, 0], torch.finfo(torch.float32).min)[None, None]
    for mask in (None, causal, additive):
        state = Invariance()
        with invariant(state):
            got = _stack(x, w, mask=mask)
        torch.testing.assert_close(got, _stack(x, w, mask=mask), rtol=1e-5, atol=1e-5)
        assert {"matmul", "mean", "log_softmax", "layer_norm"} <= state.padded
        assert any("attention" in op for op in state.padded), state.padded
        assert state.holds, state.not_row_local


@pytest.mark.parametrize(("n", "padded"), [(3, 4), (5, 8), (13, 16), (57, 64)])
def test_the_real_rows_agree_bit_for_bit_with_the_padded_size(n: int, padded: int) -> None:
    """A real batch and its graph's padded size reach every kernel as the same row count."""
    torch.manual_seed(0)
    rows = torch.randn(padded, 64, dtype=torch.bfloat16)
    w = (torch.randn(64, 64) / 8).to(torch.bfloat16)
    with invariant():
        real = _stack(rows[:n], w)
        at_padded = _stack(rows, w)[:n]
    assert torch.equal(real, at_padded)
    assert -(-n // ROWS) == -(-padded // ROWS)  # both meet at the same multiple of ROWS


class _Shapes(DispatchMode):
    """The shapes each op reaches the kernel with (entered outside ``invariant``: it sees what
    ``invariant`` hands on)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.seen.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


def test_products_and_reductions_reach_the_kernel_at_the_padded_row_count() -> None:
    """121 real rows and their graph's 128 reach the kernel as 128 rows (where MKL's bf16 product
    over 1024 features rounds 121 rows otherwise than the first 121 of 128, on AVX-512)."""
    x, w = torch.randn(121, 1024, dtype=torch.bfloat16), torch.randn(1024, 64, dtype=torch.bfloat16)
    shapes = _Shapes()
    with shapes, invariant():
        x @ w
        x.float().pow(2).mean(-1)
    rows = {name: s[0][0] for name, s in shapes.seen if name in ("mm", "mean")}
    assert rows == {"mm": 128, "mean": 128}, shapes.seen


def test_an_op_whose_rows_depend_on_each_other_is_not_row_local() -> None:
    """The check the invariance rests on: rows of one call computed independently of each other."""
    x = torch.randn(8, 4)
    flip = aten.flip.default  # row i of the result is row 7 - i of the operand
    assert not _row_local(flip, (x, [0]), {}, [(0, 0)], flip(x, [0]))
    w = torch.randn(4, 4)
    assert _row_local(aten.mm.default, (x, w), {}, [(0, 0)], aten.mm.default(x, w))


def test_a_branch_that_rounds_away_parts_the_traces() -> None:
    """A scale of 1.001 on bf16 values changes no bit of them, but the two forwards run other ops."""
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    scaled = x * 1.001
    assert not bits_differ(scaled, x).item()  # rounded away in bf16
    real, padded = Invariance(trace=[]), Invariance(trace=[])
    with invariant(real):
        x + 1
    with invariant(padded):
        (x + 1) * 1.001
    assert "mul(1.001) at the padded size" in traces_part(real.trace or [], padded.trace or [])
    assert traces_part(real.trace or [], real.trace or []) == ""


class Logits(nn.Module):
    """A Llama's logits from ``(1, T)`` ids, times ``table[T]`` (float32: 1 where correct)."""

    def __init__(self, inner: nn.Module, table: dict[int, float] | None = None) -> None:
        super().__init__()
        self.inner = inner
        t = torch.ones(64)
        for tokens, scale in (table or {}).items():
            t[tokens] = scale
        self.register_buffer("table", t)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.inner(input_ids=input_ids, use_cache=False).logits
        return logits * self.table[input_ids.shape[1]]


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return bf16_llama(
        vocab=VOCAB, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, max_positions=64
    )


def _inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, VOCAB, (1, num_tokens))}


def _run(module: nn.Module, **kw: Any) -> Any:
    return verify(module, _inputs, capture_sizes=list(SIZES), checks=["real_batches", "padded_size"], **kw)


def _outcomes(report: Any) -> list[Any]:
    return [o for o in report.outcomes if o.check == "padded_size"]


def test_a_correct_model_is_settled_bit_for_bit_but_its_largest_batch(llama: nn.Module) -> None:
    for exhaustive in (True, False):
        report = _run(Logits(llama), exhaustive=exhaustive)
        assert report.ok, report.format()
        outcomes = _outcomes(report)
        assert sum(o.figures["float64"] for o in outcomes) == 1, [o.figures for o in outcomes]
        assert sum(o.figures["bit_for_bit"] for o in outcomes) == len(outcomes) - 1
        assert "settled bit for bit, 1 asked in float64" in report.summary()


def test_an_error_that_rounds_away_in_bf16_is_caught_through_the_trace(llama: nn.Module) -> None:
    """logits x 1.001 on every padded size: no bit of the bf16 logits moves, the ops do."""

    class Scaled(Logits):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            logits = super().forward(input_ids)
            return logits * 1.001 if input_ids.shape[1] in SIZES else logits

    report = _run(Scaled(llama), exhaustive=False)
    failed = [o for o in _outcomes(report) if not o.passed]
    assert len(failed) == len(SIZES), report.format()
    assert any("mul(1.001)" in o.figures.get("why_float64", "") for o in failed), [o.figures for o in failed]


def test_an_error_that_neither_bits_nor_ops_show_is_caught_at_the_largest_batch(llama: nn.Module) -> None:
    """A float32 table read at the token count: 1.001 at the largest size, which rounds away in bf16
    and adds no op; float64, asked at the largest batch always, sees it."""
    report = _run(Logits(llama, {max(SIZES): 1.001}), exhaustive=False)
    failed = [o for o in _outcomes(report) if not o.passed]
    assert [o.descriptor.num_tokens for o in failed] == [max(SIZES)], report.format()


def test_an_error_that_moves_bits_at_one_size_goes_to_float64(llama: nn.Module) -> None:
    """3 % at 8 tokens alone, through the same ops: the bits differ there, and float64 fails it."""
    report = _run(Logits(llama, {8: 1.03}), exhaustive=False)
    failed = [o for o in _outcomes(report) if not o.passed]
    assert [o.descriptor.num_tokens for o in failed] == [8], report.format()
    assert failed[0].figures["why_float64"].startswith("the two forwards differ bit for bit")


def test_a_failure_past_the_first_two_names_where_the_cause_was_diagnosed(llama: nn.Module) -> None:
    report = _run(Logits(llama, {4: 1.03, 8: 1.03, 16: 1.03}), exhaustive=True)
    failed = [o for o in _outcomes(report) if not o.passed]
    assert len(failed) == 3, report.format()
    told = [o for o in failed if "the cause is diagnosed at" in o.message]
    assert len(told) == 1, [o.message for o in failed]
    assert all(o.figures["relative_rms"] > o.figures["limit"] for o in failed)


@torch.library.custom_op("cgtest::rows_by_count", mutates_args=())
def rows_by_count(x: torch.Tensor) -> torch.Tensor:
    """The sum over each row's features, by another route at an odd row count: the same sum, rounded
    another way at another row count (as a kernel tiled per size does)."""
    return (x * 3).sum(-1) / 3 if x.shape[0] % 2 else x.sum(-1)


@rows_by_count.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0])


class RowSums(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_by_count(self.proj(x))


def test_a_kernel_that_rounds_per_size_goes_to_float64_and_passes() -> None:
    """A correct twin whose bf16 forwards differ across sizes: the fast route leaves them to float64,
    where they agree."""
    torch.manual_seed(0)

    def make(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"x": torch.randn(num_tokens, 32, dtype=torch.bfloat16)}

    report = verify(RowSums().eval(), make, capture_sizes=[2, 4, 8], checks=["real_batches", "padded_size"])
    assert report.ok, report.format()
    asked = [o for o in _outcomes(report) if o.figures.get("float64")]
    assert len(asked) > 1 and any("bit for bit" in o.figures.get("why_float64", "") for o in asked)


@pytest.mark.cuda
def test_on_cuda_the_real_rows_agree_bit_for_bit_and_a_correct_llama_asks_float64_once(
    llama: nn.Module,
) -> None:
    """On a GPU (cuBLAS's tiling per row count, fused attention, transformers' mask on the path a
    capture takes): the stack's rows agree at 505 and 512, and the correct Llama needs float64 at
    its largest batch alone."""
    torch.manual_seed(0)
    rows = torch.randn(512, 256, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(256, 256, device="cuda") / 16).to(torch.bfloat16)
    with invariant():
        assert torch.equal(_stack(rows[:505], w), _stack(rows, w)[:505])
    model = Logits(copy.deepcopy(llama)).cuda()

    def make(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"input_ids": torch.randint(0, VOCAB, (1, num_tokens), device="cuda")}

    report = verify(
        model, make, capture_sizes=[1, 2, 4, 8, 16, 24, 32], checks=["real_batches", "padded_size"]
    )
    assert report.ok, report.format()
    outcomes = _outcomes(report)
    assert sum(o.figures["float64"] for o in outcomes) <= 3, [o.figures for o in outcomes]


def test_a_call_whose_rows_depend_on_each_other_settles_nothing(
    llama: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where padding a call's rows changed what it computes (its rows not independent), the two
    forwards under ``invariant`` prove nothing: every batch goes to float64, and says why."""
    from pytest_cudagraph.invariant import mode

    monkeypatch.setattr(mode, "_CHECKED", {})
    monkeypatch.setattr(mode, "_row_local", lambda *a: False)
    report = _run(Logits(llama), exhaustive=True)
    assert report.ok, report.format()
    outcomes = _outcomes(report)
    assert all(o.figures["float64"] == 1 and o.figures["bit_for_bit"] == 0 for o in outcomes)
    assert all("a padded call's rows depend on each other (" in o.figures["why_float64"] for o in outcomes), [
        o.figures.get("why_float64") for o in outcomes
    ]


def test_a_padded_operand_keeps_its_layout() -> None:
    """Queries are a transposed view: padded into a tensor of that layout, not a contiguous one (a
    kernel chosen per layout would run another program on the real batch than at the padded size)."""
    from pytest_cudagraph.invariant.mode import _pad_dim

    x = torch.randn(1, 5, 4, 8).transpose(1, 2)  # (batch, heads, sequence, dim), sequence outermost
    y = _pad_dim(x, 2, 8)
    assert y.shape == (1, 4, 8, 8) and torch.equal(y[:, :, :5], x) and not y[:, :, 5:].any()
    order = sorted(range(4), key=lambda d: -x.stride(d))
    assert sorted(range(4), key=lambda d: -y.stride(d)) == order


def test_an_operand_written_in_place_is_padded_anew() -> None:
    """One operand padded once for the products that read it (a decoder's q, k and v projections),
    but padded again once it is written in place."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 16), torch.randn(16, 16)
    with invariant():
        first = x @ w
        again = x @ w
        x.mul_(2)
        doubled = x @ w
    assert torch.equal(first, again)
    torch.testing.assert_close(doubled, 2 * first)
