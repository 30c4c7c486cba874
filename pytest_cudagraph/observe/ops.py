"""What an op does, read once per op from its schema: the arguments it writes (batch norm's and
c10d's unmarked writes included), the tensors whose values it reads, whether it draws random
numbers, hands back memory as the allocator left it, or overwrites its first argument without
reading it. Every dispatch mode of the package asks these tables; nothing here runs an op."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# func -> the positions (ints) and keyword names (strs) of the arguments it writes
_WRITES: dict[Any, tuple[int | str, ...]] = {}

# Ops that write arguments their schema does not mark: batch norm updates its
# running statistics (positions 3 and 4) in place; c10d's in-place
# collectives write the tensors they are given.
_UNMARKED: dict[Any, tuple[int | str, ...]] = {
    p: (3, 4, "running_mean", "running_var")
    for p in _packets(
        "native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_impl_index", "batch_norm"
    )
}
_COLLECTIVE_NAMESPACES = frozenset({"c10d"})


def _written_arguments(func: Any) -> tuple[int | str, ...]:
    found = _WRITES.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        places: list[int | str] = list(_UNMARKED.get(getattr(func, "overloadpacket", None), ()))
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            places.append(0)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    places.append(arg.name if arg.kwarg_only else i)
                    if not arg.kwarg_only:
                        places.append(arg.name)  # also given by name
        found = _WRITES[func] = tuple(places)
    return found


def written_tensors(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors ``func`` writes (its schema's write marks, batch norm's unmarked statistics)."""
    found = []
    for place in _written_arguments(func):
        t = args[place] if isinstance(place, int) and place < len(args) else kwargs.get(place)
        if isinstance(t, torch.Tensor):
            found.append(t)
    return found


_VIEWS: dict[Any, bool] = {}


def _is_view(func: Any) -> bool:
    found = _VIEWS.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = _VIEWS[func] = schema is not None and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
    return found


def data_read(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors whose values ``func`` reads: every tensor argument but those it only writes
    (the target of ``copy_``, an ``out=``), and none for a view (it reads no values)."""
    if _is_view(func):
        return []
    written = {id(t) for t in written_tensors(func, args, kwargs)}
    flat, _ = tree_flatten((args, kwargs))
    return [t for t in flat if isinstance(t, torch.Tensor) and id(t) not in written]


# Ops that draw from a generator, in every overload (those without a generator argument draw
# from the default one): the random factories and samplers, and dropout's own kernels.
_DRAWS_BY_NAME = _packets(
    "native_dropout",
    "_fused_dropout",
    "fused_dropout",
    "rrelu_with_noise",
    "feature_dropout",
    "alpha_dropout",
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "bernoulli_",
    "normal",
    "normal_",
    "uniform_",
    "multinomial",
    "poisson",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "random_",
    "binomial",
    "_standard_gamma",
    "_sample_dirichlet",
)
_DRAWS: dict[Any, bool] = {}


def draws_random(func: Any) -> bool:
    """Whether ``func`` draws from a random generator: its schema takes one, or it is dropout's."""
    found = _DRAWS.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = getattr(func, "overloadpacket", None) in _DRAWS_BY_NAME or (
            schema is not None and any("Generator" in str(a.type) for a in schema.arguments)
        )
        _DRAWS[func] = found
    return found


# Ops that hand back memory as the allocator left it.
_ALLOCATES = _packets(
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"
)
# Ops that overwrite their first argument without reading it.
_OVERWRITES = _packets(
    "copy_",
    "fill_",
    "zero_",
    "uniform_",
    "normal_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "set_",
    "resize_",
)


# Ops that read a tensor's shape, dtype and device, never its values.
_METADATA_ONLY = _packets(
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "new_ones",
    "new_full",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "detach",
    "lift_fresh",
    "_has_same_storage_numel",
)
_NOTHING_READ: dict[Any, bool] = {}


def _reads_nothing(func: Any) -> bool:
    """Whether ``func`` reads no tensor's values: a view (its result aliases an argument) or a
    metadata op."""
    found = _NOTHING_READ.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        view = schema is not None and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        found = _NOTHING_READ[func] = view or getattr(func, "overloadpacket", None) in _METADATA_ONLY
    return found
