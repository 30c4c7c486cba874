"""The plain Python values a graph holds from its capture, which a replay keeps when they change
after it: the module tree's attributes (``python_values``: a float lr, a scale kept on the module)
as each captured graph saw them, and the Python inputs of ``make_inputs`` that change with the
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

    def captured(self, desc: BatchDescriptor) -> None:
        """``desc`` is being captured: the values its graph holds are those of now."""
        self.at_capture[desc] = self.now()

    def changed_since_capture(self, desc: BatchDescriptor) -> dict[str, tuple[Any, Any]]:
        """The module's Python values that differ now from when ``desc`` was captured, other than those
        forward itself changes on every call (``python_written``): name -> (at capture, now). Empty
        where the capture's were not kept (``replay_matches_eager`` not run)."""
        captured = self.at_capture.get(desc)
        if not captured:
            return {}
        now = self.now()
        written = self.state.python_written
        return {
            name: (value, now[name])
            for name, value in captured.items()
            if name in now and name not in written and not same_value(value, now[name])
        }

    @contextlib.contextmanager
    def set(self, values: Mapping[str, Any]) -> Iterator[None]:
        """The module's Python values set to ``values`` (dotted name -> value) in the block, put back after."""
        kept = self.now()
        for name, value in values.items():
            _set_python_value(self.module, name, value)
        try:
            yield
        finally:
            for name in values:
                if name in kept:
                    _set_python_value(self.module, name, kept[name])

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
        """make_inputs at ``desc``'s own shape (its token count and the requests its graph is captured with)."""
        return call_make_inputs(self.manager.make_inputs, desc.num_tokens, self.manager.capture_reqs(desc))
