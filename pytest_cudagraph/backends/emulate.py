"""A CPU emulation of CUDA-graph semantics.

Capture runs the forward once under a ``TorchDispatchMode`` that records every
ATen op with the very tensors it read and wrote. Replay re-runs the recorded
ops, writing each result into the tensor the capture produced. That gives the
emulated graph the properties that make real graphs bite:

- Python runs only at capture: control flow, Python scalars and attributes
  read by the forward are frozen into the recording.
- Tensors created during capture are the graph's memory: the forward's
  outputs are those tensors, so a later replay overwrites them.
- Inputs are read from the storages captured, so data must be copied into the
  static buffers; rebinding a Python attribute to a new tensor is not seen.
- In-place updates of buffers (a KV cache, a counter) happen on every replay.
- Random ops draw fresh values on every replay, as with graph-safe RNG.

Graph memory is one pool per backend, shared by every graph captured into it,
as CUDA graphs of one manager share a private pool of the caching allocator.
While the forward runs, tensors are ordinary CPU memory. When the capture
ends, every storage it created gets a region of the pool, placed as a caching
allocator would have placed it: a storage occupies its region from the step
that creates it to the last step that reads or writes it, and later storages
(of this capture or of later ones) reuse the region after that. Storages that
something still holds when the capture ends (the output, a tensor the module
stored on itself) keep their region until the last holder lets go. The
recorded steps and every held tensor are then moved into the pool, so replay
writes pool memory, and graphs overwrite each other's dead intermediates
exactly where CUDA graphs sharing a pool would.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..guard import SPARSE_REASON, CaptureGuard, call_site, not_strided
from ..launches import (
    ALLOCATIONS,
    Launch,
    Unwritten,
    no_dispatch_modes,
    relaunch,
    storage_bytes,
    triton_launches,
)
from ..observe import DispatchMode, data_read, written_tensors
from .base import POISON_BYTES, Backend, CapturedGraph, OpenCapture
from .emulate_pool import _USE_COUNT, _Held, _Pool, _Request, _round, _use_count
from .emulate_pool import BLOCK as BLOCK  # where it was: tests read the pool's block size here

__all__ = ["EmulateBackend", "EmulatedGraph"]

aten = torch.ops.aten


class Unrecordable(RuntimeError):
    """The forward wrote memory where the emulator cannot see it (a compiled extension called directly):
    no step it records would redo that write on replay."""


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl itself, not its address: an out= op may resize a storage
    # (and so move its data) in the middle of the capture.
    return int(t.untyped_storage()._cdata)


# Ops that change a tensor's shape, strides or offset in place. On CUDA they run
# no kernel: the capture records the kernels before them with the tensor as it
# was, and a replay does not run them again. (resize_ that grows a storage
# allocates; here the storage's region is placed at its final size, so the
# steps before it write where the grown tensor reads.)
_METADATA_IN_PLACE = frozenset(
    getattr(aten, name)
    for name in (
        "transpose_",
        "t_",
        "swapdims_",
        "swapaxes_",
        "squeeze_",
        "unsqueeze_",
        "as_strided_",
        "resize_",
        "resize_as_",
        "detach_",
    )
    if hasattr(aten, name)
)


def _mutates(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True  # unknown: re-run it rather than risk skipping a write
    if _is_collective(func):
        return True  # c10d's in-place collectives write their inputs without saying so in the schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


#: The namespaces of torch.distributed's ops: ``dist.all_reduce`` and the rest
#: reach the dispatcher as ``c10d::allreduce_`` (in place, returning a Work
#: to wait on), functional collectives as ``_c10d_functional::all_reduce``
#: (a new tensor, waited on by ``wait_tensor``).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


def _is_collective(func: Any) -> bool:
    return getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES


#: Set by the distributed harness in a rank's process: a context manager
#: around each collective the replay issues (its op and arguments), which says
#: where a rank waits and holds the collective to the peers'; it gives whether
#: the rank answers the collective alone (a failure's diagnosis), unissued.
collective_watch: (
    Callable[[str, tuple[Any, ...], dict[str, Any]], contextlib.AbstractContextManager[bool]] | None
) = None
#: Set by the distributed harness in a rank's process: called as each replay begins.
replay_started: Callable[[], None] | None = None


def _alone(func: Any, args: tuple[Any, ...]) -> Any:
    """A collective's result on a rank alone: an in-place one (``c10d::allreduce_``) leaves its
    tensors as they are, a functional one returns a copy of its input."""
    if getattr(func, "namespace", None) == "c10d":
        return (args[0], None) if args else None
    first = args[0] if args else None
    return first.clone() if isinstance(first, torch.Tensor) else first


def _waited(func: Any, result: Any) -> Any:
    """A collective's result once it has completed: replay issues it again as
    the capture did, and what the capture's caller waited on (the Work of an
    in-place collective, the tensor of a functional one) is waited on here."""
    if getattr(func, "namespace", None) == "c10d":
        for item in tree_flatten(result)[0]:
            wait = getattr(item, "wait", None)
            if wait is not None and not isinstance(item, torch.Tensor):
                wait()
        return result
    if getattr(func, "_opname", None) != "wait_tensor":
        return tree_map_only(torch.Tensor, torch.ops._c10d_functional.wait_tensor, result)
    return result


def _map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to its tensors (or slots): as an ATen argument, or in one list of them."""
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [fn(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return fn(value)


class _Step:
    """One recorded op and how to redo it."""

    __slots__ = ("args", "func", "kwargs", "targets")

    def __init__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], targets: list[tuple[int, Any]]
    ):
        self.func = func
        self.args = args
        self.kwargs = kwargs
        # (position in the flattened result, captured tensor to write it into)
        self.targets = targets

    def __call__(self) -> None:
        if _is_collective(self.func):
            watch = collective_watch
            with (
                watch(str(self.func), self.args, self.kwargs)
                if watch is not None
                else contextlib.nullcontext(False)
            ) as alone:
                result = (
                    _alone(self.func, self.args)
                    if alone
                    else _waited(self.func, self.func(*self.args, **self.kwargs))
                )
        else:
            result = self.func(*self.args, **self.kwargs)
        if not self.targets:
            return
        if isinstance(result, torch.Tensor):
            self.targets[0][1].copy_(result)
            return
        flat, _ = tree_flatten(result)
        for index, target in self.targets:
            target.copy_(flat[index])

    def swap(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to every tensor (or slot) the step reads or writes."""
        self.args = tuple(_map_tensors(a, fn) for a in self.args)
        self.kwargs = {k: _map_tensors(v, fn) for k, v in self.kwargs.items()}
        self.targets = [(i, fn(t)) for i, t in self.targets]


def _unrecordable(op: str, what: str, site: str) -> str:
    return (
        f"launched outside torch: memory that {op} handed out was written by something torch's "
        f"dispatcher does not see (a compiled extension or a kernel called directly) {what}"
        f"{f' at {site}' if site else ''}. The emulator records ATen ops and Triton launches, so it cannot "
        "replay that write: verify this module on the cuda backend, or launch the kernel through "
        "triton.jit or as a torch.library.custom_op, which the emulator records"
    )


class _Slot:
    """Where a step held a tensor of the capture's own memory, until the pool gives it a place."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True)
class _View:
    """A tensor of the capture as a step saw it, without holding it: rebuilt on pool memory."""

    key: int  # its storage
    offset: int  # bytes into the storage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    conj: bool
    neg: bool

    @classmethod
    def of(cls, t: torch.Tensor, key: int) -> _View:
        return cls(
            key,
            int(t.storage_offset()) * t.element_size(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
            t.is_conj(),
            t.is_neg(),
        )

    def on(self, storage: torch.UntypedStorage, base: int) -> torch.Tensor:
        offset = (base + self.offset) // self.dtype.itemsize
        t = torch.empty(0, dtype=self.dtype).set_(storage, offset, self.size, self.stride)
        # The bits a lazy view sets: a step that read ``z.conj()`` must read it again.
        if self.conj:
            t = t.conj()
        if self.neg:
            t = t._neg_view()
        return t


class _Recorder(DispatchMode):
    def __init__(self, guard: CaptureGuard) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.guard = guard
        self.steps: list[_Step] = []
        #: Storages made during capture, held so that none is freed (and its
        #: identity reused) before the capture ends.
        self.created: dict[int, torch.UntypedStorage] = {}
        #: The step before which each was made.
        self.birth: dict[int, int] = {}
        #: Every tensor object seen on one of them, views included, by id: the
        #: objects still alive at the end are moved into the pool in place.
        self.known: dict[int, weakref.ref[torch.Tensor]] = {}
        #: Memory allocations handed out that no op has written yet: one read with other bytes than
        #: the marker was written where no op shows it (see launches.Unwritten).
        self.unwritten = Unwritten()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.guard.check_dispatch(func, args, kwargs)
        if (
            getattr(func, "overloadpacket", None) in _METADATA_IN_PLACE
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            self._freeze(args[0])
            out = func(*args, **kwargs)
            self._know(args[0])
            return out
        if self.unwritten.fresh:
            self._check_reads(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.guard.observer is not None:
            self.guard.observer.after(func, out)
        layout = not_strided(tree_flatten(out)[0])
        if layout is not None:
            self.guard.report(str(func), SPARSE_REASON.format(layout=layout))
        if func in ALLOCATIONS:
            # Allocation without a kernel: a real graph does not re-run it on replay, and re-running it
            # here would only produce garbage to copy.
            self._note_created(out)
            self.unwritten.allocated(func, out)
            return out
        if self.unwritten.fresh:
            for t in written_tensors(func, args, kwargs):
                self.unwritten.written(t)
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {_storage_key(t) for t in flat_in if isinstance(t, torch.Tensor)}
        flat_out, _ = tree_flatten(out)
        fresh = []
        for i, t in enumerate(flat_out):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key in inputs:
                if key in self.created:
                    self._know(t)  # a view of the capture's memory, or an in-place result
                continue
            self._create(key, t)
            if t.numel():
                fresh.append((i, t))
        if not fresh and not _mutates(func):
            # A pure view: the captured view already aliases the storage it
            # reads, so there is nothing to redo.
            return out
        self.steps.append(_Step(func, tuple(args), dict(kwargs), fresh))
        return out

    def _check_reads(self, func: Any, args: Any, kwargs: Any) -> None:
        for t in data_read(func, args, kwargs):
            entry = self.unwritten.written_outside(t)
            if entry is not None:
                raise Unrecordable(_unrecordable(entry.op, f"before {func} read it", call_site()))

    def launch(self, launch: Launch) -> Any:
        """A Triton launch during capture: run as it is (the interpreter's own copies are no ops of
        the forward), then recorded as a step that launches it again with the same arguments."""
        self.guard.suspended += 1
        try:
            with no_dispatch_modes():
                result = launch()
        finally:
            self.guard.suspended -= 1
        for t in launch.tensors:
            self.unwritten.written(t)
        self.steps.append(
            _Step(
                functools.partial(relaunch, launch.kernel, launch.run), launch.args, dict(launch.kwargs), []
            )
        )
        return result

    def check_outputs(self) -> None:
        """At the capture's end: fresh memory that nothing the dispatcher saw wrote, written all the
        same (an output an extension filled, returned as it is)."""
        with no_dispatch_modes():
            found = self.unwritten.remaining()
        for entry in found:
            raise Unrecordable(_unrecordable(entry.op, "and the forward kept it (its output, say)", ""))

    def _freeze(self, t: torch.Tensor) -> None:
        """Before ``t``'s shape changes in place: the steps recorded so far keep it as it was,
        through a view of the same memory with its present shape, strides and offset."""
        frozen = t.as_strided(t.shape, t.stride(), t.storage_offset())
        for step in self.steps:
            step.swap(lambda value: frozen if value is t else value)
        key = _storage_key(t)
        if key in self.created:
            self._know(frozen)

    def _note_created(self, out: Any) -> None:
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._create(_storage_key(t), t)

    def _create(self, key: int, t: torch.Tensor) -> None:
        if key not in self.created:
            self.created[key] = t.untyped_storage()
            self.birth[key] = len(self.steps)
        self._know(t)

    def _know(self, t: torch.Tensor) -> None:
        ref = self.known.get(id(t))
        if ref is None or ref() is not t:
            self.known[id(t)] = weakref.ref(t)

    def unhook(self) -> tuple[list[_View], dict[int, int]]:
        """Put slots where the steps held the capture's own tensors.

        Returns what each slot stands for and each storage's last step. The
        steps then no longer keep those tensors alive, so the ones that are
        alive afterwards are held by someone else.
        """
        views: list[_View] = []
        last_use: dict[int, int] = {}
        slot_of: dict[int, _Slot] = {}
        created = self.created
        # Every tensor replaced, until all are: an id is only unique among
        # objects alive at the same time.
        replaced: list[torch.Tensor] = []

        def slot(value: Any, step: int) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            key = _storage_key(value)
            if key not in created:
                return value  # a parameter, a buffer, a static input: read where it is
            last_use[key] = step
            found = slot_of.get(id(value))
            if found is None:
                found = slot_of[id(value)] = _Slot(len(views))
                views.append(_View.of(value, key))
                replaced.append(value)
            return found

        for index, step in enumerate(self.steps):
            step.swap(functools.partial(slot, step=index))
        replaced.clear()
        return views, last_use

    def alive(self) -> dict[int, list[torch.Tensor]]:
        """The tensor objects still alive on each created storage."""
        found: dict[int, list[torch.Tensor]] = {}
        for ref in self.known.values():
            t = ref()
            if t is None:
                continue
            key = _storage_key(t)  # where it is now: set_() may have moved it
            if key in self.created:
                found.setdefault(key, []).append(t)
        return found


class EmulatedGraph(CapturedGraph):
    def __init__(self, steps: list[_Step], output: Any, nbytes: int, created_bytes: int = 0) -> None:
        self._steps = steps
        self.output = output
        #: What the pool grew by for this capture (as on CUDA).
        self.nbytes = nbytes
        self.device_bytes = nbytes
        #: Bytes of every storage the capture created, as if none shared memory.
        self.created_bytes = created_bytes

    @property
    def num_ops(self) -> int:
        return len(self._steps)

    def replay(self) -> None:
        if replay_started is not None:
            replay_started()
        with torch.no_grad():
            for step in self._steps:
                step()


class _EmulatedCapture(OpenCapture):
    def __init__(self, pool: _Pool | None, guard: CaptureGuard, *, grad_enabled: bool = False) -> None:
        self.pool = pool
        self.recorder: _Recorder | None = _Recorder(guard)
        self.stack = contextlib.ExitStack()
        try:
            # Autograd off, as a forward's capture runs; on for a training step, whose backward's
            # ops are recorded like any other (the replay runs them as plain ops).
            self.stack.enter_context(torch.set_grad_enabled(grad_enabled))
            self.stack.enter_context(guard.function_mode())
            self.stack.enter_context(self.recorder)
            self.stack.enter_context(triton_launches(self.recorder.launch))
        except BaseException:
            self.stack.close()
            raise

    def end(self, output: Any) -> CapturedGraph:
        try:
            if self.recorder is not None:
                self.recorder.check_outputs()
        except BaseException:
            self.abort()
            raise
        self.stack.close()
        recorder, self.recorder = self.recorder, None
        assert recorder is not None, "capture already ended"
        created_bytes = sum(s.nbytes() for s in recorder.created.values())
        if self.pool is None:
            # No way to tell what is held: the graph keeps what it created.
            return EmulatedGraph(recorder.steps, output, created_bytes, created_bytes)
        with torch.no_grad():
            steps, nbytes = self._into_pool(recorder, self.pool)
        return EmulatedGraph(steps, output, nbytes, created_bytes)

    @staticmethod
    def _into_pool(recorder: _Recorder, pool: _Pool) -> tuple[list[_Step], int]:
        views, last_use = recorder.unhook()
        # Only the tensors something else holds are alive now (the caller's
        # output among them); gc is not run, as on CUDA an unreachable cycle
        # also keeps its blocks until it is collected.
        alive = recorder.alive()
        requests: list[_Request] = []
        stay: dict[int, torch.UntypedStorage] = {}  # storages the steps keep reading where they are
        pinned = 0
        for key, storage in recorder.created.items():
            nbytes = storage.nbytes()
            holders = alive.get(key, [])
            # One reference for our own Python object, one per tensor on it.
            unknown = _use_count(storage) - 1 - len(holders)
            if nbytes == 0 or unknown > 0:
                # Nothing to place, or a tensor on it that no op returned
                # (``.data``, a Parameter made around it) that cannot be moved:
                # the storage stays, and is graph memory outside the segments.
                if key in last_use or holders:
                    stay[key] = storage
                    pinned += _round(nbytes)
                continue
            if holders:
                requests.append(_Request(key, _round(nbytes), recorder.birth[key], None))
            elif key in last_use:
                requests.append(_Request(key, _round(nbytes), recorder.birth[key], last_use[key]))
            # else: made, never used by a step, dropped: no replay touches it.
        pool.reclaim()
        placed, grown = pool.place(requests)
        pool.pinned_bytes += pinned
        for key, holders in alive.items():
            if key not in placed:
                continue
            segment, offset = placed[key]
            storage = recorder.created[key]
            size = _round(storage.nbytes())
            region = segment.region(offset, size)
            # Held after the capture: the values the capture computed come
            # along, and every holder's tensor now reads and writes the pool.
            storage_bytes(region, storage.nbytes()).copy_(storage_bytes(storage))
            for t in holders:
                t.set_(region, t.storage_offset(), t.shape, t.stride())
            pool.held.append(_Held(segment, offset, size, region))
        twins: list[torch.Tensor] = []
        for view in views:
            if view.key in placed:
                segment, offset = placed[view.key]
                twins.append(view.on(segment.storage, offset))
            else:
                twins.append(view.on(stay[view.key], 0))

        def fill(value: Any) -> Any:
            return twins[value.index] if isinstance(value, _Slot) else value

        for step in recorder.steps:
            step.swap(fill)
        # The capture-time storages go now, unless a pinned one is still read.
        recorder.created.clear()
        recorder.known.clear()
        return recorder.steps, grown + pinned

    def abort(self) -> None:
        # The pool is only touched when a capture ends: a failed one leaves it as it was.
        self.stack.close()
        self.recorder = None


class EmulateBackend(Backend):
    name = "emulate"
    capture_executes = True

    def __init__(self, device: torch.device) -> None:
        # A forward that imports torch._dynamo (the first op under a dispatch mode that does not
        # skip Dynamo, or the module's own code) runs torch.fx.wrap, which keeps its own frame in a
        # local: a cycle that holds every frame below it, the forward's among them. The manager
        # captures with gc off, so the first graph's intermediates would stay alive and hold their
        # pool memory. Imported here, before any capture, it costs what it would cost anyway, and
        # is not counted as the first capture's time.
        import torch._dynamo  # noqa: F401

        self.device = device
        self._pool: _Pool | None = None

    @property
    def pool_bytes(self) -> int:
        """Bytes of the shared pool: what the captures into it grew it by.

        The sum of the graphs' ``nbytes``, unless a PIECEWISE capture failed
        after some of its segments had ended (their growth stays, their graph
        is gone), as with a CUDA pool.
        """
        return self._pool.nbytes if self._pool is not None else 0

    def warmup(self, fn: Callable[[], Any]) -> Any:
        with torch.set_grad_enabled(self.grad_enabled):
            return fn()

    def open_capture(self, guard: CaptureGuard) -> OpenCapture:
        if self._pool is None and _USE_COUNT is not None:
            self._pool = _Pool()
        return _EmulatedCapture(self._pool, guard, grad_enabled=self.grad_enabled)

    def poison_free(self, which: int) -> bool:
        # The free blocks of every segment: what a graph's intermediates occupy between replays
        # (no holder outside the graphs reads them).
        if self._pool is not None:
            for segment in self._pool.segments:
                data = storage_bytes(segment.storage, segment.size)
                for offset, size in segment.free:
                    data[offset : offset + size].fill_(POISON_BYTES[which])
        return True

    def release(self) -> None:
        # A later capture starts a fresh pool. Tensors still held from this one
        # keep their memory (their storages hold the segments) until they die.
        self._pool = None
