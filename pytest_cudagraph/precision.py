"""A forward run in a higher precision than its own: the reference of the ``padded_size`` check.

Eager at a graph's padded shape, cut to the real rows, should equal eager on
the real batch: a property of eager alone, which rounding blurs. In bf16 two
batch shapes differ by several percent (another GEMM tiling, through 32
layers), so a computation that depends on the padded size hides below that
blur. Run in float64 the same two forwards differ by rounding of about 1e-13,
and any such computation stands out by orders of magnitude.

``raised`` runs a block with every floating computation promoted, op by op,
without copying the module: a ``TorchDispatchMode`` converts each op's
float16, bfloat16 and float32 operands to float64 as it runs, turns requests
for those dtypes (``.to(torch.float32)``, ``torch.zeros(dtype=...)``,
autocast's casts) into float64, and leaves everything else as it is:

- views run on the tensor itself, so a write through a view still reaches it
  (a KV cache written through a slice);
- an op that writes a tensor of a lower precision (the module's own state:
  a cache, a counter) writes it in that tensor's dtype, as the module does;
- casts to float8 and integers stay: quantization is part of the module's
  computation, and rounding the same float64 value the same way gives the
  same result at every shape;
- an op with no float64 kernel (fused attention called directly,
  ``_scaled_mm``) runs in float32 with TF32 off, and the record says so: the
  reference's precision is then float32's;
- an op that runs in neither raises ``NoReference`` with the op and its error.

Weights are converted as each op reads them, so the extra memory is the
largest weight in float64 plus the forward's activations in float64, never a
copy of the model. A product whose weight would be large in float64 (an LLM's
lm_head: 3.9 GiB at 8B) is computed a block of the weight's columns at a time,
each block converted as it is used; large CUDA tensors are converted by a
Triton kernel of the module's own (``_to_float64``), faster than ``.to()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .launches import ALLOCATIONS, Launch, Unwritten, no_dispatch_modes, relaunch, triton_launches
from .observe import (
    _CONV,
    _MATMUL,
    DispatchMode,
    _written_arguments,
    data_read,
    quantizes,
    unit_roundoff,
    written_tensors,
)

__all__ = ["NoReference", "Record", "raised"]

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
_FLOAT32 = 2.0**-24
_TO_COPY = aten._to_copy.default
#: Ops whose result is exact in float64 (a selection, a sign, an integer part): the floor's run puts
#: no noise on them. Noise there would be rounding no op does, and would move an integer-valued
#: result off its integer, which a cast to int8 after it then truncates a whole step down.
_ROUNDS_NOTHING = frozenset(
    getattr(aten, n)
    for n in (
        "round",
        "floor",
        "ceil",
        "trunc",
        "sign",
        "abs",
        "neg",
        "clamp",
        "clamp_min",
        "clamp_max",
        "amax",
        "amin",
        "max",
        "min",
        "maximum",
        "minimum",
        "where",
        "relu",
        "_to_copy",
        "clone",
    )
)

#: Ops that gather or copy values without arithmetic: run on the tensor as it is, the result raised
#: after (an embedding table is not converted whole to read a few of its rows). Until 2026-12-04 the
#: overloads were looked up in this set of packets and never found: at 8B every forward of the
#: reference converted the 128256 x 4096 table to float64 (3.9 GiB, and the allocator held two).
_EXACT = frozenset(
    getattr(aten, n) for n in ("embedding", "index_select", "gather", "index") if hasattr(aten, n)
)

#: Products computed a block of their weight's columns at a time when that weight would be large in
#: the raised precision, by where the weight (``mat2``) is among their arguments. At 8B (Llama, bf16
#: weights on an H200) the lm_head weight, 128256x4096, is 3.9 GiB in float64. In blocks of
#: ``_CHUNK_BYTES`` it adds a block, not the whole weight: on the H200 an mm of 7 tokens with that
#: weight under ``raised()`` added 552 MiB at its peak and took 2.43 ms (2.30 ms unchunked). (The
#: reference stage's 22.9 GiB peak at 8B, 15.1 GiB held before it, was the embedding table's
#: conversion, ``_EXACT`` below, not this product's.)
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


class NoReference(RuntimeError):
    """The forward cannot run in the raised precision: ``op`` fails there (``error``)."""

    def __init__(self, op: str, error: BaseException) -> None:
        self.op = op
        self.error = error
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"{op} runs neither in float64 nor in float32 ({type(error).__name__}: {first})")


@dataclass
class Record:
    """What a raised forward did: the precision its products ran at, and what could not be raised."""

    #: The coarsest unit roundoff of the products and convolutions seen (0.0: none seen).
    roundoff: float = 0.0
    #: Ops that ran in float32 for want of a float64 kernel, with the first line of the error.
    fell_back: dict[str, str] = field(default_factory=dict)
    #: Tensors of a lower precision the forward wrote (its own state), op by op: the values written
    #: there are rounded to that dtype, as the module rounds them.
    lower_writes: dict[str, str] = field(default_factory=dict)
    #: Computations torch's dispatcher does not see inside (a Triton kernel, memory an extension
    #: wrote), each with the precision its values hold (float32's where a kernel computes in
    #: float32 whatever it is handed): the floor takes that precision's rounding there.
    outside: dict[str, str] = field(default_factory=dict)
    #: The precision the block ran in: float64, or float32 for a forward that cannot run in float64.
    tier: str = "float64"
    #: The dtypes the forward quantized floating values to (int8, float8_e4m3fn), by name: casts that
    #: stay in the reference, so its result holds that quantization as the module computes it.
    quantized: dict[str, None] = field(default_factory=dict)

    def merge(self, other: Record) -> None:
        self.roundoff = max(self.roundoff, other.roundoff)
        self.fell_back.update(other.fell_back)
        self.lower_writes.update(other.lower_writes)
        self.outside.update(other.outside)
        self.quantized.update(other.quantized)
        self.tier = other.tier

    @property
    def lower(self) -> list[str]:
        """The computations that held less than the reference's precision, in words (a kernel outside the
        dispatcher that kept the reference's own precision holds no less)."""
        lower = [
            f"{what}: {held}" for what, held in self.outside.items() if held != f"{self.tier}'s precision"
        ]
        return lower + [f"{op} ran in float32 (no {self.tier} kernel)" for op in self.fell_back]

    @property
    def precision(self) -> str:
        """The precision the reference ran at, in words, with the computations that held less."""
        base = "float32 (TF32 off)" if self.tier == "float32" else "float64"
        lower = self.lower
        kept = (
            f", with the module's own quantization kept (its casts to {', '.join(self.quantized)})"
            if self.quantized
            else ""
        )
        if self.tier == "float64" and self.roundoff > 2.0**-53 and not lower:
            # A float8 product accumulates in float32: its products hold that precision.
            held = "float32 (TF32 off)" if self.roundoff <= _FLOAT32 else f"unit roundoff {self.roundoff:.3g}"
            return held + kept
        if not lower:
            return base + kept
        return f"{base}, except where it holds less ({'; '.join(lower)}){kept}"


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


# How the mode treats each op, decided once per op from its schema.
_VIEW, _WRITE, _EXACT_OP, _SOFTMAX, _PRODUCT, _PLAIN, _ALLOC = range(7)
_KINDS: dict[Any, int] = {}


def _kind(func: Any) -> int:
    found = _KINDS.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        packet = getattr(func, "overloadpacket", None)
        if schema is not None and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        ):
            found = _VIEW
        elif _written_arguments(func):
            found = _WRITE
        elif func in ALLOCATIONS:
            found = _ALLOC
        elif packet in _EXACT:  # by packet: the table holds packets, ``func`` is an overload
            found = _EXACT_OP
        elif packet in (aten._softmax, aten._log_softmax):
            found = _SOFTMAX
        elif packet in _MATMUL or packet in _CONV:
            found = _PRODUCT
        else:
            found = _PLAIN
        _KINDS[func] = found
    return found


def _name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    return str(schema.name) if schema is not None else str(func)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Set on the floor's tensors that carry noise (rounding that can differ between shapes) and on what
# is computed from them. A pointwise op on values that carry none (the caller's inputs, the weights,
# an exact scale made from them) rounds the same at every shape: noise there would be rounding no
# two shapes differ by, and at a tie (x / scale exactly k + 0.5, before a cast to int8) it moves a
# quantized value a whole step.
_NOISY = "_pytest_cudagraph_noisy"


def _carries_noise(values: Any) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if getattr(v, _NOISY, False):
                return True
        elif isinstance(v, (list, tuple)) and _carries_noise(v):
            return True
    return False


def _mark_noisy(out: Any) -> None:
    if isinstance(out, torch.Tensor):
        setattr(out, _NOISY, True)
    elif isinstance(out, (list, tuple)):
        for o in out:
            _mark_noisy(o)


class _Raising(DispatchMode):
    def __init__(self, record: Record, noise: float, seed: int, to: torch.dtype = torch.float64) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.record = record
        self.noise = noise
        self.seed = seed
        self.to = to
        self.table, self.lower = _TIERS[to]
        self._generators: dict[torch.device, torch.Generator] = {}
        #: The unit roundoff of the product ``_call`` ran last, where it is a product (its operands'
        #: precision as raised: a float8 product's is float32's).
        self._product_roundoff = 0.0
        #: Memory allocations handed out that no op has written yet: one read after something
        #: outside the dispatcher wrote it is a computation the mode did not raise.
        self.unwritten = Unwritten()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Every op of the forward comes through here: the common cases are kept short (an op whose
        # operands are all float64 already, no dtype asked for, is called as it is).
        kwargs = kwargs or {}
        kind = _KINDS.get(func)
        if kind is None:
            kind = _kind(func)
        if kind == _VIEW:
            # On the tensor itself, so that a write through the view still lands there.
            out = func(*args, **kwargs)
            if self.noise and _carries_noise(args):
                _mark_noisy(out)
            return out
        if self.unwritten.fresh:
            self._check_reads(func, args, kwargs)
        if kind == _WRITE:
            out = self._write(func, args, kwargs)
            if self.noise and (_carries_noise(args) or _carries_noise(kwargs.values())):
                _mark_noisy(out)
            return out
        if kind == _EXACT_OP:
            return _raised(func(*args, **kwargs), self.table)
        if kind == _ALLOC:
            out = self._call(func, kind, args, kwargs, self.table)
            self.unwritten.allocated(func, out)
            return out
        table = self.table
        plain = kind == _PLAIN and not kwargs and not self.noise
        if plain:
            for a in args:  # a loop, not any() over a generator: this runs for most ops of a forward
                if _needs_raising(a, table):
                    plain = False
                    break
        if plain:
            try:
                out = func(*args)
            except Exception:
                pass  # the general path below tells what to do
            else:
                return (
                    out.to(table[out.dtype])
                    if type(out) is torch.Tensor and out.dtype in table
                    else _raised(out, table)
                )
        if func is _TO_COPY and kwargs:
            self._note_quantizing(args, kwargs.get("dtype"))
        roundoff = 0.0
        try:
            out = self._call(func, kind, args, kwargs, table)
        except Exception as exc:  # no kernel in the raised precision: float32 with TF32 off, said so
            if self.lower is None:
                raise NoReference(_name(func), exc) from exc
            try:
                out = self._call(func, kind, args, kwargs, self.lower)
            except Exception:
                raise NoReference(_name(func), exc) from exc
            self._fell_back(_name(func), exc)
            roundoff = _FLOAT32
            out = _raised(out, table)
        if self.noise:
            noisy = _carries_noise(args) or bool(kwargs and _carries_noise(kwargs.values()))
            exact = getattr(func, "overloadpacket", None) in _ROUNDS_NOTHING
            # Noise where rounding can differ between shapes: a product or reduction (its order
            # follows the shape), an op on values that carry such rounding, or one run in float32.
            if roundoff or not (exact or (not noisy and torch.Tag.pointwise in func.tags)):
                out = self._jitter(out, max(self.noise, roundoff, self._product_roundoff))
                noisy = True
            if noisy:
                _mark_noisy(out)
        return out

    def _note_quantizing(self, args: Any, dtype: Any) -> None:
        """A cast of floating values to an integer or float8 dtype: quantization, which stays."""
        if args and quantizes(args[0], dtype):
            self.record.quantized.setdefault(str(dtype).replace("torch.", ""), None)

    def _fell_back(self, what: str, exc: BaseException) -> None:
        self.record.fell_back.setdefault(what, _first_line(exc))
        self.record.roundoff = max(self.record.roundoff, _FLOAT32)

    def _call(
        self, func: Any, kind: int, args: Any, kwargs: Any, table: dict[torch.dtype, torch.dtype]
    ) -> Any:
        at = _BY_COLUMNS.get(func, -1) if kind == _PRODUCT else -1
        weight = args[at] if 0 <= at < len(args) and _too_large(args[at], table) else None
        if weight is None:
            args = [_raised(a, table) for a in args]
        else:  # the weight stays as it is: raised a block of columns at a time, below
            args = [a if i == at else _raised(a, table) for i, a in enumerate(args)]
        if kwargs:
            kwargs = {k: _raised(v, table) for k, v in kwargs.items()}
        self._product_roundoff = 0.0
        if kind == _SOFTMAX and len(args) > 2:
            args[2] = False  # half_to_float: the input is no longer half
        elif kind == _PRODUCT:
            for a in args:
                if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
                    # A float8 product accumulates in float32: the noise at this op is float32's.
                    self._product_roundoff = min(unit_roundoff(a.dtype), _FLOAT32)
                    self.record.roundoff = max(self.record.roundoff, self._product_roundoff)
                    break
        if weight is not None:
            return _raised(_by_columns(func, args, kwargs, at, weight, table), table)
        # What comes out below the raised precision (a factory of the default dtype) is raised too.
        return _raised(func(*args, **kwargs), table)

    def _jitter(self, out: Any, noise: float) -> Any:
        """Each floating result times (1 + noise * z), z standard normal: rounding, made on purpose."""
        if isinstance(out, (list, tuple)):
            return type(out)(self._jitter(o, noise) for o in out)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not out.numel():
            return out
        return out * self._factor(out, noise)

    def _factor(self, like: torch.Tensor, noise: float) -> torch.Tensor:
        gen = self._generators.get(like.device)
        if gen is None:
            gen = self._generators[like.device] = torch.Generator(like.device).manual_seed(self.seed)
        z = torch.randn(like.shape, generator=gen, dtype=like.dtype, device=like.device)
        return z.mul_(noise).add_(1)

    def _write(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op that writes a tensor: in that tensor's dtype, as the module writes it."""
        target = None
        for place in _written_arguments(func):
            t = args[place] if isinstance(place, int) and place < len(args) else kwargs.get(place)
            if isinstance(t, torch.Tensor):
                target = t
                break
        if target is not None and self.unwritten.fresh:
            for t in written_tensors(func, args, kwargs):
                self.unwritten.written(t)
        if target is None or target.dtype not in self.table:
            # A tensor of the raised precision (made in the forward) or an integer one: operands raised.
            try:
                return func(
                    *[_raised(a, self.table) for a in args],
                    **{k: _raised(v, self.table) for k, v in kwargs.items()},
                )
            except Exception as exc:
                if self.lower is None or target is None or target.dtype != self.to:
                    raise
                return self._write_lower(func, args, kwargs, exc)
        self.record.lower_writes.setdefault(_name(func), str(target.dtype).replace("torch.", ""))
        dtype = target.dtype
        args = [a if a is target else _lowered(a, dtype) for a in args]
        kwargs = {k: v if v is target else _lowered(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _write_lower(self, func: Any, args: Any, kwargs: Any, exc: BaseException) -> Any:
        """An op that writes float64 tensors and has no float64 kernel (an in-place custom op for
        low precision): run on float32 copies, whose results are written back."""
        assert self.lower is not None
        written = written_tensors(func, args, kwargs)
        copies: dict[int, torch.Tensor] = {}

        def lowered(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dtype in self.lower:  # type: ignore[operator]
                copy = copies.get(id(value))
                if copy is None:
                    copy = copies[id(value)] = value.to(self.lower[value.dtype])  # type: ignore[index]
                return copy
            return value

        try:
            out = func(*[lowered(a) for a in args], **{k: lowered(v) for k, v in kwargs.items()})
        except Exception:
            raise NoReference(_name(func), exc) from exc
        self._fell_back(_name(func), exc)
        back = {id(copies[id(t)]): t for t in written if id(t) in copies}
        for t in written:
            if id(t) in copies:
                t.copy_(
                    copies[id(t)] if not self.noise else self._jitter(copies[id(t)].to(t.dtype), _FLOAT32)
                )
        if isinstance(out, torch.Tensor) and id(out) in back:
            return back[id(out)]
        return _raised(out, self.table)

    # -- computations the dispatcher does not see ------------------------------------------------
    def _check_reads(self, func: Any, args: Any, kwargs: Any) -> None:
        for t in data_read(func, args, kwargs):
            entry = self.unwritten.written_outside(t)
            if entry is not None:
                self._outside(
                    entry.tensor,
                    f"memory {entry.op} handed out, written outside torch's dispatcher (an extension or a "
                    f"kernel called directly), read by {_name(func)}",
                )

    def _outside(self, t: torch.Tensor, what: str, changed: torch.Tensor | None = None) -> None:
        """``t`` (where ``changed``) was written by a computation the mode could not raise: its
        precision recorded, and in the floor's run rounding of that precision put on it."""
        if not (t.is_floating_point() and t.numel()):
            return
        values = t if changed is None else t[changed]
        held = self.to
        if t.dtype == torch.float64 and bool(
            (values.float().double() == values).logical_or_(values.isnan()).all()
        ):
            held = torch.float32  # a kernel that computes in float32 whatever it is handed
        elif t.dtype != torch.float64:
            held = t.dtype
        name = str(held).replace("torch.", "")
        self.record.outside.setdefault(what, f"{name}'s precision")
        roundoff = unit_roundoff(held)
        self.record.roundoff = max(self.record.roundoff, roundoff)
        if self.noise:
            factor = self._factor(t, max(self.noise, roundoff))
            if changed is not None:
                factor = torch.where(changed, factor, torch.ones_like(factor))
            t.mul_(factor)
            _mark_noisy(t)

    def launch(self, launch: Launch) -> Any:
        """A Triton launch in the raised forward: run on the raised tensors (a float32 copy of each
        where the kernel takes no float64), and what it wrote recorded as computed outside."""
        # Called from the forward's Python, with this mode active: its own bookkeeping, and the
        # interpreter's copies of the arguments, run without it.
        with no_dispatch_modes():
            name = f"Triton kernel {launch.name!r}"
            tensors = launch.tensors
            fresh = [t for t in tensors if self.unwritten.is_fresh(t)]
            watched = [t for t in tensors if t.dtype == self.to and not self.unwritten.is_fresh(t)]
            before = [t.clone() for t in watched]
            try:
                out = launch()
            except Exception as exc:
                if self.lower is None:
                    raise NoReference(name, exc) from exc
                out = self._launch_lower(launch, name, exc)
            for t in fresh:
                entry = self.unwritten.written_outside(t)
                if entry is not None:
                    self._outside(entry.tensor, name)
            for t, b in zip(watched, before, strict=True):
                changed = (t != b).logical_and_(~(t.isnan() & b.isnan()))
                if bool(changed.any()):
                    self._outside(t, f"{name} (in place)", changed)
            return out

    def _launch_lower(self, launch: Launch, name: str, exc: BaseException) -> Any:
        assert self.lower is not None
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def lowered(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return type(value)(lowered(v) for v in value)
            if isinstance(value, torch.Tensor) and value.dtype in self.lower:  # type: ignore[operator]
                copy = value.to(self.lower[value.dtype])  # type: ignore[index]
                copies.append((value, copy))
                return copy
            return value

        args = tuple(lowered(a) for a in launch.args)
        kwargs = {k: lowered(v) for k, v in launch.kwargs.items()}
        originals = [c.clone() for _, c in copies]
        try:
            out = Launch(launch.kernel, launch.run, args, kwargs)()
        except Exception:
            raise NoReference(name, exc) from exc
        self._fell_back(name, exc)
        for (t, copy), was in zip(copies, originals, strict=True):
            if not torch.equal(copy, was):
                t.copy_(copy)
        return out

    def finish(self) -> None:
        """At the block's end: fresh memory written outside and never read (an output an extension
        filled, returned as it is)."""
        with no_dispatch_modes():
            for entry in self.unwritten.remaining():
                self._outside(
                    entry.tensor,
                    f"memory {entry.op} handed out, written outside torch's dispatcher and returned",
                )


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """float32 products and convolutions at float32's own precision, not TF32's."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


@contextlib.contextmanager
def raised(*, noise: float = 0.0, seed: int = 0, to: torch.dtype = torch.float64) -> Iterator[Record]:
    """Run the block's floating computation in float64 (see the module's docstring); yields the
    ``Record`` of what it did. ``NoReference`` where an op runs in neither float64 nor float32.

    ``to=torch.float32`` raises only float16 and bfloat16, to float32 (TF32 off): the reference of a
    forward that cannot run in float64 (an extension that takes float32 alone).

    ``noise`` > 0 multiplies every floating result by ``1 + noise * z`` (z standard normal, drawn
    from generators seeded with ``seed``): rounding of that size at every op, at one shape, so that
    how far rounding can move the output is measured by something that holds no computation of
    another shape. Where an op holds less than the reference's precision (it ran in float32 for
    want of a kernel, a float8 product, a kernel outside the dispatcher computing in float32), the
    noise there is that precision's unit roundoff."""
    if to not in _TIERS:
        raise ValueError(f"raised(to=...) takes torch.float64 or torch.float32, not {to}")
    record = Record(tier=str(to).replace("torch.", ""))
    mode = _Raising(record, noise, seed, to)
    with _no_tf32(), torch.no_grad(), mode, triton_launches(mode.launch):
        yield record
        mode.finish()
