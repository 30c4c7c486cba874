"""Two kernels the float64 reference cannot run, as engines write them, and their references.

- ``attention(q, k, v)``: the custom op ``cgref::attention``, causal attention over tensors of shape
  (heads, tokens, head_dim) in bfloat16 or float16 alone, refusing any other dtype with a
  ``TypeError`` as FlashAttention does. Inside, torch's SDPA in the input dtype stands for the fused
  kernel; the dispatcher sees the op whole, never inside it.
- ``rms_norm(x, weight, eps)``: a Triton RMSNorm launched from a Python function that takes bfloat16
  alone (a kernel written for one dtype checks it before it launches).

Each has a reference of plain torch ops that takes the same arguments and returns what the kernel
returns, in any dtype: ``attention_reference`` and ``rms_norm_reference``, the functions a user hands
in (``references={attention: attention_reference, rms_norm: rms_norm_reference}``) so that the
float64 reference runs them in the kernels' place.

Triton is optional: without it ``rms_norm`` raises (``HAS_TRITON`` says so) and the rest imports and
runs. Without a GPU the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported when CUDA is absent), which launches it on CPU tensors; ``INTERPRETED``
says whether it does (it does not where triton was imported before the variable was set). The
interpreter is slow (about 1.5 ms a program, so 50 ms for a norm over 32 tokens) and rounds the
float32 -> bfloat16 store toward zero where a GPU rounds to nearest: on the CPU the kernel is up to
one bfloat16 ulp from its reference, not half of one.
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError:  # the attention op and the references need no triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = [
    "ATTENTION_DTYPES",
    "ATTENTION_OP",
    "HAS_TRITON",
    "INTERPRETED",
    "attention",
    "attention_reference",
    "rms_norm",
    "rms_norm_reference",
]

#: Whether triton imports (``rms_norm`` needs it).
HAS_TRITON = triton is not None

# -- attention: a custom op for half precision alone ------------------------------------------------

#: The op's qualified name, as ``references`` and ``register_reference`` take it as a string.
ATTENTION_OP = "cgref::attention"
#: The dtypes the op takes (FlashAttention's).
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


@torch.library.custom_op(ATTENTION_OP, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q``, ``k``, ``v`` of shape (heads, tokens, head_dim), in their dtype,
    which must be float16 or bfloat16: a fused kernel's dtype check, which is what keeps the float64
    reference from running it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in ATTENTION_DTYPES:
            raise TypeError(f"{ATTENTION_OP} takes float16 or bfloat16 only, got {name} of {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{ATTENTION_OP} takes q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What ``attention`` computes, in plain torch ops of any dtype: causal SDPA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# -- RMSNorm: a Triton kernel for bfloat16 alone -----------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _rms_norm_row(
        x_ptr, w_ptr, y_ptr, n_rows, D: tl.constexpr, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr
    ):
        # ROWS rows a program, each whole row in one block: a float32 sum of squares per row, then
        # the row scaled by its reciprocal RMS and the weight, in float32, stored in the output's
        # dtype. Several rows a program keep Triton's interpreter (the CPU) to a few programs.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < D)
        at = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        tl.store(y_ptr + at, (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=inside)


def _interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter, on CPU tensors: TRITON_INTERPRET=1 was set
    before triton was imported (triton.language's own helpers are jitted when it is imported)."""
    return HAS_TRITON and all(
        type(f).__name__ == "InterpretedFunction" for f in (_rms_norm_row, tl.standard.zeros)
    )


#: Rows each program of the kernel normalizes.
ROWS = 16

#: Whether the Triton kernel runs in Triton's interpreter (on CPU tensors).
INTERPRETED = _interpreted()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` by the Triton kernel, launched directly (outside
    torch's dispatcher). Takes bfloat16 alone, as a kernel written for one dtype does: the float64
    reference cannot run it, ``rms_norm_reference`` stands in for it there."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise TypeError(f"rms_norm takes bfloat16 only, got x of {x.dtype} and weight of {weight.dtype}")
    if not HAS_TRITON:
        raise RuntimeError("rms_norm launches a Triton kernel: install triton (pip install triton)")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {d}")
    x = x.contiguous()  # rows at a stride of d, as the kernel reads them
    y = torch.empty_like(x)
    n_rows = x.numel() // d if d else 0
    if n_rows:
        _rms_norm_row[(triton.cdiv(n_rows, ROWS),)](
            x, weight, y, n_rows, d, eps, BLOCK=triton.next_power_of_2(d), ROWS=ROWS
        )
    return y


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """What ``rms_norm`` computes, in plain torch ops of any dtype: the statistic and the scaling in
    float32 or wider (never narrower than ``x``, so float64 stays float64), the result in ``x``'s dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # a Python choice: no op to capture
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(acc)).to(x.dtype)
