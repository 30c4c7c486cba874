"""``invariant``: the function mode that pads the rows of products, row-wise reductions and attention
to a multiple of ``ROWS``, and ``Invariance``, what a block run under it did (see the package's
docstring).

Why a ``TorchFunctionMode`` and not a dispatch mode: the fast route runs two forwards a size, 134 at
vLLM's 67 sizes, and a forward is bound by the host (a 1B Llama's 1,300 ops). A dispatch mode puts
every aten op through Python (a no-op one cost 1.4x to 3x an eager forward on an H100 host, 2026-12-05);
a function mode sees the calls the module's Python makes (``F.linear``, ``x.mean(-1)``,
``x * 1.001``), about as many, for a fraction of that (1.1x), and the padded call's own ops run
below it unseen. The calls are where a branch on the token count shows, too: that is the trace.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

#: Rows are padded up to a multiple of this. vLLM's capture sizes are 1, 2, 4 and multiples of 8,
#: and a real batch lies above the next smaller size, so no multiple of 8 lies between a real
#: batch's row count and its graph's: both reach the kernel padded to the same count. A smaller
#: multiple would fail that for some plans; a larger one computes more padding at small sizes.
ROWS = 8


def _round_up(rows: int) -> int:
    return -(-rows // ROWS) * ROWS


def _pad_dim(x: torch.Tensor, dim: int, target: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``target``, laid out in memory as ``x`` is: the
    queries of a decoder are a transposed view, and a kernel picked (and on a GPU set up) per
    layout would run another program on the real batch than at the padded size."""
    shape = list(x.shape)
    shape[dim] = target
    if x.is_contiguous() or x.dim() < 2:
        out = x.new_zeros(shape)
    else:
        strides = x.stride()
        order = sorted(range(x.dim()), key=lambda d: -strides[d])  # outermost first; stable on ties
        out = x.new_zeros([shape[d] for d in order]).permute([order.index(d) for d in range(x.dim())])
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


@dataclass
class Invariance:
    """What the blocks run under ``invariant`` did: the calls padded (by name) and the calls whose
    rows came out depending on other rows of the same call (``not_row_local``: call and shapes)."""

    padded: set[str] = field(default_factory=set)
    not_row_local: list[str] = field(default_factory=list)
    #: Each torch call the block made, with its Python float, bool and string arguments (not its
    #: ints, which are mostly sizes): two forwards of one program at two sizes make the same calls,
    #: and a branch on the size that adds a call or changes a constant shows here even where its
    #: effect is below the precision's rounding (``trace`` is None unless asked for).
    trace: list[tuple[Any, ...]] | None = None

    #: The last tensor padded and its padded copy: a decoder feeds one input to its query, key and
    #: value projections (and its gate and up ones), padded once for all three.
    _last: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def holds(self) -> bool:
        return not self.not_row_local

    def _padded_once(self, x: torch.Tensor, dim: int, target: int) -> torch.Tensor:
        last = self._last
        if last and last[0] is x and last[1] == (x._version, dim, target):
            return last[2]  # type: ignore[no-any-return]
        out = _pad_dim(x, dim, target)
        self._last = (x, (x._version, dim, target), out)
        return out


#: The signatures checked so far in this process, and those that failed (shared by every run: the
#: same kernel on the same features behaves the same at every row count).
_CHECKED: dict[Any, str] = {}


def _signature(func: Any, args: tuple[Any, ...], rows_at: list[tuple[int, int]], by_rows: bool) -> Any:
    """What the row check is keyed by: the call and its arguments, each tensor by shape (its row count
    left out unless ``by_rows``), dtype and device. A plain loop: it runs at every padded call."""
    dims = {} if by_rows else dict(rows_at)
    key: list[Any] = [func]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            shape: tuple[int, ...] = tuple(a.shape)
            dim = dims.get(i)
            if dim is not None and dim < len(shape):
                shape = (*shape[:dim], -1, *shape[dim + 1 :])  # the row count is not what a row gets
            key.append((shape, a.dtype, a.device.type))
        elif isinstance(a, (int, float, bool, type(None))):
            key.append(a)
        else:
            key.append(repr(a))
    return tuple(key)


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
    *,
    by_rows: bool = False,
) -> None:
    """The row independence of ``func`` on these features, checked once per process (at each row
    count too where ``by_rows``: attention, whose keys are its rows)."""
    key = _signature(func, args, rows_at, by_rows)
    found = _CHECKED.get(key)
    if found is None:
        found = "" if _row_local(func, args, kwargs, rows_at, out) else _described(func, args)
        _CHECKED[key] = found
    if found and found not in state.not_row_local:
        state.not_row_local.append(found)


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func))


def _described(func: Any, args: tuple[Any, ...]) -> str:
    shapes = ", ".join(
        f"{tuple(a.shape)} {str(a.dtype).replace('torch.', '')}" for a in args if isinstance(a, torch.Tensor)
    )
    return f"{_name(func)} on {shapes}"


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _padded_call(
    state: Invariance,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    at: list[tuple[int, int]],
    rows: int,
    *,
    by_rows: bool = False,
) -> Any:
    """``func`` on ``args`` whose tensors at ``at`` (argument index, row dim) hold ``rows`` rows,
    padded to a multiple of ``ROWS``: the output, its rows still padded (the caller cuts them)."""
    target = _round_up(rows)
    if target != rows:
        new = list(args)
        for i, dim in at:
            new[i] = state._padded_once(args[i], dim, target)
        args = tuple(new)
    out = func(*args, **kwargs)
    state.padded.add(_name(func))
    _checked(state, func, args, kwargs, at, out, by_rows=by_rows)
    return out


def _flat_rows(row_arg: int, bias_arg: int | None = None) -> Callable[..., Any]:
    """A product whose rows are ``args[row_arg]``'s leading dims (a matrix on its right: ``F.linear``,
    ``x @ W``, ``mm``, ``addmm`` and its bias where it has rows)."""

    def run(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = args[row_arg]
        other = args[row_arg + 1] if len(args) > row_arg + 1 else kwargs.get("weight")
        if (
            not _floating(a)
            or a.dim() < 2
            or not isinstance(other, torch.Tensor)
            or other.dim() > 2
            or "out" in kwargs
        ):
            return func(*args, **kwargs)
        if a.dim() == 2 or all(d == 1 for d in a.shape[:-2]):
            # Rows in one dim (a decoder's (1, tokens, hidden)): padded there, no reshape either way.
            dim = a.dim() - 2
            rows = a.shape[dim]
            at = [(row_arg, dim)]
            if bias_arg is not None and dim == 0:
                bias = args[bias_arg]
                if isinstance(bias, torch.Tensor) and bias.dim() == 2 and bias.shape[0] == rows and rows > 1:
                    at.append((bias_arg, 0))
            out = _padded_call(state, func, args, kwargs, at, rows)
            return out if rows % ROWS == 0 else out.narrow(out.dim() - 2, 0, rows)
        lead = a.shape[:-1]
        rows = math.prod(lead)
        new = list(args)
        new[row_arg] = a.reshape(rows, a.shape[-1])
        at = [(row_arg, 0)]
        if bias_arg is not None:
            bias = args[bias_arg]
            if isinstance(bias, torch.Tensor) and bias.dim() == 2 and bias.shape[0] == rows and rows > 1:
                at.append((bias_arg, 0))
        out = _padded_call(state, func, tuple(new), kwargs, at, rows)
        return out[:rows].reshape(*lead, *out.shape[1:])

    return run


def _batched_rows(row_arg: int, bias_arg: int | None = None) -> Callable[..., Any]:
    """A product of stacks of matrices (``bmm``, ``baddbmm``, ``matmul`` of two stacks): the rows of
    each, ``args[row_arg]``'s dim -2."""

    def run(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = args[row_arg]
        if not _floating(a) or a.dim() < 3 or "out" in kwargs:
            return func(*args, **kwargs)
        dim = a.dim() - 2
        rows = a.shape[dim]
        at = [(row_arg, dim)]
        if bias_arg is not None:
            bias = args[bias_arg]
            if (
                isinstance(bias, torch.Tensor)
                and bias.dim() == a.dim()
                and bias.shape[dim] == rows
                and rows > 1
            ):
                at.append((bias_arg, dim))
        out = _padded_call(state, func, args, kwargs, at, rows)
        return out.narrow(out.dim() - 2, 0, rows)

    return run


_FLAT_MATMUL = _flat_rows(0)
_BATCHED_MATMUL = _batched_rows(0)


def _matmul(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``matmul`` and ``@``: rows flattened where the right side is a matrix, else per stack."""
    other = args[1] if len(args) > 1 else kwargs.get("other")
    if isinstance(other, torch.Tensor) and other.dim() > 2:
        return _BATCHED_MATMUL(state, func, args, kwargs)
    return _FLAT_MATMUL(state, func, args, kwargs)


def _dims(x: torch.Tensor, dims: Any) -> list[int] | None:
    """The reduced dims, sorted and non-negative; None for a reduction over everything."""
    if dims is None or isinstance(dims, bool):
        return None
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not dims or not all(isinstance(d, int) for d in dims):
        return None  # an empty dim list reduces everything; a named dim is passed through
    return sorted(d % x.dim() for d in dims)


def _rowwise(dim_arg: int | None, *, trailing: int | None = None) -> Callable[..., Any]:
    """A reduction of ``args[0]`` over the dims in ``args[dim_arg]`` (or the trailing dims that
    ``args[trailing]``, a shape, names): the leading dims before the first reduced one are its
    rows, flattened and padded."""

    def run(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        if not _floating(x) or x.dim() < 2 or "out" in kwargs:
            return func(*args, **kwargs)
        if trailing is not None:
            shape = args[trailing] if len(args) > trailing else kwargs.get("normalized_shape")
            n = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
            dims: list[int] | None = list(range(x.dim() - n, x.dim()))
        else:
            given = args[dim_arg] if dim_arg is not None and len(args) > dim_arg else kwargs.get("dim")
            dims = _dims(x, given)
        if dims is None or dims[0] == 0:
            return func(*args, **kwargs)  # over the leading dim: statistics over the batch, as they are
        lead = dims[0]
        if all(d == 1 for d in x.shape[: lead - 1]):
            # Rows in one dim (a norm over (1, tokens, hidden)): padded there, the dims as given.
            rows = x.shape[lead - 1]
            out = _padded_call(state, func, args, kwargs, [(0, lead - 1)], rows)
            if rows % ROWS == 0:
                return out
            return _each(out, lambda t: t.narrow(lead - 1, 0, rows) if _has_rows(t, lead - 1, rows) else t)
        rows = math.prod(x.shape[:lead])
        new = list(args)
        new[0] = x.reshape(rows, *x.shape[lead:])
        if trailing is None:
            shifted = [d - lead + 1 for d in dims]
            if dim_arg is not None and len(args) > dim_arg:
                new[dim_arg] = shifted[0] if isinstance(args[dim_arg], int) else shifted
            else:
                kwargs = {**kwargs, "dim": shifted[0] if isinstance(kwargs.get("dim"), int) else shifted}
        out = _padded_call(state, func, tuple(new), kwargs, [(0, 0)], rows)
        target = _round_up(rows)

        def back(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != target:
                return t
            return t[:rows].reshape(*x.shape[:lead], *t.shape[1:])

        return _each(out, back)

    return run


def _has_rows(t: Any, dim: int, rows: int) -> bool:
    """Whether ``t`` is an output with the call's padded rows in ``dim`` (a statistic is)."""
    return isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == _round_up(rows)


def _each(out: Any, cut: Callable[[Any], Any]) -> Any:
    """``cut`` applied to ``out`` or to each of its outputs (a named tuple stays one)."""
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(cut(t) for t in out))
    return tuple(cut(t) for t in out) if isinstance(out, (tuple, list)) else cut(out)


def _pad_mask(mask: torch.Tensor, target: int) -> torch.Tensor:
    """An attention mask over (queries, keys) padded to ``target`` of each, the new places masked:
    False for a boolean mask, for an additive one the most negative value it holds (what masks the
    keys past the causal diagonal, as the larger size's mask holds it there), never more than the
    dtype's lowest finite value. No value comes to the host: this runs in every attention call."""
    rows = mask.shape[-1]
    shape = [*mask.shape[:-2], target, target]
    if mask.dtype == torch.bool:
        out = mask.new_zeros(shape)
    else:
        lowest = mask.amin().clamp(max=torch.finfo(mask.dtype).min)
        out = lowest.expand(shape).clone()
    out[..., :rows, :rows] = mask
    return out


def _attention(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.scaled_dot_product_attention`` over (batch, heads, sequence, dim) of queries and keys of one
    length: the sequence of the query, keys and values padded alike, for causal attention with no
    mask (row i attends keys 0..i, so no real row attends a padded key) and for attention with a
    mask over (queries, keys), padded with masked places (transformers builds one on the path a
    capture takes); anything else (dropout, keys of another length, no mask and not causal: a
    padded key would be attended) passes as it is."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    q, k, v = given.get("query"), given.get("key"), given.get("value")
    mask, dropout, causal = given.get("attn_mask"), given.get("dropout_p", 0.0), given.get("is_causal", False)
    if (
        not isinstance(q, torch.Tensor)
        or not q.is_floating_point()
        or not isinstance(k, torch.Tensor)
        or not isinstance(v, torch.Tensor)
        or q.dim() != 4
    ):
        return func(*args, **kwargs)
    rows = q.shape[-2]
    plain = k.shape[-2] != rows or v.shape[-2] != rows or bool(dropout)
    masked = isinstance(mask, torch.Tensor) and mask.dim() >= 2 and tuple(mask.shape[-2:]) == (rows, rows)
    if plain or (mask is not None and not masked) or (mask is None and not causal):
        return func(*args, **kwargs)
    target = _round_up(rows)
    rest = {n: given[n] for n in given if n not in ("query", "key", "value", "attn_mask")}
    if mask is not None and target != rows:
        mask = _pad_mask(mask, target)
    if mask is not None:
        rest["attn_mask"] = mask
    out = _padded_call(state, func, (q, k, v), rest, [(0, 2), (1, 2), (2, 2)], rows, by_rows=True)
    return out.narrow(2, 0, rows)


#: On the CPU an elementwise op runs its SIMD kernel on whole vectors and a scalar loop on the tail,
#: and for a transcendental function the two round differently (bf16 ``rsqrt`` of 57 values: the
#: last 25 through the scalar loop, 64 values all through the vector one). Their operand is padded
#: to a multiple of this many elements, every vector width's multiple, so each element takes the
#: vector path at every size. A GPU runs one function per element; it needs none of this.
_LANES = 64


def _elementwise(state: Invariance, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A unary transcendental op on the CPU, on its operand flattened and padded to ``_LANES``."""
    x = args[0] if args else None
    if (
        not isinstance(x, torch.Tensor)
        or not x.is_cpu  # first: on a GPU nothing here pads, and this runs at every such call
        or not x.is_floating_point()
        or x.numel() % _LANES == 0
        or any(isinstance(a, torch.Tensor) for a in args[1:])
        or kwargs.get("inplace")
        or "out" in kwargs
    ):
        return func(*args, **kwargs)
    flat = _pad_dim(x.reshape(-1), 0, -(-x.numel() // _LANES) * _LANES)
    out = func(flat, *args[1:], **kwargs)
    state.padded.add(_name(func))
    return out[: x.numel()].view(x.shape)


#: The unary functions whose vector and scalar kernels round differently on the CPU (by name, in
#: ``torch``, as ``Tensor`` methods, in ``torch.nn.functional`` and ``torch.special``).
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
    "pow",
    "__pow__",
)


def _handlers() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {}

    def add(names: tuple[str, ...], handler: Callable[..., Any], *spaces: Any) -> None:
        for space in spaces or (torch, torch.Tensor):
            for name in names:
                func = getattr(space, name, None)
                if callable(func):
                    table[func] = handler

    add(("linear",), _flat_rows(0), F)
    add(("mm", "mv"), _flat_rows(0))
    add(("addmm", "addmv"), _flat_rows(1, bias_arg=0))
    add(("bmm",), _batched_rows(0))
    add(("baddbmm",), _batched_rows(1, bias_arg=0))
    add(("matmul", "__matmul__"), _matmul)
    add(
        (
            "sum",
            "mean",
            "nansum",
            "nanmean",
            "var",
            "std",
            "var_mean",
            "std_mean",
            "logsumexp",
            "softmax",
            "log_softmax",
        ),
        _rowwise(1),
    )
    add(("softmax", "log_softmax"), _rowwise(1), F)
    add(("norm",), _rowwise(2))
    add(("vector_norm", "norm"), _rowwise(2), torch.linalg)
    add(("layer_norm", "rms_norm"), _rowwise(None, trailing=1), torch, F)
    add(("scaled_dot_product_attention",), _attention, F)
    add(_TRANSCENDENTAL, _elementwise, torch, torch.Tensor, F, torch.special)
    return table


_HANDLERS: dict[Any, Callable[..., Any]] = {}

#: Calls that read a tensor's metadata, lay it out or move its values, with no arithmetic: left out
#: of the trace, which is for effects that round away (a forward makes thousands of these; one that
#: moves other values shows in the bits, and the harness cuts the padded size's output with them).
_UNTRACED_NAMES = frozenset(
    {
        "__get__",
        "size",
        "dim",
        "stride",
        "numel",
        "is_contiguous",
        "data_ptr",
        "element_size",
        "view",
        "reshape",
        "transpose",
        "permute",
        "contiguous",
        "expand",
        "unsqueeze",
        "squeeze",
        "flatten",
        "__len__",
        "__getitem__",
        "__setitem__",
        "narrow",
        "select",
        "split",
        "chunk",
        "unbind",
        "cat",
        "stack",
        "clone",
        "copy_",
        "detach",
        "index_select",
        "gather",
    }
)
#: Per function seen: whether the trace lists it, and its handler (None: called as it is).
_KINDS: dict[Any, tuple[bool, Callable[..., Any] | None]] = {}

_SCALARS = (float, bool, str)


def _constants(values: Any) -> list[Any]:
    """The float, bool and string arguments among ``values`` (a list of them flattened one level).
    By class, not ``isinstance``: an int is no constant here, and a bool is not an int."""
    found: list[Any] = []
    for v in values:
        cls = v.__class__
        if cls in _SCALARS:
            found.append(v)
        elif cls is list or cls is tuple:
            found.extend(x for x in v if x.__class__ in _SCALARS)
    return found


class _Invariant(TorchFunctionMode):
    def __init__(self, state: Invariance) -> None:
        super().__init__()
        self.state = state
        if not _HANDLERS:
            _HANDLERS.update(_handlers())

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        # Every torch call of the forward passes here (about 1,300 in a 1B Llama's): kept lean.
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = (_name(func) not in _UNTRACED_NAMES, _HANDLERS.get(func))
        traced, handler = kind
        trace = self.state.trace
        if trace is not None and traced:
            found = _constants(args)
            if kwargs:
                found += _constants(kwargs.values())
            trace.append((func, *found))
        if handler is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return handler(self.state, func, args, kwargs or {})


@contextlib.contextmanager
def invariant(state: Invariance | None = None) -> Iterator[Invariance]:
    """Run the block with products, row-wise reductions and attention padded to a multiple of
    ``ROWS`` rows."""
    state = state if state is not None else Invariance()
    with _Invariant(state):
        yield state
