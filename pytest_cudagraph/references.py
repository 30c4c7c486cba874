"""References: plain-torch functions that stand in for kernels the float64 reference cannot run.

A serving model's attention (FlashAttention, FlashInfer, an engine's paged attention), and often its
norms, rotary and MoE, run through kernels that take bfloat16 or float16 alone. The float64
reference (``raised``) cannot run them, so without help ``padded_size`` has no float64 question to
ask. The user hands in, per kernel, a function of plain torch ops with the kernel's arguments and
results (``references={op: fn}`` or ``register_reference(op, fn)`` in a conftest); the reference
runs it in the kernel's place, its ops raised like the module's.

A key is a kernel as the module reaches it:

- a ``torch.library`` custom op (the object ``custom_op`` returns, ``torch.ops.ns.name``, one of
  its overloads, or the string ``"ns::name"``): found where the dispatcher hands it to the
  reference's dispatch mode (``References.for_op``);
- a Python function that launches a kernel outside the dispatcher (a Triton wrapper, an
  extension's entry point): the function object. A Python function is redirected where it
  stands, whatever name the module's code reaches it by (its code is swapped for a trampoline for
  the block, ``redirected``); a built-in (an extension's entry point) is rebound in the module
  namespaces that hold it, which covers ``ext.op(...)`` and ``from ext import op``.

This module holds the keys, the suite's registry and the redirection; ``checks/kernel_references``
holds each reference against its kernel before it stands in.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .plan.validate import UsageError, short

__all__ = [
    "Entry",
    "References",
    "clear_registered",
    "normalized",
    "redirected",
    "register_reference",
    "registered",
]

#: What a key may be, for the usage lines.
_KEYS = (
    "a torch.library custom op (the object custom_op returns, torch.ops.ns.name, or the string "
    "'ns::name') or the Python function the module calls to launch its kernel"
)


@dataclass(frozen=True)
class Entry:
    """One reference: the kernel it stands in for and the function that stands in."""

    #: The op's qualified name (``"ns::name"``, ``"ns::name.overload"``) or the Python function itself.
    key: Any
    #: The kernel in the report's words: the op's name, or the function's module and qualified name.
    name: str
    #: The plain-torch function that stands in for it.
    fn: Callable[..., Any]

    @property
    def is_op(self) -> bool:
        return isinstance(self.key, str)

    @property
    def fn_name(self) -> str:
        return _callable_name(self.fn)


@dataclass(frozen=True)
class References:
    """The references of one verification: ops by qualified name, Python functions by identity."""

    entries: tuple[Entry, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def ops(self) -> dict[str, Entry]:
        return {e.key: e for e in self.entries if e.is_op}

    @property
    def functions(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if not e.is_op)

    def for_op(self, func: Any) -> Entry | None:
        """The reference for the op overload ``func`` the dispatcher hands over: by its overload's
        name first (``ns::name.overload``), then by its packet's (``ns::name``)."""
        ops = self.ops
        if not ops:
            return None
        schema = getattr(func, "_schema", None)
        if schema is None:
            return None
        name = str(schema.name)
        if schema.overload_name:
            found = ops.get(f"{name}.{schema.overload_name}")
            if found is not None:
                return found
        return ops.get(name)

    def merged_over(self, base: References) -> References:
        """``base``'s entries with this one's in place of any with the same key (a call's references win
        over the suite's)."""
        mine = {_identity(e.key) for e in self.entries}
        return References(tuple(e for e in base.entries if _identity(e.key) not in mine) + self.entries)


def _identity(key: Any) -> Any:
    return key if isinstance(key, str) else ("function", id(key))


def _callable_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def _op_name(key: Any) -> str | None:
    """The qualified name of a torch op key (None: not an op): ``custom_op``'s object, a packet, an
    overload or a string ``ns::name[.overload]``; a string names a registered op or is refused."""
    import torch

    if isinstance(key, str):
        text = key.strip()
        ns, sep, rest = text.partition("::")
        name, _, overload = rest.partition(".")
        if (
            not sep
            or not ns.isidentifier()
            or not name.isidentifier()
            or (overload and not overload.isidentifier())
        ):
            raise UsageError(
                f"references: the key {short(key)} is not an op name 'ns::name'; a key is {_KEYS}"
            )
        try:
            packet = getattr(getattr(torch.ops, ns), name)
            if overload:
                getattr(packet, overload)
        except (AttributeError, RuntimeError):
            raise UsageError(
                f"references: no op {text!r} is registered with torch (torch.ops.{ns}.{name}"
                f"{'.' + overload if overload else ''}); import the library that defines it before the "
                "verification, or key the reference by the function the module calls"
            ) from None
        return text
    custom_op_def = getattr(getattr(torch, "_library", None), "custom_ops", None)
    if custom_op_def is not None and isinstance(key, custom_op_def.CustomOpDef):  # what custom_op returns
        return str(key._qualname)
    if isinstance(key, torch._ops.OpOverloadPacket):
        return str(key._qualified_op_name)
    if isinstance(key, torch._ops.OpOverload):
        schema = key._schema
        return f"{schema.name}.{schema.overload_name}" if schema.overload_name else str(schema.name)
    return None


def _entry(key: Any, fn: Any) -> Entry:
    name = _op_name(key)
    if name is None and not callable(key):
        raise UsageError(f"references: a key is {_KEYS}; got {short(key)}")
    label = name if name is not None else _callable_name(key)
    if not callable(fn):
        raise UsageError(
            f"references[{label!r}] must be a function of plain torch ops that takes the kernel's arguments and "
            f"returns what it returns; got {short(fn)}"
        )
    if name is not None and name.startswith("aten::"):
        raise UsageError(
            f"references: {name} is one of torch's own ops, which the float64 reference runs itself; a "
            "reference stands in for a kernel it cannot run (a custom op, a Triton or extension kernel)"
        )
    if name is None and fn is key:
        raise UsageError(
            f"references[{label!r}] is the kernel itself; hand in a function of plain torch ops that computes "
            "what it computes"
        )
    return Entry(name if name is not None else key, label, fn)


def normalized(references: Any) -> References:
    """``references`` (a mapping of kernels to their references, a ``References``, or None) as a
    ``References``; a ``UsageError`` (one line) for a key or a value it cannot take."""
    if references is None:
        return References()
    if isinstance(references, References):
        return references
    if not isinstance(references, Mapping):
        raise UsageError(
            "references must map each kernel to a plain-torch function that stands in for it, such as "
            f"{{'ns::attention': attention_reference}}; got {short(references)}"
        )
    entries: dict[Any, Entry] = {}
    for key, fn in references.items():
        entry = _entry(key, fn)
        entries[_identity(entry.key)] = entry
    return References(tuple(entries.values()))


_REGISTERED: dict[Any, Entry] = {}


def register_reference(op: Any, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as the reference of the kernel ``op`` for every verification of this process
    (a conftest's suite); a verification's own ``references=`` win over it for the same kernel.
    ``op`` and ``fn`` are as in ``references={op: fn}``; a ``UsageError`` for what it cannot take."""
    entry = _entry(op, fn)
    _REGISTERED[_identity(entry.key)] = entry


def registered() -> References:
    """The references ``register_reference`` registered."""
    return References(tuple(_REGISTERED.values()))


def clear_registered() -> None:
    """Forget every registered reference (tests that register their own)."""
    _REGISTERED.clear()


# -- Python functions, redirected for a block ------------------------------------------------------

_NAMES = itertools.count()


def _trampoline(fn: types.FunctionType, name: str) -> types.CodeType:
    """Code for ``fn`` that calls the global ``name`` with the arguments it was called with. It has as
    many free variables as ``fn`` has cells (a function's code can only be swapped for code with the
    same number), none of them used; it keeps ``fn``'s name (a lambda's, a wrapper's) for tracebacks."""
    cells = len(fn.__code__.co_freevars)
    dummies = [f"_c{i}" for i in range(cells)]
    inner = "    def _kernel(*args, **kwargs):\n"
    if dummies:
        inner += f"        ({', '.join(dummies)},)\n"
    inner += f"        return {name}(*args, **kwargs)\n"
    source = (
        "def _outer():\n" + "".join(f"    {d} = None\n" for d in dummies) + inner + "    return _kernel\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, fn.__code__.co_filename, "exec"), namespace)
    code: types.CodeType = namespace["_outer"]().__code__
    code = code.replace(co_name=fn.__code__.co_name)
    if sys.version_info >= (3, 11):
        code = code.replace(co_qualname=fn.__code__.co_qualname)
    return code


def original(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` with the code it has now: what a redirected call runs as the kernel."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _module_dicts_holding(obj: Any) -> list[tuple[dict[str, Any], str]]:
    """(namespace, name) of every module namespace that holds ``obj`` (a built-in cannot be swapped)."""
    spaces = {
        id(m.__dict__): m.__dict__ for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)
    }
    found: list[tuple[dict[str, Any], str]] = []
    for referrer in gc.get_referrers(obj):
        if type(referrer) is dict and id(referrer) in spaces:
            found.extend((referrer, name) for name, value in list(referrer.items()) if value is obj)
    return found


@contextlib.contextmanager
def redirected(
    entries: tuple[Entry, ...],
    handler: Callable[[Entry, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
) -> Iterator[None]:
    """While the block runs, a call of any Python-function key in ``entries`` runs
    ``handler(entry, kernel, args, kwargs)`` instead (``kernel``: the function as it was, for a
    handler that runs it). Put back on the way out, whatever happened."""
    undo: list[Callable[[], None]] = []
    try:
        for entry in entries:
            fn = entry.key
            if isinstance(fn, types.FunctionType):
                kernel = original(fn)
                name = f"__cudagraph_reference_{next(_NAMES)}__"
                fn.__globals__[name] = lambda *a, _e=entry, _k=kernel, **k: handler(_e, _k, a, k)
                saved = fn.__code__
                fn.__code__ = _trampoline(fn, name)

                def restore(
                    fn: types.FunctionType = fn, saved: types.CodeType = saved, name: str = name
                ) -> None:
                    fn.__code__ = saved
                    fn.__globals__.pop(name, None)

                undo.append(restore)
            else:  # a built-in: rebound where modules hold it
                wrapper = lambda *a, _e=entry, _k=fn, **k: handler(_e, _k, a, k)  # noqa: E731
                for space, name in _module_dicts_holding(fn):
                    space[name] = wrapper

                    def rebind(space: dict[str, Any] = space, name: str = name, fn: Any = fn) -> None:
                        space[name] = fn

                    undo.append(rebind)
        yield
    finally:
        for step in reversed(undo):
            step()
