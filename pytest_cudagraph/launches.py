"""Kernels launched outside torch's dispatcher: Triton launches seen, and memory nobody recorded writing.

A Triton kernel (``kernel[grid](...)``) or a compiled extension called from
Python writes tensors without any op reaching torch's dispatcher, so neither a
``TorchDispatchMode`` (the emulator's recorder, the float64 reference) nor a
fingerprint of the ops sees it. Two things here make them visible:

- ``triton_launches(hook)``: while it is active, every top-level Triton launch
  (through ``triton.jit``, ``triton.autotune`` or ``triton.heuristics``; what
  an autotuner launches while it benchmarks is part of its caller's launch) is
  handed to ``hook`` as a ``Launch``, which the hook runs, records or runs
  again later with other tensors. Triton is patched once, the first time a
  hook is entered after it was imported; it is never imported here, so a
  module without Triton pays nothing.
- ``Unwritten``: the storages ``torch.empty`` and its kin handed out, filled
  with a marker, until an op writes them. One read by an op before any op
  wrote it, with the marker gone, was written by something the dispatcher did
  not see; with the marker intact it is a read of unwritten memory (the
  ``determinism`` check's subject, not this one's).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ALLOCATIONS",
    "Launch",
    "Unwritten",
    "kernel_name",
    "no_dispatch_modes",
    "storage_bytes",
    "triton_launches",
    "watching_launches",
]

aten = torch.ops.aten

#: Allocation without a kernel: what it hands back holds whatever the memory held.
ALLOCATIONS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)

#: The byte ``Unwritten`` fills fresh memory with (a NaN in every floating dtype, -1 in integers).
MARKER = 0xFF

Hook = Callable[["Launch"], Any]
_HOOKS: list[Hook] = []
#: Watchers see every top-level launch, whoever handles it: each returns a context that is open
#: while the launch runs (the handling hook's, or Triton's own).
Watcher = Callable[["Launch"], contextlib.AbstractContextManager[Any]]
_WATCHERS: list[Watcher] = []
_PATCHED: set[type] = set()
_LOCAL = threading.local()


def kernel_name(kernel: Any) -> str:
    """The Python name of a Triton kernel, through its autotuner and heuristics wrappers."""
    seen = 0
    while kernel is not None and seen < 8:
        fn = getattr(kernel, "fn", None)
        if fn is None or not hasattr(fn, "__name__") or fn is kernel:
            break
        kernel, seen = fn, seen + 1
    return str(getattr(kernel, "__name__", type(kernel).__name__))


def _depth() -> int:
    return int(getattr(_LOCAL, "depth", 0))


@dataclass
class Launch:
    """One top-level launch: the kernel object the caller indexed, its arguments (``grid`` among
    the keywords), and the unpatched ``run`` that launches it."""

    kernel: Any
    run: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Its tensor arguments (one level into tuples, as Triton takes them)."""
        found: list[torch.Tensor] = []
        for value in (*self.args, *self.kwargs.values()):
            items = value if isinstance(value, (tuple, list)) else (value,)
            found.extend(v for v in items if isinstance(v, torch.Tensor))
        return found

    def __call__(self) -> Any:
        return relaunch(self.kernel, self.run, *self.args, **self.kwargs)


def relaunch(kernel: Any, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Launch ``kernel`` with these arguments as its caller did, past every hook (a replay's step)."""
    _LOCAL.depth = _depth() + 1
    try:
        return run(kernel, *args, **kwargs)
    finally:
        _LOCAL.depth -= 1


def _wrapped(run: Callable[..., Any]) -> Callable[..., Any]:
    def patched_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not (_HOOKS or _WATCHERS) or _depth() or kwargs.get("warmup"):
            # No hook, a launch inside a launch (an autotuner's benchmark, its final run), or a
            # compile-only warm-up: as Triton would.
            return run(self, *args, **kwargs)
        launch = Launch(self, run, args, kwargs)
        with contextlib.ExitStack() as watched:
            for watcher in list(_WATCHERS):
                watched.enter_context(watcher(launch))
            return _HOOKS[-1](launch) if _HOOKS else launch()

    patched_run.__wrapped__ = run  # type: ignore[attr-defined]
    return patched_run


def _patch_triton() -> None:
    """Wrap ``run`` of Triton's kernel classes that are loaded (never importing triton)."""
    for module_name, class_names in (
        ("triton.runtime.jit", ("JITFunction",)),
        ("triton.runtime.interpreter", ("InterpretedFunction",)),
        ("triton.runtime.autotuner", ("Autotuner", "Heuristics")),
    ):
        module = sys.modules.get(module_name)
        for class_name in class_names:
            cls = getattr(module, class_name, None) if module is not None else None
            if cls is None or cls in _PATCHED or "run" not in vars(cls):
                continue
            cls.run = _wrapped(vars(cls)["run"])
            _PATCHED.add(cls)


@contextlib.contextmanager
def triton_launches(hook: Hook) -> Iterator[None]:
    """Hand every top-level Triton launch in the block to ``hook`` (the innermost block's hook)."""
    _patch_triton()
    _HOOKS.append(hook)
    try:
        yield
    finally:
        _HOOKS.remove(hook)


@contextlib.contextmanager
def watching_launches(watcher: Watcher) -> Iterator[None]:
    """Open ``watcher(launch)`` around every top-level Triton launch in the block, whichever hook (or
    none) runs it: a record of what a forward launches that leaves the launches to their handler."""
    _patch_triton()
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.remove(watcher)


def no_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    """No dispatch mode while a hook launches a kernel or reads memory: Triton's interpreter copies
    its arguments with ATen ops, and a hook's own reads are no ops of the forward either."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def storage_bytes(storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    """The first ``nbytes`` (default: all) of ``storage`` as a uint8 tensor on its device."""
    size = storage.nbytes() if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (size,), (1,))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return storage_bytes(t.untyped_storage())


def _marked(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage still holds the marker in every byte. ``torch.equal``, not
    ``bool(tensor)``: a capture guard watches the latter as a host sync."""
    data = _bytes(t)
    return torch.equal(data, torch.full_like(data, MARKER))


@dataclass
class Fresh:
    """A storage handed out by an allocation and not yet written by any op."""

    tensor: torch.Tensor  # what the allocation returned (held: its storage's identity stays unique)
    op: str


class Unwritten:
    """The storages allocations handed out that no op has written yet (see the module's docstring).

    Called from inside a dispatch mode's ``__torch_dispatch__`` (the mode is off there, so its own
    fills and reads are not the forward's ops)."""

    def __init__(self) -> None:
        self.fresh: dict[int, Fresh] = {}

    def allocated(self, func: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.untyped_storage().nbytes():
            _bytes(out).fill_(MARKER)
            self.fresh[_key(out)] = Fresh(out, str(func))

    def written(self, t: torch.Tensor) -> None:
        if self.fresh:
            self.fresh.pop(_key(t), None)

    def is_fresh(self, t: torch.Tensor) -> bool:
        return bool(self.fresh) and _key(t) in self.fresh

    def written_outside(self, t: torch.Tensor) -> Fresh | None:
        """Whether ``t``, about to be read, sits on fresh memory that something outside the
        dispatcher wrote (its entry, which is forgotten), or None (not fresh, written by an op, or
        still holding the marker: nothing wrote it)."""
        if not self.fresh:
            return None
        entry = self.fresh.pop(_key(t), None)
        if entry is None:
            return None
        return None if _marked(entry.tensor) else entry

    def remaining(self) -> list[Fresh]:
        """The fresh storages no op read or wrote, that something outside wrote (an output a kernel
        wrote, returned as it is); forgotten with the rest."""
        found = [e for e in self.fresh.values() if not _marked(e.tensor)]
        self.fresh.clear()
        return found
