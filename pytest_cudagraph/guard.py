"""Finding the operations that cannot live in a graph, and who called them.

A CUDA graph records kernel launches. Anything that needs the host to see a
value computed on the device (``.item()``, ``bool(tensor)``, an output whose
size depends on data) or that moves data between host and device cannot be
recorded. On a GPU such an op either fails deep inside the driver or, worse,
is recorded with a value frozen at capture. The guard sees every op before it
runs, so both backends can name the op, the submodule and the line that
called it instead.

On the emulator the graph's device is the CPU, so "host" and "device" cannot
be told apart by a tensor's device: there the guard goes by provenance
instead, and treats what the forward made from Python data (or with a
factory given no device) as host memory. While a guard is active the code it
watches is told that a stream is capturing, as a real capture would tell it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.cuda.graphs
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .capturability import (
    HELD,
    REFUSED,
    VALUE_RULES,
    VALUE_RULES_SOURCE,
    Table,
    Verdict,
    load_table,
    pattern,
    value_rule,
)
from .observe import ForwardObserver

__all__ = ["CaptureGuard", "GuardDispatchMode", "ModuleTracker", "Violation", "find_violations"]

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


# Values the host makes inside the forward and hands to the device. The probe
# runs behind these rules (torch 2.11 on an H200) saw a real capture refuse
# each with "Cannot copy between CPU and CUDA tensors during CUDA graph capture
# unless the CPU tensor is pinned": torch.tensor/as_tensor/new_tensor with a
# device, `.to(device)` of a CPU tensor (0-dim too), a CPU tensor written by
# copy_ or index_put_ (0-dim too: `t[0] = 3.0`, `t[idx] = 2.0`), and a 0-dim
# CPU tensor in torch.where. It accepted a 0-dim CPU tensor as an operand of
# mul (a CPU scalar), fill_ from one, masked_fill_ and `t[mask] = 0.0`, and
# torch.full/arange/scalar_tensor/new_full/new_ones on the device.
_WRITE_REASON = (
    "host-to-device copy: a value made on the host (a Python number, or torch.tensor data) is written "
    "into a graph tensor, which a graph cannot record; write it with fill_/torch.where from a device "
    "tensor, or keep it in a registered buffer updated on the device"
)
_ONE_HOT_REASON = (
    "host sync: without num_classes it reads the largest label back to size its output; pass num_classes"
)
_DATA_TO_DEVICE_REASON = (
    "host-to-device copy: Python data is copied into a new device tensor, which a graph cannot record; "
    "build it on the device (torch.full/torch.arange with device=) or keep it in a registered buffer"
)
_LIST_INDEX_REASON = (
    "host-to-device copy: torch turns a Python list index into a host tensor and copies it to the device "
    "below every dispatcher, which a graph cannot record; index with a tensor kept on the device (a "
    "registered buffer), or with slices"
)
_MOVE_REASON = (
    "host-to-device copy: a tensor made on the host in forward is moved to the device, which a graph "
    "cannot record; create it there (e.g. torch.arange(n, device=x.device)) or register it as a buffer"
)
_OPERAND_REASON = (
    "host tensor on the graph's path: a tensor made on the host in forward (torch.tensor data, or a "
    "factory given no device=) is read with graph tensors, a host-to-device copy a graph cannot record; "
    "make it on the device (device=x.device) or register it as a buffer"
)
_WHERE_REASON = (
    "host-to-device copy: torch.where copies a 0-dim tensor made on the host to the device, which a "
    "graph cannot record; pass a Python number or a device tensor instead"
)

# In-place writes and the position of the value they write.
_WRITES: dict[Any, int] = {aten.copy_: 1, aten.index_put_: 2, aten.index_put: 2, aten._index_put_impl_: 2}
_WRITE_KWARG: dict[Any, str] = {aten.copy_: "src"}


@dataclass(frozen=True)
class Violation:
    """One op that cannot be captured, and where it was called.

    ``location`` is part of equality: the same op called from two lines is
    two violations, one call repeated (a loop) is one.
    """

    op: str
    reason: str
    module_path: str
    #: "path:line in function" of the call, the first frame outside torch,
    #: this package and contextlib/functools; "" when unknown.
    location: str = ""

    def describe(self) -> str:
        where = f"submodule '{self.module_path}'" if self.module_path else "the top-level module"
        at = f", at {self.location}" if self.location else ""
        return f"{self.op} ({self.reason}) in {where}{at}"


# Frames that are machinery, not the caller a violation should name.
_SKIPPED_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # this package
)
_SKIPPED_FILES = frozenset(
    os.path.abspath(m.__file__) for m in (contextlib, functools) if m.__file__ is not None
)


def call_site(frame: FrameType | None = None) -> str:
    """ "path:line in function" of the first frame outside torch, this package and contextlib/functools.

    Walked only when a violation is reported: the failure path pays for it.
    """
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    while f is not None:
        filename = os.path.abspath(f.f_code.co_filename)
        if not filename.startswith(_SKIPPED_DIRS) and filename not in _SKIPPED_FILES:
            return f"{_short_path(filename)}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return ""


def _short_path(filename: str) -> str:
    cwd = os.getcwd() + os.sep
    if filename.startswith(cwd):
        return filename[len(cwd) :]
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        _head, found, tail = filename.rpartition(marker)
        if found:
            return tail
    return filename


class ModuleTracker:
    """Keeps the dotted path of the submodule whose forward is running."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._stack: list[str] = []
        #: The submodule that was running when a tracked forward last failed.
        self.failed_path = ""
        #: Ops the emulator's guard met that the capturability table does not cover, with the
        #: submodule that ran each first: whether CUDA captures them is not known.
        self.not_known: dict[str, str] = {}
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
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in flat)


def check_op(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[str, str] | None:
    """(op name, reason) when ``func`` cannot be captured on ``device``, else None."""
    reason = _DATA_DEPENDENT.get(func)
    if reason is not None:
        return str(func), reason
    packet = getattr(func, "overloadpacket", None)
    if device.type != "cpu" and _is_masked_fill(packet, args, kwargs):
        # `t[mask] = 0.0`: index_put_ with one boolean mask and a CPU scalar is
        # masked_fill_ with that number (no nonzero, no copy), which a graph
        # holds; seen captured on an H200. (The emulator tells a host scalar
        # by provenance: CaptureGuard.check_dispatch.)
        return None
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
        if (
            func is aten.lift_fresh.default
            and args
            and args[0].device.type == device.type
            and args[0].numel()
        ):
            # torch.tensor(data, device=...) and kin: the data was copied to
            # the device before the op (its argument is already there). Empty
            # data copies nothing: torch skips a copy of no elements.
            return str(func), _DATA_TO_DEVICE_REASON
        position = _WRITES.get(packet)
        if position is not None:
            # A CPU value written into a device tensor is a copy from pageable
            # memory, 0-dim too (`t[0] = 3.0`): unlike an operand, a written
            # value is no CPU scalar a kernel takes by value.
            dest = args[0] if args else None
            value = _written_value(packet, position, args, kwargs)
            if (
                isinstance(dest, torch.Tensor)
                and dest.device.type == device.type
                and isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
            ):
                return str(func), _WRITE_REASON
        if (
            packet is aten.where
            and any(
                isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0 for t in args[1:3]
            )
            and any(isinstance(t, torch.Tensor) and t.device.type == device.type for t in args[:3])
        ):
            # where copies a CPU 0-dim operand to the device; a Python number
            # (torch.where(c, x, 0.0)) arrives already made on the device.
            return str(func), _WHERE_REASON
        tensors = tensors_in(args, kwargs)
        on_host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        on_dev = [t for t in tensors if t.device.type == device.type]
        if packet is aten._to_copy:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != tensors[0].device.type:
                return str(func), "device-to-host copy" if torch.device(
                    target
                ).type == "cpu" else "host-to-device copy"
        if on_host and on_dev:
            return str(func), "CPU tensor on the CUDA path (host-device copy)"
    return None


_TABLE_OFF = 0


@contextlib.contextmanager
def no_capturability_table() -> Iterator[None]:
    """The guard as it was before the learned table (scripts/capturability.py's ``agree --before``)."""
    global _TABLE_OFF
    _TABLE_OFF += 1
    try:
        yield
    finally:
        _TABLE_OFF -= 1


def capturability_table() -> Table | None:
    """The learned table the guard consults, unless turned off."""
    return None if _TABLE_OFF else load_table()


# Packets some rule of check_op looks at beyond the op itself (its arguments' devices, a boolean
# index, an output_size, a written value).
_RULED = frozenset(getattr(f, "overloadpacket", f) for f in _DATA_DEPENDENT) | {
    aten.index,
    aten.index_put,
    aten.index_put_,
    aten._index_put_impl_,
    aten.repeat_interleave,
    aten.lift_fresh,
    aten.copy_,
    aten.where,
    aten._to_copy,
}


def _decisive(table: Table, func: Any) -> bool:
    """Whether the table's exact verdict can change what the rules say of ``func`` on a device: it
    refuses some pattern, or knows one with a host tensor or a boolean mask, or a rule looks at
    the op's arguments. Otherwise the pattern is not worth building on the capture's hot path:
    an exact held verdict and the rules agree (the rules refuse only host tensors, masks and the
    ops above). Memoised on the table."""
    found = table.memo.get(func)
    if found is None:
        entry = table.ops.get(str(func), {})
        packet = getattr(func, "overloadpacket", None)
        found = table.memo[func] = (
            packet in _RULED
            or str(packet) in VALUE_RULES
            or any(v.kind != HELD or "h" in p or "b" in p for p, v in entry.items())
        )
    return bool(found)


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _refused(table: Table, func: Any, verdict: Verdict) -> tuple[str, str]:
    if verdict.by_rule:
        return str(func), f"a CUDA graph capture refuses it: {verdict.reason} (held to {VALUE_RULES_SOURCE})"
    return (
        str(func),
        f"a CUDA graph capture refuses it: {verdict.reason.partition(': ')[2] or verdict.reason}, "
        f"learned on {table.source}",
    )


def _is_view(func: Any) -> bool:
    """A view or an alias: no kernel runs, so there is nothing for a capture to refuse."""
    schema = getattr(func, "_schema", None)
    return (
        schema is not None
        and bool(schema.returns)
        and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    )


def _is_masked_fill(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """index_put_ with a single boolean mask and a 0-dim CPU value: torch runs masked_fill_ with the number."""
    if packet not in (aten.index_put, aten.index_put_, aten._index_put_impl_) or len(args) < 2:
        return False
    indices = args[1]
    if not (
        isinstance(indices, (list, tuple))
        and len(indices) == 1
        and isinstance(indices[0], torch.Tensor)
        and indices[0].dtype == torch.bool
    ):
        return False
    value = _written_value(packet, 2, args, kwargs)
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu"


def _written_value(packet: Any, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(_WRITE_KWARG.get(packet, "values"))


def _storage_key(t: torch.Tensor) -> int:
    # The storage, not the tensor: a view of a host-made tensor (t[None],
    # t.view(...)) is as much on the host as the tensor itself. A sparse
    # tensor has no one storage: the tensor stands for itself.
    if t.layout != torch.strided:
        return id(t)
    return int(t.untyped_storage()._cdata)


SPARSE_REASON = (
    "sparse tensor ({layout}): the emulator records ops on strided tensors only, so it cannot tell what a "
    "graph of this op does; verify it on a GPU (a CUDA capture may hold it), or keep the graph's tensors dense"
)


def not_strided(tensors: Iterable[Any]) -> torch.layout | None:
    """The layout of the first tensor that is not strided (sparse, say), or None."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            return t.layout
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
        observer: ForwardObserver | None = None,
    ) -> None:
        self.tracker = tracker
        self.device = device
        self.on_violation = on_violation
        #: Sees every op the guard sees (the module's writes, its precision).
        self.observer = observer
        self.violations: list[Violation] = []
        self._in_host_method = 0
        #: Above zero while a submodule that runs eagerly anyway (a PIECEWISE
        #: graph's eager piece) is running: its ops are not the graph's.
        self.suspended = 0
        #: On the emulator the graph's device is the CPU: host memory is told
        #: apart by provenance (see _HostValueMode), not by device.
        self.by_provenance = device.type == "cpu"
        #: Storage key -> a tensor made on the host during the forward, held
        #: weakly: a strong hold would keep the emulator from moving a
        #: capture's memory into its pool. An entry leaves with its tensor,
        #: so a storage freed and reused by a graph tensor is not mistaken.
        self.host_made: dict[int, weakref.ref[torch.Tensor]] = {}

    @contextlib.contextmanager
    def exempt(self, modules: list[torch.nn.Module]) -> Iterator[None]:
        """Report nothing while any of ``modules`` runs."""

        def count(step: int) -> None:
            self.suspended += step

        try:
            with _while_running(modules, count):
                yield
        finally:
            self.suspended = 0

    def report(self, op: str, reason: str) -> None:
        if self.suspended:
            return
        violation = Violation(
            op=op, reason=reason, module_path=self.tracker.path, location=call_site(sys._getframe(1))
        )
        if violation not in self.violations:
            self.violations.append(violation)
        if self.on_violation is not None:
            self.on_violation(violation)

    def check_dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.observer is not None and not self.suspended:
            self.observer.observe(func, args, kwargs)
        if self._in_host_method:
            return  # already reported under its Python name
        if self.by_provenance:
            layout = not_strided(tensors_in(args, kwargs))
            if layout is not None:
                self.report(str(func), SPARSE_REASON.format(layout=layout))
                return
        if (
            self.by_provenance
            and self.host_made
            and _is_masked_fill(getattr(func, "overloadpacket", None), args, kwargs)
        ):
            value = _written_value(func.overloadpacket, 2, args, kwargs)
            if _storage_key(value) in self.host_made:
                return  # `t[mask] = 0.0` with a number made on the host: masked_fill_ on a GPU
        table = capturability_table()
        if table is not None and (self.by_provenance or _decisive(table, func)):
            learned = self._learned(table, func, args, kwargs, exact=True)
            if learned is not None:
                # What a GPU did with this op and these kinds of arguments outranks the rules below,
                # which are written for the general case (a boolean mask on the host is no sync).
                if learned.kind == REFUSED:
                    self.report(*_refused(table, func, learned))
                return
        found = check_op(func, args, kwargs, self.device)
        if found is None and self.by_provenance:
            if func is aten.lift_fresh.default:
                # Python data made a tensor (torch.tensor, as_tensor, the value
                # of `t[i] = 3.0`): on a GPU it would be host memory.
                self.mark_host(args[0])
                return
            if self.host_made:
                found = self._check_host_values(func, args, kwargs)
        if (
            found is None
            and self.by_provenance
            and not self.suspended
            and table is not None
            and not _is_view(func)
        ):
            # On the emulator, what its CPU cannot refuse: what a GPU refused when the table was
            # learned. An op the table does not cover is kept as not known (the report says so).
            verdict = self._learned(table, func, args, kwargs, exact=False)
            if verdict is None:
                self.tracker.not_known.setdefault(str(func), self.tracker.path)
            elif verdict.kind == REFUSED:
                found = _refused(table, func, verdict)
        if found is not None:
            self.report(*found)

    def _learned(self, table: Table, func: Any, args: Any, kwargs: Any, *, exact: bool) -> Verdict | None:
        if self.by_provenance:
            is_host = (lambda t: _storage_key(t) in self.host_made) if self.host_made else None
        else:
            is_host = _on_cpu
        letters = pattern(args, kwargs, is_host)
        if "h" not in letters:
            # Where shapes or values decide (an isin's sizes, an LU's shape), the op's value rule
            # outranks what the table learned for the pattern.
            ruled = value_rule(str(func), args, kwargs)
            if ruled is not None:
                return ruled
        return table.verdict(str(func), letters, exact=exact)

    # -- host-made values (the emulator) ------------------------------------
    def mark_host(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and not self.suspended:
            key = _storage_key(t)
            host = self.host_made

            def forget(ref: weakref.ref[torch.Tensor]) -> None:
                if host.get(key) is ref:
                    del host[key]

            host[key] = weakref.ref(t, forget)

    def unmark_host(self, t: torch.Tensor) -> None:
        self.host_made.pop(_storage_key(t), None)

    def is_host(self, t: torch.Tensor) -> bool:
        return bool(self.host_made) and _storage_key(t) in self.host_made

    def _check_host_values(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, str] | None:
        """The emulator's version of the CUDA rules in ``check_op``, with "made on
        the host in this forward" standing in for "on the CPU"."""
        tensors = tensors_in(args, kwargs)
        host = self.host_made
        on_host = [t for t in tensors if _storage_key(t) in host]
        if not on_host or len(on_host) == len(tensors):
            return None  # no host value, or an op of the host's own: nothing the graph records
        packet = getattr(func, "overloadpacket", None)
        position = _WRITES.get(packet)
        if position is not None:
            dest = args[0] if args else None
            value = _written_value(packet, position, args, kwargs)
            if (
                isinstance(dest, torch.Tensor)
                and _storage_key(dest) not in host
                and isinstance(value, torch.Tensor)
                and _storage_key(value) in host
            ):
                return str(func), _WRITE_REASON
        if packet is aten.where and any(t.dim() == 0 for t in on_host):
            return str(func), _WHERE_REASON
        if any(t.dim() > 0 for t in on_host):
            return str(func), _OPERAND_REASON
        # A 0-dim host tensor as a plain operand (x * torch.tensor(2.0)) is a
        # CPU scalar on a GPU, passed to the kernel by value.
        return None

    @contextlib.contextmanager
    def function_mode(self) -> Iterator[None]:
        """Report the Python-level tensor methods that hand device data to the host.

        The eight methods are replaced on ``torch.Tensor`` (see
        ``host_methods_watched``) rather than watched through a
        ``TorchFunctionMode``: a mode sees every torch call, which doubles the
        cost of a capture, while these wrappers cost nothing to the calls they
        do not name. They report to the innermost active guard.

        While it is active ``torch.cuda.is_current_stream_capturing()`` answers
        True (see ``host_methods_watched``), and on the emulator a cheap
        function mode (``_HostValueMode``) follows the values made on the host.
        """
        with host_methods_watched():
            _ACTIVE.append(self)
            try:
                if self.by_provenance:
                    # Only the emulator pays for a function mode: there a
                    # tensor's device cannot say whether it is host memory.
                    with _HostValueMode(self):
                        yield
                else:
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

    ``torch.cuda.is_current_stream_capturing`` is replaced alongside (under
    both names code reaches it by), to answer True while a guard is active:
    code that asks (transformers skips a ``bool(tensor)`` check that way)
    must take the path it takes under a real capture, also on the emulator
    and in the guarded eager runs, where no stream is capturing.
    """
    global _PATCH_DEPTH
    wrappers = _host_wrappers()
    _PATCH_DEPTH += 1
    try:
        if _PATCH_DEPTH == 1:
            for name, (_original, wrapper) in wrappers.items():
                setattr(torch.Tensor, name, wrapper)
            for home in _CAPTURE_QUERY_HOMES:
                original = getattr(home, _CAPTURE_QUERY)
                _SAVED_QUERIES.append((home, original))
                setattr(home, _CAPTURE_QUERY, _answering_capturing(original))
        yield
    finally:
        _PATCH_DEPTH -= 1
        if _PATCH_DEPTH == 0:
            for name, (original, _wrapper) in wrappers.items():
                setattr(torch.Tensor, name, original)
            while _SAVED_QUERIES:
                home, original = _SAVED_QUERIES.pop()
                setattr(home, _CAPTURE_QUERY, original)


_PATCH_DEPTH = 0
#: Guards whose function_mode is active, innermost last.
_ACTIVE: list[CaptureGuard] = []
_WRAPPERS: dict[str, tuple[Any, Any]] = {}
_CAPTURE_QUERY = "is_current_stream_capturing"
# torch.cuda re-exports it from torch.cuda.graphs, whose own functions read the
# module global: both names are replaced.
_CAPTURE_QUERY_HOMES = (torch.cuda, torch.cuda.graphs)
#: (module, the function replaced there) while the replacement holds.
_SAVED_QUERIES: list[tuple[Any, Any]] = []


#: One entry per active ``as_captured`` block: how many of its exempt modules are running.
_AS_CAPTURED: list[list[int]] = []


class _InertFunctionMode(TorchFunctionMode):
    """A function mode that changes nothing but being there.

    torch takes other paths while any function mode is active
    (``has_torch_function`` is then true: ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` leave their fused fast paths). The
    emulated capture runs under ``_HostValueMode``; a reference run meant to
    be the same program runs under this one.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def as_captured(exempt: list[torch.nn.Module] | tuple[()] = (), *, emulated: bool = False) -> Iterator[None]:
    """Run a forward eagerly on the path a capture takes: ``is_current_stream_capturing()`` answers True.

    The checks compare a graph with eager runs of the same program. Code that
    asks whether it is captured (transformers builds its attention mask
    another way then, and on a GPU another kernel runs) would otherwise run
    one program in the graph and another in the reference, and a bit-for-bit
    comparison would fail a correct graph. ``exempt`` modules (a PIECEWISE
    graph's eager pieces) get the plain answer, as they do on replay.
    ``emulated``: the graph was recorded under the emulator's function mode,
    so the run is made under an inert one (see ``_InertFunctionMode``).
    """
    running = [0]

    def count(step: int) -> None:
        running[0] += step

    with (
        _while_running(exempt, count),
        host_methods_watched(),
        _InertFunctionMode() if emulated else contextlib.nullcontext(),
    ):
        _AS_CAPTURED.append(running)
        try:
            yield
        finally:
            _AS_CAPTURED.pop()


@contextlib.contextmanager
def _while_running(modules: Iterable[torch.nn.Module], count: Callable[[int], None]) -> Iterator[None]:
    """``count(+1)`` when any of ``modules`` starts its forward, ``count(-1)`` when it ends
    (also on an exception), for the duration of the block."""
    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(lambda *_: count(1)))
        handles.append(m.register_forward_hook(lambda *_: count(-1), always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _answering_capturing(original: Any) -> Any:
    @functools.wraps(original)
    def is_current_stream_capturing() -> Any:
        if _ACTIVE:
            if not _ACTIVE[-1].suspended:
                # A guard's forward is a capture, emulated, real or rehearsed
                # (the guarded eager runs); an exempt eager piece runs outside it.
                return True
        elif _AS_CAPTURED and not _AS_CAPTURED[-1][0]:
            return True  # a reference run of the captured program (as_captured)
        # Outside, exactly what it did before (on a CPU-only build it raises).
        return original()

    return is_current_stream_capturing


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
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if self.guard.device.type == "cuda" and _capturing(self.guard.device):
                # The op itself failed the capture (a sync or a pageable copy inside its kernel
                # code): a finding that names it, with CUDA's own words, not a raw exception.
                lines = str(exc).strip().splitlines()
                self.guard.report(
                    str(func), f"a CUDA graph capture refuses it: {lines[0] if lines else type(exc).__name__}"
                )
            raise
        if self.guard.observer is not None:
            self.guard.observer.after(func, out)
        if self.guard.by_provenance:
            layout = not_strided(tree_flatten(out)[0])
            if layout is not None:
                self.guard.report(str(func), SPARSE_REASON.format(layout=layout))
        if self.keep_alive is not None:
            for t in tensors_in(args, kwargs):
                key = _address(t)
                if key not in self._made and key not in self._kept:
                    self._kept.add(key)
                    self.keep_alive.append(t)
            outs = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else ()
            for t in tensors_in(outs, None):
                self._made.add(_address(t))
        return out


def _address(t: torch.Tensor) -> int:
    """Where a tensor's memory is (a sparse tensor, with no one storage, is itself)."""
    return id(t) if t.layout != torch.strided else int(t.untyped_storage().data_ptr())


def _capturing(device: torch.device) -> bool:
    """Whether the current stream is capturing, asked of CUDA itself (the Python query may be
    answered by as_captured)."""
    query = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    try:
        return bool(query()) if query is not None else False
    except RuntimeError:
        return False


class _FirstFound(Exception):
    """Stops a forward at its first violation, before the op runs."""


def _stop(_violation: Violation) -> None:
    raise _FirstFound


def find_violations(
    forward: Callable[[], object],
    tracker: ModuleTracker,
    device: torch.device,
    *,
    exempt: Sequence[torch.nn.Module] = (),
    first_only: bool = False,
    observer: ForwardObserver | None = None,
) -> list[Violation]:
    """Run ``forward`` eagerly under the full guard and return the ops a graph cannot hold, in the order met.

    The full guard sees every ATen op, the host methods (``.item()``,
    ``bool(tensor)``, ...) and, on the emulator, the values made on the host;
    ``tracker`` names the submodule of each op. ``exempt`` modules run eagerly
    anyway (a PIECEWISE graph's eager pieces): their ops are not the graph's.
    ``device`` is the graph's device (the CPU on the emulator).

    ``first_only``: stop the forward at the first violation, before that op
    runs (a diagnosis needs one name, and on a GPU the op is not run); a
    failure of the forward after a violation was met then returns that
    violation. Otherwise every violation is listed (each op still runs) and
    a failure of the forward propagates; either way ``tracker.failed_path``
    then names the submodule that was running.
    """
    guard = CaptureGuard(tracker, device, on_violation=_stop if first_only else None, observer=observer)
    try:
        with tracker.track(), guard.exempt(list(exempt)), guard.function_mode(), GuardDispatchMode(guard):
            forward()
    except _FirstFound:
        pass
    except Exception:
        # A module may catch the stop and fail another way: the op met first is still the answer.
        if not (first_only and guard.violations):
            raise
    return guard.violations[:1] if first_only else guard.violations


class _HostValueMode(TorchFunctionMode):
    """The emulator's eyes for values the host makes and hands to the device.

    A CPU tensor moved to the CPU by ``.to`` is not even dispatched, and
    ``torch.tensor(data, device=x.device)`` dispatches as the same
    ``lift_fresh`` as ``torch.tensor(data)``: only the Python call says what
    a GPU would have done. A function mode sees every torch call, so this one
    looks up each in one dict and passes the rest straight through; it follows
    host-made values through other calls only once the forward has made one.
    Active only while a CPU guard's ``function_mode`` is (never on CUDA): 32
    emulated captures of a two-layer Llama took 0.55 s with it, 0.53 s without.
    """

    def __init__(self, guard: CaptureGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        guard = self.guard
        if not _ACTIVE or _ACTIVE[-1] is not guard:
            return func(*args, **kwargs)  # an inner guard's forward: its own mode watches it
        handler = _HOST_VALUE_CALLS.get(func)
        if handler is not None:
            return handler(guard, func, args, kwargs)
        out = func(*args, **kwargs)
        if guard.host_made:
            # An op of host values alone runs on the host (torch.arange(n) * 2):
            # its result is host memory too.
            tensors = tensors_in(args, kwargs)
            if tensors and all(guard.is_host(t) for t in tensors):
                _mark_all(guard, out)
        return out


def _mark_all(guard: CaptureGuard, out: Any) -> None:
    for t in tensors_in(
        (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else (), None
    ):
        guard.mark_host(t)


def _on_device(guard: CaptureGuard, device: Any) -> bool:
    return device is not None and torch.device(device).type == guard.device.type


def _call_quietly(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    # Reported under its Python name: the ops beneath are the same event.
    guard._in_host_method += 1
    try:
        return func(*args, **kwargs)
    finally:
        guard._in_host_method -= 1


def _factory(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    out = func(*args, **kwargs)
    if kwargs.get("device") is None and torch.get_default_device().type == "cpu":
        # No device: on a GPU this tensor is host memory.
        _mark_all(guard, out)
    return out


def _from_data(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    """torch.tensor / torch.as_tensor: Python data, or a tensor, and maybe a device."""
    data = args[0] if args else kwargs.get("data")
    if isinstance(data, torch.Tensor):
        if guard.is_host(data) and _on_device(guard, kwargs.get("device")):
            return _moved(guard, f"torch.{func.__name__}(host tensor, device=...)", func, args, kwargs)
        return func(*args, **kwargs)
    if _on_device(guard, kwargs.get("device")):
        out = _call_quietly(guard, func, args, kwargs)
        if isinstance(out, torch.Tensor) and out.numel() == 0:
            # torch.tensor([], device=...) (transformers' DynamicCache starts
            # so): a copy of nothing, which torch skips and a capture holds.
            return out
        guard.report(f"torch.{func.__name__}(..., device=...)", _DATA_TO_DEVICE_REASON)
        return out
    return func(*args, **kwargs)  # host data: lift_fresh marks it


def _new_tensor(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    self = args[0]
    device = kwargs.get("device")
    if device is None and guard.is_host(self):
        return func(*args, **kwargs)  # made beside a host tensor: on the host (lift_fresh marks it)
    if device is None or _on_device(guard, device):
        guard.report("Tensor.new_tensor()", _DATA_TO_DEVICE_REASON)
        return _call_quietly(guard, func, args, kwargs)
    return func(*args, **kwargs)


def _to(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    self = args[0]
    if not guard.is_host(self):
        return func(*args, **kwargs)
    if _on_device(guard, _target_device(args, kwargs)):
        return _moved(guard, "Tensor.to(device)", func, args, kwargs)
    out = func(*args, **kwargs)
    _mark_all(guard, out)  # another dtype, still on the host
    return out


def _target_device(args: Any, kwargs: Any) -> Any:
    """The device of a ``Tensor.to`` call, or None: ``to(device, ...)``, ``to(other, ...)``,
    ``to(dtype, ...)`` (read here: torch's own parser refuses ``copy=``)."""
    device = kwargs.get("device")
    if device is None and isinstance(kwargs.get("other"), torch.Tensor):
        device = kwargs["other"].device
    if device is None and len(args) > 1:
        first = args[1]
        if isinstance(first, torch.Tensor):
            device = first.device
        elif isinstance(first, (str, torch.device)) or (
            isinstance(first, int) and not isinstance(first, bool)
        ):
            device = first
    return device


def _cuda(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    if guard.is_host(args[0]):
        return _moved(guard, "Tensor.cuda()", func, args, kwargs)
    return func(*args, **kwargs)


def _list_index(index: Any) -> bool:
    """Whether ``t[index]`` indexes with a Python list of numbers (``t[[0, 2]]``, ``t[:, [1, 3]]``),
    which torch makes a tensor of in C++, on the host, and copies to ``t``'s device. (A list that
    holds slices or tensors is read as a tuple of indices: no copy.)"""

    def numbers(value: Any) -> bool:
        if isinstance(value, list):
            return all(numbers(v) for v in value)
        return isinstance(value, (bool, int))

    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) and part and numbers(part) for part in parts)


def _one_hot(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    """``F.one_hot``: its CPU kernel checks the labels' range with ``.item()``, where CUDA's
    leaves that to a device assert; CUDA reads a value back only to count the classes when
    ``num_classes`` is not given. So what the ops beneath do on the CPU is not the event."""
    labels = args[0] if args else kwargs.get("tensor")
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    out = _call_quietly(guard, func, args, kwargs)
    if isinstance(labels, torch.Tensor) and guard.is_host(labels):
        _mark_all(guard, out)  # one_hot of host labels runs on the host
    elif num_classes == -1 and isinstance(labels, torch.Tensor) and labels.numel() > 0:
        guard.report("torch.nn.functional.one_hot(num_classes=-1)", _ONE_HOT_REASON)
    return out


def _indexed(guard: CaptureGuard, func: Any, args: Any, kwargs: Any) -> Any:
    """``t[[0, 2]]`` and ``t[[0, 2]] = v`` on a graph tensor: learned on the H200 from OpInfo's
    ``__getitem__`` samples, which CUDA refused while its dispatch mode saw no op at all."""
    if len(args) > 1 and not guard.is_host(args[0]) and _list_index(args[1]):
        guard.report(f"Tensor.{func.__name__} with a Python list index", _LIST_INDEX_REASON)
        return _call_quietly(guard, func, args, kwargs)
    return func(*args, **kwargs)


def _moved(guard: CaptureGuard, label: str, func: Any, args: Any, kwargs: Any) -> Any:
    guard.report(label, _MOVE_REASON)
    out = _call_quietly(guard, func, args, kwargs)
    if isinstance(out, torch.Tensor):
        # On the device now (on the emulator it may be the very same tensor):
        # its uses are not the same mistake again.
        guard.unmark_host(out)
    return out


_FACTORIES = (
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.empty_strided,
    torch.eye,
    torch.linspace,
    torch.logspace,
    torch.scalar_tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tril_indices,
    torch.triu_indices,
)
_HOST_VALUE_CALLS: dict[Any, Callable[[CaptureGuard, Any, Any, Any], Any]] = {
    **dict.fromkeys(_FACTORIES, _factory),
    torch.tensor: _from_data,
    torch.as_tensor: _from_data,
    torch.Tensor.new_tensor: _new_tensor,
    torch.Tensor.to: _to,
    torch.Tensor.cuda: _cuda,
    torch.nn.functional.one_hot: _one_hot,
    torch.Tensor.__getitem__: _indexed,
    torch.Tensor.__setitem__: _indexed,
}
