"""What forward reads from outside the module and its inputs (``Outside``): module-level dicts and
objects (an engine's forward context, which its runner fills each step), class attributes,
closure cells, ``contextvars.ContextVar``s, thread-locals, and the plain containers a module keeps
beside its buffers (``self.state = {...}``). A graph freezes what forward read there at capture: a
Python number stays the capture's, a tensor stays the one captured (another one put in its place
is never read). The checks name such a value by where it lives, the line that read it, and its
values at capture and now.

How it is found, at a cost paid once: the Python functions one forward calls are seen
(``sys.setprofile`` around the first pass of ``learn_writes``; without a pass, each submodule's
``forward``), and their bytecode read for the globals, closure cells and ``self`` attributes they
load, and what they take from them (``FORWARD_CONTEXT['meta'].num_actual_tokens``: a subscript
and an attribute after the load, a local that holds it, a function that returns it). Torch's,
this package's and the standard library's own code are not read. What those places hold is then
read as leaves (plain values and tensors), a few levels deep and at most ``_MOST`` of them per
place, at each capture and on a failure: nothing runs per forward."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import dis
import functools
import itertools
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..manager.layout import same_value

__all__ = ["HeldTensor", "Outside", "Place"]

#: Whether verifications track what forward reads from outside the module (the cost benchmark,
#: ``benchmarks/outside_cost.py``, turns it off to measure a run without it).
TRACKED = True

#: The most leaves read from one place, the deepest they are looked for, and the most items of one
#: container: a forward context holds a handful of fields; a dict of a thousand entries is not one.
_MOST = 64
_DEEPEST = 4
_WIDEST = 32
#: A tensor up to this size is kept alive from its capture, so that one put in its place can be put
#: back to see whether it is the cause; a larger one only by a weak reference.
_KEPT_BYTES = 1 << 24

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_SITE = ("site-packages", "dist-packages")


def _ours_or_torch(filename: str) -> bool:
    """Code whose globals are nobody's forward context: torch's, this package's, the standard
    library's (installed libraries are read: an engine's attention layer is one)."""
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, _OUR_DIR)) or filename.startswith("<"):
        return True
    return path.startswith(_STDLIB_DIR) and not any(s in path for s in _SITE)


@dataclass(frozen=True)
class HeldTensor:
    """A tensor as a place held it: the storage a graph captured reads (``address``), its shape and
    dtype, and the tensor itself (kept alive when small, else weakly) to put back."""

    address: int
    shape: tuple[int, ...]
    dtype: str
    _ref: Any = field(compare=False, repr=False)

    @classmethod
    def of(cls, t: torch.Tensor) -> HeldTensor:
        size = t.numel() * t.element_size()
        ref: Any = t if size <= _KEPT_BYTES else weakref.ref(t)
        return cls(t.data_ptr(), tuple(t.shape), str(t.dtype).replace("torch.", ""), ref)

    def tensor(self) -> torch.Tensor | None:
        return self._ref if isinstance(self._ref, torch.Tensor) else self._ref()

    def __repr__(self) -> str:
        return f"a {self.dtype} tensor {list(self.shape)} at 0x{self.address:x}"


Step = tuple[str, Any]  # ("key", k), ("attr", name) or ("get", None) (a ContextVar's value)


@dataclass(frozen=True)
class Place:
    """Where a value forward reads lives: ``name`` as code spells it (``FORWARD_CONTEXT``,
    ``Sampler.scale``, ``CTX.get()``), what it is (``kind``), how to read it and rebind it."""

    name: str
    kind: str
    read: Callable[[], Any]
    rebind: Callable[[Any], Callable[[], None]] | None  # set, returning how to undo it


def _label(place: Place, steps: tuple[Step, ...]) -> str:
    text = place.name
    for kind, arg in steps:
        text += f"[{arg!r}]" if kind == "key" else f".{arg}"
    return text


_MISSING = object()


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype))


def _descend(value: Any) -> bool:
    """Whether an object is looked into: data a runner fills (dicts, lists, dataclasses, plain
    objects of user or library code, namespaces, thread-locals), not code, modules, a module tree
    (whose own values are the module's), or the standard library's machinery."""
    if isinstance(value, (dict, list, tuple, types.SimpleNamespace, threading.local)):
        return True
    if isinstance(
        value,
        (
            types.ModuleType,
            type,
            types.FunctionType,
            types.BuiltinFunctionType,
            types.MethodType,
            torch.nn.Module,
        ),
    ):
        return False
    if callable(value) and not dataclasses.is_dataclass(value):
        return False
    module = type(value).__module__.split(".")[0]
    return module not in sys.stdlib_module_names and module not in ("torch", "builtins", "pytest_cudagraph")


def _fields(value: Any) -> list[tuple[Step, Any]]:
    if isinstance(value, dict):
        items = itertools.islice(value.items(), _WIDEST)
        return [(("key", k), v) for k, v in items if isinstance(k, (str, int))]
    if isinstance(value, (list, tuple)):
        return [(("key", i), v) for i, v in enumerate(itertools.islice(value, _WIDEST))]
    names: list[str] = []
    with contextlib.suppress(TypeError):
        names = [n for n in vars(value) if not n.startswith("__")]
    for klass in type(value).__mro__:
        names += [n for n in getattr(klass, "__slots__", ()) if n not in names and not n.startswith("__")]
    found = []
    for name in names[:_WIDEST]:
        try:
            got = getattr(value, name, _MISSING)
        except Exception:  # a property that raises: nothing a graph read
            continue
        if got is not _MISSING:
            found.append((("attr", name), got))
    return found


def _leaves(value: Any, steps: tuple[Step, ...], out: dict[tuple[Step, ...], Any], depth: int) -> None:
    if len(out) >= _MOST:
        return
    if _is_plain(value):
        out[steps] = value
    elif isinstance(value, torch.Tensor):
        with contextlib.suppress(RuntimeError, NotImplementedError):  # no storage to hold (sparse, meta)
            out[steps] = HeldTensor.of(value)
    elif depth < _DEEPEST and _descend(value):
        for step, item in _fields(value):
            _leaves(item, (*steps, step), out, depth + 1)


def same(a: Any, b: Any) -> bool:
    """Whether a leaf holds the same now as before: a tensor the same storage and shape; a value equal
    (``same_value``: NaN the same as NaN)."""
    if isinstance(a, HeldTensor) or isinstance(b, HeldTensor):
        return bool(a == b)
    return same_value(a, b)


def _qualname(code: types.CodeType) -> str:
    return str(getattr(code, "co_qualname", code.co_name))  # co_qualname: Python 3.11


def _line_of(ins: dis.Instruction, line: int | None) -> int | None:
    """The line of ``ins`` (positions: Python 3.11; before, the line it starts), else ``line``."""
    positions = getattr(ins, "positions", None)
    if positions is not None and positions.lineno is not None:
        return int(positions.lineno)
    return ins.starts_line if isinstance(ins.starts_line, int) and ins.starts_line else line


class _Chains:
    """What a code object takes from each place it loads: the steps after the load, and the line."""

    def __init__(self) -> None:
        self.read: dict[tuple[str, tuple[Step, ...]], str] = {}

    def note(self, place: str, steps: tuple[Step, ...], site: str) -> None:
        self.read.setdefault((place, steps), site)


_SKIP = frozenset({"CACHE", "PRECALL", "NOP", "PUSH_NULL", "EXTENDED_ARG", "KW_NAMES", "COPY", "RESUME"})


def _site(code: types.CodeType, line: int | None) -> str:
    from ..guard.tracker import _short_path

    return f"{_short_path(os.path.abspath(code.co_filename))}:{line} in {_qualname(code)}"


def _chains_of(
    code: types.CodeType,
    start: Callable[[dis.Instruction], str | None],
    returned: Mapping[str, tuple[str, tuple[Step, ...]]],
    chains: _Chains,
) -> tuple[str, tuple[Step, ...]] | None:
    """Walk ``code``: each load that ``start`` names a place of starts a chain of subscripts and
    attributes, kept through a local it is stored in, and through a call of a function whose result
    is a chain (``returned``: the function's global name -> (place, steps)). Each chain is noted with
    its line; what the code returns, when it is one chain, is returned."""
    locals_: dict[str, tuple[tuple[str, tuple[Step, ...]], str]] = {}
    current: tuple[str, tuple[Step, ...]] | None = None
    pending_const: Any = _MISSING
    calls = False  # the chain is a function's result, or a ContextVar's get: one call passes through
    result: tuple[str, tuple[Step, ...]] | None = None
    line: int | None = code.co_firstlineno
    at = ""  # the site of the chain's last step
    # A chain is noted where it ends (used whole from there), not at each step: reading
    # FORWARD_CONTEXT['temp'] is no read of FORWARD_CONTEXT['meta']. One stored in a local is noted
    # where the local's own chain ends.
    for ins in dis.get_instructions(code):
        line = _line_of(ins, line)
        op = ins.opname
        if op in _SKIP:
            continue
        if current is not None:
            if op in ("LOAD_CONST", "LOAD_SMALL_INT") and pending_const is _MISSING:
                pending_const = ins.argval
                continue
            if pending_const is not _MISSING and (
                op == "BINARY_SUBSCR" or (op == "BINARY_OP" and "[" in ins.argrepr)
            ):
                current = (current[0], (*current[1], ("key", pending_const)))
                pending_const, at = _MISSING, _site(code, line)
                continue
            if calls and op == "CALL":
                calls = False
                continue
            if pending_const is _MISSING and op in ("LOAD_ATTR", "LOAD_METHOD"):
                if ins.argval == "get" and current[0].endswith(".get()") and not current[1]:
                    calls = True  # CTX.get(): the ContextVar's value is the place's
                    continue
                current = (current[0], (*current[1], ("attr", ins.argval)))
                at = _site(code, line)
                continue
            if pending_const is _MISSING and op.startswith("STORE_FAST"):
                locals_[ins.argval] = (current, at)
                current = None
                continue
            if pending_const is _MISSING and op == "RETURN_VALUE":
                result = current  # its caller notes it, where the caller's chain ends
            else:
                chains.note(*current, at)
            current, pending_const, calls = None, _MISSING, False
        if op.startswith("LOAD_FAST") and isinstance(ins.argval, str) and ins.argval in locals_:
            current, at = locals_[ins.argval]
            continue
        if op in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in returned:
            current, calls, at = returned[ins.argval], True, _site(code, line)
            continue
        place = start(ins)
        if place is not None:
            current, calls, at = (place, ()), False, _site(code, line)
    if current is not None:
        chains.note(*current, at)
    return result


class Outside:
    """The places forward reads from outside ``module`` and its inputs, found once (``watching``
    around a forward, or from each submodule's ``forward``), and their leaves read on demand."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.tracked = TRACKED
        self._codes: dict[types.CodeType, dict[str, Any]] | None = None
        self._places: dict[str, Place] | None = None
        self._chains = _Chains()
        #: Leaf name -> (place, steps), for every leaf read so far.
        self._where: dict[str, tuple[Place, tuple[Step, ...]]] = {}

    # -- finding the places -------------------------------------------------------------------
    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """See the Python functions the block calls (a forward), to read their code for places. A
        profiler already set (cProfile) is left alone: the submodules' forwards are read instead."""
        if self._codes is not None or sys.getprofile() is not None or not self.tracked:
            yield
            return
        seen: dict[types.CodeType, dict[str, Any]] = {}

        def profile(frame: types.FrameType, event: str, arg: Any) -> None:
            if event == "call":
                seen[frame.f_code] = frame.f_globals

        sys.setprofile(profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            self._codes = {c: g for c, g in seen.items() if not _ours_or_torch(c.co_filename)}
            self._places = None

    def _module_codes(self) -> dict[types.CodeType, tuple[type, types.FunctionType]]:
        """The code of every method of the module tree's classes, with its class and function."""
        found: dict[types.CodeType, tuple[type, types.FunctionType]] = {}
        for kind in dict.fromkeys(type(sub) for sub in self.module.modules()):
            for klass in kind.__mro__:
                if klass is torch.nn.Module or klass is object:
                    continue
                for value in vars(klass).values():
                    fn = getattr(value, "__func__", value)
                    fn = getattr(fn, "__wrapped__", fn)
                    if isinstance(fn, types.FunctionType) and fn.__code__ not in found:
                        found[fn.__code__] = (kind, fn)
        return found

    def places(self) -> dict[str, Place]:
        if self._places is None:
            self._places = self._find() if self.tracked else {}
        return self._places

    def _find(self) -> dict[str, Place]:
        places: dict[str, Place] = {}
        methods = self._module_codes()
        codes = dict(self._codes) if self._codes is not None else {}
        if self._codes is None:  # no pass seen: each submodule's forward
            for code, (_, fn) in methods.items():
                if fn.__name__ == "forward" and not _ours_or_torch(code.co_filename):
                    codes[code] = fn.__globals__
        # Only code that can load a place is read (reading bytecode is the cost): a global that holds
        # state, a closure cell, or, in a method of the module tree, an attribute that can be one.
        attrs = self._state_attributes(methods)
        every = codes
        codes = {
            code: globals_
            for code, globals_ in codes.items()
            if any(self._holds_state(globals_[n]) for n in code.co_names if n in globals_)
            or (
                code in methods
                and (
                    set(code.co_freevars) - {"__class__"}  # a closure's cells (``__class__``: super())
                    or not attrs.get(methods[code][0], set()).isdisjoint(code.co_names)
                )
            )
        }
        # Functions that return a chain (get_forward_context()), read first, so that their callers
        # continue the chain.
        returned: dict[str, tuple[str, tuple[Step, ...]]] = {}
        for code, globals_ in codes.items():
            if code in methods:
                continue
            starts = self._starts(code, globals_, None, None, places)
            got = _chains_of(code, starts, {}, _Chains())
            if got is not None:
                returned[code.co_name] = got
        # ... and the code that calls one of those functions, which loads no place itself.
        codes.update({c: g for c, g in every.items() if not set(returned).isdisjoint(c.co_names)})
        for code, globals_ in codes.items():
            owner = methods.get(code)
            if owner is None:
                self._chains_of_code(code, globals_, None, None, returned, places)
            else:
                self._chains_of_code(code, globals_, owner[0], owner[1], returned, places)
        return places

    def _state_attributes(self, methods: Mapping[types.CodeType, tuple[type, Any]]) -> dict[type, set[str]]:
        """Per class of the module tree, the attribute names ``self.name`` can load a place by: a class
        attribute that holds state, or a container an instance keeps in its ``__dict__``."""
        found: dict[type, set[str]] = {klass: set() for klass, _ in methods.values()}
        for sub in self.module.modules():
            names = found.setdefault(type(sub), set())
            for name, value in vars(sub).items():
                if (
                    not isinstance(value, (torch.Tensor, torch.nn.Module))
                    and not _is_plain(value)
                    and _descend(value)
                ):
                    names.add(name)
        for klass, names in found.items():
            for owner in klass.__mro__:
                if owner in (torch.nn.Module, object):
                    continue
                names.update(
                    n for n, v in vars(owner).items() if not n.startswith("__") and self._holds_state(v)
                )
        return found

    def _chains_of_code(
        self,
        code: types.CodeType,
        globals_: dict[str, Any],
        klass: type | None,
        fn: types.FunctionType | None,
        returned: Mapping[str, tuple[str, tuple[Step, ...]]],
        places: dict[str, Place],
    ) -> None:
        starts = self._starts(code, globals_, klass, fn, places)
        usable = {name: chain for name, chain in returned.items() if name in code.co_names}
        _chains_of(code, starts, usable, self._chains)
        for const in code.co_consts:  # comprehensions and inner functions, with the same globals
            if isinstance(const, types.CodeType):
                _chains_of(const, self._starts(const, globals_, None, None, places), usable, self._chains)

    def _starts(
        self,
        code: types.CodeType,
        globals_: dict[str, Any],
        klass: type | None,
        fn: types.FunctionType | None,
        places: dict[str, Place],
    ) -> Callable[[dis.Instruction], str | None]:
        """For ``code``: the place each instruction that loads one loads, or None."""
        module_name = str(globals_.get("__name__", "?"))
        cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=False)) if fn is not None else {}
        self_name = code.co_varnames[0] if klass is not None and code.co_argcount else None
        pending_self = [False]

        def start(ins: dis.Instruction) -> str | None:
            op, name = ins.opname, ins.argval
            was_self, pending_self[0] = pending_self[0], False
            if op == "LOAD_GLOBAL" and isinstance(name, str):
                return self._global(globals_, name, module_name, places)
            if op == "LOAD_DEREF" and name in cells:
                return self._cell(cells[name], name, code, places)
            if op.startswith("LOAD_FAST") and name == self_name and self_name is not None:
                pending_self[0] = True
                return None
            if was_self and op in ("LOAD_ATTR", "LOAD_METHOD") and klass is not None:
                return self._attribute(klass, name, places)
            return None

        return start

    def _global(
        self, globals_: dict[str, Any], name: str, module: str, places: dict[str, Place]
    ) -> str | None:
        value = globals_.get(name, _MISSING)
        if value is _MISSING or not self._holds_state(value):
            return None
        label = f"{name}.get()" if isinstance(value, contextvars.ContextVar) else name
        if label in places and places[label].kind.endswith(f"of {module}"):
            return label
        if label in places:  # the same name in another module
            label = f"{module}.{label}"

        def rebind(new: Any, g: dict[str, Any] = globals_, n: str = name) -> Callable[[], None]:
            old = g[n]
            g[n] = new
            return lambda: g.__setitem__(n, old)

        if isinstance(value, contextvars.ContextVar):
            var = value

            def set_var(new: Any) -> Callable[[], None]:
                token = var.set(new)
                return lambda: var.reset(token)

            places[label] = Place(label, f"a ContextVar of {module}", lambda: var.get(_MISSING), set_var)
        else:
            what = (
                "a thread-local"
                if isinstance(value, threading.local)
                else "a module-level dict"
                if isinstance(value, dict)
                else "a module-level tensor"
                if isinstance(value, torch.Tensor)
                else "a module-level value"
                if _is_plain(value)
                else "a module-level object"
            )
            places[label] = Place(label, f"{what} of {module}", functools.partial(globals_.get, name), rebind)
        return label

    def _cell(self, cell: Any, name: str, code: types.CodeType, places: dict[str, Place]) -> str | None:
        try:
            value = cell.cell_contents
        except ValueError:
            return None
        if not self._holds_state(value):
            return None

        def rebind(new: Any, c: Any = cell) -> Callable[[], None]:
            old = c.cell_contents
            c.cell_contents = new
            return lambda: setattr(c, "cell_contents", old)

        places[name] = Place(
            name,
            f"a closure cell of {_qualname(code)}",
            functools.partial(getattr, cell, "cell_contents"),
            rebind,
        )
        return name

    def _attribute(self, klass: type, name: str, places: dict[str, Place]) -> str | None:
        """``self.name`` where it is no parameter, buffer or submodule: a class attribute, or a
        container the module keeps in its ``__dict__`` (a plain value there is the module's own)."""
        for sub_name, sub in self.module.named_modules():
            if type(sub) is klass and name in vars(sub):
                value = vars(sub)[name]
                if (
                    isinstance(value, (torch.Tensor, torch.nn.Module))
                    or _is_plain(value)
                    or not _descend(value)
                ):
                    return None
                label = f"{sub_name}.{name}" if sub_name else name
                places[label] = Place(
                    label,
                    f"held by {type(sub).__name__} outside its buffers",
                    functools.partial(vars(sub).get, name, _MISSING),
                    None,
                )
                return label
        for owner in klass.__mro__:
            if name in vars(owner):
                value = vars(owner)[name]
                if not self._holds_state(value):
                    return None
                label = f"{owner.__name__}.{name}"

                def rebind(new: Any, o: type = owner, n: str = name) -> Callable[[], None]:
                    old = vars(o)[n]
                    setattr(o, n, new)
                    return lambda: setattr(o, n, old)

                places[label] = Place(
                    label,
                    f"a class attribute of {owner.__qualname__}",
                    functools.partial(getattr, owner, name, _MISSING),
                    rebind,
                )
                return label
        return None

    @staticmethod
    def _holds_state(value: Any) -> bool:
        return (
            _is_plain(value)
            or isinstance(value, (torch.Tensor, contextvars.ContextVar))
            or (_descend(value) and not isinstance(value, tuple))
        ) and not isinstance(value, (torch.dtype, str, bytes))

    # -- reading and setting leaves ----------------------------------------------------------
    def leaves(self) -> dict[str, Any]:
        """Every leaf of every place, by the name code spells it with."""
        found: dict[str, Any] = {}
        for place in self.places().values():
            value = place.read()
            if value is _MISSING:
                continue
            out: dict[tuple[Step, ...], Any] = {}
            _leaves(value, (), out, 0)
            for steps, leaf in out.items():
                label = _label(place, steps)
                self._where.setdefault(label, (place, steps))
                found[label] = leaf
        return found

    def read_by_forward(self, name: str) -> bool:
        """Whether a chain forward was seen to take leads to or into leaf ``name``."""
        place, steps = self._where[name]
        return any(
            p == place.name and (steps[: len(s)] == s or s[: len(steps)] == steps)
            for p, s in self._chains.read
        )

    def site(self, name: str) -> str:
        """The line that read leaf ``name`` (the longest chain seen that leads to it), or ""."""
        place, steps = self._where[name]
        best, best_len = "", -1
        for (p, s), where in self._chains.read.items():
            if p == place.name and steps[: len(s)] == s and len(s) > best_len:
                best, best_len = where, len(s)
        return best

    def describe(self, name: str) -> str:
        """``name`` with what it is and where forward read it, for a message."""
        place, _ = self._where[name]
        site = self.site(name)
        return f"{name} ({place.kind}{f', read at {site}' if site else ''})"

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def set(self, name: str, value: Any) -> Callable[[], None]:
        """Leaf ``name`` set to ``value`` (a ``HeldTensor``: the tensor it held); how to undo it."""
        place, steps = self._where[name]
        if isinstance(value, HeldTensor):
            value = value.tensor()
            if value is None:
                raise LookupError(f"{name}: the tensor held at capture is gone")
        if not steps:
            if place.rebind is None:
                raise LookupError(f"{name} cannot be set")
            return place.rebind(value)
        owner = place.read()
        for kind, arg in steps[:-1]:
            owner = owner[arg] if kind == "key" else getattr(owner, arg)
        kind, arg = steps[-1]
        if kind == "key":
            old = owner[arg]
            owner[arg] = value
            return lambda: owner.__setitem__(arg, old)
        old = getattr(owner, arg)
        try:
            setattr(owner, arg, value)
            return lambda: setattr(owner, arg, old)
        except (AttributeError, TypeError):  # a frozen dataclass: set beneath its guard
            object.__setattr__(owner, arg, value)
            return lambda: object.__setattr__(owner, arg, old)

    def value(self, name: str) -> Any:
        """Leaf ``name`` now (a tensor as a ``HeldTensor``); ``MISSING`` where it is no longer there."""
        place, steps = self._where[name]
        value = place.read()
        try:
            for kind, arg in steps:
                value = value[arg] if kind == "key" else getattr(value, arg)
        except (KeyError, IndexError, AttributeError, TypeError):
            return MISSING
        return HeldTensor.of(value) if isinstance(value, torch.Tensor) else value


#: What ``Outside.value`` gives for a leaf no longer there.
MISSING = _MISSING
