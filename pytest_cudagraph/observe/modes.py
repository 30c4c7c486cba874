"""The package's dispatch modes over a module's forwards and ``make_inputs``: ``DispatchMode``, the
base every dispatch mode of the package derives from; ``observing`` (each op fed to a
``ForwardObserver``), ``restoring`` (forwards run for what they show, what they wrote put back),
``poisoned`` (memory ``torch.empty`` hands back filled), ``outside_forward`` (what ``make_inputs``
writes or rebinds, which is no forward's write); and ``internal_error``, how a failure of this
bookkeeping is told apart from the user's code it runs inside."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import InternalError
from ..faults import cuda_error_code
from .observer import ForwardObserver
from .ops import _ALLOCATES, _written_arguments, written_tensors
from .tensors import _storage_key


class DispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A ``TorchDispatchMode`` that is never compiled: without ``_should_skip_dynamo``, torch wraps every
    call of ``__torch_dispatch__`` (each op of a forward) in a guard against Dynamo, which costs
    more than the bookkeeping of most of the modes here. Every dispatch mode of the package derives
    from it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def internal_error(step: str, exc: Exception, tensor: str | None = None) -> NoReturn:
    """Raise ``exc``, which the harness's own bookkeeping raised, as an ``InternalError`` saying
    ``step``: never as the user's code failing, though it ran inside their make_inputs or forward.
    A CUDA error or an out-of-memory error goes up as it is (the device's state, told by faults),
    and so does an ``InternalError`` already told."""
    if isinstance(exc, (InternalError, torch.OutOfMemoryError)) or cuda_error_code(exc) is not None:
        raise exc
    raise InternalError(step, exc, tensor) from exc


def _written_name(observer: ForwardObserver, func: Any, args: Any, kwargs: Any) -> str | None:
    """The module tensor ``func`` writes, by name, for an error message: None when it writes none
    or finding it fails too. Only read after a failure, never per op."""
    try:
        for t in written_tensors(func, args, kwargs or {}):
            key = _storage_key(t)
            for name, _ in observer._owner_map().get(key, ()) if key is not None else ():
                return name
    except Exception:
        return None
    return None


class _WritesOutside(DispatchMode):
    """Names the module tensors the block's ops write, without copying or changing anything."""

    def __init__(self, observer: ForwardObserver) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.observer = observer
        self.names: dict[str, None] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            for place in _written_arguments(func):
                value = args[place] if isinstance(place, int) and place < len(args) else kwargs.get(place)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    key = _storage_key(t) if isinstance(t, torch.Tensor) else None
                    for name, _ in self.observer._owner_map().get(key, ()) if key is not None else ():
                        self.names.setdefault(name, None)
        except Exception as exc:  # ours, not make_inputs': said so
            internal_error(
                f"observing make_inputs' writes to the module (at {func})",
                exc,
                _written_name(self.observer, func, args, kwargs),
            )
        return func(*args, **kwargs)  # make_inputs' own op: what it raises is make_inputs'


@contextlib.contextmanager
def outside_forward(observer: ForwardObserver) -> Iterator[None]:
    """Code that is not a forward (``make_inputs``): the module tensors it writes in place are told to
    ``observer.on_outside_writes`` when the block ends, so that they are not taken for a forward's;
    those it rebinds to new memory (``param.data = new``) to ``observer.on_outside_rebinds``.

    A rebinding is told by the storage each tensor had before the block, held until it ends: the
    allocator cannot hand that memory to the new tensor, so a new address is a new storage.
    What this bookkeeping raises is an ``InternalError``; what the block raises goes up as it is."""
    name: str | None = None
    held: dict[str, Any] = {}
    try:
        for name, t in observer.tensors():
            if t.numel():
                held[name] = t.untyped_storage()
    except Exception as exc:
        internal_error("reading the module's tensors before make_inputs", exc, name)
    watch = _WritesOutside(observer)
    with watch:
        yield
    moved: list[str] = []
    name = None
    try:
        for name, t in observer.tensors():
            if name in held and t.untyped_storage().data_ptr() != held[name].data_ptr():
                moved.append(name)
    except Exception as exc:
        internal_error(
            "reading the module's tensors after make_inputs (to tell the ones it rebound)", exc, name
        )
    del held
    try:
        if moved:
            observer.refresh()
            for rebound in list(observer.on_outside_rebinds):
                rebound(moved)
        if watch.names:
            for listener in list(observer.on_outside_writes):
                listener(list(watch.names))
    except Exception as exc:
        internal_error(
            f"telling the harness which module tensors make_inputs changed ({[*moved, *watch.names]})", exc
        )


class _Observing(DispatchMode):
    def __init__(self, observer: ForwardObserver) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.observer = observer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            self.observer.observe(func, args, kwargs)
        except Exception as exc:  # ours, not the forward's: said so
            internal_error(
                f"observing the forward's op {func}", exc, _written_name(self.observer, func, args, kwargs)
            )
        out = func(*args, **kwargs)  # the forward's own op: what it raises is the forward's
        try:
            self.observer.after(func, out)
        except Exception as exc:
            internal_error(f"observing what the forward's op {func} returned", exc)
        return out


class _Poisoning(DispatchMode):
    """Fills the memory ``torch.empty`` and kin hand back with a value of its own."""

    def __init__(self, which: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.which = which

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            getattr(func, "overloadpacket", None) in _ALLOCATES
            and isinstance(out, torch.Tensor)
            and out.numel()
        ):
            out.fill_(_POISON[self.which](out.dtype))
        return out


def _poison_value(first: bool) -> Callable[[torch.dtype], Any]:
    def value(dtype: torch.dtype) -> Any:
        if dtype == torch.bool:
            return first
        if dtype.is_floating_point or dtype.is_complex:
            return 1234.5 if first else -2345.25  # finite, and far from what a forward computes
        return 0x5A if first else 0x25

    return value


_POISON = (_poison_value(True), _poison_value(False))


@contextlib.contextmanager
def poisoned(which: int) -> Iterator[None]:
    """Every ``torch.empty`` (and kin) the block makes holds poison ``which`` (0 or 1): a forward that
    reads memory nobody wrote gives other results under the two."""
    with _Poisoning(which):
        yield


@contextlib.contextmanager
def observing(observer: ForwardObserver) -> Iterator[None]:
    """Feed every op run in the block to ``observer``."""
    with _Observing(observer):
        yield


@contextlib.contextmanager
def restoring(observer: ForwardObserver) -> Iterator[dict[str, torch.Tensor]]:
    """Run forwards for what they show, not for their effect: every parameter
    or buffer the block writes is copied just before its first write and put
    back, in place, when the block ends. Yields the copies."""
    copies: dict[str, torch.Tensor] = {}
    observer._open.append(copies)
    try:
        with _Observing(observer):
            yield copies
    finally:
        observer._open.remove(copies)
        if copies:
            name: str | None = None
            try:
                live = dict(observer.tensors())
                with torch.no_grad():
                    for name, saved in copies.items():
                        if name in live:
                            live[name].copy_(saved)
            except Exception as exc:  # ours: the forwards ran, putting the module back failed
                internal_error("putting back the module tensors the forwards wrote", exc, name)


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """``restoring`` with an observer of its own: forwards run in the block (to
    learn shapes or memory) leave the module's tensors as they found them."""
    with restoring(ForwardObserver(module)):
        yield
