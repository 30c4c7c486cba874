"""The guard's hand-written rules: which ops and which arguments a CUDA graph cannot hold, and why.

``check_op`` reads them for one ATen op on a device: ops whose output size
depends on data, host syncs, boolean masks, and host memory written into or
read with device tensors (the reasons below are the words a finding gives).
The capturability table learned on a GPU (``capturability.py``) is asked
first; how it is consulted is here too (``capturability_table``,
``_decisive``, ``_refused``), beside the rules it outranks, because which ops
it must be asked about on the hot path depends on what the rules look at
(``_RULED``). The helpers the guard shares with the rules (``tensors_in``,
``_storage_key``, ``not_strided``) live here, below everything that uses
them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..capturability import HELD, REFUSED, VALUE_RULES, VALUE_RULES_SOURCE, Table, Verdict, load_table

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
    aten._local_scalar_dense.default: "host sync: reads a device value on the host; keep it on the device "
    "(compute with the tensor, torch.where instead of a Python branch) or read it before the graph",
    aten.equal.default: "host sync: returns a Python bool; compare on the device ((a == b).all() kept a "
    "tensor, used through torch.where) or before the graph",
    aten.is_nonzero.default: "host sync: returns a Python bool; keep the condition a tensor (torch.where "
    "instead of a Python if) or decide it before the graph",
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


def _held_on_device(table: Table, func: Any) -> bool:
    """Whether every verdict the table holds for ``func`` on arguments that are all on the device
    (a pattern without ``h``) is held or depends, and no value rule looks at its arguments: then
    for such a call the table can only agree with the rules or stay silent. Memoised on the table."""
    key = ("held on device", func)
    found = table.memo.get(key)
    if found is None:
        entry = table.ops.get(str(func), {})
        packet = getattr(func, "overloadpacket", None)
        found = table.memo[key] = str(packet) not in VALUE_RULES and not any(
            v.kind == REFUSED for p, v in entry.items() if "h" not in p
        )
    return bool(found)


def _any_on_cpu(args: Any, kwargs: Any) -> bool:
    """Whether a tensor among an ATen op's arguments (``tensors_in``'s) is on the CPU."""
    return any(_on_cpu(t) for t in tensors_in(args, kwargs))


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
