"""The manager's capture part: making the graphs, and dropping them.

It owns the capture sequence (``capture``: one pool, largest graph first, the
cyclic garbage collector off), staging each descriptor's sample into the
static buffers, the capture guard's use during capture, the diagnosis of a
failed capture (which op, which submodule, which eager piece), a failed
descriptor's record under ``keep_going`` (``capture_failures``), learning how
each output is cut to a batch's real rows (the output-row probe and its
settling across descriptors), and ``release``.

It hands the runtime part one ``Entry`` per captured descriptor, in
``_entries``, and clears the runtime's hot-path cache whenever the graphs
change. It stages samples through the runtime's own copy-in (``batch_of``,
``load_inputs``, ``forward_inputs``), so a graph is captured on exactly the
buffers it will replay from.
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from .. import faults
from ..backends.base import CapturedGraph
from ..context import running
from ..errors import CaptureError, InternalError
from ..guard import CaptureGuard, Violation, find_violations, host_methods_watched
from ..observe import MODULE_INTERNALS
from ..plan import BatchDescriptor, GraphMode
from ..progress import over, progress_label
from . import estimate, output_rows
from .pieces import EagerPieceError, capture_in_pieces, piece_of, resolve_eager_submodules
from .runtime import Runtime
from .staging import Staging
from .types import Entry

if TYPE_CHECKING:
    from .state import ManagerState

__all__ = ["Capture"]

# What every nn.Module keeps in its __dict__ (hook tables, the parameter and
# buffer dicts, ...): never user state, so never walked.


def _tensor_holders(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, list[str]]]:
    """Each module with the names of its own attributes (not nn.Module's
    bookkeeping): read once a capture sequence, so that each graph's walk
    over them is short."""
    return [(sub, [k for k in sub.__dict__ if k not in MODULE_INTERNALS]) for sub in modules]


# Attribute values that hold no tensor, told by their exact type alone.
_NO_TENSOR_TYPES = frozenset({int, float, bool, str, type(None)})


def _tensors_of(holders: list[tuple[torch.nn.Module, list[str]]]) -> list[Any]:
    """Every tensor the modules hold now: parameters, buffers and tensor attributes.

    Walked once a graph, so written for speed: empty tables and plain
    scalars are passed over without a call."""
    found: list[Any] = []
    extend = found.extend
    append = found.append
    tensor = torch.Tensor
    scalars = _NO_TENSOR_TYPES
    for sub, names in holders:
        params = sub._parameters
        if params:
            extend(params.values())
        buffers = sub._buffers
        if buffers:
            extend(buffers.values())
        if not names:
            continue
        attrs = sub.__dict__
        for name in names:
            value = attrs.get(name)
            if type(value) in scalars:
                continue
            if isinstance(value, tensor):
                append(value)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    if isinstance(v, tensor):
                        append(v)
            elif isinstance(value, dict):
                for v in value.values():
                    if isinstance(v, tensor):
                        append(v)
    return found


class _Uncapturable(Exception):
    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation


def _raise_violation(violation: Violation) -> None:
    raise _Uncapturable(violation)


def _forget_frames(exc: BaseException) -> None:
    """Drop the local variables of the frames ``exc`` and its causes and
    contexts went through: a failure that is kept (in ``capture_failures``,
    by pytest for its report) must not keep the failed capture's tensors
    (graph-pool memory on a GPU) alive. Frames still running are left as
    they are. The tracebacks still print."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


@dataclass
class _Staged:
    """A descriptor's sample after its warm-up: what ``make_inputs`` gave (None
    once it is in the static buffers, unless the capture loads it again), and
    the forward's keyword inputs."""

    sample: dict[str, Any] | None
    kwargs: dict[str, Any]


class Capture:
    """The capture sequence, its diagnosis and output-row learning (see the module's docstring).

    It reads and writes the manager's state, and stages samples through the runtime's own
    copy-in, so that a graph is captured on exactly the buffers it will replay from."""

    def __init__(self, state: ManagerState, runtime: Runtime) -> None:
        self.state = state
        self.runtime = runtime
        #: make_inputs checked and each descriptor's sample staged (staging.py).
        self.staging = Staging(state, runtime)

    # -- what an estimate reads besides the state (estimate.Sizing) ---------
    def capture_reqs(self, desc: BatchDescriptor) -> int:
        return self.runtime.capture_reqs(desc)

    def eager_kwargs(self, inputs: Mapping[str, Any], num_tokens: int) -> dict[str, Any]:
        return self.runtime.eager_kwargs(inputs, num_tokens)

    @property
    def make_inputs(self) -> Callable[[int, int], Mapping[str, Any]]:
        return self.staging.make_inputs

    # -- the sequence ---------------------------------------------------
    @property
    def not_known_ops(self) -> dict[str, str]:
        """Ops the emulator's guard met that the capturability table does not cover (op -> the
        submodule that ran it first): whether a CUDA capture holds them is not known."""
        return dict(self.state.tracker.not_known)

    def capture(
        self, descriptors: Iterable[BatchDescriptor] | None = None, *, keep_going: bool = False
    ) -> None:
        """Capture every descriptor of the plan (or those given), largest first.

        Each descriptor is warmed up eagerly, then captured on the static
        buffers into one pool shared by all graphs. The fast capture (the
        default) warms every descriptor up first and then captures them all,
        the loop PyTorch's docs write; the checked capture warms each up just
        before its own capture, vLLM's order, which verification reproduces. On failure every graph is
        released, ``CaptureError`` is raised, and the manager runs batches
        eagerly until a later ``capture()`` succeeds.

        ``keep_going=True``: a descriptor whose capture fails is that
        descriptor's failure alone. It gets no graph (what its capture made is
        dropped), its ``CaptureError`` is kept in ``capture_failures``, the
        others are still captured, and capture() returns; batches it would
        serve run eagerly. A failure that is no one descriptor's (the memory
        estimate refusing the sequence, an interrupt) still releases every
        graph and raises.
        """
        order = list(self.state.plan.capture_order if descriptors is None else descriptors)
        known = set(self.state.plan.descriptors)
        unknown = [d for d in order if d not in known]
        if unknown:
            raise ValueError(f"descriptor {unknown[0]} is not in this manager's plan")
        if self.state.entries:
            self.release()
        self.state.hot.clear()
        self.state.capture_failures = {}
        self.state.guarded_every_op = set()
        # From here on run() may run eagerly (a failed or refused capture);
        # before any capture() it is a mistake (see run_batch).
        self.state.capture_called = True
        if self.state.backend.name == "cuda":
            faults.watch_out_of_memory()  # an out-of-memory capture then says what it asked for
        # The fast CUDA capture measures the largest graph's footprint during
        # its own warm-up (see _warm_up) and refuses there, before any capture;
        # every other capture runs a forward of its own for the estimate first.
        measured = self.state.backend.name == "cuda" and not self.state.backend.checked
        if not measured:
            estimate.check_capture_memory(self, order)  # refuses what will not fit
        started = time.perf_counter()
        self.state.tracker.refresh()
        self.state.observer.refresh()  # parameters or buffers replaced since the last capture are found again
        self.state.holders = _tensor_holders(list(self.state.module.modules()))
        self.state.walked = None
        # Submodules replaced since the last capture are found again.
        self.state.eager_pieces = resolve_eager_submodules(self.state.module, self.state.eager_spec)
        # No cyclic garbage collection while the sequence runs: a collected
        # graph of another manager, captured on a stream PyTorch's stream pool
        # also handed to this one, would drop that stream's cuBLAS workspace
        # in the middle of it (pytorch#193402).
        collecting = gc.isenabled()
        gc.disable()
        staged: dict[BatchDescriptor, _Staged | Exception] = {}
        try:
            self.state.backend.begin()
            if self.state.probed_rows is None:
                # On the warm-up stream, after begin(): the blocks its forwards
                # free stay cached there for the warm-ups to reuse.
                self.state.probed_rows = self.state.backend.warmup(
                    lambda: output_rows.probe(self.state, self.runtime.eager_kwargs)
                )
            with host_methods_watched():  # once for the sequence: see its docstring
                # The fast capture warms every shape up first, then captures
                # them all; the checked capture (verification) warms each up
                # just before its capture, as vLLM's capture loop does, so a
                # warm-up that leaves state for the capture shows as it
                # would in such an engine (a tensor memoised by identity).
                staged = (
                    {}
                    if self.state.backend.checked
                    else self._warm_up(order, measure=measured and estimate.memory_check_enabled())
                )
                label = progress_label(type(self.state.module).__name__, self.state.backend.name)
                for desc in over(order, self.state.progress, label=label, stage="capture", unit="graph"):
                    try:
                        self._capture_one(desc, staged.get(desc))
                    except CaptureError as exc:
                        _forget_frames(exc)
                        # A lost CUDA context is no one descriptor's failure: nothing after it can run.
                        if not keep_going or faults.is_sticky(exc):
                            raise
                        self.state.capture_failures[desc] = exc
            self.state.backend.finish()
        except BaseException as exc:
            # The warm-ups' failures and their frames hold device memory too.
            for kept in staged.values():
                if isinstance(kept, BaseException):
                    _forget_frames(kept)
            _forget_frames(exc)
            if faults.is_sticky(exc):
                with contextlib.suppress(Exception):  # every CUDA call fails now: the original error says why
                    self.release()
            else:
                self.release()
            raise
        finally:
            if collecting:
                gc.enable()
        if self.state.probed_rows is None:
            output_rows.settle(self.state.entries)
        self.state.capture_seconds = time.perf_counter() - started

    def release(self) -> None:
        """Drop every graph and the pool. Static buffers stay; capture() again works."""
        self.state.entries.clear()
        self.state.hot.clear()
        self.state.backend.release()

    # -- warm-up ----------------------------------------------------------
    def _warm_up(
        self, order: list[BatchDescriptor], *, measure: bool = False
    ) -> dict[BatchDescriptor, _Staged | Exception]:
        """Stage every descriptor's sample and run its forward once, back to back, in one warm-up.

        Lazy initialisation (cuBLAS handles, workspaces) must happen before a
        capture, not inside it. One warm-up pass over every shape, then the
        captures, is the loop PyTorch's docs write: the forwards run back to
        back on the side stream, and each descriptor's ``make_inputs`` runs
        once. A forward that fails here
        is kept as its descriptor's failure, told by ``_capture_one``; a bad
        ``make_inputs`` (the caller's mistake) raises at once.

        ``measure`` (the fast CUDA capture, memory check on): the largest
        descriptor's warm-up is also its memory footprint, counted as it runs
        (``WarmupMeter``), and a sequence
        that will not fit is refused once the warm-up ends, before any
        capture: what ``check_capture_memory`` tells, without a forward of
        its own.
        """
        staged: dict[BatchDescriptor, _Staged | Exception] = {}
        largest = max(order, key=lambda d: d.num_tokens) if measure and order else None
        meter = estimate.WarmupMeter(self.state.device) if largest is not None else None

        def warm() -> None:
            for desc in order:
                sample, kwargs = self.staging.stage_sample(desc)
                try:
                    with self._phase("warm-up", desc), running(desc):
                        if desc is largest and meter is not None:
                            meter.run(self.state.module, kwargs)
                        else:
                            self.state.module(**kwargs)
                except InternalError:
                    raise  # the harness's own failure, never the module's warm-up
                except Exception as exc:
                    staged[desc] = exc
                else:
                    # The fast capture keeps no sample past its staging (each
                    # would hold device memory of its size, and allocating them
                    # all costs the driver calls a warm-up on a warm cache
                    # does not), except where the capture must load it again.
                    staged[desc] = _Staged(sample if self._reloads(desc) else None, kwargs)

        self.state.backend.warmup(warm)
        if largest is not None and meter is not None and isinstance(staged.get(largest), _Staged):

            def remeasure() -> Any:
                # Only when the allocator's reading would refuse: the largest
                # warm-up again, under the storage counter, on its own sample.
                return self.state.backend.warmup(
                    lambda: estimate.measure_forward(
                        self.state.module, self.staging.stage_sample(largest)[1], marker=largest
                    )
                )

            estimate.check_measured_memory(self, order, largest, meter, remeasure)
        return staged

    def _reloads(self, desc: BatchDescriptor) -> bool:
        """Whether ``desc``'s capture runs the forward on the values in the static
        buffers (the emulator; eager pieces between PIECEWISE segments), so that its
        sample must be loaded again after later samples' staging overwrote it. A
        CUDA capture records addresses, not values."""
        return self.state.backend.capture_executes or bool(
            self.state.eager_pieces and desc.mode is GraphMode.PIECEWISE
        )

    # -- one descriptor -------------------------------------------------
    def _capture_one(self, desc: BatchDescriptor, staged: _Staged | Exception | None) -> None:
        """Capture ``desc``: warmed up here (``staged`` None), or by ``_warm_up`` (its
        sample and inputs, or the exception its warm-up raised, told as a failed capture)."""
        reqs = self.runtime.capture_reqs(desc)
        sample: dict[str, Any] | None
        if isinstance(staged, _Staged):
            sample, kwargs = staged.sample, staged.kwargs
        else:
            sample, kwargs = self.staging.stage_sample(desc)

        def forward() -> Any:
            with running(desc):
                return self.state.module(**kwargs)

        self.state.tracker.failed_path = ""
        holders = self.state.holders
        # The checked CUDA capture holds its sequence's first graph to the guard's rules op by op;
        # each later one still goes through the guard's dispatch mode (every op observed, what it
        # reads kept alive, the host methods watched) but leaves what a graph cannot hold to the
        # device, which fails the capture on it: the op is then named by its failure and by the
        # eager run under the full guard below. At real size the rules on every op of every capture
        # cost more than the captures themselves (issue #48).
        light = self._light()
        guard = CaptureGuard(
            self.state.tracker,
            self.state.device,
            on_violation=_raise_violation,
            observer=self.state.observer,
            rules=not light,
        )
        if not light and (self.state.backend.checked or self.state.backend.name != "cuda"):
            self.state.guarded_every_op.add(desc)  # the fast CUDA capture has no guard on its ops
        try:
            try:
                # Capture runs as fast as the module allows: no hooks on
                # submodules. Only a failure pays for naming where it came
                # from, by an eager rerun under the tracker.
                if staged is None:
                    with self._phase("warm-up", desc):
                        watch = self.state.warmup_watch
                        if watch is None:
                            self.state.backend.warmup(forward)
                        else:
                            watch(desc, kwargs, partial(self.state.backend.warmup, forward))
                elif isinstance(staged, Exception):
                    raise staged
                elif sample is not None and self._reloads(desc):
                    self.runtime.load_inputs(desc, sample, self.runtime.batch_of(sample, num_reqs=reqs))
                if staged is None or self._reloads(desc):
                    held = _tensors_of(holders)
                else:
                    # The fast capture's whole graphs: every warm-up ran before
                    # the first capture, and nothing but these captures runs the
                    # module since, so one walk after the warm-ups finds every
                    # tensor bound before any of them. (A capture that rebinds
                    # module state binds pool memory, which replay never
                    # rebinds: the state frozen at capture that the checks name.)
                    if self.state.walked is None:
                        self.state.walked = _tensors_of(holders)
                    held = self.state.walked
                with self._phase("capture", desc):
                    graph = self._record(desc, forward, guard)
            except Exception as exc:
                if faults.is_sticky(exc):
                    raise  # the context is gone: no diagnosis can run, and none is needed
                self.state.walked = None  # the diagnosis below runs the module eagerly
                found = self._diagnose(desc, forward)
                if found is not None:
                    raise _Uncapturable(found) from None
                if isinstance(exc, _Uncapturable):
                    # The rerun did not meet the op again (it came from a
                    # capture-only branch): name what the capture saw.
                    raise _Uncapturable(
                        Violation(
                            exc.violation.op,
                            exc.violation.reason,
                            self.state.tracker.failed_path,
                            exc.violation.location,
                        )
                    ) from None
                raise
            # Tensors bound before capture are what the graph reads; those bound
            # during capture live in its own pool.
            graph.hold(held)
        except _Uncapturable as exc:
            v = exc.violation
            raise CaptureError(
                f"cannot capture {v.describe()} while capturing {desc} on the {self.state.backend.name} "
                f"backend. A graph cannot read device values on the host or size outputs "
                f"from data: keep shapes static and values on the device{self._piece_hint(desc, v.module_path)}",
                op=v.op,
                reason=v.reason,
                module_path=v.module_path,
                descriptor=desc,
                backend=self.state.backend.name,
            ) from None
        except CaptureError:
            raise
        except Exception as exc:
            InternalError.raise_if_in(
                exc
            )  # the harness's own failure: said as one, not as the module's capture
            where = self.state.tracker.failed_path or (exc.path if isinstance(exc, EagerPieceError) else "")
            raise CaptureError(
                f"capture of {desc} failed on the {self.state.backend.name} backend"
                f"{f' in submodule {where!r}' if where else ''}: {faults.described(exc, self.state.device)}"
                f"{self._piece_hint(desc, where)}",
                module_path=where,
                descriptor=desc,
                backend=self.state.backend.name,
            ) from exc
        # Only the checked capture keeps the sample (capture_sample, which the
        # checks replay on); the fast capture drops it (see _warm_up).
        self.state.entries[desc] = Entry(
            graph,
            reqs,
            output_rows.out_dims(graph.output, desc.num_tokens, reqs, self.state.probed_rows),
            sample if self.state.backend.checked else None,
        )

    def _light(self) -> bool:
        """Whether the next capture is one of the checked CUDA sequence's later ones, whose ops the
        guard observes without its rules (see ``_capture_one``): not the sequence's first, nor on
        the emulator (whose capture holds every op to the rules)."""
        backend = self.state.backend
        return backend.name == "cuda" and backend.checked and bool(self.state.guarded_every_op)

    def _phase(self, name: str, desc: BatchDescriptor) -> Any:
        return faults.phase(name, type(self.state.module).__name__, desc, self.state.device)

    def _diagnose(self, desc: BatchDescriptor, forward: Callable[[], Any]) -> Violation | None:
        """After a failed capture, run the forward eagerly under the full guard:
        the first op a graph cannot hold, named before torch fails on it, or
        None. When the forward fails eagerly too, the tracker's ``failed_path``
        names the submodule that was running."""
        try:
            found: list[Violation] = self.state.backend.warmup(
                lambda: find_violations(
                    forward,
                    self.state.tracker,
                    self.state.device,
                    exempt=self.eager_modules(desc),
                    first_only=True,
                )
            )
        except Exception:
            return None  # no op to name: the original error stands
        return found[0] if found else None

    def _record(
        self, desc: BatchDescriptor, forward: Callable[[], Any], guard: CaptureGuard
    ) -> CapturedGraph:
        """Capture ``desc``'s forward, whole or in pieces.

        The backend keeps the allocator's cache through a sequence (see
        CudaBackend.begin), and an allocation inside a capture cannot hand
        cached blocks back to the driver. So a capture that runs out of
        memory is tried once more after the cache is handed back, which is
        where torch.cuda.graph would have started it.
        """
        for last in (False, True):
            try:
                if self.state.eager_pieces and desc.mode is GraphMode.PIECEWISE:
                    return capture_in_pieces(
                        self.state.backend, forward, guard, self.state.eager_pieces, desc
                    )
                return self.state.backend.capture(forward, guard)
            except torch.OutOfMemoryError:
                # Retried outside this handler, once the traceback (and the
                # graph memory its frames hold) is gone.
                if last or not self.state.backend.trim():
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def eager_modules(self, desc: BatchDescriptor) -> list[torch.nn.Module]:
        """The submodules ``desc``'s graph runs eagerly: the eager pieces in a
        PIECEWISE graph, none in a FULL one. Their ops are not the graph's."""
        return [m for _, m in self.state.eager_pieces] if desc.mode is GraphMode.PIECEWISE else []

    def _piece_hint(self, desc: BatchDescriptor, path: str) -> str:
        # An eager piece runs eagerly only in PIECEWISE graphs; a FULL graph
        # holds the whole forward, pieces included.
        if desc.mode is GraphMode.PIECEWISE:
            return ""
        piece = piece_of(path, [p for p, _ in self.state.eager_pieces])
        if piece is not None:
            return (
                f". '{piece}' is an eager piece, but only PIECEWISE graphs run it eagerly: a FULL "
                f"graph captures the whole forward. Make it capturable, or use mode='PIECEWISE' "
                f"(no FULL graphs)"
            )
        return ""
