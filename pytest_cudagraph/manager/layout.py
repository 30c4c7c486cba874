"""Static input buffers: which dimensions of each input follow the batch.

``make_inputs(num_tokens, num_reqs)`` builds one batch of keyword inputs. The
manager calls it at two probe shapes to learn, for each input and each of its
dimensions, whether that dimension is ``num_tokens + c``, ``num_reqs + c`` or
fixed (``input_ids`` of shape ``(1, T)`` follows tokens in dimension 1, a
square ``(T, T)`` mask in both), then once at the largest shape to allocate
the static buffers. Buffers are allocated once and never reallocated: graphs
read them by address.

A batch of one shape sees each buffer through a contiguous view of its first
elements (``InputSpec.window``): for an input that follows the batch in its
first dimension that is the prefix of rows it always was; for any other it
keeps the module's view of its input as contiguous as ``make_inputs`` made it
(``x.view(...)`` works in the graph as it does eagerly), whatever the shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..plan.validate import UsageError, short
from .estimate import check_input_memory
from .inputs import MakeInputsError, call_make_inputs

__all__ = [
    "PROBES",
    "PYTHON_KINDS",
    "BatchDim",
    "InputSpec",
    "MakeInputsError",
    "call_make_inputs",
    "check_module",
    "forward_probes",
    "infer_layout",
    "not_a_module",
    "padded_inputs",
    "same_value",
]

# "multi": several dimensions follow the batch (see InputSpec.dims); code
# that slices rows of "tokens" and "reqs" inputs leaves it alone. "const": a Python value
# make_inputs gives the same at every shape; "value": a Python number that changes with the batch
# (a max_seq_len), which each graph holds at the value its capture was given (``PYTHON_KINDS``).
Kind = Literal["tokens", "reqs", "fixed", "const", "value", "multi"]
#: The kinds of Python (not tensor) inputs: no static buffer, passed to the forward as they are.
PYTHON_KINDS = frozenset({"const", "value"})
#: The Python values an input may change with the batch and still be held per graph: numbers
#: and flags, which a graph freezes at capture and a check can hold to what eager does with another.
_NUMBERS = (bool, int, float)
CountKind = Literal["tokens", "reqs"]
PadValue = int | float | bool | Literal["edge"]
# One dimension that follows the batch: (its index, the count it follows, c)
# with size = count + c.
BatchDim = tuple[int, CountKind, int]

# Two probe shapes: different token and request counts, none equal to another,
# so ``tokens + c``, ``reqs + c`` and "fixed" cannot be confused.
PROBES = ((7, 3), (11, 5))

# Shapes the output probe may run the module at, in order of preference: the two
# above first, then smaller ones for small plans.
_FORWARD_PROBES = ((7, 3), (11, 5), (5, 2), (6, 4), (5, 4), (3, 2), (4, 3), (3, 1), (2, 1), (5, 3))


def forward_probes(max_tokens: int, max_reqs: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Two batch shapes, within the plan's bounds, at which the module's outputs tell a per-token
    dimension from a per-request one: different token counts, different request counts, never as
    many tokens as requests, and not in proportion. None when the plan is too small to hold two.

    Within the bounds because a module need not run beyond them (a slot table of ``max_num_reqs``
    rows), and on a GPU an index out of range is a device-side assert that ends the process's
    CUDA context, not an exception to catch."""
    fit = [(t, r) for t, r in _FORWARD_PROBES if t <= max_tokens and r <= max_reqs and t > r]
    for i, (t1, r1) in enumerate(fit):
        for t2, r2 in fit[i + 1 :]:
            if t1 != t2 and r1 != r2 and t1 * r2 != t2 * r1:
                return (t1, r1), (t2, r2)
    return None


_COUNT_NAME = {"tokens": "num_tokens", "reqs": "num_reqs"}


def _count(kind: CountKind, offset: int, num_tokens: int, num_reqs: int) -> int:
    return (num_tokens if kind == "tokens" else num_reqs) + offset


def _count_text(kind: CountKind, offset: int) -> str:
    text = _COUNT_NAME[kind]
    if offset:
        text += f" {'+' if offset > 0 else '-'} {abs(offset)}"
    return text


@dataclass
class InputSpec:
    """One keyword input of the module and its static buffer.

    ``dims`` lists the dimensions that follow the batch, each as
    ``(dimension, "tokens" | "reqs", c)``; every other dimension is fixed.
    ``kind``, ``offset`` and ``dim`` describe the one such dimension of a
    "tokens" or "reqs" input (``dim`` 0 for the common row-major layouts). An
    input with several (a square mask) has kind "multi": code written for
    rows (``buffer[real:rows]``) skips it rather than cutting the wrong block.
    ``trailing`` is the buffer's shape past its first dimension, at the
    largest batch.
    """

    name: str
    kind: Kind
    offset: int = 0  # kind's dim = count + offset ("fixed": the leading size itself)
    dtype: torch.dtype | None = None
    trailing: tuple[int, ...] = ()
    pad: PadValue = 0
    buffer: torch.Tensor | None = None
    value: Any = None  # "const": the Python value frozen into every graph; "value": at the largest batch
    dim: int = 0  # the dimension kind and offset describe
    dims: tuple[BatchDim, ...] = ()

    def __post_init__(self) -> None:
        # Specs written the old way (kind and offset alone) follow in dim 0.
        if not self.dims and self.kind in ("tokens", "reqs"):
            kind: CountKind = "tokens" if self.kind == "tokens" else "reqs"
            self.dims = ((self.dim, kind, self.offset),)

    @property
    def is_python(self) -> bool:
        """A Python value, not a tensor: no buffer, passed to the forward as it is."""
        return self.kind in PYTHON_KINDS

    @property
    def following(self) -> frozenset[int]:
        """The dimensions that follow the batch."""
        return frozenset(d for d, _, _ in self.dims)

    def rows(self, num_tokens: int, num_reqs: int) -> int:
        """Size of dimension ``dim`` for a batch of that shape (the leading
        size for the usual row-major inputs; "fixed": the leading size)."""
        if self.kind == "tokens":
            return num_tokens + self.offset
        if self.kind == "reqs":
            return num_reqs + self.offset
        if self.kind == "multi":
            _, kind, offset = self.dims[0]
            return _count(kind, offset, num_tokens, num_reqs)
        return self.offset

    def shape_at(self, num_tokens: int, num_reqs: int) -> tuple[int, ...]:
        """This input's full shape for a batch of that shape."""
        if self.buffer is None:
            return (self.rows(num_tokens, num_reqs), *self.trailing) if not self.is_python else ()
        shape = list(self.buffer.shape)
        for d, kind, offset in self.dims:
            shape[d] = _count(kind, offset, num_tokens, num_reqs)
        return tuple(shape)

    def window(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        """The static buffer as a batch of that shape sees it: a contiguous
        view of its first elements (its first rows, when only dim 0 follows)."""
        buf = self.buffer
        if buf is None:
            raise UsageError(f"input '{self.name}' is a Python value, not a tensor; it has no buffer")
        if not self.dims:
            return buf
        if len(self.dims) == 1 and self.dims[0][0] == 0:
            return buf.narrow(0, 0, self.rows(num_tokens, num_reqs))
        shape = self.shape_at(num_tokens, num_reqs)
        return buf.view(-1).narrow(0, 0, math.prod(shape)).view(shape)

    def expected(self) -> str:
        if self.kind == "const":
            return f"the Python value {self.value!r}"
        if self.kind == "value":
            return "a Python number (each graph holds the value it was captured with)"
        if self.buffer is None:  # a spec written by hand: rows and trailing
            lead = str(self.offset) if self.kind == "fixed" else _count_text(self.dims[0][1], self.dims[0][2])
            return f"a {self.dtype} tensor of shape ({', '.join([lead, *map(str, self.trailing)])})"
        parts = [str(n) for n in self.buffer.shape]
        for d, kind, offset in self.dims:
            parts[d] = _count_text(kind, offset)
        return f"a {self.dtype} tensor of shape ({', '.join(parts)})"


def same_value(a: Any, b: Any) -> bool:
    """Whether two Python inputs are the same value (NaN the same as NaN; an object without a
    meaningful ``==`` by identity)."""
    if a is b:
        return True
    try:
        return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    except Exception:
        return False


def not_a_module(module: object, where: str = "module") -> str:
    """The message for a ``module`` argument that is not a ``torch.nn.Module``: a Module class
    given for an instance of it is told as such."""
    name = getattr(module, "__qualname__", None) or type(module).__name__
    if isinstance(module, type) and issubclass(module, torch.nn.Module):
        cls = module.__name__
        return (
            f"{where} must be a torch.nn.Module instance; got the class {cls} itself, not an instance of it: "
            f"pass {cls}() (with its constructor's arguments), not {cls}"
        )
    kind = "a class" if isinstance(module, type) else "a function" if callable(module) else "an object"
    return (
        f"{where} must be a torch.nn.Module; got {kind} ({type(module).__name__} {name!r}). Graphs are "
        "captured per module (its parameters and buffers are what replay reads); wrap the code in a "
        "Module: class Wrapped(torch.nn.Module): def forward(self, x): return f(x)"
    )


def check_module(module: object, where: str = "module") -> None:
    """A ``UsageError`` unless ``module`` is an ``nn.Module`` the harness can run: not a function or
    another object, not a TorchScript module (which takes no forward hooks, and whose ops the
    guard and the observer cannot see)."""
    if not isinstance(module, torch.nn.Module):
        raise UsageError(not_a_module(module, where))
    if isinstance(module, torch.jit.ScriptModule):
        raise UsageError(
            f"{where} is a TorchScript module ({type(module).__name__}, from torch.jit.script or torch.jit.trace): "
            "its forward takes no hooks and runs outside Python, so the harness can neither guard nor observe "
            "it; verify the eager module you scripted"
        )


def _shapes_seen(shapes: list[tuple[int, ...]], max_tokens: int, max_reqs: int) -> str:
    at = [*PROBES, (max_tokens, max_reqs)]
    return ", ".join(
        f"{shape} at (num_tokens={t}, num_reqs={r})" for shape, (t, r) in zip(shapes, at, strict=True)
    )


def _following_dims(
    name: str, shapes: list[tuple[int, ...]], max_tokens: int, max_reqs: int
) -> list[BatchDim]:
    """The dimensions of an input that follow a count, learned from its shapes
    at the two probes and at the largest batch; every other one must be fixed."""
    (t1, r1), (t2, r2) = PROBES
    following: list[BatchDim] = []
    for d in range(len(shapes[-1])):
        d1, d2, full = (shape[d] for shape in shapes)
        if d1 == d2 == full:
            continue
        kind: CountKind
        if d1 != d2 and d1 - t1 == d2 - t2:
            kind, offset = "tokens", d1 - t1
        elif d1 != d2 and d1 - r1 == d2 - r2:
            kind, offset = "reqs", d1 - r1
        else:
            raise UsageError(
                f"input '{name}': dimension {d} is {d1}, {d2} and {full} across the shapes seen "
                f"({_shapes_seen(shapes, max_tokens, max_reqs)}), which is neither num_tokens + c, "
                "num_reqs + c nor fixed; the manager can only pad dimensions that follow num_tokens "
                "or num_reqs (by a constant offset) and keep the others fixed"
            )
        if full != _count(kind, offset, max_tokens, max_reqs):
            raise UsageError(
                f"input '{name}': dimension {d} is {full} at (num_tokens={max_tokens}, num_reqs={max_reqs}) "
                f"but the probes say {_count_text(kind, offset)} = {_count(kind, offset, max_tokens, max_reqs)} "
                f"(shapes seen: {_shapes_seen(shapes, max_tokens, max_reqs)})"
            )
        following.append((d, kind, offset))
    return following


def _check_batch_dims(batch_dims: Mapping[str, int], specs: Mapping[str, Any]) -> None:
    unknown = [n for n in batch_dims if n not in specs]
    if unknown:
        raise UsageError(f"batch_dims names unknown input(s) {sorted(unknown)}; inputs are {list(specs)}")
    for name, d in batch_dims.items():
        if not isinstance(d, int) or isinstance(d, bool):
            raise UsageError(
                f"batch_dims['{name}'] must be an int, the one dimension of '{name}' that follows "
                f"num_tokens or num_reqs; got {d!r}"
            )


def _pad_hint(name: str, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return (
            f"pad_values={{'{name}': False}} or {{'{name}': True}}, whichever your mask's convention "
            "reads as 'masked out'"
        )
    if dtype.is_floating_point:
        return f"pad_values={{'{name}': float('-inf')}} for an additive mask (0 for a multiplicative one)"
    return f"pad_values={{'{name}': 0}} (or whatever value your module reads as padding)"


def infer_layout(
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    *,
    max_tokens: int,
    max_reqs: int,
    device: torch.device,
    pad_values: Mapping[str, PadValue],
    batch_dims: Mapping[str, int] | None = None,
) -> dict[str, InputSpec]:
    """Learn each input's layout and allocate its static buffer.

    ``batch_dims`` names, for some inputs, the one dimension that follows the
    batch: what the probes learn is then checked against it.
    """
    batch_dims = dict(batch_dims or {})
    probes = [call_make_inputs(make_inputs, t, r) for t, r in PROBES]
    check_input_memory(  # refuses static buffers that will not fit, before making them
        probes, PROBES, max_tokens=max_tokens, max_reqs=max_reqs, device=device
    )
    full = call_make_inputs(make_inputs, max_tokens, max_reqs)
    names = list(full)
    for (t, r), probe in zip(PROBES, probes, strict=False):
        if list(probe) != names:
            raise UsageError(
                f"make_inputs returned inputs {sorted(probe)} at (num_tokens={t}, num_reqs={r}) "
                f"but {sorted(names)} at (num_tokens={max_tokens}, num_reqs={max_reqs}); "
                "it must return the same names for every shape"
            )
    unknown = set(pad_values) - set(names)
    if unknown:
        raise UsageError(f"pad_values names unknown input(s) {sorted(unknown)}; inputs are {names}")
    _check_batch_dims(batch_dims, full)
    specs: dict[str, InputSpec] = {}
    for name in names:
        values = [p[name] for p in probes] + [full[name]]
        pad = pad_values.get(name, 0)
        if not isinstance(values[-1], torch.Tensor):
            if any(isinstance(v, torch.Tensor) for v in values):
                raise UsageError(f"input '{name}' is a tensor at some shapes and not at others")
            if name in batch_dims:
                raise UsageError(
                    f"batch_dims['{name}'] names a Python value ({values[-1]!r}); batch_dims applies to "
                    "tensor inputs only"
                )
            if all(same_value(v, values[-1]) for v in values):
                specs[name] = InputSpec(name, "const", value=values[-1], pad=pad)
                continue
            if not all(isinstance(v, _NUMBERS) for v in values):
                raise UsageError(
                    f"input '{name}' is a Python value that changes from batch to batch "
                    f"({short(values[0])} at 7 tokens, {short(values[1])} at 11) and is not a number or a "
                    "flag, so the harness cannot hold what each graph froze of it to eager; pass it as a "
                    "tensor, or read the padded shape from pytest_cudagraph.current_descriptor()"
                )
            # Each graph holds the value make_inputs gives at its capture shape; the checks hold that
            # to eager with each batch's own value and name this input where it decides the result.
            specs[name] = InputSpec(name, "value", value=values[-1], pad=pad)
            continue
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise UsageError(f"input '{name}' is a tensor at some shapes and not at others")
        tensors: list[torch.Tensor] = values
        if any(t.device.type == "meta" for t in tensors):
            raise UsageError(
                f"make_inputs returned input '{name}' on the meta device, which holds no data, so it can be "
                f"neither copied into a static buffer nor compared; build it with real values "
                f"({'on the CPU' if device.type == 'cpu' else f'on the CPU or on {device}'}), e.g. torch.randn(num_tokens, ..., device=...)"
            )
        dtype = tensors[-1].dtype
        if any(t.dtype != dtype for t in tensors):
            raise UsageError(
                f"input '{name}' changes dtype with the batch shape: {[t.dtype for t in tensors]}"
            )
        shapes = [tuple(t.shape) for t in tensors]
        ndim = len(shapes[-1])
        if any(len(shape) != ndim for shape in shapes):
            raise UsageError(
                f"input '{name}' changes its number of dimensions with the batch shape "
                f"({_shapes_seen(shapes, max_tokens, max_reqs)}); it must keep them and let some "
                "follow num_tokens or num_reqs"
            )
        given = batch_dims.get(name)
        if given is not None and not (ndim and -ndim <= given < ndim):
            raise UsageError(
                f"batch_dims['{name}'] = {given} is out of range for its {ndim}-dimensional input "
                f"(shape {shapes[-1]} at the largest batch); expected a dimension in "
                f"{f'[{-ndim}, {ndim - 1}]' if ndim else 'none: a 0-d tensor has no dimension to follow the batch'}"
            )
        following = _following_dims(name, shapes, max_tokens, max_reqs)
        if given is not None:
            given %= ndim
            moving = [d for d, _, _ in following]
            if moving != [given]:
                if given in moving:
                    found = f"dimension(s) {[d for d in moving if d != given]} also change with the batch"
                else:
                    found = f"dimension {given} is {shapes[-1][given]} at every shape seen" + (
                        f", and dimension(s) {moving} change with the batch instead" if moving else ""
                    )
                raise UsageError(
                    f"batch_dims['{name}'] = {given}, but {found} "
                    f"({_shapes_seen(shapes, max_tokens, max_reqs)}); the dimension given must follow "
                    "num_tokens or num_reqs and every other must stay fixed (leave the input out of "
                    "batch_dims to have several dimensions learned)"
                )
        kind: Kind
        if not following:
            kind, dim, offset = "fixed", 0, (shapes[-1][0] if ndim else 0)
        elif len(following) == 1:
            dim, kind, offset = following[0]
        else:
            kind, dim, offset = "multi", following[0][0], following[0][2]
            described = ", ".join(f"dim {d} follows {_count_text(k, c)}" for d, k, c in following)
            if name not in pad_values:
                raise UsageError(
                    f"input '{name}' has several dimensions that follow the batch ({described}): its padding "
                    "is a block around the real entries, and what a padded entry must hold is the module's "
                    "semantics (a mask's 'masked out'), not the manager's to guess. Pass "
                    f"{_pad_hint(name, dtype)}"
                )
            if pad == "edge":
                raise UsageError(
                    f"pad_values['{name}'] = 'edge' needs one dimension that follows the batch, and "
                    f"'{name}' has several ({described}); give a number or a bool: {_pad_hint(name, dtype)}"
                )
        if pad == "edge" and kind not in ("tokens", "reqs"):
            raise UsageError(f"pad_values['{name}'] = 'edge' needs an input that follows tokens or requests")
        if pad != "edge" and not isinstance(pad, (bool, int, float)):
            raise UsageError(f"pad_values['{name}'] must be a number, a bool or 'edge'; got {pad!r}")
        # Contiguous and owned by the manager: graphs hold its address for life.
        buffer = tensors[-1].detach().to(device=device, copy=True).contiguous()
        specs[name] = InputSpec(
            name,
            kind,
            offset,
            dtype,
            tuple(buffer.shape[1:]),
            pad,
            buffer,
            dim=dim,
            dims=tuple(following),
        )
    tensors_given = {n: s for n, s in specs.items() if not s.is_python}
    if tensors_given and all(s.kind == "fixed" for s in tensors_given.values()):
        # Nothing follows the batch: every graph would read the same rows, whatever its size, and every
        # check that compares batch shapes could not run. One line instead of a failure per check.
        fixed = ", ".join(
            f"'{n}' {tuple(s.buffer.shape)}" for n, s in tensors_given.items() if s.buffer is not None
        )
        raise UsageError(
            f"no input of make_inputs follows num_tokens or num_reqs (at every probe shape: {fixed}); a graph "
            "serves batches of different sizes through inputs sized by them: build the batch dimension "
            "from num_tokens, e.g. torch.randn(num_tokens, hidden)"
        )
    return specs


def padded_inputs(
    specs: Mapping[str, InputSpec], inputs: Mapping[str, Any], num_tokens: int, num_reqs: int
) -> dict[str, Any]:
    """``inputs`` of a real batch padded to ``num_tokens`` tokens and ``num_reqs`` requests as the
    static buffers pad them (each input's pad value, or its last row for "edge"), as new tensors:
    what a graph of that size would read, for an eager run of the same program."""
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        spec = specs.get(name)
        if spec is None or spec.is_python or spec.kind == "fixed" or not isinstance(value, torch.Tensor):
            out[name] = value
            continue
        shape = list(value.shape)
        for d, kind, offset in spec.dims:
            shape[d] = _count(kind, offset, num_tokens, num_reqs)
        if spec.kind == "multi" or spec.pad != "edge":
            pad = spec.pad if spec.pad != "edge" else 0
            t = torch.full(shape, pad, dtype=value.dtype, device=value.device)
            block = t
            for d in range(value.dim()):
                block = block.narrow(d, 0, value.shape[d])
            block.copy_(value)
        else:
            d = spec.dim
            tail = value.narrow(d, value.shape[d] - 1, 1).expand(
                *[shape[i] - value.shape[i] if i == d else shape[i] for i in range(value.dim())]
            )
            t = torch.cat([value, tail], d)
        out[name] = t
    return out
