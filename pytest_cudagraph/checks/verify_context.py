"""What every check needs: the manager, real batches, state snapshots, eager runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import faults
from ..context import running
from ..errors import InternalError
from ..guard import as_captured, host_numbers
from ..manager import GraphManager, tree
from ..manager.layout import call_make_inputs, same_value
from ..observe import ForwardObserver, fingerprint, poisoned, restoring
from ..options import VerifyOptions
from ..plan import Batch, BatchDescriptor, GraphMode
from ..plan.properties import exact_batch
from . import causes
from .causes import HostNumbers
from .compare import Difference, TreePrint, first_difference, tree_print
from .floor import across_shapes, given
from .reference import Reference

__all__ = ["ModuleState", "Snapshot", "VerifyContext", "clone_tree", "python_values"]

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
        names = {name for name, _ in self._state_items()}
        unknown = set(self.scratch_state) - names
        if unknown:
            raise ValueError(
                f"scratch_state names {sorted(unknown)}, which are not buffers or parameters of the "
                f"module; it has {sorted(names)}"
            )
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
        with restoring(self.observer):
            for forward in forwards:
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


@dataclass(frozen=True)
class FreshEager:
    """An eager run ``fresh_inputs`` made at a descriptor's padded shape, kept for ``real_batches``."""

    #: The real batch, the inputs make_inputs gave for it, and the padded inputs the eager run read
    #: (copied before it ran: a forward may write its inputs).
    batch: Batch
    inputs: dict[str, Any]
    padded: dict[str, Any]
    #: What eager returned, whole (not cut to the real rows).
    output: Any


class VerifyContext(ModuleState):
    """Helpers shared by the checks; one per ``verify`` call."""

    def __init__(
        self,
        manager: GraphManager,
        options: VerifyOptions,
        *,
        plan_dispatch: bool = False,
        dispatch_here: bool = True,
    ) -> None:
        super().__init__(manager.module, options.scratch_state or {}, options.seed, manager.observer)
        self.manager = manager
        self.options = options
        self.rtol = options.rtol
        self.atol = options.atol
        self.batch_invariant = options.batch_invariant
        self.exhaustive = options.exhaustive
        #: padding_isolation also fills padded rows with NaN and inf.
        self.nonfinite_padding = options.nonfinite_padding
        batches = options.batches
        self.real_batches_run = 0
        #: Plain tensor attributes of the module tree right after capture,
        #: by dotted name (what a replay leaves there).
        self.captured_attributes: dict[str, Any] = {}
        #: Attributes forward rebinds on every call (found once, lazily).
        self.rebound_attributes: list[str] | None = None
        #: A verification split by descriptor: the dispatch check tests the
        #: plan's dispatch, and only in the item of the plan's first descriptor.
        self.plan_dispatch = plan_dispatch
        self.dispatch_here = dispatch_here
        #: What checks prepared before capture, by check name (address_stability: the addresses).
        self.prepared: dict[str, Any] = {}
        #: Real batches given by the caller (a trace's shapes) in place of the sweep, and which
        #: descriptor serves each (found once).
        self.given_batches = tuple(batches) if batches is not None else None
        self._served: dict[BatchDescriptor, list[Batch]] | None = None
        #: Per descriptor, replay_matches_eager's eager run at the captured shape (the inputs as it
        #: left them, the state it wrote), for the state check; dropped when the descriptor is done.
        self.exact_eager: dict[BatchDescriptor, tuple[dict[str, Any], Snapshot, Snapshot]] = {}
        self._uninitialized: str | None = None
        #: The float64 reference of the cross-shape question (``padded_size``): None when that check
        #: does not run; ``real_batches`` queues its batches there when the module runs in float64.
        self.reference: Reference | None = None
        #: Per descriptor, ``fresh_inputs``' eager run at the padded shape of the descriptor's most
        #: padded real batch, where it passed and ``real_batches`` would run the very same forward
        #: next (``shares_eager``); ``real_batches`` takes it, and it is dropped when the descriptor is done.
        self.fresh_eager: dict[BatchDescriptor, FreshEager] = {}
        #: Descriptors whose graph ``determinism`` replayed under two seeds (and two poisons) with
        #: the same result, for a module that draws nothing: ``rng``'s question there ("the graph
        #: draws nothing either") is answered by those replays; dropped when the descriptor is done.
        self.seed_free: set[BatchDescriptor] = set()
        #: Per descriptor, ``real_batches``' run of ``fresh_inputs``' inputs at its most padded batch,
        #: where it shared that check's eager run (``shares_eager``): the batch, the inputs and the
        #: graph's real rows, with every padded row at its pad value, which is ``padding_isolation``'s
        #: base where each floating input pads with zeros; dropped when the descriptor is done.
        self.padding_base: dict[BatchDescriptor, tuple[Batch, dict[str, Any], Any]] = {}
        #: The per-descriptor checks this verification runs, by name (set by the engine).
        self.checks_run: frozenset[str] = frozenset()
        #: Per descriptor, ``fresh_inputs``' replay, made with the graphs' free memory poisoned the
        #: first way where it passed and nothing but graph memory can make two replays of the same
        #: inputs from one state and seed differ (``shares_replay``): the batch, the inputs and the
        #: print of what the replay returned (not the output: memory of its size held across the
        #: checks between), which ``determinism`` takes as its first replay; dropped when the
        #: descriptor is done.
        self.first_replay: dict[BatchDescriptor, tuple[Batch, dict[str, Any], TreePrint]] = {}
        #: Per descriptor, prints of its checked capture's warm-up (``watch_warmup``): the inputs it
        #: read before and after it ran, and its output; ``replay_matches_eager`` takes them.
        self.warm_prints: dict[
            BatchDescriptor, tuple[TreePrint | None, TreePrint | None, TreePrint | None]
        ] = {}
        #: Per descriptor that was not captured (quick mode's other sizes), the Python values that
        #: change with the batch as make_inputs gives them at its own shape: what its graph would hold.
        self._values_at: dict[BatchDescriptor, dict[str, Any]] = {}
        self._host_draws: list[HostNumbers] | None = None
        #: Per descriptor captured with replay_matches_eager's watch, the module's plain Python values
        #: at its capture (``python_now``): what its graph holds of them.
        self.python_at_capture: dict[BatchDescriptor, dict[str, Any]] = {}
        self._python_slots: list[tuple[str, dict[str, Any], str]] | None = None

    def uninitialized(self) -> str:
        """Why the module's results are undefined, when a forward reads memory nobody wrote (``""``
        when none does): the observer saw an op read what ``torch.empty`` (or kin) handed back
        before anything wrote it, and two eager runs from one state and seed, with that memory
        poisoned two ways, give other results. Found once a verification."""
        if self._uninitialized is None:
            self._uninitialized = ""
            seen = self.observer.unwritten_read
            if seen is not None:
                reader, maker = seen
                batch = self.exact_batch(min(self.manager.plan.capture_order, key=lambda d: d.num_tokens))
                inputs = self.make(batch)
                outs = []
                with self.preserved_state() as state0:
                    for which in (0, 1):
                        self.restore(state0)
                        self.seed_all(self.seed)
                        with poisoned(which):
                            outs.append(self.eager_real(clone_tree(inputs), batch, captured_path=False))
                if first_difference(outs[0], outs[1]) is not None:
                    self._uninitialized = (
                        f"forward reads memory nobody wrote: {reader} reads what {maker} handed back before "
                        "anything wrote it, so its results are whatever the allocator left there (eager differs "
                        "from itself, and a graph reads other memory again). Write it fully first, or make it "
                        "with torch.zeros"
                    )
        return self._uninitialized

    def host_draws(self) -> list[HostNumbers]:
        """Kernels (custom ops, Triton launches) handed Python numbers that move from one forward to the
        next: two eager runs of the same inputs from the same tensor state and seed, the module's
        Python attributes left to move between them as they do between calls, hand every op the
        same numbers unless a seed or offset kept on the host is incremented per call. Found once a
        verification (two eager forwards at the plan's smallest shape); a forward that raises there
        shows nothing (capture_safety tells its error)."""
        if self._host_draws is None:
            self._host_draws = []
            desc = min(self.manager.plan.capture_order, key=lambda d: d.num_tokens)
            batch = self.exact_batch(desc)
            inputs = self.make(batch)
            runs: list[list[host_numbers.Call]] = []
            python: list[tuple[dict[str, Any], dict[str, Any]]] = []
            with self.preserved_state() as state0:
                tensors_only = Snapshot(state0)
                tensors_only.python = {}
                try:
                    for i in range(2):
                        if i:
                            self.restore(tensors_only)
                        before = python_values(self.module)
                        self.seed_all(self.seed)
                        with host_numbers.recording() as calls:
                            self.eager_real(clone_tree(inputs), batch, captured_path=False)
                        runs.append(calls)
                        python.append((before, python_values(self.module)))
                except Exception as exc:
                    if faults.is_sticky(exc):
                        raise
                    InternalError.raise_if_in(exc)
                    return self._host_draws
            for call, numbers in host_numbers.moved(*runs):
                if not call.kernel:
                    continue
                values = {v for _, a, b in numbers for v in (a, b)}
                kept = tuple(
                    name
                    for before, after in python
                    for name, value in after.items()
                    if before.get(name, value) != value and (value in values or before[name] in values)
                )
                self._host_draws.append(
                    causes.HostNumbers(call.op, call.site, numbers, tuple(dict.fromkeys(kept)))
                )
        return self._host_draws

    def shares_eager(self, desc: BatchDescriptor) -> bool:
        """Whether ``fresh_inputs``' eager run at the padded shape is the one ``real_batches`` would
        make next, so that it can be kept for it rather than run again: the float64 reference
        runs (``real_batches`` then holds the graph to eager at its padded shape on one batch, the
        most padded, which is the one ``fresh_inputs`` runs), and nothing can make two eager runs of
        the same inputs differ but the kernels: the module draws no random numbers, writes no
        state of its own (tensors or Python values), and ``make_inputs`` writes none either (a weight
        sync between the two checks would change what eager computes)."""
        return (
            self.reference is not None
            and self.reference.ready
            and self.given_batches is None
            and self.repeats_itself(desc)
        )

    def watch_warmup(
        self, desc: BatchDescriptor, kwargs: Mapping[str, Any], warm_up: Callable[[], Any]
    ) -> Any:
        """The manager's ``warmup_watch``: ``warm_up()``, an eager run at ``desc``'s shape on the
        capture's own inputs, made on the path a capture takes, with prints of those inputs before
        and after it and of its output kept (queued sums, read when ``replay_matches_eager``
        compares)."""
        before = tree_print(dict(kwargs))
        # On the path a capture takes, as ``eager`` runs it: the program the graph holds (and what
        # the capture will run is what the warm-up initialises).
        with as_captured(self.manager.eager_modules(desc), emulated=self.manager.backend == "emulate"):
            out = warm_up()
        self.warm_prints[desc] = (before, tree_print(dict(kwargs)), tree_print(out))
        # The Python values this graph holds: what a replay keeps when something else changes them later.
        self.python_at_capture[desc] = self.python_now()
        return out

    def python_now(self) -> dict[str, Any]:
        """The module tree's plain Python values now, by dotted name: those ``python_values`` found
        when first asked, read again (no walk of the module tree: at 8B that walk costs 7.6 ms, once
        per capture a tenth of a second)."""
        if self._python_slots is None:
            self._python_slots = []
            for dotted in python_values(self.module):
                path, _, attr = dotted.rpartition(".")
                owner = self.module.get_submodule(path) if path else self.module
                self._python_slots.append((dotted, owner.__dict__, attr))
        return {dotted: held[attr] for dotted, held, attr in self._python_slots if attr in held}

    def changed_since_capture(self, desc: BatchDescriptor) -> dict[str, tuple[Any, Any]]:
        """The module's Python values that differ now from when ``desc`` was captured, other than those
        forward itself changes on every call (``python_written``): name -> (at capture, now). Empty
        where the capture's were not kept (``replay_matches_eager`` not run)."""
        captured = self.python_at_capture.get(desc)
        if not captured:
            return {}
        now = self.python_now()
        return {
            name: (value, now[name])
            for name, value in captured.items()
            if name in now and name not in self.python_written and not same_value(value, now[name])
        }

    @contextlib.contextmanager
    def python_set(self, values: Mapping[str, Any]) -> Iterator[None]:
        """The module's Python values set to ``values`` (dotted name -> value) in the block, put back after."""
        kept = self.python_now()
        for name, value in values.items():
            _set_python_value(self.module, name, value)
        try:
            yield
        finally:
            for name in values:
                if name in kept:
                    _set_python_value(self.module, name, kept[name])

    def repeats_itself(self, desc: BatchDescriptor) -> bool:
        """Whether nothing but the kernels (and a graph's memory) can make two runs of the same inputs
        differ, one made before another: the module draws no random numbers (seen op by op), and
        neither it nor ``make_inputs`` writes state of its own (tensors or Python values). Then the
        capture's warm-up is the eager run ``replay_matches_eager`` would make, and one check's run
        can stand for another's (``shares_eager``, ``shares_replay``)."""
        return (
            not self.module_is_random(desc)
            and not self.observer.written
            and not self.python_written
            and not self.synced
        )

    def shares_replay(self, desc: BatchDescriptor) -> bool:
        """Whether ``fresh_inputs``' replay can be ``determinism``'s first, the graphs' free memory
        poisoned the first way before it: ``determinism`` runs, and between the two checks nothing
        but that memory can change what a replay of the same inputs gives (``repeats_itself``)."""
        return "determinism" in self.checks_run and self.repeats_itself(desc)

    def module_is_random(self, desc: BatchDescriptor) -> bool:
        """Whether the module draws random numbers: told by its use of a generator, op by op, in
        every forward the observer saw (the first pass, the guarded runs, every checked capture),
        never by two runs that differ, which Python state or memory nobody wrote also make."""
        return bool(self.observer.random_ops)

    # -- real batches ---------------------------------------------------
    def real_batches(self, desc: BatchDescriptor) -> list[Batch]:
        """Every real batch ``desc`` serves, one per token count, smallest first; or, when the
        caller gave batches (a trace's), those of them ``desc`` serves."""
        if self.given_batches is not None:
            if self._served is None:
                self._served = {}
                for batch in sorted(self.given_batches, key=lambda b: (b.num_tokens, b.num_reqs)):
                    # The plan's answer: a verification split by descriptor captures one graph only.
                    self._served.setdefault(self.manager.plan.dispatch_batch(batch), []).append(batch)
            return list(self._served.get(desc, ()))
        plan = self.manager.plan
        reqs_cap = self.manager.capture_reqs(desc)
        found: list[Batch] = []
        for n in plan.candidate_range(desc):
            candidate = self._batch_for(desc, n, reqs_cap)
            if candidate is not None and self.manager.dispatch_batch(candidate) == desc:
                found.append(candidate)
        return found

    def integer_ranges(self, desc: BatchDescriptor) -> dict[str, tuple[int, int]]:
        """(min, max) of each integer input in make_inputs' batch of ``desc``'s own shape (the capture
        sample): values an index may hold at that shape and stay an index (a request row below the
        descriptor's request count, say)."""
        try:
            sample = self.manager.capture_sample(desc)
        except LookupError:
            sample = self.make(self.exact_batch(desc))
        return {
            name: (int(value.min()), int(value.max()))
            for name, value in sample.items()
            if isinstance(value, torch.Tensor)
            and value.numel()
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype != torch.bool
        }

    def checked_batches(self, desc: BatchDescriptor) -> list[Batch]:
        """The real batches ``real_batches`` runs for ``desc``: its smallest (the most padding:
        where a computation that depends on the padded size shows, and a branch on the token
        count is crossed) and its largest. Each costs an eager forward at a shape nothing else
        ran, so a 67-size plan checks 134 batches, not every token count up to 512; a trace's
        batches (``batches=``) are all run when verification is exhaustive.

        With the float64 reference (``padded_size``) the smallest alone: the graph is held there to
        eager at its own shape, and the largest, a batch of the graph's own size, would be what
        ``fresh_inputs`` already holds (fresh inputs at that shape), while the question across
        shapes is the reference's."""
        batches = self.real_batches(desc)
        if self.given_batches is not None and self.exhaustive:
            return batches
        if self.reference is not None and self.reference.ready:
            return batches[:1]
        return batches if len(batches) <= 2 else [batches[0], batches[-1]]

    def _batch_for(self, desc: BatchDescriptor, n: int, reqs_cap: int) -> Batch | None:
        loras = desc.num_active_loras
        if desc.uniform_token_count is not None:
            u = desc.uniform_token_count
            if n % u:
                return None
            return Batch(
                num_tokens=n,
                num_reqs=n // u,
                uniform_token_count=u,
                max_query_len=u,
                num_active_loras=loras,
                num_ubatches=desc.num_ubatches,
            )
        if desc.max_query_len is not None:
            # Varlen decode: as many requests as fit, so no request exceeds q.
            r = min(n, reqs_cap)
            longest = -(-n // r)
            if longest > desc.max_query_len:
                return None
            return Batch(
                num_tokens=n,
                num_reqs=r,
                max_query_len=longest,
                num_active_loras=loras,
                num_ubatches=desc.num_ubatches,
            )
        # Mixed batches: requests of about two tokens, like a prefill mix.
        r = min(reqs_cap, max(1, (n + 1) // 2), self.manager.config.max_num_reqs)
        return Batch(num_tokens=n, num_reqs=r, num_active_loras=loras, num_ubatches=desc.num_ubatches)

    def padded_batch(self, desc: BatchDescriptor) -> Batch | None:
        """The smallest real batch of ``desc`` (the most padding), or None."""
        batches = self.real_batches(desc)
        return batches[0] if batches else None

    def exact_batch(self, desc: BatchDescriptor) -> Batch:
        """A real batch of exactly the descriptor's shape (no padding)."""
        return exact_batch(self.manager.plan, desc)

    def make(self, batch: Batch) -> dict[str, Any]:
        return call_make_inputs(self.manager.make_inputs, batch.num_tokens, batch.num_reqs)

    # -- running ----------------------------------------------------------
    def load(self, desc: BatchDescriptor, inputs: Mapping[str, Any], batch: Batch) -> dict[str, Any]:
        """Load a real batch into the static buffers; return a copy of the padded inputs: what a
        graph of ``desc`` reads, its Python values that change with the batch as its capture
        gave them (make_inputs at ``desc``'s own shape, for a size that was not captured)."""
        self.manager.load_inputs(desc, inputs, batch)
        reqs = self.manager.capture_reqs(desc)
        padded: dict[str, Any] = clone_tree(self.manager.forward_inputs(desc.num_tokens, reqs))
        state = self.manager.state
        if state.value_names and (desc.num_tokens, reqs) not in state.values_at:
            if desc not in self._values_at:
                made = self.make(Batch(num_tokens=desc.num_tokens, num_reqs=reqs))
                self._values_at[desc] = {name: made[name] for name in state.value_names}
            padded.update(self._values_at[desc])
        return padded

    def values_per_shape(self, desc: BatchDescriptor, held: Mapping[str, tuple[Any, Any]]) -> bool:
        """Whether make_inputs gives ``desc``'s shape the Python values its graph holds (``held``: name
        -> (held, the batch's)) again: values set by the shape alone (a max_seq_len), not drawn anew
        for every batch (a temperature). Asked where a held value decided a result."""
        made = self.make(Batch(num_tokens=desc.num_tokens, num_reqs=self.manager.capture_reqs(desc)))
        return all(same_value(made.get(name), at) for name, (at, _) in held.items())

    def held_values(self, padded: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """The Python inputs that change with the batch whose value in ``padded`` (what a graph holds
        from its capture) is not the batch's own (``inputs``): name -> (at capture, in the batch)."""
        return {
            name: (padded[name], inputs[name])
            for name in self.manager.state.value_names
            if name in padded and name in inputs and not same_value(padded[name], inputs[name])
        }

    def replay(self, desc: BatchDescriptor, *, wait: bool = True) -> Any:
        """Replay on whatever the static buffers hold; a copy of the full output. ``wait=False``:
        queued, not waited for (the caller's phase waits)."""
        with self.phase("replay", desc):
            out = self.manager.replay(desc)
            if wait:
                self.manager.synchronize()
            return clone_tree(out)

    def phase(self, name: str, desc: Any) -> Any:
        """``faults.phase`` for this module: where a lost CUDA context showed."""
        return faults.phase(name, type(self.module).__name__, desc, self.manager.device)

    def eager(
        self,
        kwargs: Mapping[str, Any],
        desc: BatchDescriptor | None = None,
        *,
        captured_path: bool = True,
        served_by: BatchDescriptor | None = None,
    ) -> Any:
        """Run the module eagerly on exactly these keyword inputs.

        ``captured_path``: on the path a capture takes (``as_captured``), the
        program the graph holds, which bit-for-bit comparisons need; the eager
        pieces of the descriptor that serves the batch (``served_by``, else
        ``desc``) answer as they do on replay.
        """
        marker = desc or BatchDescriptor(mode=GraphMode.NONE, num_tokens=0)
        where = served_by or desc
        if not captured_path:
            with self.phase("eager", where), torch.no_grad(), running(marker):
                return clone_tree(self.module(**dict(kwargs)))
        graph = served_by or desc
        exempt = self.manager.eager_modules(graph) if graph is not None else []
        with (
            self.phase("eager", where),
            torch.no_grad(),
            running(marker),
            as_captured(exempt, emulated=self.manager.backend == "emulate"),
        ):
            return clone_tree(self.module(**dict(kwargs)))

    def eager_real(self, inputs: Mapping[str, Any], batch: Batch, *, captured_path: bool = True) -> Any:
        """Eager on an unpadded real batch, with an all-False mask if the module takes one.

        ``captured_path=False`` runs it as users run the module without graphs
        (``real_batches`` compares with that, within tolerance)."""
        kwargs = self.manager.eager_kwargs(inputs, batch.num_tokens)
        desc = BatchDescriptor(
            mode=GraphMode.NONE,
            num_tokens=batch.num_tokens,
            num_reqs=batch.num_reqs,
            num_active_loras=self.manager.plan.effective_loras(batch.num_active_loras),
        )
        return self.eager(
            kwargs, desc, captured_path=captured_path, served_by=self.manager.dispatch_batch(batch)
        )

    def eager_padded(self, desc: BatchDescriptor, inputs: Mapping[str, Any], batch: Batch) -> Any:
        """Eager at ``desc``'s padded shape on the batch as the graph sees it (padding
        included, on the path a capture takes), cut to the real rows as the
        graph's output is: the same program as the graph, run eagerly."""
        padded = self.load(desc, inputs, batch)
        return self.manager.cut_output(desc, self.eager(padded, desc), batch)

    def rows_ndim(self, desc: BatchDescriptor) -> list[int]:
        """Per output leaf of ``desc``'s graph, how many leading dimensions make its rows."""
        return [max(d for d, _ in dims) + 1 if dims else 0 for dims in self.manager.output_dims(desc)]

    def run(self, inputs: Mapping[str, Any], batch: Batch) -> Any:
        """The user's path: ``GraphManager.run_batch``."""
        self.real_batches_run += 1
        desc = self.manager.dispatch_batch(batch)
        with self.phase("replay" if desc.is_graphed else "eager fallback", desc):
            return self.manager.run_batch(inputs, batch)
