"""What every check needs: the manager, real batches, state snapshots, eager runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import faults
from ..context import running
from ..errors import InternalError
from ..guard import as_captured, host_numbers
from ..manager import GraphManager
from ..manager.layout import call_make_inputs
from ..observe import poisoned
from ..options import VerifyOptions
from ..plan import Batch, BatchDescriptor, GraphMode
from ..plan.properties import exact_batch
from . import causes
from .causes import HostNumbers
from .compare import TreePrint, first_difference, tree_print
from .module_state import ModuleState, Snapshot, clone_tree, python_values
from .module_state import ScratchRegion as ScratchRegion
from .python_held import PythonHeld
from .reference import Reference

# ModuleState, Snapshot, clone_tree, python_values and ScratchRegion live in module_state.py;
# imported from here as before.
__all__ = ["ModuleState", "Snapshot", "VerifyContext", "clone_tree", "python_values"]


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
        self._host_draws: list[HostNumbers] | None = None
        #: The Python values graphs hold from their capture (the module tree's attributes, make_inputs'
        #: Python inputs that change with the batch).
        self.python = PythonHeld(manager, self)

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
        self.python.captured(desc)
        return out

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
            padded.update(self.python.inputs_at(desc))
        return padded

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
