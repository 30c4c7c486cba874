"""``invariant``: the dispatch mode that pads the rows of products and row-wise reductions to a
multiple of ``ROWS``, and ``Invariance``, what a block run under it did (see the package's docstring)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..observe import DispatchMode

aten = torch.ops.aten

#: Rows are padded up to a multiple of this. vLLM's capture sizes are 1, 2, 4 and multiples of 8,
#: and a real batch lies above the next smaller size, so no multiple of 8 lies between a real
#: batch's row count and its graph's: both reach the kernel padded to the same count. A smaller
#: multiple would fail that for some plans; a larger one computes more padding at small sizes.
ROWS = 8


def _round_up(rows: int) -> int:
    return -(-rows // ROWS) * ROWS


def _pad_dim(x: torch.Tensor, dim: int, target: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``target`` (a new contiguous tensor)."""
    shape = list(x.shape)
    shape[dim] = target
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


@dataclass
class Invariance:
    """What the blocks run under ``invariant`` did: the ops padded (by name) and the ops whose rows
    came out depending on other rows of the same call (``not_row_local``: op and shapes)."""

    padded: set[str] = field(default_factory=set)
    not_row_local: list[str] = field(default_factory=list)
    #: Each op the block ran, with its Python float, bool and string arguments (not its ints, which
    #: are mostly sizes): two forwards of one program at two sizes run the same trace, and a branch
    #: on the size that adds an op or changes a constant shows here even where its effect is below
    #: the precision's rounding (``trace`` is None unless asked for).
    trace: list[tuple[Any, ...]] | None = None

    @property
    def holds(self) -> bool:
        return not self.not_row_local


#: The signatures checked so far in this process, and those that failed (shared by every run: the
#: same kernel at the same shape behaves the same).
_CHECKED: dict[Any, str] = {}


def _signature(func: Any, args: tuple[Any, ...]) -> Any:
    return (
        func,
        tuple(
            (tuple(a.shape), a.dtype, a.device.type, tuple(a.stride()))
            if isinstance(a, torch.Tensor)
            else a
            if isinstance(a, (int, float, bool, type(None)))
            else repr(a)
            for a in args
        ),
    )


def _row_local(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rows_at: list[tuple[int, int]], out: Any
) -> bool:
    """Whether ``func``'s first half of rows is the same when the other rows are zeroed: ``rows_at``
    lists (argument index, its row dim) of the arguments whose rows are the call's rows."""
    n = args[rows_at[0][0]].shape[rows_at[0][1]]
    half = n // 2
    if half == 0:
        return True
    changed = list(args)
    for i, dim in rows_at:
        t = args[i].clone()
        t.narrow(dim, half, n - half).zero_()
        changed[i] = t
    again = func(*changed, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    agains = again if isinstance(again, (tuple, list)) else (again,)
    out_dim = rows_at[0][1]
    for a, b in zip(outs, agains, strict=False):
        if not isinstance(a, torch.Tensor) or a.dim() <= out_dim or a.shape[out_dim] != n:
            continue
        if not torch.equal(a.narrow(out_dim, 0, half), b.narrow(out_dim, 0, half)):
            return False
    return True


def _checked(
    state: Invariance,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rows_at: list[tuple[int, int]],
    out: Any,
) -> None:
    """The row independence of ``func`` at this signature, checked once per process."""
    key = _signature(func, args)
    found = _CHECKED.get(key)
    if found is None:
        found = "" if _row_local(func, args, kwargs, rows_at, out) else _described(func, args)
        _CHECKED[key] = found
    if found and found not in state.not_row_local:
        state.not_row_local.append(found)


def _described(func: Any, args: tuple[Any, ...]) -> str:
    shapes = ", ".join(
        f"{tuple(a.shape)} {str(a.dtype).replace('torch.', '')}" for a in args if isinstance(a, torch.Tensor)
    )
    return f"{func} on {shapes}"


def _product(row_arg: int, row_dim: int, bias_arg: int | None = None) -> Callable[..., Any]:
    """A handler for a product whose rows are ``args[row_arg]``'s dim ``row_dim`` (and a bias with rows)."""

    def run(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = args[row_arg]
        rows = a.shape[row_dim]
        target = _round_up(rows)
        new = list(args)
        rows_at = [(row_arg, row_dim)]
        if target != rows:
            new[row_arg] = _pad_dim(a, row_dim, target)
        if bias_arg is not None:
            bias = args[bias_arg]
            if (
                isinstance(bias, torch.Tensor)
                and bias.dim() > row_dim
                and bias.shape[row_dim] == rows
                and rows > 1
            ):
                if target != rows:
                    new[bias_arg] = _pad_dim(bias, row_dim, target)
                rows_at.append((bias_arg, row_dim))
        args2 = tuple(new)
        out = func(*args2, **kwargs)
        state.padded.add(str(func.overloadpacket.__name__))
        _checked(state, func, args2, kwargs, rows_at, out)
        return out.narrow(row_dim, 0, rows) if target != rows else out

    return run


def _reduced_dims(x: torch.Tensor, dims: Any) -> list[int] | None:
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        return None  # an empty dim list reduces everything
    return sorted(d % x.dim() for d in dims)


def _rowwise(dim_arg: int | None, *, trailing: int | None = None) -> Callable[..., Any]:
    """A handler for a reduction of ``args[0]`` over the dims in ``args[dim_arg]`` (or its
    ``trailing`` last dims): the leading dims before the first reduced one are its rows, padded."""

    def run(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return func(*args, **kwargs)
        if trailing is not None:
            n = len(args[trailing]) if isinstance(args[trailing], (list, tuple)) else 1
            dims: list[int] | None = list(range(x.dim() - n, x.dim()))
        else:
            dims = _reduced_dims(
                x, args[dim_arg] if dim_arg is not None and len(args) > dim_arg else kwargs.get("dim")
            )
        if dims is None or dims[0] == 0:
            return func(*args, **kwargs)  # over the leading dim: statistics over the batch, as they are
        lead = dims[0]
        rows = math.prod(x.shape[:lead])
        target = _round_up(rows)
        flat = x.reshape(rows, *x.shape[lead:])
        if target != rows:
            flat = _pad_dim(flat, 0, target)
        new = list(args)
        new[0] = flat
        if dim_arg is not None and trailing is None:
            shifted = [d - lead + 1 for d in dims]
            if len(args) > dim_arg:
                original = args[dim_arg]
                new[dim_arg] = shifted[0] if isinstance(original, int) else shifted
            else:
                kwargs = {**kwargs, "dim": shifted}
        args2 = tuple(new)
        out = func(*args2, **kwargs)
        state.padded.add(str(func.overloadpacket.__name__))
        _checked(state, func, args2, kwargs, [(0, 0)], out)

        def back(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != target:
                return t
            return t[:rows].reshape(*x.shape[:lead], *t.shape[1:])

        return tuple(back(t) for t in out) if isinstance(out, (tuple, list)) else back(out)

    return run


def _pad_mask(mask: torch.Tensor, target: int) -> torch.Tensor:
    """An attention mask over (queries, keys) padded to ``target`` of each, the new places masked:
    False for a boolean mask, for an additive one the most negative value it holds (what masks the
    keys past the causal diagonal, as the larger size's mask holds it there), never more than the
    dtype's lowest finite value."""
    rows = mask.shape[-1]
    shape = [*mask.shape[:-2], target, target]
    if mask.dtype == torch.bool:
        out = mask.new_zeros(shape)
    else:
        lowest = torch.tensor(torch.finfo(mask.dtype).min, dtype=mask.dtype, device=mask.device)
        out = torch.minimum(mask.amin(), lowest).expand(shape).clone()
    out[..., :rows, :rows] = mask
    return out


def _attention(causal_arg: int, bias_arg: int | None) -> Callable[..., Any]:
    """A handler for fused attention over (batch, heads, sequence, dim) of queries and keys of one
    length: the sequence of the query, keys and values padded alike, for causal attention with no
    mask (row i attends keys 0..i, so no real row attends a padded key) and for attention with a
    mask over (queries, keys), padded with masked places (transformers builds one on the path a
    capture takes); anything else (dropout, keys of another length, no mask and not causal: a
    padded key would be attended) passes as it is."""

    def run(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        q, k, v = args[0], args[1], args[2]
        causal = args[causal_arg] if len(args) > causal_arg else kwargs.get("is_causal", False)
        where: int | str | None = None
        mask: Any = None
        if bias_arg is not None and len(args) > bias_arg and args[bias_arg] is not None:
            where, mask = bias_arg, args[bias_arg]
        elif kwargs.get("attn_mask") is not None:
            where, mask = "attn_mask", kwargs["attn_mask"]
        dropout = args[causal_arg - 1] if len(args) >= causal_arg else kwargs.get("dropout_p", 0.0)
        rows = q.shape[-2] if q.dim() == 4 else -1
        plain = q.dim() != 4 or k.shape[-2] != rows or v.shape[-2] != rows or bool(dropout)
        masked = isinstance(mask, torch.Tensor) and mask.dim() >= 2 and tuple(mask.shape[-2:]) == (rows, rows)
        if plain or (mask is not None and not masked) or (mask is None and not causal):
            return func(*args, **kwargs)
        target = _round_up(rows)
        new = list(args)
        if target != rows:
            new[0], new[1], new[2] = (_pad_dim(t, 2, target) for t in (q, k, v))
            if isinstance(where, int) and mask is not None:
                new[where] = _pad_mask(mask, target)
            elif isinstance(where, str) and mask is not None:
                kwargs = {**kwargs, where: _pad_mask(mask, target)}
        args2 = tuple(new)
        out = func(*args2, **kwargs)
        state.padded.add(str(func.overloadpacket.__name__))
        _checked(state, func, args2, kwargs, [(0, 2), (1, 2), (2, 2)], out)
        if target == rows:
            return out

        def back(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[2] == target:
                return t.narrow(2, 0, rows)
            return rows if isinstance(t, int) and t == target else t

        return tuple(back(t) for t in out)

    return run


#: On the CPU an elementwise op runs its SIMD kernel on whole vectors and a scalar loop on the tail,
#: and for a transcendental function the two round differently (bf16 ``rsqrt`` of 57 values: the
#: last 25 through the scalar loop, 64 values all through the vector one). Their operand is padded
#: to a multiple of this many elements, every vector width's multiple, so each element takes the
#: vector path at every size. A GPU runs one function per element; it needs none of this.
_LANES = 64


def _elementwise(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A unary transcendental op on the CPU, on its operand flattened and padded to ``_LANES``."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.numel() % _LANES == 0:
        return func(*args, **kwargs)
    flat = _pad_dim(x.reshape(-1), 0, -(-x.numel() // _LANES) * _LANES)
    out = func(flat, *args[1:], **kwargs)
    state.padded.add(str(func.overloadpacket.__name__))
    return out[: x.numel()].view(x.shape)


#: The unary ops whose vector and scalar kernels round differently on the CPU (by packet name).
_TRANSCENDENTAL = (
    "rsqrt",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "log2",
    "log10",
    "tanh",
    "sigmoid",
    "silu",
    "gelu",
    "erf",
    "erfc",
    "erfinv",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "reciprocal",
    "softplus",
    "mish",
    "elu",
    "logit",
    "hardswish",
)


def _handlers() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {}

    def add(name: str, overload: str, handler: Callable[..., Any]) -> None:
        packet = getattr(aten, name, None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is not None:
            table[op] = handler

    add("mm", "default", _product(0, 0))
    add("addmm", "default", _product(1, 0, bias_arg=0))
    add("bmm", "default", _product(0, 1))
    add("baddbmm", "default", _product(1, 1, bias_arg=0))
    add("mv", "default", _product(0, 0))
    add("addmv", "default", _product(1, 0, bias_arg=0))
    for name, overload in (
        ("sum", "dim_IntList"),
        ("mean", "dim"),
        ("amax", "default"),
        ("amin", "default"),
        ("var", "correction"),
        ("std", "correction"),
        ("var_mean", "correction"),
        ("linalg_vector_norm", "default"),
        ("logsumexp", "default"),
        ("_softmax", "default"),
        ("_log_softmax", "default"),
    ):
        dim_arg = 2 if name == "linalg_vector_norm" else 1
        add(name, overload, _rowwise(dim_arg))
    for name in _TRANSCENDENTAL:
        add(name, "default", _elementwise)
    add("pow", "Tensor_Scalar", _elementwise)
    add("native_layer_norm", "default", _rowwise(None, trailing=1))
    add("_fused_rms_norm", "default", _rowwise(None, trailing=1))
    add("_scaled_dot_product_flash_attention_for_cpu", "default", _attention(4, None))
    add("_scaled_dot_product_flash_attention", "default", _attention(4, None))
    add("_scaled_dot_product_efficient_attention", "default", _attention(6, 3))
    add("_scaled_dot_product_cudnn_attention", "default", _attention(6, 3))
    add("_scaled_dot_product_fused_attention_overrideable", "default", _attention(5, 3))
    return table


_HANDLERS: dict[Any, Callable[..., Any]] = {}


#: Ops that move or lay out values without arithmetic: where a tensor is contiguous at one size and a
#: view at the other (a padded product's rows cut), a reshape copies at one size alone.
_LAYOUT = frozenset(
    getattr(aten, n)
    for n in ("clone", "copy_", "_unsafe_view", "contiguous", "empty_like", "detach")
    if hasattr(aten, n)
)
_LAYOUT_ONLY: dict[Any, bool] = {}


def _layout_only(func: Any) -> bool:
    found = _LAYOUT_ONLY.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = getattr(func, "overloadpacket", None) in _LAYOUT or (
            schema is not None
            and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        )
        _LAYOUT_ONLY[func] = found
    return found


def _constants(values: Any) -> tuple[Any, ...]:
    """The float, bool and string arguments among ``values`` (a list of them flattened one level)."""
    found: list[Any] = []
    for v in values:
        if isinstance(v, (float, bool, str)):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(x for x in v if isinstance(x, (float, bool, str)))
    return tuple(found)


class _Invariant(DispatchMode):  # type: ignore[misc]
    def __init__(self, state: Invariance) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state
        if not _HANDLERS:
            _HANDLERS.update(_handlers())

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        trace = self.state.trace
        if trace is not None and not _layout_only(func):
            trace.append((func, *_constants(args), *_constants(kwargs.values())))
        handler = _HANDLERS.get(func)
        if handler is None or not all(t.is_floating_point() for t in args if isinstance(t, torch.Tensor)):
            return func(*args, **kwargs)
        return handler(self.state, func, args, kwargs)


@contextlib.contextmanager
def invariant(state: Invariance | None = None) -> Iterator[Invariance]:
    """Run the block with products and row-wise reductions padded to a multiple of ``ROWS`` rows."""
    state = state if state is not None else Invariance()
    with _Invariant(state):
        yield state
