"""The Python numbers a forward hands its ops and kernels, and those that move from call to call.

A graph freezes every Python number it was captured with: a seed and an offset kept in Python and
passed to a sampling kernel (``sample(logits, seed, offset)``, a Triton kernel's ``seed``
argument) are the capture's on every replay, so every replay repeats the capture's draw while
eager draws anew. The dispatcher and Triton's launches show what each op and kernel is handed:
``recording`` lists it, op by op, for one forward, and ``moved`` compares two forwards of the
same inputs from the same state, which hand every op the same numbers unless something kept on
the host moves between calls.

Ops outside ATen (a custom op, a Triton kernel) are the kernels such numbers reach; a number that
moves in an ATen op (``x * self.calls``) is Python state the checks name as such.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..launches import Launch, kernel_name, watching_launches
from ..observe import DispatchMode
from .tracker import call_site

__all__ = ["Call", "moved", "recording"]

# Numbers only: a flag (bool) is a switch, not a counter, and tensors are the graph's to read.
Numbers = tuple[tuple[str, int | float], ...]
# What Triton's launch takes besides the kernel's own arguments.
_LAUNCH_OPTIONS = frozenset({"grid", "num_warps", "num_stages", "num_ctas", "warmup", "stream"})


@dataclass(frozen=True)
class Call:
    """One op or kernel launch of a forward: its name, the numbers it was handed (argument name,
    value), whether it runs outside ATen (a custom op or a Triton kernel), and its call site in
    the caller's code (kernels only: the walk costs, and ATen ops are not where counters go)."""

    op: str
    numbers: Numbers
    kernel: bool
    site: str = ""


def _numbers(name: str, value: Any) -> list[tuple[str, int | float]]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [(name, value)]
    if isinstance(value, (list, tuple)):
        return [
            (f"{name}[{i}]", v)
            for i, v in enumerate(value)
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
    return []


def _op_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    found: list[tuple[str, int | float]] = []
    for i, arg in enumerate(args):
        found.extend(_numbers(names[i] if i < len(names) else f"argument {i}", arg))
    for key, arg in kwargs.items():
        found.extend(_numbers(key, arg))
    kernel = getattr(func, "namespace", "aten") not in ("aten", "prim", "prims")
    return Call(str(func), tuple(found), kernel, call_site() if kernel else "")


def _launch_call(launch: Launch) -> Call:
    fn = launch.kernel
    while getattr(fn, "arg_names", None) is None and getattr(fn, "fn", None) not in (None, fn):
        fn = fn.fn
    names = list(getattr(fn, "arg_names", None) or [])
    found: list[tuple[str, int | float]] = []
    for i, arg in enumerate(launch.args):
        found.extend(_numbers(names[i] if i < len(names) else f"argument {i}", arg))
    for key, arg in launch.kwargs.items():
        if key not in _LAUNCH_OPTIONS:
            found.extend(_numbers(key, arg))
    return Call(f"Triton kernel {kernel_name(launch.kernel)}", tuple(found), True, call_site(launch=True))


class _Recording(DispatchMode):
    def __init__(self, calls: list[Call]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls = calls

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls.append(_op_call(func, args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Every op and top-level Triton launch the block runs, with the numbers each was handed."""
    calls: list[Call] = []

    @contextlib.contextmanager
    def launched(launch: Launch) -> Iterator[None]:
        calls.append(_launch_call(launch))
        yield

    with watching_launches(launched), _Recording(calls):
        yield calls


def moved(first: list[Call], second: list[Call]) -> list[tuple[Call, tuple[tuple[str, Any, Any], ...]]]:
    """The calls of two forwards of the same inputs whose numbers differ, in order, each with the
    numbers that moved (argument, first value, second value); compared up to where the two call
    other ops (a branch), beyond which positions no longer pair."""
    found = []
    for a, b in zip(first, second, strict=False):
        if a.op != b.op:
            break
        if len(a.numbers) != len(b.numbers):
            continue
        diff = tuple(
            (na, va, vb)
            for (na, va), (nb, vb) in zip(a.numbers, b.numbers, strict=True)
            if na == nb and va != vb and not (va != va and vb != vb)  # NaN is no move
        )
        if diff:
            found.append((a, diff))
    return found
