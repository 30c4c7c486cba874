"""The plain Python values a graph holds from its capture, which a replay keeps when they change
after it: the module tree's attributes (``python_values``: a float lr, a scale kept on the module)
and what forward reads from outside the module (``outside.Outside``: a forward context's
``num_actual_tokens``, a tensor a runner puts in a module-level dict) as each captured graph saw
them, and the Python inputs of ``make_inputs`` that change with the
batch (layout kind ``value``: a max_seq_len, a temperature) as each graph holds them. One per
verification, composed by ``VerifyContext`` (``ctx.python``); the checks that name a value a graph
froze (``replay_matches_eager``, ``real_batches``, ``padded_size``) ask it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from ..manager import GraphManager
from ..manager.layout import call_make_inputs, same_value
from ..plan import BatchDescriptor
from .module_state import ModuleState, _set_python_value, python_values
from .outside import same

__all__ = ["PythonHeld"]


class PythonHeld:
    """The Python values graphs hold, for the state ``state`` of ``manager``'s module (its
    ``python_written``: the values forward itself changes on every call)."""

    def __init__(self, manager: GraphManager, state: ModuleState) -> None:
        self.manager = manager
        self.module = manager.module
        self.state = state
        #: Per descriptor captured with replay_matches_eager's watch, the module's plain Python values
        #: at its capture (``now``): what its graph holds of them.
        self.at_capture: dict[BatchDescriptor, dict[str, Any]] = {}
        self._slots: list[tuple[str, dict[str, Any], str]] | None = None
        #: Per descriptor that was not captured (quick mode's other sizes), the Python values that
        #: change with the batch as make_inputs gives them at its own shape: what its graph would hold.
        self._inputs_at: dict[BatchDescriptor, dict[str, Any]] = {}

    # -- the module tree's attributes --------------------------------------------------------
    def now(self) -> dict[str, Any]:
        """The module tree's plain Python values now, by dotted name: those ``python_values`` found
        when first asked, read again (no walk of the module tree: at 8B that walk costs 7.6 ms, once
        per capture a tenth of a second)."""
        if self._slots is None:
            self._slots = []
            for dotted in python_values(self.module):
                path, _, attr = dotted.rpartition(".")
                owner = self.module.get_submodule(path) if path else self.module
                self._slots.append((dotted, owner.__dict__, attr))
        return {dotted: held[attr] for dotted, held, attr in self._slots if attr in held}

    def outside_now(self) -> dict[str, Any]:
        """What forward reads from outside the module now, by the name code spells it with (those
        forward itself moves left out: they are ``python_written``)."""
        outside, written = self.state.outside, self.state.python_written
        return {
            name: value
            for name, value in outside.leaves().items()
            if name not in written and outside.read_by_forward(name)
        }

    def captured(self, desc: BatchDescriptor) -> None:
        """``desc`` is being captured: the values its graph holds are those of now."""
        self.at_capture[desc] = {**self.now(), **self.outside_now()}

    def describe(self, name: str) -> str:
        """``name`` for a message: what forward reads from outside the module says where it lives and
        the line that read it; a module attribute is its dotted name."""
        outside = self.state.outside
        return outside.describe(name) if name in outside and name not in self._module_names() else name

    def described(self, names: Iterator[str] | list[str] | Mapping[str, Any]) -> dict[str, str]:
        """Those of ``names`` forward reads from outside the module, each described (``describe``)."""
        return {name: self.describe(name) for name in names if self.outside(name)}

    def written_now(self) -> dict[str, Any]:
        """The values forward itself moves on every call that it reads from outside the module, now."""
        return {
            name: self.state.outside.value(name) for name in self.state.python_written if self.outside(name)
        }

    @contextlib.contextmanager
    def as_made(self, values: Mapping[str, Any]) -> Iterator[None]:
        """What forward reads from outside the module set to ``values`` (``outside_now`` of a batch,
        taken when make_inputs made it) in the block, put back after: a batch run after others were
        made reads its own forward context, not the last one's. A value no longer there is left."""
        outside = self.state.outside
        undo = []
        for name, value in values.items():
            with contextlib.suppress(LookupError, KeyError, AttributeError, TypeError, IndexError):
                undo.append(outside.set(name, value))
        try:
            yield
        finally:
            for step in reversed(undo):
                step()

    def outside_moving(self, desc: BatchDescriptor | None = None) -> dict[str, tuple[Any, Any]]:
        """What forward reads from outside the module that moves from batch to batch (make_inputs
        sets it per step): name -> (at ``desc``'s capture, or at the first capture kept where
        ``desc``'s was not, and now), for the values that differ between two captures or between a
        capture and now."""
        kept = [self.at_capture[desc]] if desc in self.at_capture else list(self.at_capture.values())
        if not kept:
            return {}
        now = self.outside_now()
        moving: dict[str, tuple[Any, Any]] = {}
        for name, value in now.items():
            if not self.outside(name):
                continue
            seen = [k[name] for k in kept if name in k]
            if seen and any(not same(v, value) for v in seen):
                moving[name] = (seen[0], value)
            elif len(self.at_capture) > 1 and len({repr(k.get(name)) for k in self.at_capture.values()}) > 1:
                moving[name] = (seen[0] if seen else None, value)
        return moving

    def outside(self, name: str) -> bool:
        """Whether ``name`` is a value forward reads from outside the module (not an attribute of it)."""
        return name in self.state.outside and name not in self._module_names()

    def _module_names(self) -> set[str]:
        self.now()
        return {dotted for dotted, _, _ in self._slots or ()}

    def changed_since_capture(self, desc: BatchDescriptor) -> dict[str, tuple[Any, Any]]:
        """The module's Python values that differ now from when ``desc`` was captured, other than those
        forward itself changes on every call (``python_written``): name -> (at capture, now). Empty
        where the capture's were not kept (``replay_matches_eager`` not run)."""
        captured = self.at_capture.get(desc)
        if not captured:
            return {}
        now = {**self.now(), **self.outside_now()}
        written = self.state.python_written
        return {
            name: (value, now[name])
            for name, value in captured.items()
            if name in now and name not in written and not same(value, now[name])
        }

    @contextlib.contextmanager
    def set(self, values: Mapping[str, Any]) -> Iterator[None]:
        """The module's Python values set to ``values`` (dotted name -> value) in the block, put back after."""
        kept = self.now()
        undo = []
        try:
            for name, value in values.items():
                if self.outside(name):
                    undo.append(self.state.outside.set(name, value))
                else:
                    _set_python_value(self.module, name, value)
            yield
        finally:
            for name in values:
                if name in kept:
                    _set_python_value(self.module, name, kept[name])
            for step in reversed(undo):
                step()

    # -- make_inputs' Python inputs ----------------------------------------------------------
    def inputs_at(self, desc: BatchDescriptor) -> dict[str, Any]:
        """The Python inputs that change with the batch as make_inputs gives them at ``desc``'s own
        shape (made once per descriptor): what a graph of ``desc`` holds, or would hold."""
        if desc not in self._inputs_at:
            made = self._make(desc)
            self._inputs_at[desc] = {name: made[name] for name in self.manager.state.value_names}
        return self._inputs_at[desc]

    def values_per_shape(self, desc: BatchDescriptor, held: Mapping[str, tuple[Any, Any]]) -> bool:
        """Whether make_inputs gives ``desc``'s shape the Python values its graph holds (``held``: name
        -> (held, the batch's)) again: values set by the shape alone (a max_seq_len), not drawn anew
        for every batch (a temperature). Asked where a held value decided a result."""
        made = self._make(desc)
        return all(same_value(made.get(name), at) for name, (at, _) in held.items())

    def held_values(self, padded: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """The Python inputs that change with the batch whose value in ``padded`` (what a graph holds
        from its capture) is not the batch's own (``inputs``): name -> (at capture, in the batch)."""
        return {
            name: (padded[name], inputs[name])
            for name in self.manager.state.value_names
            if name in padded and name in inputs and not same_value(padded[name], inputs[name])
        }

    def _make(self, desc: BatchDescriptor) -> dict[str, Any]:
        """make_inputs at ``desc``'s own shape (its token count and the requests its graph is captured
        with), for its values alone: what it sets outside the module (a forward context it fills) is
        put back, for the batch being run was made before and reads its own."""
        outside = self.state.outside
        before = outside.leaves() if outside.places() else {}
        made = call_make_inputs(self.manager.make_inputs, desc.num_tokens, self.manager.capture_reqs(desc))
        if before:
            for name, value in outside.leaves().items():
                if name in before and not same(before[name], value):
                    with contextlib.suppress(LookupError, KeyError, AttributeError, TypeError, IndexError):
                        outside.set(name, before[name])
        return made
