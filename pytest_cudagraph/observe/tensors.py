"""The one walk over a module's parameters and buffers: each as the plain tensors that hold its
data (``plain_parts``: a wrapper subclass such as torchao's quantized weight as its inner
tensors), tied ones under each of their names, which addresses, state, fingerprints and copies
read; the storage a tensor lives in; and whether a cast quantizes."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def plain_parts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``t`` as the plain tensors that hold its data, by name: ``t`` itself, or for a wrapper
    subclass (torchao's quantized weights, a DTensor) its inner tensors (``__tensor_flatten__``),
    each as ``name.attr``, recursively. A wrapper holds no storage of its own and implements few
    ops, so its address, its bits and its copies are those of its parts."""
    if not is_traceable_wrapper_subclass(t):
        return [(name, t)]
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    parts: list[tuple[str, torch.Tensor]] = []
    for attr in attrs:
        inner = getattr(t, attr)
        if isinstance(inner, torch.Tensor):
            parts.extend(plain_parts(f"{name}.{attr}", inner))
    return parts


def named_tensors(
    module: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` as it holds them, by name, tied ones under each of
    their names (lazy ones and wrapper subclasses included): ``named_parameters`` then
    ``named_buffers``, with ``remove_duplicate=False``, in their order.

    ``modules``: ``module.named_modules(remove_duplicate=False)`` read once before (an observer
    keeps it), so that a walk reads each submodule's tables as they are now without walking the
    tree again: this runs around every ``make_inputs`` call, hundreds of times a verification."""
    if modules is None:
        modules = list(module.named_modules(remove_duplicate=False))
    items: list[tuple[str, torch.Tensor]] = []
    append = items.append
    for table in ("_parameters", "_buffers"):
        for prefix, sub in modules:
            for key, value in getattr(sub, table).items():
                if value is not None:
                    append((f"{prefix}.{key}" if prefix else key, value))
    return items


def module_tensors(
    module: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` as plain tensors (``plain_parts``), by name, tied
    ones under each of their names; lazy ones (``nn.LazyLinear`` before its first forward) left out,
    as they hold nothing yet. ``modules`` as ``named_tensors`` takes it."""
    lazy = torch.nn.parameter.is_lazy
    wrapper = is_traceable_wrapper_subclass
    found: list[tuple[str, torch.Tensor]] = []
    for name, t in named_tensors(module, modules):
        if lazy(t):
            continue
        if wrapper(t):
            found.extend(plain_parts(name, t))
        else:
            found.append((name, t))
    return found


def quantizes(t: Any, dtype: Any) -> bool:
    """Whether casting ``t`` to ``dtype`` quantizes: floating values to an integer or float8 dtype."""
    return (
        isinstance(dtype, torch.dtype)
        and dtype != torch.bool
        and (not (dtype.is_floating_point or dtype.is_complex) or dtype.itemsize == 1)
        and isinstance(t, torch.Tensor)
        and t.is_floating_point()
    )


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse, meta, and the like: no storage to write
        return None


#: nn.Module's own bookkeeping attributes: what is not the module's state (the manager's walk over
#: tensors a module holds, and the side_outputs check, skip them).
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)
