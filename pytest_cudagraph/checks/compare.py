"""Comparing outputs: bit for bit (NaN equals NaN) or within a dtype-aware tolerance."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..manager import tree
from ..observe import bit_sums

__all__ = [
    "CHUNK",
    "Difference",
    "default_tolerance",
    "first_difference",
    "largest_difference",
    "last_place",
    "leaves",
    "nothing_finite",
    "same_print",
    "tree_print",
]

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


def default_tolerance(dtype: torch.dtype, compute: torch.dtype | None = None) -> tuple[float, float]:
    """(rtol, atol) for a result of ``dtype`` computed at ``compute``'s precision
    (an fp32 output of bf16 products, or of TF32 on a GPU, rounds as its
    products do): the looser of the two dtypes' tolerances."""
    rtol, atol = _TOLERANCES.get(dtype, (0.0, 0.0))
    if compute is not None and dtype in _TOLERANCES and compute in _TOLERANCES:
        crtol, catol = _TOLERANCES[compute]
        rtol, atol = max(rtol, crtol), max(atol, catol)
    return rtol, atol


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


#: A print of an output tree (``tree_print``): each leaf's path and what it is (a tensor's shape,
#: dtype, device and the strides that address memory; any other leaf itself), and the bit sums
#: of its tensors (``observe.bit_sums``) on the device, not yet read.
TreePrint = tuple[tuple[Any, ...], list[torch.Tensor]]

#: Leaves other than tensors that a print holds as they are (compared with ==).
_PLAIN_LEAVES = (type(None), bool, int, float, str)


def nothing_finite(value: Any) -> bool:
    """True when ``value`` holds tensors, every one of them floating (or complex) and NaN or inf in
    every element: a comparison of such outputs sees NaN equal NaN and inf equal inf, bit for bit,
    whatever computed them, so it can tell nothing. A tensor of integers or bools, a finite element
    anywhere, or no element at all: False."""
    tensors = [leaf for _, leaf in leaves(value) if isinstance(leaf, torch.Tensor)]
    if not tensors or not any(t.numel() for t in tensors):
        return False
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            return False
        if t.numel() and bool(torch.isfinite(t).any()):
            return False
    return True


def tree_print(value: Any) -> TreePrint | None:
    """A print of ``value`` that ``same_print`` holds to bit-for-bit equality, as
    ``first_difference(..., check_strides=True)`` does, short of a contrived collision of the sums,
    and stricter on NaN (two NaNs of other bit patterns differ here): queued work, read when
    compared. None where a leaf is neither a strided tensor nor a plain value."""
    meta: list[Any] = []
    sums: list[torch.Tensor] = []
    for path, leaf in leaves(value):
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided or type(leaf) not in (torch.Tensor, torch.nn.Parameter):
                return None  # a subclass's bits are not its values
            meta.append((path, tuple(leaf.shape), leaf.dtype, str(leaf.device), _layout(leaf)))
            sums.append(bit_sums(leaf))
        elif isinstance(leaf, _PLAIN_LEAVES):
            meta.append((path, type(leaf), leaf))
        else:
            return None
    return tuple(meta), sums


def same_print(a: TreePrint, b: TreePrint) -> bool:
    """Whether two prints are of the same tree, bit for bit (a synchronization per tensor leaf)."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    if not a[1]:
        return True
    return all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers: between two values of one sign (ULPs are counted only where signs
    agree), the difference of these is the count of representable values from one to the other."""
    return t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64)


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


#: Elements compared per step: large outputs (logits of 512 tokens over a
#: 128k vocabulary) are compared in pieces, so that the comparison's
#: temporaries (masks, float64 differences) stay a few tens of MiB.
CHUNK = 1 << 22


def _same(g: torch.Tensor, e: torch.Tensor, floating: bool, rtol: float, atol: float) -> torch.Tensor:
    """Where ``g`` equals ``e``: bit for bit when both tolerances are 0, else within them."""
    if not floating:
        return g == e
    both_nan = torch.isnan(g) & torch.isnan(e)
    if rtol == 0 and atol == 0:
        # Bit for bit: 0.0 == -0.0 in IEEE arithmetic, but the sign bit is
        # part of the value (1 / x, atan2 and copysign read it).
        return ((g == e) & _same_sign(g, e)) | both_nan
    return torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)


def _pieces(g: torch.Tensor, e: torch.Tensor, widen: bool) -> Any:
    """(offset, piece of g, piece of e) over the flattened tensors, CHUNK elements at a time."""
    gf, ef = g.reshape(-1), e.reshape(-1)
    for start in range(0, gf.numel(), CHUNK):
        gp, ep = gf[start : start + CHUNK], ef[start : start + CHUNK]
        if widen:
            gp, ep = gp.float(), ep.float()
        yield start, gp, ep


_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _identical(g: torch.Tensor, e: torch.Tensor) -> bool:
    """Bit for bit the same, in one reduction: the common case of every comparison (the same
    program gives the same bits), NaN payloads and signed zeros included. False where it cannot
    tell cheaply (a non-contiguous float view): the elementwise comparison then decides."""
    if not (g.is_floating_point() or g.is_complex()):
        return bool(torch.equal(g, e))
    if not (g.is_contiguous() and e.is_contiguous()):
        return False
    if g.is_complex():
        g, e = torch.view_as_real(g), torch.view_as_real(e)
    width = _WIDTH.get(g.element_size())
    if width is None:
        return False
    return bool(torch.equal(g.view(width), e.view(width)))


def _compare_tensors(
    path: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    rtol: float,
    atol: float,
    check_strides: bool,
    figures: bool = True,
) -> Difference | None:
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
    if _identical(g, e):
        return None
    floating = g.is_floating_point() or g.is_complex()
    dtype = g.dtype
    # float8 and the like lack most CPU kernels (signbit, isfinite, isclose); float32
    # holds each of their values exactly, signed zeros and NaN included.
    widen = floating and not g.is_complex() and dtype not in _INT_VIEW
    flat_index = -1
    for start, gp, ep in _pieces(g, e, widen):
        same = _same(gp, ep, floating, rtol, atol)
        if not bool(same.all()):
            flat_index = start + int((~same).nonzero()[0, 0])
            break
    if flat_index < 0:
        return None
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), g.shape))
    diff = Difference(path, "values differ", index=index, got=_scalar(g[index]), expected=_scalar(e[index]))
    if figures:
        diff.max_abs, diff.max_ulp = _largest(g, e, widen)
    return diff


def _largest(
    g: torch.Tensor, e: torch.Tensor, widen: bool, ulp: bool = True
) -> tuple[float | None, int | None]:
    """The largest absolute and (``ulp``) ULP difference over the finite elements, piece by piece."""
    floating = g.is_floating_point() or g.is_complex()
    max_abs: float | None = None
    max_ulp: int | None = None
    for _, gp, ep in _pieces(g, e, widen):
        if floating and not g.is_complex():
            finite = torch.isfinite(gp) & torch.isfinite(ep)
            if bool(finite.any()):
                # float32 holds the difference of two values of 32 bits or fewer closely enough for a figure.
                wide = torch.float64 if gp.dtype == torch.float64 else torch.float32
                delta = torch.where(finite, (gp.to(wide) - ep.to(wide)).abs(), 0)
                max_abs = max(max_abs or 0.0, float(delta.max()))
                # ULPs count steps between values of one sign: across a sign change they would
                # count the whole range between them, a figure that means nothing.
                signed = finite & _same_sign(gp, ep)
                if ulp and g.dtype in _INT_VIEW and bool(signed.any()):
                    ulps = torch.where(signed, (_int_bits(gp) - _int_bits(ep)).abs(), 0)
                    max_ulp = max(max_ulp or 0, int(ulps.max()))
        elif not floating and g.dtype != torch.bool:
            max_abs = max(max_abs or 0.0, float((gp.long() - ep.long()).abs().max()))
    return max_abs, max_ulp


def largest_difference(got: torch.Tensor, expected: torch.Tensor, *, ulp: bool = True) -> tuple[float, int]:
    """(largest absolute difference, largest ULP difference) over the finite elements of two
    tensors of one shape and dtype; (0.0, 0) when they are bit for bit the same. ``ulp=False``
    leaves the ULP figure (0) out, which costs as much again."""
    g, e = got.detach(), expected.detach().to(got.device)
    if g.numel() == 0 or _identical(g, e):
        return 0.0, 0
    widen = g.is_floating_point() and g.dtype not in _INT_VIEW
    max_abs, max_ulp = _largest(g, e, widen, ulp)
    return max_abs or 0.0, max_ulp or 0


def last_place(t: torch.Tensor) -> float:
    """One unit in the last place of ``t``'s largest finite element, in ``t``'s dtype (0.0 for an
    integer tensor, an empty one, or one of zeros)."""
    if not t.is_floating_point() or not t.numel():
        return 0.0
    finite = t.detach()[torch.isfinite(t.detach())]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    return float(torch.finfo(t.dtype).eps) * 2.0 ** math.floor(math.log2(top)) if top > 0 else 0.0


def first_difference(
    got: Any,
    expected: Any,
    *,
    rtol: float | None = 0.0,
    atol: float | None = 0.0,
    check_strides: bool = False,
    compute: torch.dtype | None = None,
    figures: bool = True,
) -> Difference | None:
    """None when ``got`` equals ``expected``; else where they first differ.

    With ``rtol`` and ``atol`` 0 the comparison is bit for bit, NaN equal to
    NaN. ``None`` for either picks the dtype's default tolerance, at least
    ``compute``'s when given (the precision the products ran at).
    ``figures=False`` leaves the largest differences (``max_abs``, ``max_ulp``)
    out, which costs another pass over a large output.
    """
    got_leaves, exp_leaves = leaves(got), leaves(expected)
    if [p for p, _ in got_leaves] != [p for p, _ in exp_leaves]:
        return Difference(
            "", f"output structure {[p for p, _ in got_leaves]} but eager gives {[p for p, _ in exp_leaves]}"
        )
    for (path, g), (_, e) in zip(got_leaves, exp_leaves, strict=True):
        if isinstance(g, torch.Tensor) or isinstance(e, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor)):
                return Difference(path, f"{type(g).__name__} but eager gives {type(e).__name__}")
            r, a = default_tolerance(g.dtype, compute)
            found = _compare_tensors(
                path, g, e, r if rtol is None else rtol, a if atol is None else atol, check_strides, figures
            )
            if found is not None:
                return found
        elif not (_plain(g) and _plain(e)):
            if g is not e:
                # Not a value but an object forward made (a KV cache, say): no
                # equality to trust, and a graph hands back the capture's one.
                return Difference(
                    path,
                    f"a {type(g).__name__} object, not a tensor or a plain value",
                    got=g,
                    expected=e,
                    opaque=True,
                )
        elif g != e and not (g != g and e != e):
            return Difference(path, "values differ", got=g, expected=e)
    return None


_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _plain(value: Any) -> bool:
    """A value compared by ``==``: numbers, strings, None, dtypes, enums."""
    return value is None or isinstance(value, _PLAIN) or isinstance(value, enum.Enum)
