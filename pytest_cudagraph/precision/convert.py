"""How a value is raised: what each dtype becomes at each target precision (``_TIERS``), an op's
operands raised (``_raised``), or lowered to the dtype of the tensor an op writes (``_lowered``), a
product with a large weight computed a block of the weight's columns at a time (``_by_columns``),
and large dense CUDA tensors converted to float64 by a Triton kernel of our own
(``_to_float64``), faster than ``.to()``."""

from __future__ import annotations

from typing import Any

import torch

from ..launches import relaunch
from ..observe import unit_roundoff

aten = torch.ops.aten

#: What each dtype becomes in the raised forward.
_RAISE = {
    torch.float16: torch.float64,
    torch.bfloat16: torch.float64,
    torch.float32: torch.float64,
    torch.complex32: torch.complex128,
    torch.complex64: torch.complex128,
}
#: Where an op without a float64 kernel runs instead (float32, with TF32 off for the whole block).
_LOWER = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float64: torch.float32,
    torch.complex32: torch.complex64,
    torch.complex128: torch.complex64,
}
#: The float32 reference, for a forward that cannot run in float64 (an extension that takes float32
#: alone, a dtype check): float16 and bfloat16 raised to float32, float32 left as it is.
_RAISE32 = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.complex32: torch.complex64,
}
#: Per target precision: what each dtype becomes, and where an op without a kernel there runs.
_TIERS: dict[torch.dtype, tuple[dict[torch.dtype, torch.dtype], dict[torch.dtype, torch.dtype] | None]] = {
    torch.float64: (_RAISE, _LOWER),
    torch.float32: (_RAISE32, None),
}

#: Products computed a block of their weight's columns at a time when that weight would be large in
#: the raised precision, by where the weight (``mat2``) is among their arguments. At 8B (Llama, bf16
#: weights on an H200) the lm_head weight, 128256x4096, is 3.9 GiB in float64. In blocks of
#: ``_CHUNK_BYTES`` it adds a block, not the whole weight: on the H200 an mm of 7 tokens with that
#: weight under ``raised()`` added 552 MiB at its peak and took 2.43 ms (2.30 ms unchunked). (The
#: reference stage's 22.9 GiB peak at 8B, 15.1 GiB held before it, was the embedding table's
#: conversion, ``_EXACT`` in raising.py, not this product's.)
_BY_COLUMNS = {aten.mm.default: 1, aten.addmm.default: 2}
_CHUNK_BYTES = 512 << 20

_FLOAT64 = torch.float64
#: Tensors raised to float64 by a Triton kernel of our own (``_to_float64``) rather than ``.to()``:
#: at least this many elements, on these device types, dense in memory. On an H200 (torch 2.11,
#: triton 3.6) ``.to(torch.float64)`` of a 14336x4096 bf16 weight (Llama-8B's MLP) took 0.239 ms and
#: the kernel 0.154 ms, bit-identical, and so for its transpose (what ``mm`` receives from
#: ``F.linear``); the 136 forwards of the ``padded_size`` reference convert every weight each time.
#: Below the threshold a launch's Python cost eats the gain. Tests widen the devices to "cpu" (the
#: kernel then runs in Triton's interpreter) and lower the threshold.
_FAST_MIN_NUMEL = 1 << 25
_FAST_DEVICES = {"cuda"}
_FAST_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
_FAST_BLOCK = 2048
#: The kernel, jitted at the first large conversion (importing this module never imports triton):
#: None before, False where triton cannot be imported or the kernel's first launch failed
#: (``.to()`` from then on).
_kernel: Any = None
#: ``triton.language``, set with ``_kernel``: the name the kernel's body reads it by.
tl: Any = None


def _raise_to_float64(src, dst, n, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def,valid-type]
    """Triton kernel (jitted by ``_load_kernel``): ``dst[i] = float64(src[i])`` for i < n, flat.

    bfloat16 comes as its bits (int16), made float32 by putting them in a float32's upper half, as
    torch does: exact for every value, subnormals included, where Triton's interpreter flushes
    them."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    values = tl.load(src + offs, mask=inside)
    if BF16_BITS:
        values = (values.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    tl.store(dst + offs, values.to(tl.float64), mask=inside)


def _load_kernel() -> Any:
    """The conversion kernel, or False where triton is not there (imported here, at first use)."""
    global _kernel, tl
    try:
        import triton  # type: ignore[import-untyped,import-not-found]
        import triton.language  # type: ignore[import-untyped,import-not-found]
    except Exception:
        _kernel = False
    else:
        tl = triton.language
        _kernel = triton.jit(_raise_to_float64)
    return _kernel


def _on_grid(kernel: Any, src: torch.Tensor, dst: torch.Tensor, n: int) -> Any:
    """``relaunch``'s ``run``: the kernel launched over ``n`` elements."""
    bf16 = src.dtype == torch.bfloat16
    return kernel[((n + _FAST_BLOCK - 1) // _FAST_BLOCK,)](
        src.view(torch.int16) if bf16 else src, dst, n, BF16_BITS=bf16, BLOCK=_FAST_BLOCK
    )


def _to_float64(t: torch.Tensor) -> torch.Tensor:
    """``t.to(torch.float64)``, bit for bit with the same shape and strides: by the Triton kernel where
    ``t`` is a large dense tensor of a fast device (see ``_FAST_MIN_NUMEL``), else by ``.to()``.

    Dense: contiguous, or a 2-D tensor whose transpose is contiguous (the weight side of ``mm``
    from ``F.linear``), converted as that transpose and transposed back, as ``.to()`` keeps the
    strides of a dense tensor. The launch goes past ``triton_launches``' hooks (``relaunch``): the
    reference's hook would take it for a kernel of the module's own."""
    global _kernel
    if (
        t.device.type not in _FAST_DEVICES
        or t.dtype not in _FAST_DTYPES
        or type(t) not in (torch.Tensor, torch.nn.Parameter)  # a subclass's memory is its own business
        or t.is_neg()
        or t.numel() < max(_FAST_MIN_NUMEL, 1)
    ):
        return t.to(_FLOAT64)
    if t.is_contiguous():
        src = t
    elif t.dim() == 2 and t.t().is_contiguous():
        src = t.t()
    else:
        return t.to(_FLOAT64)
    first = _kernel is None
    kernel = _load_kernel() if first else _kernel
    if kernel is False:
        return t.to(_FLOAT64)
    out = torch.empty_like(src, dtype=_FLOAT64)
    try:
        relaunch(kernel, _on_grid, src, out, src.numel())
    except Exception:
        if not first:
            raise
        _kernel = False  # no compiler, no driver Triton can use: .to() from now on, silently
        return t.to(_FLOAT64)
    return out if src is t else out.t()


def _raised(value: Any, table: dict[torch.dtype, torch.dtype]) -> Any:
    """``value`` with its tensors and dtypes of ``table`` raised, in lists and tuples too (a
    hand-written walk: the dispatcher's arguments are flat, and a general tree walk costs more
    than most ops do)."""
    if isinstance(value, torch.Tensor):
        to = table.get(value.dtype)
        if to is None:
            return value
        if to is _FLOAT64 and value.numel() >= _FAST_MIN_NUMEL:
            return _to_float64(value)
        return value.to(to)
    if isinstance(value, torch.dtype):
        return table.get(value, value)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (torch.Tensor, list, tuple)):
        return type(value)(_raised(v, table) for v in value)
    return value


def _needs_raising(value: Any, table: dict[torch.dtype, torch.dtype]) -> bool:
    """Whether ``_raised`` may change ``value``: a tensor of a lower precision, a dtype, or a list that
    ``_raised`` walks (one of tensors or lists; a list of sizes or dimensions it leaves alone)."""
    if type(value) is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype in table
    if isinstance(value, (list, tuple)):
        return bool(value) and isinstance(value[0], (torch.Tensor, list, tuple))
    return isinstance(value, torch.dtype)


def _lowered(value: Any, dtype: torch.dtype) -> Any:
    """A floating operand in ``dtype`` (an op writing a tensor of that dtype takes its values in it)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_lowered(v, dtype) for v in value)
    if (
        isinstance(value, torch.Tensor)
        and (value.is_floating_point() or value.is_complex())
        and value.dtype != dtype
        and value.dtype.is_complex == dtype.is_complex
        and unit_roundoff(value.dtype) != 0.0
        and value.dtype.itemsize >= dtype.itemsize
    ):
        return value.to(dtype)
    return value


def _too_large(weight: Any, table: dict[torch.dtype, torch.dtype]) -> bool:
    """Whether ``weight``, a product's ``mat2``, is a plain matrix of a lower precision that would take
    more than ``_CHUNK_BYTES`` raised (a subclass, a quantized weight, is left to its own ops)."""
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.dim() != 2:
        return False
    to = table.get(weight.dtype)
    return to is not None and weight.numel() * to.itemsize > _CHUNK_BYTES


def _by_columns(
    func: Any,
    args: list[Any],
    kwargs: dict[str, Any],
    at: int,
    weight: torch.Tensor,
    table: dict[torch.dtype, torch.dtype],
) -> torch.Tensor:
    """``func`` (``mm`` or ``addmm``, its other arguments raised) with its weight ``weight`` (``args[at]``,
    of a lower precision) raised a block of columns at a time, each block's product written into its
    columns of one output: the memory the weight takes raised is a block of ``_CHUNK_BYTES``, not the
    whole of it. ``addmm``'s bias is broadcast to the output's shape and cut with the block, with
    ``beta`` and ``alpha`` as they were. Each column of the output is the same dot products as
    without blocks; only which kernel the library picks for a narrower product may differ, by
    rounding of float64's size."""
    to = table[weight.dtype]
    rows, cols = weight.shape
    step = max(1, _CHUNK_BYTES // max(1, rows * to.itemsize))
    bias = args[0] if at == 2 else None
    out: torch.Tensor | None = None
    for lo in range(0, cols, step):
        hi = min(lo + step, cols)
        part_args = list(args)
        part_args[at] = _raised(weight[:, lo:hi], table)
        if bias is not None:
            part_args[0] = bias.expand(args[1].shape[0], cols)[:, lo:hi]
        part = func(*part_args, **kwargs)
        del part_args  # the block raised goes before the next one is made
        if out is None:
            out = part.new_empty((part.shape[0], cols))
        out[:, lo:hi].copy_(part)
        del part
    assert out is not None
    return out
