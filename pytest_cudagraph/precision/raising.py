"""``raised``: the ``TorchDispatchMode`` that runs a block's floating computation in float64 (or
float32) op by op, without copying the module (see the package's docstring), and records what it
did in a ``Record``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..launches import ALLOCATIONS, Launch, Unwritten, no_dispatch_modes, triton_launches
from ..observe import (
    _CONV,
    _MATMUL,
    DispatchMode,
    _written_arguments,
    data_read,
    quantizes,
    unit_roundoff,
    written_tensors,
)
from ..references import Entry, References, redirected
from .convert import _BY_COLUMNS, _TIERS, _by_columns, _lowered, _needs_raising, _raised, _too_large
from .noise import _ROUNDS_NOTHING, _carries_noise, _mark_noisy
from .record import _FLOAT32, NoReference, Record, _first_line

aten = torch.ops.aten

_TO_COPY = aten._to_copy.default

#: Ops that gather or copy values without arithmetic: run on the tensor as it is, the result raised
#: after (an embedding table is not converted whole to read a few of its rows). Until 2026-12-04 the
#: overloads were looked up in this set of packets and never found: at 8B every forward of the
#: reference converted the 128256 x 4096 table to float64 (3.9 GiB, and the allocator held two).
_EXACT = frozenset(
    getattr(aten, n) for n in ("embedding", "index_select", "gather", "index") if hasattr(aten, n)
)


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


class _Raising(DispatchMode):
    def __init__(
        self,
        record: Record,
        noise: float,
        seed: int,
        to: torch.dtype = torch.float64,
        references: References | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.record = record
        #: The custom ops a reference stands in for, by overload as the dispatcher hands them over
        #: (an entry or None, looked up once per overload); None where no reference is an op.
        self._stand_ins: dict[Any, Entry | None] | None = {} if references and references.ops else None
        self.references = references or References()
        #: The thread's dispatch key sets inside the block (``raised`` sets them): what a reference
        #: run from ``__torch_dispatch__`` runs with.
        self.dispatch_keys: tuple[Any, Any] | None = None
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
        if self._stand_ins is not None:
            if func in self._stand_ins:
                entry = self._stand_ins[func]
            else:
                entry = self._stand_ins[func] = self.references.for_op(func)
            if entry is not None:
                return self.stand_in(entry, args, kwargs)
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

    def stand_in(self, entry: Entry, args: Any, kwargs: Any) -> Any:
        """The user's reference in the kernel's place, its ops raised (and jittered) by this mode like
        the module's own. Called from ``__torch_dispatch__``, where the mode is off: entered again."""
        self.record.stood_in.setdefault(entry.name, entry.fn_name)
        if _is_active(self):  # from the forward's Python (a Python function's key)
            return entry.fn(*args, **kwargs)
        # From __torch_dispatch__ (a custom op's key): the dispatcher has left the keys above Python
        # (autograd, the composite decompositions) behind for this op, so the reference's ops
        # would reach the mode whole (``aten.to.dtype``, a view to the mode: its float32 cast
        # would stay). They run with the dispatch keys the forward had, the mode entered again.
        keys = (
            torch._C._ForceDispatchKeyGuard(*self.dispatch_keys)
            if self.dispatch_keys
            else contextlib.nullcontext()
        )
        with keys, self:
            return entry.fn(*args, **kwargs)

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
def raised(
    *,
    noise: float = 0.0,
    seed: int = 0,
    to: torch.dtype = torch.float64,
    references: References | None = None,
) -> Iterator[Record]:
    """Run the block's floating computation in float64 (see the module's docstring); yields the
    ``Record`` of what it did. ``NoReference`` where an op runs in neither float64 nor float32.

    ``to=torch.float32`` raises only float16 and bfloat16, to float32 (TF32 off): the reference of a
    forward that cannot run in float64 (an extension that takes float32 alone).

    ``noise`` > 0 multiplies every floating result by ``1 + noise * z`` (z standard normal, drawn
    from generators seeded with ``seed``): rounding of that size at every op, at one shape, so that
    how far rounding can move the output is measured by something that holds no computation of
    another shape. Where an op holds less than the reference's precision (it ran in float32 for
    want of a kernel, a float8 product, a kernel outside the dispatcher computing in float32), the
    noise there is that precision's unit roundoff.

    ``references`` (``precision.references``) stand in for the kernels they name: a custom op where
    the dispatcher hands it over, a Python function wherever the forward calls it; each runs with
    its ops raised, and the record names it (``Record.stood_in``)."""
    if to not in _TIERS:
        raise ValueError(f"raised(to=...) takes torch.float64 or torch.float32, not {to}")
    record = Record(tier=str(to).replace("torch.", ""))
    references = references or References()
    mode = _Raising(record, noise, seed, to, references)
    with (
        _no_tf32(),
        torch.no_grad(),
        redirected(references.functions, lambda entry, _kernel, a, k: mode.stand_in(entry, a, k)),
        mode,
        triton_launches(mode.launch),
    ):
        mode.dispatch_keys = (
            torch._C._dispatch_tls_local_include_set(),
            torch._C._dispatch_tls_local_exclude_set(),
        )
        yield record
        mode.finish()


def _is_active(mode: Any) -> bool:
    """Whether ``mode`` is on the dispatch mode stack now (in the forward's Python it is; inside its
    own ``__torch_dispatch__`` it is not)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(m is mode for m in _get_current_dispatch_mode_stack())
