"""The emulator's rules of provenance: which values the forward made on the host, and where they go.

On the emulator the graph's device is the CPU, so a tensor's device cannot
say whether a GPU would have it in host memory. ``_HostValueMode`` watches
the Python calls that make or move such values (``torch.tensor``, the
factories given no device, ``.to``, ``.cuda``, a Python list index,
``one_hot``) and marks or reports them on the active guard, whose dispatch
mode then follows the marked values op by op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from . import host
from .rules import (
    _DATA_TO_DEVICE_REASON,
    _LIST_INDEX_REASON,
    _MOVE_REASON,
    _ONE_HOT_REASON,
    tensors_in,
)


class ProvenanceGuard(host.ActiveGuard, Protocol):
    """What the emulator's function mode asks of its guard (``CaptureGuard`` has it): an active
    guard's reports, and the marks of host-made values and the device besides. A protocol here,
    so that this module, below the guard, never names the guard's own module."""

    @property
    def device(self) -> torch.device: ...
    @property
    def host_made(self) -> Mapping[int, weakref.ref[torch.Tensor]]: ...
    def mark_host(self, t: Any) -> None: ...
    def unmark_host(self, t: torch.Tensor) -> None: ...
    def is_host(self, t: torch.Tensor) -> bool: ...


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

    def __init__(self, guard: ProvenanceGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        guard = self.guard
        if not host._ACTIVE or host._ACTIVE[-1] is not guard:
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


def _mark_all(guard: ProvenanceGuard, out: Any) -> None:
    for t in tensors_in(
        (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else (), None
    ):
        guard.mark_host(t)


def _on_device(guard: ProvenanceGuard, device: Any) -> bool:
    return device is not None and torch.device(device).type == guard.device.type


def _call_quietly(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
    # Reported under its Python name: the ops beneath are the same event.
    guard._in_host_method += 1
    try:
        return func(*args, **kwargs)
    finally:
        guard._in_host_method -= 1


def _factory(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
    out = func(*args, **kwargs)
    if kwargs.get("device") is None and torch.get_default_device().type == "cpu":
        # No device: on a GPU this tensor is host memory.
        _mark_all(guard, out)
    return out


def _from_data(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
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


def _new_tensor(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
    self = args[0]
    device = kwargs.get("device")
    if device is None and guard.is_host(self):
        return func(*args, **kwargs)  # made beside a host tensor: on the host (lift_fresh marks it)
    if device is None or _on_device(guard, device):
        guard.report("Tensor.new_tensor()", _DATA_TO_DEVICE_REASON)
        return _call_quietly(guard, func, args, kwargs)
    return func(*args, **kwargs)


def _to(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
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


def _cuda(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
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


def _one_hot(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
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


def _indexed(guard: ProvenanceGuard, func: Any, args: Any, kwargs: Any) -> Any:
    """``t[[0, 2]]`` and ``t[[0, 2]] = v`` on a graph tensor: learned on the H200 from OpInfo's
    ``__getitem__`` samples, which CUDA refused while its dispatch mode saw no op at all."""
    if len(args) > 1 and not guard.is_host(args[0]) and _list_index(args[1]):
        guard.report(f"Tensor.{func.__name__} with a Python list index", _LIST_INDEX_REASON)
        return _call_quietly(guard, func, args, kwargs)
    return func(*args, **kwargs)


def _moved(guard: ProvenanceGuard, label: str, func: Any, args: Any, kwargs: Any) -> Any:
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
_HOST_VALUE_CALLS: dict[Any, Callable[[ProvenanceGuard, Any, Any, Any], Any]] = {
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
