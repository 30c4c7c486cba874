"""Comparing outputs: bit for bit (NaN equals NaN) or within a dtype-aware tolerance."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from ..manager import tree

__all__ = ["Difference", "default_tolerance", "first_difference", "leaves"]

# (rtol, atol) per dtype for real batches against unpadded eager: kernels may
# sum a different number of rows in another order, so the last bits move.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return _TOLERANCES.get(dtype, (0.0, 0.0))


@dataclass
class Difference:
    """The first place two outputs disagree."""

    path: str
    reason: str
    index: tuple[int, ...] | None = None
    got: Any = None
    expected: Any = None
    max_abs: float | None = None
    max_ulp: int | None = None
    #: The leaf is an object forward made, neither a tensor nor a plain value.
    opaque: bool = False


def leaves(value: Any) -> list[tuple[str, Any]]:
    """(path, leaf) pairs: ``['logits']``, ``[1]``, ``.logits`` (a dataclass's
    or namedtuple's field); dataclasses are walked, not compared whole."""
    return tree.flatten_with_paths(value)


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    bits = t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64)
    width = t.element_size() * 8
    magnitude = bits & ((1 << (width - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def _layout(t: torch.Tensor) -> tuple[int | None, ...]:
    """The strides that address memory: a dimension of size 1 is never stepped
    along, so its stride says nothing (torch's contiguity ignores it too)."""
    return tuple(stride if size > 1 else None for size, stride in zip(t.shape, t.stride(), strict=True))


def _same_sign(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Where the sign bits of two floating tensors agree (both parts of a complex one)."""
    if g.is_complex():
        return _same_sign(g.real, e.real) & _same_sign(g.imag, e.imag)
    return torch.signbit(g) == torch.signbit(e)


def _scalar(t: torch.Tensor) -> Any:
    value = t.item()
    return value


def _compare_tensors(path: str, got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
                     check_strides: bool) -> Difference | None:
    if got.shape != expected.shape:
        return Difference(path, f"shape {tuple(got.shape)} but eager gives {tuple(expected.shape)}")
    if got.dtype != expected.dtype:
        return Difference(path, f"dtype {got.dtype} but eager gives {expected.dtype}")
    if check_strides and got.numel() > 1 and _layout(got) != _layout(expected):
        return Difference(path, f"strides {got.stride()} but eager gives {expected.stride()}")
    if got.numel() == 0:
        return None
    g = got.detach()
    e = expected.detach().to(g.device)
    floating = g.is_floating_point() or g.is_complex()
    dtype = g.dtype
    if floating and not g.is_complex() and dtype not in _INT_VIEW:
        # float8 and the like lack most CPU kernels (signbit, isfinite, isclose); float32
        # holds each of their values exactly, signed zeros and NaN included.
        g, e = g.float(), e.float()
    if floating:
        both_nan = torch.isnan(g) & torch.isnan(e)
        if rtol == 0 and atol == 0:
            # Bit for bit: 0.0 == -0.0 in IEEE arithmetic, but the sign bit is
            # part of the value (1 / x, atan2 and copysign read it).
            same = ((g == e) & _same_sign(g, e)) | both_nan
        else:
            same = torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
        same = g == e
    if bool(same.all()):
        return None
    flat_index = int((~same).reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), g.shape))
    diff = Difference(path, "values differ", index=index, got=_scalar(g[index]), expected=_scalar(e[index]))
    if floating and not g.is_complex():
        finite = torch.isfinite(g) & torch.isfinite(e)
        if bool(finite.any()):
            delta = (g.double() - e.double()).abs()[finite]
            diff.max_abs = float(delta.max())
            if dtype in _INT_VIEW:
                ulps = (_ordered_bits(g) - _ordered_bits(e)).abs()[finite]
                diff.max_ulp = int(ulps.max())
    elif not floating:
        diff.max_abs = float((g.long() - e.long()).abs().max()) if dtype != torch.bool else None
    return diff


def first_difference(
    got: Any,
    expected: Any,
    *,
    rtol: float | None = 0.0,
    atol: float | None = 0.0,
    check_strides: bool = False,
) -> Difference | None:
    """None when ``got`` equals ``expected``; else where they first differ.

    With ``rtol`` and ``atol`` 0 the comparison is bit for bit, NaN equal to
    NaN. ``None`` for either picks the dtype's default tolerance.
    """
    got_leaves, exp_leaves = leaves(got), leaves(expected)
    if [p for p, _ in got_leaves] != [p for p, _ in exp_leaves]:
        return Difference("", f"output structure {[p for p, _ in got_leaves]} but eager gives "
                              f"{[p for p, _ in exp_leaves]}")
    for (path, g), (_, e) in zip(got_leaves, exp_leaves, strict=True):
        if isinstance(g, torch.Tensor) or isinstance(e, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor)):
                return Difference(path, f"{type(g).__name__} but eager gives {type(e).__name__}")
            r, a = default_tolerance(g.dtype)
            found = _compare_tensors(
                path, g, e, r if rtol is None else rtol, a if atol is None else atol, check_strides
            )
            if found is not None:
                return found
        elif not (_plain(g) and _plain(e)):
            if g is not e:
                # Not a value but an object forward made (a KV cache, say): no
                # equality to trust, and a graph hands back the capture's one.
                return Difference(path, f"a {type(g).__name__} object, not a tensor or a plain value",
                                  got=g, expected=e, opaque=True)
        elif g != e and not (g != g and e != e):
            return Difference(path, "values differ", got=g, expected=e)
    return None


_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _plain(value: Any) -> bool:
    """A value compared by ``==``: numbers, strings, None, dtypes, enums."""
    return value is None or isinstance(value, _PLAIN) or isinstance(value, enum.Enum)
