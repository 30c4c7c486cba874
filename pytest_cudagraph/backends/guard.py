"""Finding the operations that cannot live in a graph, and who called them.

A CUDA graph records kernel launches. Anything that needs the host to see a
value computed on the device (``.item()``, ``bool(tensor)``, an output whose
size depends on data) or that moves data between host and device cannot be
recorded. On a GPU such an op either fails deep inside the driver or, worse,
is recorded with a value frozen at capture. The guard sees every op before it
runs, so both backends can name the op and the submodule instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CaptureGuard", "ModuleTracker", "Violation"]

aten = torch.ops.aten

# Ops whose output size depends on tensor values: the host must read the
# device to size the result, which a graph cannot do.
_DATA_DEPENDENT = {
    aten.nonzero.default: "data-dependent output shape",
    aten.masked_select.default: "data-dependent output shape",
    aten._unique.default: "data-dependent output shape",
    aten._unique2.default: "data-dependent output shape",
    aten.unique_dim.default: "data-dependent output shape",
    aten.unique_consecutive.default: "data-dependent output shape",
    aten.bincount.default: "data-dependent output shape",
    aten._local_scalar_dense.default: "host sync: reads a device value on the host",
    aten.equal.default: "host sync: returns a Python bool",
    aten.is_nonzero.default: "host sync: returns a Python bool",
}

# Python-level tensor methods that hand device data to the host.
_HOST_METHODS: dict[Any, tuple[str, str]] = {
    torch.Tensor.item: ("host sync", "Tensor.item()"),
    torch.Tensor.tolist: ("device-to-host copy", "Tensor.tolist()"),
    torch.Tensor.numpy: ("device-to-host copy", "Tensor.numpy()"),
    torch.Tensor.cpu: ("device-to-host copy", "Tensor.cpu()"),
    torch.Tensor.__bool__: ("host sync", "bool(tensor)"),
    torch.Tensor.__int__: ("host sync", "int(tensor)"),
    torch.Tensor.__float__: ("host sync", "float(tensor)"),
    torch.Tensor.__index__: ("host sync", "tensor used as an index"),
}


@dataclass(frozen=True)
class Violation:
    """One op that cannot be captured."""

    op: str
    reason: str
    module_path: str

    def describe(self) -> str:
        where = f"submodule '{self.module_path}'" if self.module_path else "the top-level module"
        return f"{self.op} ({self.reason}) in {where}"


class ModuleTracker:
    """Keeps the dotted path of the submodule whose forward is running."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._stack: list[str] = []
        #: The submodule that was running when a tracked forward last failed.
        self.failed_path = ""
        self.refresh()

    def refresh(self) -> None:
        """Read the module tree's names again (after submodules are added or replaced)."""
        self._named = list(self._module.named_modules())

    @property
    def path(self) -> str:
        return self._stack[-1] if self._stack else ""

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self._stack = []
        handles = []
        for name, sub in self._named:
            if not name:
                continue
            handles.append(sub.register_forward_pre_hook(functools.partial(self._enter, name)))
            handles.append(sub.register_forward_hook(self._leave))
        try:
            yield
        except BaseException:
            # Where the forward was when it failed, for the error message:
            # the stack itself is cleared below.
            self.failed_path = self.path
            raise
        finally:
            for h in handles:
                h.remove()
            self._stack = []

    def _enter(self, name: str, _module: Any, _args: Any) -> None:
        self._stack.append(name)

    def _leave(self, _module: Any, _args: Any, _out: Any) -> None:
        if self._stack:
            self._stack.pop()


def tensors_in(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among an ATen op's arguments.

    ATen schemas take tensors directly or in one flat list (``Tensor[]``,
    ``Tensor?[]``), so two levels suffice; this runs for every op during
    capture, where a general pytree walk costs more than the op's launch.
    """
    found: list[torch.Tensor] = []
    for group in (args, kwargs.values() if kwargs else ()):
        for value in group:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _is_bool_index(indices: Any) -> bool:
    flat, _ = tree_flatten(indices)
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in flat
    )


def check_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> tuple[str, str] | None:
    """(op name, reason) when ``func`` cannot be captured on ``device``, else None."""
    reason = _DATA_DEPENDENT.get(func)
    if reason is not None:
        return str(func), reason
    packet = getattr(func, "overloadpacket", None)
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) and len(args) > 1:
        if _is_bool_index(args[1]):
            return str(func), "boolean-mask indexing: data-dependent output shape"
    if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int:
        if kwargs.get("output_size") is None:
            return str(func), "data-dependent output shape (pass output_size=)"
    if device.type != "cpu":
        # Transfers and host tensors only matter when the graph lives on a
        # device: a CPU tensor read by a device kernel during capture is
        # copied from pageable memory, which a graph cannot record.
        tensors = tensors_in(args, kwargs)
        on_host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        on_dev = [t for t in tensors if t.device.type == device.type]
        if packet is aten._to_copy:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != tensors[0].device.type:
                return str(func), "device-to-host copy" if torch.device(target).type == "cpu" else "host-to-device copy"
        if on_host and on_dev:
            return str(func), "CPU tensor on the CUDA path (host-device copy)"
    return None


class CaptureGuard:
    """Checks every op while the module runs; raises or collects violations.

    With ``collect=False`` (used during capture) the first violation raises
    through ``on_violation`` before the op runs, so the device never sees it.
    With ``collect=True`` every violation is listed and the op still runs
    eagerly, so one pass finds them all.
    """

    def __init__(
        self,
        tracker: ModuleTracker,
        device: torch.device,
        *,
        on_violation: Callable[[Violation], None] | None = None,
    ) -> None:
        self.tracker = tracker
        self.device = device
        self.on_violation = on_violation
        self.violations: list[Violation] = []
        self._in_host_method = 0
        #: Above zero while a submodule that runs eagerly anyway (a PIECEWISE
        #: graph's eager piece) is running: its ops are not the graph's.
        self.suspended = 0

    @contextlib.contextmanager
    def exempt(self, modules: list[torch.nn.Module]) -> Iterator[None]:
        """Report nothing while any of ``modules`` runs."""

        def enter(*_: Any) -> None:
            self.suspended += 1

        def leave(*_: Any) -> None:
            self.suspended -= 1

        handles = []
        for m in modules:
            handles.append(m.register_forward_pre_hook(enter))
            handles.append(m.register_forward_hook(leave, always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self.suspended = 0

    def report(self, op: str, reason: str) -> None:
        if self.suspended:
            return
        violation = Violation(op=op, reason=reason, module_path=self.tracker.path)
        if violation not in self.violations:
            self.violations.append(violation)
        if self.on_violation is not None:
            self.on_violation(violation)

    def check_dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._in_host_method:
            return  # already reported under its Python name
        found = check_op(func, args, kwargs, self.device)
        if found is not None:
            self.report(*found)

    @contextlib.contextmanager
    def function_mode(self) -> Iterator[None]:
        """Report the Python-level tensor methods that hand device data to the host.

        The eight methods are replaced on ``torch.Tensor`` (see
        ``host_methods_watched``) rather than watched through a
        ``TorchFunctionMode``: a mode sees every torch call, which doubles the
        cost of a capture, while these wrappers cost nothing to the calls they
        do not name. They report to the innermost active guard.
        """
        with host_methods_watched():
            _ACTIVE.append(self)
            try:
                yield
            finally:
                _ACTIVE.pop()


@contextlib.contextmanager
def host_methods_watched() -> Iterator[None]:
    """Keep the eight host methods replaced by reporting wrappers for the duration.

    Nested uses share one replacement. A capture sequence holds it from its
    first graph to its last: replacing an attribute of ``torch.Tensor``
    invalidates the interpreter's attribute caches for every tensor, which
    costs more than the replacement itself, so it is done once a sequence,
    not once a graph. With no guard active the wrappers call straight through.
    """
    global _PATCH_DEPTH
    wrappers = _host_wrappers()
    if _PATCH_DEPTH == 0:
        for name, (_original, wrapper) in wrappers.items():
            setattr(torch.Tensor, name, wrapper)
    _PATCH_DEPTH += 1
    try:
        yield
    finally:
        _PATCH_DEPTH -= 1
        if _PATCH_DEPTH == 0:
            for name, (original, _wrapper) in wrappers.items():
                setattr(torch.Tensor, name, original)


_PATCH_DEPTH = 0
#: Guards whose function_mode is active, innermost last.
_ACTIVE: list[CaptureGuard] = []
_WRAPPERS: dict[str, tuple[Any, Any]] = {}


def _host_wrappers() -> dict[str, tuple[Any, Any]]:
    """Method name -> (the original, a wrapper that reports it to the active guard)."""
    if not _WRAPPERS:
        for func, (reason, label) in _HOST_METHODS.items():
            original = getattr(torch.Tensor, func.__name__)
            _WRAPPERS[func.__name__] = (original, _reporting(original, reason, label))
    return _WRAPPERS


def _reporting(method: Any, reason: str, name: str) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return method(*args, **kwargs)
        guard = _ACTIVE[-1]
        guard.report(name, reason)
        # The aten op beneath (``_local_scalar_dense``) is the same event.
        guard._in_host_method += 1
        try:
            return method(*args, **kwargs)
        finally:
            guard._in_host_method -= 1

    return wrapper


class GuardDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that checks every ATen op against the guard.

    With ``keep_alive`` it also collects every tensor an op reads that was not
    made during this capture, for the graph to hold (see
    ``CapturedGraph.hold``).
    """

    def __init__(self, guard: CaptureGuard, keep_alive: list[torch.Tensor] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.guard = guard
        self.keep_alive = keep_alive
        self._made: set[int] = set()
        self._kept: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.guard.check_dispatch(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.keep_alive is not None:
            for t in tensors_in(args, kwargs):
                key = t.untyped_storage().data_ptr()
                if key not in self._made and key not in self._kept:
                    self._kept.add(key)
                    self.keep_alive.append(t)
            outs = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else ()
            for t in tensors_in(outs, None):
                self._made.add(t.untyped_storage().data_ptr())
        return out
