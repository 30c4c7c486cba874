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
copy of the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .observe import _CONV, _MATMUL, _written_arguments, unit_roundoff

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
#: Ops that gather or copy values without arithmetic: run on the tensor as it is, the result raised
#: after (an embedding table is not converted whole to read a few of its rows).
_EXACT = frozenset(
    getattr(aten, n) for n in ("embedding", "index_select", "gather", "index") if hasattr(aten, n)
)


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

    def merge(self, other: Record) -> None:
        self.roundoff = max(self.roundoff, other.roundoff)
        self.fell_back.update(other.fell_back)
        self.lower_writes.update(other.lower_writes)

    @property
    def precision(self) -> str:
        """The precision the products ran at, in words."""
        if self.roundoff <= 2.0**-53:
            return "float64"
        if self.roundoff <= 2.0**-24:
            return "float32 (TF32 off)"
        return f"unit roundoff {self.roundoff:.3g}"


def _raised(value: Any, table: dict[torch.dtype, torch.dtype]) -> Any:
    """``value`` with its tensors and dtypes of ``table`` raised, in lists and tuples too (a
    hand-written walk: the dispatcher's arguments are flat, and a general tree walk costs more
    than most ops do)."""
    if isinstance(value, torch.Tensor):
        to = table.get(value.dtype)
        return value if to is None else value.to(to)
    if isinstance(value, torch.dtype):
        return table.get(value, value)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (torch.Tensor, list, tuple)):
        return type(value)(_raised(v, table) for v in value)
    return value


def _needs_raising(value: Any) -> bool:
    """Whether ``_raised`` would change ``value`` (a tensor or dtype of a lower precision, or a list)."""
    if type(value) is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype in _RAISE
    return isinstance(value, (torch.dtype, list, tuple))


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


# How the mode treats each op, decided once per op from its schema.
_VIEW, _WRITE, _EXACT_OP, _SOFTMAX, _PRODUCT, _PLAIN = range(6)
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
        elif func in _EXACT:
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


class _Raising(TorchDispatchMode):  # type: ignore[no-untyped-call]
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Never compiled: without it, torch wraps every call of __torch_dispatch__ (each op) in a
        # guard against Dynamo that costs more than the op's own bookkeeping here.
        return False

    def __init__(self, record: Record, noise: float, seed: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.record = record
        self.noise = noise
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Every op of the forward comes through here: the common cases are kept short (an op whose
        # operands are all float64 already, no dtype asked for, is called as it is).
        kwargs = kwargs or {}
        kind = _KINDS.get(func)
        if kind is None:
            kind = _kind(func)
        if kind == _VIEW:
            # On the tensor itself, so that a write through the view still lands there.
            return func(*args, **kwargs)
        if kind == _WRITE:
            return self._write(func, args, kwargs)
        if kind == _EXACT_OP:
            return _raised(func(*args, **kwargs), _RAISE)
        if kind == _PLAIN and not kwargs and not self.noise and not any(map(_needs_raising, args)):
            try:
                out = func(*args)
            except Exception:
                pass  # the general path below tells what to do
            else:
                return (
                    out.to(_RAISE[out.dtype])
                    if type(out) is torch.Tensor and out.dtype in _RAISE
                    else _raised(out, _RAISE)
                )
        try:
            out = self._call(func, kind, args, kwargs, _RAISE)
        except Exception as exc:  # no float64 kernel: float32 with TF32 off, said in the record
            try:
                out = self._call(func, kind, args, kwargs, _LOWER)
            except Exception:
                raise NoReference(_name(func), exc) from exc
            self.record.fell_back.setdefault(_name(func), _first_line(exc))
            out = _raised(out, _RAISE)
        if self.noise:
            out = self._jitter(out)
        return out

    def _call(
        self, func: Any, kind: int, args: Any, kwargs: Any, table: dict[torch.dtype, torch.dtype]
    ) -> Any:
        args = [_raised(a, table) for a in args]
        if kwargs:
            kwargs = {k: _raised(v, table) for k, v in kwargs.items()}
        if kind == _SOFTMAX and len(args) > 2:
            args[2] = False  # half_to_float: the input is no longer half
        elif kind == _PRODUCT:
            for a in args:
                if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
                    # A float8 product accumulates in float32.
                    self.record.roundoff = max(self.record.roundoff, min(unit_roundoff(a.dtype), 2.0**-24))
                    break
        # What comes out below the raised precision (a factory of the default dtype) is raised too.
        return _raised(func(*args, **kwargs), table)

    def _jitter(self, out: Any) -> Any:
        """Each floating result times (1 + noise * z), z standard normal: rounding, made on purpose."""
        if isinstance(out, (list, tuple)):
            return type(out)(self._jitter(o) for o in out)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not out.numel():
            return out
        gen = self._generators.get(out.device)
        if gen is None:
            gen = self._generators[out.device] = torch.Generator(out.device).manual_seed(self.seed)
        z = torch.randn(out.shape, generator=gen, dtype=out.dtype, device=out.device)
        return out * z.mul_(self.noise).add_(1)

    def _write(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op that writes a tensor: in that tensor's dtype, as the module writes it."""
        target = None
        for place in _written_arguments(func):
            t = args[place] if isinstance(place, int) and place < len(args) else kwargs.get(place)
            if isinstance(t, torch.Tensor):
                target = t
                break
        if target is None or target.dtype not in _RAISE:
            # A tensor of the raised precision (made in the forward) or an integer one: operands raised.
            return func(
                *[_raised(a, _RAISE) for a in args], **{k: _raised(v, _RAISE) for k, v in kwargs.items()}
            )
        self.record.lower_writes.setdefault(_name(func), str(target.dtype).replace("torch.", ""))
        dtype = target.dtype
        args = [a if a is target else _lowered(a, dtype) for a in args]
        kwargs = {k: v if v is target else _lowered(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


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
def raised(*, noise: float = 0.0, seed: int = 0) -> Iterator[Record]:
    """Run the block's floating computation in float64 (see the module's docstring); yields the
    ``Record`` of what it did. ``NoReference`` where an op runs in neither float64 nor float32.

    ``noise`` > 0 multiplies every floating result by ``1 + noise * z`` (z standard normal, drawn
    from generators seeded with ``seed``): rounding of that size at every op, at one shape, so that
    how far rounding can move the output is measured by something that holds no computation of
    another shape."""
    record = Record()
    with _no_tf32(), torch.no_grad(), _Raising(record, noise, seed):
        yield record
