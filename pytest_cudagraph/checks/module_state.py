"""The module's state as the checks see it (``ModuleState``): the parameters and buffers its
forwards write and the plain Python values they change, snapshot and put back around each
comparison, and compared outside the declared scratch regions; ``python_values``, the plain
Python values a module tree holds (what a graph freezes); ``clone_tree``. Shared by
``VerifyContext`` (our manager's checks) and the runner verification's ``RunnerContext``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import UsageError
from ..manager import tree
from ..observe import ForwardObserver, fingerprint, restoring
from ..plan.validate import did_you_mean
from .compare import Difference, first_difference
from .floor import across_shapes, given
from .outside import MISSING, Outside, same

__all__ = ["ModuleState", "ScratchRegion", "Snapshot", "clone_tree", "python_values"]

# A region of a buffer that padded rows may legitimately write (a KV cache's
# padding slot): an index, a slice, or a callable returning a boolean mask.
ScratchRegion = int | slice | Callable[[torch.Tensor], torch.Tensor]


def clone_tree(value: Any) -> Any:
    """``value`` with every tensor cloned, dataclass fields included, in the same structure."""
    return tree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def python_values(module: torch.nn.Module) -> dict[str, Any]:
    """Plain Python values held by the module tree (what a graph freezes), by dotted name."""
    found: dict[str, Any] = {}
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr == "training" or attr.startswith("__"):
                continue
            if isinstance(value, (bool, int, float, str)) or value is None:
                found[f"{path}.{attr}" if path else attr] = value
    return found


#: The most state names a message lists (a model's parameters run to hundreds).
_LISTED = 12


def _not_state(module: torch.nn.Module, unknown: list[str], names: list[str]) -> str:
    """The one line for ``scratch_state`` keys that name no buffer or parameter of ``module``:
    which, the nearest name, the module's buffers (where scratch regions live) and what to do."""
    said = ", ".join(repr(n) for n in unknown)
    which = "is not a buffer or parameter" if len(unknown) == 1 else "are not buffers or parameters"
    buffers = {name for name, _ in module.named_buffers(remove_duplicate=False)}
    held = [n for n in names if n in buffers]

    def listed(items: list[str]) -> str:
        more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
        return ", ".join(items[:_LISTED]) + more

    has = (
        f"its buffers are {listed(held)}"
        if held
        else f"it has no buffers (its parameters: {listed(names) or 'none'})"
    )
    return (
        f"scratch_state names {said}, which {which} of {type(module).__name__}{did_you_mean(unknown[0], names)}; "
        f"{has}. Key scratch_state by the name module.named_buffers() gives the buffer forward may leave "
        "changed (a submodule's dotted, such as 'cache.slots')"
    )


def _set_python_value(module: torch.nn.Module, dotted: str, value: Any) -> None:
    path, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(path) if path else module
    owner.__dict__[attr] = value


class Snapshot(dict[str, torch.Tensor]):
    """Copies of the tensors forwards write, and (``python``) the plain Python values they change."""

    python: dict[str, Any]


class ModuleState:
    """The module's state as the checks see it: the parameters and buffers its
    forwards write (``observer.written``), snapshot and restored around each
    comparison, compared outside the declared ``scratch_state`` regions.
    Shared by ``VerifyContext`` (our manager) and the runner verification's
    context (someone else's runner).

    Only what a forward writes is copied: the weights of an 8B model are
    never duplicated. What is written is learned op by op (see
    ``pytest_cudagraph.observe``): by ``learn_writes``, a first pass that puts
    back what it wrote, and by every guarded forward and capture after it.
    A tensor written where no op shows it (a Triton kernel called directly)
    is found by its fingerprint (``unseen_writes``)."""

    def __init__(
        self,
        module: torch.nn.Module,
        scratch_state: Mapping[str, ScratchRegion],
        seed: int,
        observer: ForwardObserver | None = None,
    ) -> None:
        self.module = module
        self.seed = seed
        self.observer = observer if observer is not None else ForwardObserver(module)
        self.scratch_state = dict(scratch_state)
        names = [name for name, _ in self._state_items()]
        unknown = sorted(set(self.scratch_state) - set(names))
        if unknown:
            raise UsageError(_not_state(module, unknown, names))
        #: Fingerprints of the tensors no forward was seen writing, taken by learn_writes.
        self._unwritten: dict[str, tuple[int, int]] = {}
        #: Tensors found written only by their fingerprint (no op showed the write).
        self.unseen: list[str] = []
        #: What the verification could not do as usual, for the report.
        self.notes: list[str] = []
        #: Plain Python values of the module tree that forwards change (a counter, an offset), by
        #: dotted name: snapshot and put back with the tensors.
        self.python_written: list[str] = []
        #: Module tensors make_inputs writes in place (a weight sync), by name: the state each run
        #: starts from, not a forward's write; their fingerprints follow each such write.
        self.synced: dict[str, None] = {}
        #: Each tensor's storage address when learn_writes ran: a tensor found elsewhere since was
        #: rebound (``param.data = new``), which address_stability names, not a write.
        self._addresses: dict[str, int] = {}
        self.observer.on_outside_writes.append(self._written_outside)
        #: Module tensors make_inputs rebound to new memory (``param.data = new``), by name, in the
        #: order first seen: graphs captured before keep reading the old memory (address_stability).
        self.rebound_outside: dict[str, None] = {}
        self.observer.on_outside_rebinds.append(self._rebound_outside)
        #: What forward reads from outside the module and its inputs (a forward context, a module-level
        #: dict, a class attribute): found in learn_writes' first pass.
        self.outside = Outside(module)

    def _rebound_outside(self, names: list[str]) -> None:
        for name in names:
            self.rebound_outside.setdefault(name, None)

    def _written_outside(self, names: list[str]) -> None:
        """make_inputs wrote these in place: what forwards start from now, not a forward's write."""
        items = dict(self._state_items())
        for name in names:
            self.synced.setdefault(name, None)
            if name in self._unwritten and name in items:
                self._unwritten[name] = fingerprint(items[name])

    # -- module state -------------------------------------------------------
    def _state_items(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and buffer, by name."""
        return self.observer.tensors()

    def snapshot(self) -> Snapshot:
        """Copies of the tensors forwards write (nothing else can change), and the Python values they change."""
        snap = Snapshot({name: t.detach().clone() for name, t in self.observer.written_items()})
        snap.python = self._python_now()
        return snap

    def _python_now(self) -> dict[str, Any]:
        values = {}
        for dotted in self.python_written:
            if dotted in self.outside:
                value = self.outside.value(dotted)
                if value is not MISSING:
                    values[dotted] = value
                continue
            path, _, attr = dotted.rpartition(".")
            with contextlib.suppress(AttributeError):
                owner = self.module.get_submodule(path) if path else self.module
                if attr in owner.__dict__:
                    values[dotted] = owner.__dict__[attr]
        return values

    def restore(self, snap: Mapping[str, torch.Tensor]) -> None:
        # A Python counter or offset goes back too: left alone, two eager runs "from one state"
        # differ, and a module with Python state reads as random.
        for dotted, value in getattr(snap, "python", {}).items():
            if dotted in self.outside:
                with contextlib.suppress(LookupError, KeyError, AttributeError, TypeError, IndexError):
                    self.outside.set(dotted, value)
            else:
                _set_python_value(self.module, dotted, value)
        if not snap:
            return
        with torch.no_grad():
            for name, t in self.observer.written_items():
                if name in snap:
                    t.copy_(snap[name])

    @contextlib.contextmanager
    def preserved_state(self) -> Iterator[Snapshot]:
        """Snapshot the module's state and put it back afterwards."""
        snap = self.snapshot()
        try:
            yield snap
        finally:
            self.restore(snap)

    def learn_writes(self, forwards: Sequence[Callable[[], Any]]) -> None:
        """Run ``forwards`` to learn what they write, and put it back.

        Each write an op shows is copied first and restored after. Any other
        tensor whose fingerprint changed was written where no op showed it:
        it is watched from then on (``unseen``), though what the pass wrote
        there cannot be undone."""
        before = {name: fingerprint(t) for name, t in self._state_items()}
        python_before = python_values(self.module)
        outside_between: dict[str, Any] = {}
        with restoring(self.observer):
            for i, forward in enumerate(forwards):
                self.seed_all(self.seed)
                if i:
                    forward()
                    continue
                # The first pass also finds what forward reads from outside the module; a second one
                # shows which of those values forward itself moves (a counter in a module-level dict).
                with self.outside.watching():
                    forward()
                outside_between = self.outside.leaves()
                if outside_between and len(forwards) == 1:
                    self.seed_all(self.seed)
                    forward()
        python_after = python_values(self.module)
        self.python_written = [
            name
            for name, value in python_after.items()
            if name not in python_before or python_before[name] != value
        ]
        for name in self.python_written:
            if name in python_before:
                _set_python_value(self.module, name, python_before[name])
        if outside_between:
            outside_after = self.outside.leaves()
            moved = [
                name
                for name, value in outside_between.items()
                if name in outside_after
                and not same(value, outside_after[name])
                and self.outside.read_by_forward(name)
            ]
            for name in moved:
                # Put back to the value after the first pass (the one before it was not yet known).
                with contextlib.suppress(LookupError, KeyError, AttributeError, TypeError, IndexError):
                    self.outside.set(name, outside_between[name])
            self.python_written += moved
        self._unwritten = {}
        self._addresses = {}
        for name, t in self._state_items():
            self._addresses[name] = t.data_ptr()
            if name in self.observer.written:
                continue
            now = fingerprint(t)
            if before.get(name, now) != now:
                self.observer.written.setdefault(name, None)
                self.unseen.append(name)
            else:
                self._unwritten[name] = now

    def unseen_writes(self) -> list[str]:
        """Tensors that no forward was seen writing when ``learn_writes`` ran and that hold other values
        now, in the memory they had then (a tensor rebound to new memory is ``rebound()``'s)."""
        items = dict(self._state_items())
        return [
            name
            for name, fp in self._unwritten.items()
            if name in items
            and name not in self.rebound_outside
            and items[name].data_ptr() == self._addresses.get(name)
            and fingerprint(items[name]) != fp
        ]

    def rebound(self) -> list[str]:
        """Tensors whose storage moved since ``learn_writes`` ran (``param.data = new``, in forward or in
        make_inputs): graphs captured before keep reading the old memory."""
        return [
            name
            for name, t in self._state_items()
            if name in self._addresses and t.data_ptr() != self._addresses[name]
        ]

    @property
    def roundoff(self) -> float:
        """The coarsest unit roundoff of the forward's products seen so far (0.0: none seen)."""
        return self.observer.roundoff

    def outside_scratch(
        self, name: str, *tensors: torch.Tensor, like: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """``tensors`` (snapshots of state ``name``) with its declared scratch region zeroed, one
        region for all of them: a callable region is asked of ``like`` (default: the first tensor)
        only, so that the tensors compared are masked alike."""
        region = self.scratch_state.get(name)
        if region is None:
            return list(tensors)
        where = region(tensors[0] if like is None else like) if callable(region) else region
        masked = []
        for t in tensors:
            t = t.clone()
            t[where] = 0
            masked.append(t)
        return masked

    def state_difference(
        self,
        got: Mapping[str, torch.Tensor],
        expected: Mapping[str, torch.Tensor],
        *,
        use_scratch: bool,
        rtol: float | None = 0.0,
        atol: float | None = 0.0,
    ) -> Difference | None:
        for name in expected:
            g, e = got[name], expected[name]
            if use_scratch:
                g, e = self.outside_scratch(name, g, e)
            found = first_difference(g, e, rtol=rtol, atol=atol)
            if found is not None:
                found.path = name
                return found
        return None

    def state_across_shapes(
        self,
        got: Mapping[str, torch.Tensor],
        expected: Mapping[str, torch.Tensor],
        before: Mapping[str, torch.Tensor],
        padded: Callable[[], Mapping[str, torch.Tensor] | None],
        *,
        rtol: float | None,
        atol: float | None,
    ) -> tuple[str, Difference, str] | None:
        """(name, where, why) of the first tensor a padded run (``got``) left otherwise than eager on the
        unpadded batch (``expected``), both from ``before``, outside ``scratch_state``; or None.

        Where eager's real rows wrote nothing, bit for bit: a padded row that wrote there wrote where
        no real row does. Where they wrote, held to the floor across shapes (``checks/floor.py``):
        ``padded()`` is the state eager at the padded shape leaves (run only when needed; None: no
        floor, the tolerance decides)."""
        reference: list[Mapping[str, torch.Tensor] | None] = []

        def floor_state() -> Mapping[str, torch.Tensor] | None:
            if not reference:
                reference.append(padded())
            return reference[0]

        for name, e in expected.items():
            raw, start = got[name], before.get(name)
            g, e = self.outside_scratch(name, raw, e)
            if start is None:
                diff = first_difference(g, e, rtol=rtol, atol=atol)
                if diff is not None:
                    diff.path = name
                    return name, diff, diff.reason
                continue
            (start,) = self.outside_scratch(name, start, like=raw)
            same = (
                (e == start) | (torch.isnan(e) & torch.isnan(start)) if e.is_floating_point() else e == start
            )
            wrote = ~same
            untouched = first_difference(torch.where(wrote, 0, g), torch.where(wrote, 0, e))
            if untouched is not None:
                untouched.path = name
                return name, untouched, f"{untouched.reason} where eager's real rows wrote nothing"
            if not bool(wrote.any()):
                continue
            state = floor_state()
            floor = None
            if state is not None and name in state:
                (p,) = self.outside_scratch(name, state[name], like=raw)
                floor = given(p[wrote])
            verdict = across_shapes(g[wrote], e[wrote], floor, rtol=rtol, atol=atol, roundoff=self.roundoff)
            if not verdict.passed:
                diff = verdict.diff or Difference(name, "values differ")
                diff.path = name
                diff.index = None  # an index into the written values alone, not into the tensor
                # The verdict speaks of real rows: here they are the values the real rows wrote.
                return name, diff, verdict.why.replace("real rows", "the values the real rows wrote", 1)
        return None

    def seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def from_one_state(self, run: Callable[[int], Any], times: int = 2) -> list[Any]:
        """``run(i)`` for i in ``range(times)``, each from the same module state and seed (the
        determinism checks)."""
        outs = []
        with self.preserved_state() as state0:
            for i in range(times):
                self.restore(state0)
                self.seed_all(self.seed)
                outs.append(run(i))
        return outs
