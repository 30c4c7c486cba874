"""Triton kernels as serving engines write them, and two with the bugs such kernels have.

Each computes in float32 whatever it is handed and picks its blocking from the
token count (an autotune keyed on the row count, or a heuristic on it), so its
rounding changes with the batch shape, correctly. Without a GPU they run in
Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is
imported when CUDA is absent), which launches them on CPU tensors.

- ``rms_norm(x, w, how="autotune" | "heuristic")``: one program per row, a
  float32 sum of squares in blocks of ``BLOCK`` columns.
- ``rms_norm_over_launch(x, w)``: the bug: one mean square over every launched
  row, padded rows included (a per-tensor statistic).
- ``fake_quant(x, per_token=...)``: int8 round trip with a per-token absmax, or
  the bug: one absmax over every launched row.
- ``noise_from(x, seed, offset)``: Philox noise seeded from Python numbers (the bug a graph
  freezes: every replay repeats the capture's draw); ``noise_at(x, seed, offset_tensor)`` reads
  the offset from device memory and advances it there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

__all__ = ["INTERPRETED", "fake_quant", "noise_at", "noise_from", "rms_norm", "rms_norm_over_launch"]


def _interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter, on CPU tensors: TRITON_INTERPRET=1 was set
    before triton was imported (triton.language's own helpers are jitted when it is imported)."""
    return all(type(f).__name__ == "InterpretedFunction" for f in (_rms_norm_rows, tl.standard.zeros))


def _cpu_bench(fn: Callable[[], Any], quantiles: Any = None, **_: Any) -> Any:
    """Autotune's timer where no GPU times it: wall-clock, so the chosen block varies run to run."""
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return [ms, ms, ms] if quantiles else ms


_BENCH: dict[str, Any] = {"do_bench": _cpu_bench} if os.environ.get("TRITON_INTERPRET") == "1" else {}


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, y_ptr, n_rows, D: tl.constexpr, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    # The sum of squares block by block: D / BLOCK partial sums added in float32, in order.
    acc = tl.zeros([1], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        acc += tl.sum(x * x, 0)
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / D + eps)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=cols < D)


#: Whether the kernels run in Triton's interpreter (on CPU tensors).
INTERPRETED = _interpreted()

_rms_norm_autotuned = triton.autotune(
    configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n_rows"], **_BENCH
)(_rms_norm_rows)
_rms_norm_heuristic = triton.heuristics(
    {"BLOCK": lambda args: 16 if args["n_rows"] < 4 else 32 if args["n_rows"] < 8 else 64}
)(_rms_norm_rows)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, *, how: str = "autotune") -> torch.Tensor:
    """RMSNorm over the last dimension of a 2-D ``x``, launched directly."""
    y = torch.empty_like(x)
    n_rows, d = x.shape
    kernel = _rms_norm_autotuned if how == "autotune" else _rms_norm_heuristic
    kernel[(n_rows,)](x, w, y, n_rows, d, eps)
    return y


@triton.jit
def _rms_norm_launch(x_ptr, w_ptr, y_ptr, n_rows, D: tl.constexpr, eps, BLOCK: tl.constexpr):
    # One program: the mean square over every launched row, then every row scaled by it.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(0, n_rows):
        for start in range(0, D, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / (D * n_rows) + eps)
    for row in range(0, n_rows):
        for start in range(0, D, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
            tl.store(y_ptr + row * D + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=cols < D)


def rms_norm_over_launch(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    y = torch.empty_like(x)
    n_rows, d = x.shape
    _rms_norm_launch[(1,)](x, w, y, n_rows, d, eps, BLOCK=64)
    return y


@triton.jit
def _fake_quant(x_ptr, y_ptr, n_rows, D: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if PER_TOKEN:
        amax = tl.max(tl.abs(tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)), 0)
    else:
        # The bug: one absmax over every launched row, padded rows included.
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for r in range(0, n_rows):
            v = tl.load(x_ptr + r * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        amax = tl.max(amax, 0)
    scale = tl.maximum(amax, 1e-6) / 127.0
    x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    q = tl.floor(x / scale + 0.5)
    tl.store(y_ptr + row * D + cols, (q * scale).to(y_ptr.dtype.element_ty), mask=cols < D)


def fake_quant(x: torch.Tensor, *, per_token: bool = True) -> torch.Tensor:
    """An int8 round trip of a 2-D ``x``, scaled per token, or (the bug) per launch."""
    y = torch.empty_like(x)
    n_rows, d = x.shape
    _fake_quant[(n_rows,)](x, y, n_rows, d, PER_TOKEN=per_token, BLOCK=triton.next_power_of_2(d))
    return y


@triton.jit
def _noise_kernel(y_ptr, n, seed, offset, BLOCK: tl.constexpr):
    # Philox noise from (seed, offset, element): a sampling kernel as engines write it.
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        tl.store(y_ptr + idx, tl.rand(seed, idx + offset * n), mask=idx < n)


@triton.jit
def _noise_at_kernel(y_ptr, n, seed, offset_ptr, BLOCK: tl.constexpr):
    # The same draw, its offset read from device memory and advanced there: a graph replays it anew.
    offset = tl.load(offset_ptr)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        tl.store(y_ptr + idx, tl.rand(seed, idx + offset * n), mask=idx < n)
    tl.store(offset_ptr, offset + 1)


def noise_from(like: torch.Tensor, seed: int, offset: int) -> torch.Tensor:
    """Uniform noise shaped like ``like`` from a seed and an offset given as Python numbers: the bug a
    graph freezes (every replay draws the capture's noise)."""
    y = torch.empty(like.shape, device=like.device, dtype=torch.float32)
    _noise_kernel[(1,)](y, like.numel(), seed, offset, BLOCK=256)
    return y.to(like.dtype)


def noise_at(like: torch.Tensor, seed: int, offset: torch.Tensor) -> torch.Tensor:
    """The same noise, its offset read from (and advanced in) ``offset``, a one-element int64 tensor."""
    y = torch.empty(like.shape, device=like.device, dtype=torch.float32)
    _noise_at_kernel[(1,)](y, like.numel(), seed, offset, BLOCK=256)
    return y.to(like.dtype)
