"""``ForwardObserver``: what the forwards it is fed do to a module, op by op (the parameters and
buffers they write, the coarsest precision of their products, the random ops they draw with, the
quantizing casts and whole-tensor reductions they make, the first read of memory nobody wrote)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .ops import _ALLOCATES, _OVERWRITES, _reads_nothing, _written_arguments, aten, draws_random
from .roundoff import _CONV, _MATMUL, _fp32_roundoff, unit_roundoff
from .tensors import _storage_key, module_tensors, quantizes

# Reductions a per-tensor scale is taken with (absmax, min and max).
_REDUCTIONS = frozenset(getattr(aten, n) for n in ("amax", "amin", "max", "min", "aminmax"))


def _over_every_element(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether a reduction of ``_REDUCTIONS`` runs over every element of a floating tensor of more
    than one element (``max()`` with no dimension, ``amax`` over all of them)."""
    t = args[0] if args else None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() < 2:
        return False
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dim" not in names:
        return True  # max(), min(): no dimension to keep
    at = names.index("dim")
    dim = args[at] if len(args) > at else (kwargs or {}).get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return True
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return len({int(d) % max(t.dim(), 1) for d in dims}) >= t.dim()


# What ``ForwardObserver`` notes of an op, decided once per op (it runs for every op of a forward):
# bits of the kinds below, 0 for an op with nothing to note (most of them).
_K_WRITES, _K_PRODUCT, _K_CONV, _K_TO_COPY, _K_REDUCTION, _K_RANDOM, _K_ALLOCATES = (1 << i for i in range(7))
_OBSERVED: dict[Any, int] = {}


def _observed_kind(func: Any) -> int:
    packet = getattr(func, "overloadpacket", None)
    kind = _K_WRITES if _written_arguments(func) else 0
    if packet in _MATMUL or packet in _CONV:
        kind |= _K_PRODUCT | (_K_CONV if packet in _CONV else 0)
    elif packet is aten._to_copy:
        kind |= _K_TO_COPY
    elif packet in _REDUCTIONS:
        kind |= _K_REDUCTION
    elif draws_random(func):
        kind |= _K_RANDOM
    if packet in _ALLOCATES:
        kind |= _K_ALLOCATES
    _OBSERVED[func] = kind
    return kind


class ForwardObserver:
    """What the forwards it sees do to ``module``: the parameters and buffers
    they write (``written``, by dotted name, in the order first written) and
    the coarsest unit roundoff of their matrix products and convolutions
    (``roundoff``; 0.0 until one is seen)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.written: dict[str, None] = {}
        self.roundoff = 0.0
        #: Ops seen drawing random numbers (by name): the module's randomness, told by its use of a
        #: generator rather than by two runs that differ (Python state or uninitialized memory differ too).
        self.random_ops: dict[str, None] = {}
        #: Memory handed back as the allocator left it (``torch.empty`` and kin) and not yet written:
        #: storage address -> the op that made it. Entries leave with their tensors.
        self._fresh: dict[int, str] = {}
        #: The first op seen reading such memory: (the op that read, the op that made it), or None.
        self.unwritten_read: tuple[str, str] | None = None
        # storage address -> the (name, tensor) pairs that live there; made on first use
        self._owners: dict[int, list[tuple[str, torch.Tensor]]] | None = None
        # the submodules by name, read once until refresh(): see tensors()
        self._modules: list[tuple[str, torch.nn.Module]] | None = None
        # copies taken before first writes, one dict per open ``restoring`` block
        self._open: list[dict[str, torch.Tensor]] = []
        #: Called with the names of the module tensors ``make_inputs`` wrote (a weight sync in place),
        #: after each call that wrote any: what the module's forwards start from, not what they write.
        self.on_outside_writes: list[Callable[[list[str]], None]] = []
        #: The dtypes forwards cast floating values to, quantizing (int8, float8_e4m3fn), by name.
        self.quantized: dict[str, None] = {}
        #: The first reduction seen over every element of a floating tensor (``x.abs().amax()``, a
        #: per-tensor scale), by op name; "" until one is seen. Where the tensor holds the batch's
        #: rows, padded rows take part in it.
        self.whole_reduction = ""
        #: Called with the names of the module tensors ``make_inputs`` rebound to new memory
        #: (``param.data = new``): graphs captured before keep reading the old memory.
        self.on_outside_rebinds: list[Callable[[list[str]], None]] = []

    def refresh(self) -> None:
        """Read the module's tensors again (after parameters or buffers, or submodules, were replaced)."""
        self._owners = None
        self._modules = None

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and buffer as plain tensors by name (``module_tensors``: a quantized
        weight as its inner tensors), tied ones under each of their names: each submodule's tables
        read now, the submodules as the last ``refresh`` found them."""
        if self._modules is None:
            self._modules = list(self.module.named_modules(remove_duplicate=False))
        return module_tensors(self.module, self._modules)

    def _owner_map(self) -> dict[int, list[tuple[str, torch.Tensor]]]:
        if self._owners is None:
            owners: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for name, t in self.tensors():
                key = _storage_key(t)
                if key is not None and t.numel():
                    owners.setdefault(key, []).append((name, t))
            self._owners = owners
        return self._owners

    def observe(self, func: Any, args: Any, kwargs: Any) -> None:
        """One op about to run (called before it runs, so a copy taken here holds the old value)."""
        if self._fresh:
            self._reads_fresh(func, args, kwargs)
        kind = _OBSERVED.get(func)
        if kind is None:
            kind = _observed_kind(func)
        if not kind:
            return  # most ops of a forward: nothing here to note
        if kind & _K_WRITES:
            for place in _written_arguments(func):
                value = (
                    args[place]
                    if isinstance(place, int) and place < len(args)
                    else kwargs.get(place)
                    if isinstance(place, str) and kwargs
                    else None
                )
                if isinstance(value, torch.Tensor):
                    self._wrote(value)
                elif isinstance(value, (list, tuple)):
                    for v in value:
                        if isinstance(v, torch.Tensor):
                            self._wrote(v)
        if kind & _K_PRODUCT:
            self._note_precision(args, conv=bool(kind & _K_CONV))
        elif kind & _K_TO_COPY:
            dtype = kwargs.get("dtype") if kwargs else None
            if quantizes(args[0] if args else None, dtype):
                self.quantized.setdefault(str(dtype).replace("torch.", ""), None)
        elif kind & _K_REDUCTION:
            if not self.whole_reduction and _over_every_element(func, args, kwargs):
                self.whole_reduction = str(func)
        elif kind & _K_RANDOM:
            self.random_ops.setdefault(str(func), None)

    def after(self, func: Any, out: Any) -> None:
        """One op that ran: memory it handed back unwritten (``torch.empty``) is watched for reads."""
        kind = _OBSERVED.get(func)
        if kind is None:
            kind = _observed_kind(func)
        if not kind & _K_ALLOCATES or not isinstance(out, torch.Tensor):
            return
        key = _storage_key(out)
        if key is None or not out.numel():
            return
        fresh = self._fresh
        fresh[key] = str(func)

        def forget(_: Any = None, key: int = key) -> None:
            fresh.pop(key, None)

        weakref.finalize(out, forget)

    def _reads_fresh(self, func: Any, args: Any, kwargs: Any) -> None:
        """Mark what ``func`` writes as written; the first read of memory nobody wrote is a finding.

        An argument the op writes (its schema says so, ``out=`` included) counts as written,
        unless the op is an in-place method that reads its ``self`` first (``add_``, not
        ``copy_``). Views and ops that read only a tensor's metadata (``empty_like``) read nothing.
        A write to part of the memory counts for all of it: a partial write followed by a read of
        the rest is not told, while nothing that writes is ever taken for a read."""
        if _reads_nothing(func):
            return
        packet = getattr(func, "overloadpacket", None)
        written = _written_arguments(func)
        in_place = (
            getattr(getattr(func, "_schema", None), "name", "").endswith("_") and packet not in _OVERWRITES
        )
        places: list[tuple[int | str, Any]] = list(enumerate(args))
        if kwargs:
            places.extend(kwargs.items())
        for place, value in places:
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                key = _storage_key(t)
                if key is None or key not in self._fresh:
                    continue
                if place in written and not (place == 0 and in_place):
                    del self._fresh[key]  # written, not read
                elif self.unwritten_read is None:
                    self.unwritten_read = (str(func), self._fresh[key])

    def _wrote(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None:
            return
        for name, tensor in self._owner_map().get(key, ()):
            self.written.setdefault(name, None)
            for copies in self._open:
                if name not in copies:
                    copies[name] = tensor.detach().clone()

    def _note_precision(self, args: Any, *, conv: bool) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
                u = unit_roundoff(a.dtype)
                if a.dtype in (torch.float32, torch.complex64):
                    u = _fp32_roundoff(a.device, conv)
                self.roundoff = max(self.roundoff, u)
                return

    def written_items(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters and buffers seen written, by name."""
        if not self.written:
            return []
        return [(name, t) for name, t in self.tensors() if name in self.written]
