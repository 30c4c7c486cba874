"""Real CUDA graphs: ``torch.cuda.CUDAGraph`` captured into one shared pool."""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..guard import CaptureGuard, GuardDispatchMode
from .base import POISON_BYTES, Backend, CapturedGraph, OpenCapture

__all__ = ["CudaBackend", "CudaGraph"]


def _reserved(index: int) -> int:
    # torch.cuda.memory_reserved builds the whole statistics dict (a third of
    # a millisecond); the raw nested dict gives the same number for less.
    try:
        return int(torch._C._cuda_memoryStats(index)["reserved_bytes"]["all"]["current"])
    except (AttributeError, KeyError, TypeError):
        return int(torch.cuda.memory_reserved(index))


def _graph_collects_garbage() -> bool:
    config = getattr(torch.compiler, "config", None)
    # Older versions collected unconditionally, before the flag existed.
    return bool(getattr(config, "force_cudagraph_gc", True))


class _OnDevice:
    """``torch.cuda.device(index)`` for an index already resolved.

    torch.cuda.device resolves its argument (``_get_device_index``) on every
    use; a capture sequence enters the device twice a graph.
    """

    __slots__ = ("index", "previous")

    def __init__(self, index: int) -> None:
        self.index = index
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = torch.cuda._exchange_device(self.index)

    def __exit__(self, *exc: object) -> None:
        torch.cuda._maybe_exchange_device(self.previous)


class _OnStream:
    """``torch.cuda.stream(stream)`` for a stream of the current device.

    torch.cuda.stream looks the current device up (an environment read and
    more) three times a use and builds a ``Stream`` object for the stream it
    puts back; a capture sequence switches streams twice a graph. This keeps
    the previous stream as the raw (id, device, type) triple instead.
    """

    __slots__ = ("index", "previous", "stream")

    def __init__(self, stream: torch.cuda.Stream, index: int) -> None:
        self.stream = stream
        self.index = index
        self.previous: tuple[int, int, int] = (0, index, 0)

    def __enter__(self) -> None:
        self.previous = torch._C._cuda_getCurrentStream(self.index)
        stream = self.stream
        torch._C._cuda_setStream(
            stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
        )

    def __exit__(self, *exc: object) -> None:
        stream_id, device_index, device_type = self.previous
        torch._C._cuda_setStream(stream_id=stream_id, device_index=device_index, device_type=device_type)


class CudaGraph(CapturedGraph):
    def __init__(
        self, graph: torch.cuda.CUDAGraph, output: Any, nbytes: int, device_bytes: int, *, empty: bool = False
    ) -> None:
        self.graph = graph
        self.output = output
        self.nbytes = nbytes
        self.device_bytes = device_bytes
        #: Nothing was recorded (a PIECEWISE segment between two eager pieces):
        #: replaying it would only ask the driver to launch nothing.
        self.empty = empty

    def replay(self) -> None:
        if not self.empty:
            self.graph.replay()


class _CudaCapture(OpenCapture):
    """capture_begin .. capture_end on the backend's capture stream.

    The Python-level host methods are always watched. The checked capture
    also routes every op through the guard's dispatch mode, which names an
    uncapturable op before the device sees it and collects the tensors the
    graph reads; the fast capture lets such an op fail the capture loudly,
    and the manager then names it by running the forward eagerly under the
    full guard.
    """

    def __init__(self, backend: CudaBackend, guard: CaptureGuard, *, whole: bool = False) -> None:
        self.backend = backend
        #: A whole forward's capture (``CudaBackend.capture``), not a segment
        #: between eager pieces: see CudaBackend._reserved_after.
        self.whole = whole
        index = backend.index
        # The pool reading the last whole capture ended with, if nothing has
        # run on the device since; taken once.
        chained = backend._reserved_after if whole else None
        backend._reserved_after = None
        self.reads: list[torch.Tensor] = []
        # What is entered around the capture, undone in reverse by _leave:
        # the device, autograd off and the capture stream outside it
        # (``outer``), the guard inside it (``inner``). Plain lists, not
        # ExitStacks: this runs twice a graph.
        self.outer: list[Any] = []
        self.inner: list[Any] = []
        _enter(self.outer, _OnDevice(index))
        # torch.cuda.graph synchronizes, collects garbage and empties the
        # allocator's cache before every capture. The synchronize is kept
        # (the capture starts from a quiet device); the collection and the
        # emptying are done once a sequence (CudaBackend.begin), as vLLM does
        # for every graph after its first: here they would only hand the
        # warm-up's blocks back to the driver for the next warm-up to
        # allocate again, at a tenth of a millisecond and more a graph. Pool
        # growth is still this graph's alone: nothing outside the pool is
        # allocated or returned while the capture runs. (torch.cuda.synchronize
        # would resolve and enter the device again: it is current already.)
        self.graph: torch.cuda.CUDAGraph | None = None
        try:
            torch._C._cuda_synchronize()
            self.free_before = torch.cuda.mem_get_info(index)[0] if backend.measure_device_memory else 0
            self.graph = torch.cuda.CUDAGraph()
            _enter(self.outer, _GradOff(backend.grad_enabled))
            _enter(self.outer, _OnStream(backend._streams()[1], index))
            self.graph.capture_begin(pool=backend._pool)
        except BaseException:
            self.graph = None
            _leave(self.outer)
            # capture_begin readies the generator for capture before it
            # fails: without the recovery every later random op fails.
            backend._pool = None
            backend._recover()
            raise
        try:
            # Read once the capture has begun: capture_begin itself allocates,
            # outside the pool, the RNG seed and offset of the first graph that
            # registers with the generator, which are no graph's pool growth.
            self.before = chained if chained is not None else _reserved(index)
            _enter(self.inner, guard.function_mode())
            if backend.checked:
                _enter(self.inner, GuardDispatchMode(guard, self.reads))
        except BaseException:
            self.abort()
            raise

    def end(self, output: Any) -> CapturedGraph:
        graph = self.graph
        assert graph is not None, "capture already ended"
        try:
            _leave(self.inner, strict=True)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                graph.capture_end()
        except BaseException:
            self.abort()
            raise
        _leave(self.outer)
        empty = False
        for w in seen:
            if "CUDA Graph is empty" in str(w.message):
                empty = True
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.graph = None
        index = self.backend.index
        after = _reserved(index)
        if self.whole:
            self.backend._reserved_after = after
        grown = after - self.before
        taken = grown
        if self.backend.measure_device_memory:
            # Device-wide: the pool's growth plus what the driver keeps for
            # the instantiated graph, which the caching allocator never sees.
            torch.cuda.synchronize(index)
            taken = self.free_before - torch.cuda.mem_get_info(index)[0]
        captured = CudaGraph(graph, output, max(grown, 0), max(taken, 0), empty=empty)
        if self.reads:
            captured.hold(self.reads)  # what the checked capture saw the graph read
        return captured

    def abort(self) -> None:
        backend = self.backend
        backend._reserved_after = None
        # Ending an invalidated capture raises its own, vaguer error; the
        # caller re-raises the error that says why.
        _leave(self.inner)
        graph, self.graph = self.graph, None
        if graph is not None:
            ended = False
            with contextlib.suppress(BaseException):
                graph.capture_end()
                ended = True
            if not ended:
                # A capture_end that failed after the capture ended (in the
                # graph's instantiation) left the graph counted out of the pool
                # by its own reset: pool() answers only for an ended capture.
                with contextlib.suppress(BaseException):
                    graph.pool()
                    ended = True
            if not ended:
                # capture_begin routed the capture stream's allocations into
                # the pool and counted one more user of it; a capture_end that
                # fails (an invalidated capture) undoes neither, and the graph
                # gives the count back only once its capture ended. Without
                # this the pool, and every block allocated in it, is never
                # freed: memory lost at every failed capture.
                _give_back_pool(backend.index, backend._pool)
            del graph
        # Later captures take a fresh pool. The failed graph was this pool's
        # only user when it was the first capture (its death then frees the
        # pool, and capturing into a handle whose last user died trips the
        # allocator's "use_count > 0" assertion, after the generator was
        # readied for capture); and what the failed capture allocated there
        # (its tensors, the cuBLAS workspace it started) may still be held.
        backend._pool = None
        _leave(self.outer)
        backend._recover()


def _give_back_pool(index: int, pool: Any) -> None:
    """Stop routing the capture stream's allocations to ``pool`` and drop the
    failed capture's count on it (PyTorch's private allocator calls; absent
    in builds without them, where nothing is done)."""
    if pool is None:
        return
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        call = getattr(torch._C, name, None)
        if call is not None:
            with contextlib.suppress(Exception):
                call(index, pool)


class _GradOff:
    """``torch.no_grad()`` without its object's set-up (it runs twice a graph); ``enabled``: autograd
    on instead (a training step's capture)."""

    __slots__ = ("enabled", "previous")

    def __init__(self, enabled: bool = False) -> None:
        self.previous = True
        self.enabled = enabled

    def __enter__(self) -> None:
        self.previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self.enabled)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.previous)


def _enter(entered: list[Any], context: Any) -> None:
    context.__enter__()
    entered.append(context)


def _leave(entered: list[Any], *, strict: bool = False) -> None:
    """Exit what was entered, last first, each once. ``strict``: the first
    exit that raises stops there and raises (the rest are left for abort);
    else every exit runs and their errors are dropped."""
    while entered:
        context = entered.pop()
        if strict:
            context.__exit__(None, None, None)
        else:
            with contextlib.suppress(BaseException):
                context.__exit__(None, None, None)


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        assert device.index is not None, "make_backend resolves the device index"
        self.device = device
        self.index: int = device.index
        #: Also measure device-wide memory per graph (cudaMemGetInfo, which
        #: costs about a millisecond a call); benchmarks turn it on.
        self.measure_device_memory = False
        #: Checked capture: every op goes through the guard's dispatch mode,
        #: which keeps every tensor the graph reads alive with it, and (with
        #: ``CaptureGuard.rules``: the sequence's first capture) names an
        #: uncapturable op before the device sees it. The fast capture (the
        #: manager's default; see resolve_checked) costs what a hand-written
        #: loop does and relies on the capture failing loudly, then on an
        #: eager diagnosis.
        self.checked = False
        self._pool: Any = None
        #: The pool's free blocks as byte views, found once per layout of the pool (``poison_free``),
        #: with the key of that layout: the pool, the bytes the allocator reserves, the captures so far.
        self._free_blocks: tuple[tuple[Any, int, int], list[torch.Tensor]] | None = None
        self._captures = 0
        # Separate streams for warm-up and capture. PyTorch caches one cuBLAS
        # workspace per stream, and destroying *any* graph captured on a
        # stream drops that stream's workspace. A workspace first allocated
        # during capture comes from this manager's private pool, where no
        # eager tensor can ever be handed its memory; one allocated by an
        # eager warm-up on the same stream would not.
        self._warmup_stream: torch.cuda.Stream | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        #: (caller -> warm-up stream, warm-up stream -> caller), recorded anew by every warm-up.
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._caller: torch.cuda.Stream | None = None
        self._caller_raw: tuple[int, int, int] | None = None
        # The allocator's reserved bytes when the last whole capture ended,
        # kept only while nothing can have allocated or freed device memory
        # since: the next whole capture starts from it instead of reading the
        # statistics again (a dozen microseconds a graph). Reserved memory
        # changes only when the allocator takes a segment from the driver or
        # hands one back. Between two whole captures of the fast sequence only
        # the manager's bookkeeping runs (every warm-up ran before the first
        # capture, and staging copies into buffers that exist), and
        # capture_begin allocates only the first graph's RNG state, which the
        # sequence's first capture reads after. Anything else that runs
        # device work forgets it: a warm-up (the checked capture's, a
        # failure's diagnosis), a segment between eager pieces, a failed
        # capture, trim, begin and release.
        self._reserved_after: int | None = None

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._warmup_stream is None or self._capture_stream is None:
            self._warmup_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            self._capture_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return self._warmup_stream, self._capture_stream

    def begin(self) -> None:
        # Once a sequence, what torch.cuda.graph does before every capture
        # (see _CudaCapture): collect garbage if this PyTorch version would,
        # synchronize, and hand cached blocks back to the driver, so that the
        # pool has the most room. A collect costs 100 ms and more in a big
        # process: it is not paid where torch.cuda.graph would not pay it.
        #
        # Stale cuBLAS workspaces are dropped so that the capture stream's
        # workspace is allocated inside this pool. The manager keeps the
        # cyclic garbage collector off for the sequence, so a garbage graph of
        # another manager (captured on a pool stream this one was also handed)
        # cannot die in the middle of it and drop that stream's workspace; one
        # that dies after it frees the block into this private pool, which
        # only this manager's captures use.
        self._reserved_after = None
        if _graph_collects_garbage():
            gc.collect()
        torch.cuda.synchronize(self.index)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()

    def finish(self) -> None:
        # The warm-ups' blocks, kept cached through the sequence for the next
        # warm-up, go back to the driver.
        self.trim()

    def trim(self) -> bool:
        self._reserved_after = None
        torch.cuda.synchronize(self.index)
        torch.cuda.empty_cache()
        return True

    def _current_stream(self) -> torch.cuda.Stream:
        """The caller's current stream, as a ``Stream`` made again only when it changes."""
        raw = torch._C._cuda_getCurrentStream(self.index)
        if raw != self._caller_raw or self._caller is None:
            self._caller = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                stream_id=raw[0], device_index=raw[1], device_type=raw[2]
            )
            self._caller_raw = raw
        return self._caller

    def warmup(self, fn: Callable[[], Any]) -> Any:
        # Warm up on the side stream the capture uses, as PyTorch advises:
        # lazy initialisation (cuBLAS handles, workspaces) must not happen
        # inside the capture. The two streams are ordered by two events made
        # once, not by wait_stream, which makes an event for every wait.
        self._reserved_after = None
        index = self.index
        stream = self._streams()[0]
        if self._events is None:
            self._events = (torch.cuda.Event(), torch.cuda.Event())  # type: ignore[no-untyped-call]
        to_side, to_caller = self._events
        with _OnDevice(index):
            caller = self._current_stream()
            to_side.record(caller)
            to_side.wait(stream)
            try:
                with torch.set_grad_enabled(self.grad_enabled), _OnStream(stream, index):
                    return fn()
            finally:
                # Also after a failure: the caller's later work (the next
                # sample copied into the static buffers) must not overtake it.
                to_caller.record(stream)
                to_caller.wait(caller)

    def open_capture(self, guard: CaptureGuard) -> OpenCapture:
        # A segment between eager pieces: the pieces allocate outside the pool.
        return self._open(guard, whole=False)

    def _open(self, guard: CaptureGuard, *, whole: bool) -> _CudaCapture:
        self._captures += 1  # the pool's layout may change: poison_free looks again
        if self._pool is None:
            # One pool for every graph of this manager: smaller graphs,
            # captured after larger ones, reuse the larger ones' memory.
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.graph_pool_handle()
        return _CudaCapture(self, guard, whole=whole)

    def open_whole_capture(self, guard: CaptureGuard) -> OpenCapture:
        return self._open(guard, whole=True)

    def _recover(self) -> None:
        """Leave the device fit for another capture after a failed one.

        When a capture is invalidated (a host sync the guard could not see,
        say), ending it fails before the default generator leaves capture
        mode, and every later random op then fails. An empty capture on the
        same stream runs the generator's prologue and epilogue again.
        """
        self._reserved_after = None
        try:
            torch.cuda.synchronize(self.index)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
                empty = torch.cuda.CUDAGraph()
                with torch.cuda.graph(empty, stream=self._streams()[1]):
                    pass
            del empty
        except RuntimeError:
            pass  # the original error is what the caller needs to see

    def release(self) -> None:
        # Graphs that shared the old pool are gone; a later capture gets a
        # fresh pool instead of reusing a handle whose last user died (which
        # trips the allocator's "use_count > 0" assertion).
        self._pool = None
        self._free_blocks = None
        self._reserved_after = None
        # The capture stream's cuBLAS workspace was allocated in that pool
        # (see begin): while cuBLAS holds it, the pool is never freed. Every
        # graph of this manager is gone, so nothing replays with it.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            torch.cuda.synchronize(self.index)
            clear()
        self.trim()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def poison_free(self, which: int) -> bool:
        # The pool's inactive blocks, found in the caching allocator's snapshot: the graphs'
        # intermediates between replays. They are written through tensors that alias them
        # (no allocation, so the pool is neither grown nor reshaped), on the current stream,
        # where the replays that read them run next.
        pool = self._pool
        if pool is None:
            return True
        # The blocks are found once for a layout of the pool: between captures nothing allocates in
        # it (replays allocate nothing), and a segment handed back to the driver changes what the
        # allocator reserves. A verification poisons twice a descriptor, and the snapshot walks
        # every segment of the device (an 8B model's weights included) and syncs it.
        key = (tuple(pool), torch.cuda.memory_reserved(self.index), self._captures)
        if self._free_blocks is None or self._free_blocks[0] != key:
            snapshot = getattr(torch.cuda, "memory_snapshot", None)
            if snapshot is None:
                return False
            torch.cuda.synchronize(self.index)
            blocks = []
            for segment in snapshot():
                if segment.get("device") != self.index or tuple(segment.get("segment_pool_id", ())) != tuple(
                    pool
                ):
                    continue
                address = segment["address"]
                for block in segment["blocks"]:
                    size = block["size"]
                    start = block.get("address", address)
                    if block["state"] == "inactive" and size:
                        blocks.append(_device_bytes(start, size, self.index))
                    address = start + size
            self._free_blocks = (key, blocks)
        with _OnDevice(self.index):
            for block_bytes in self._free_blocks[1]:
                block_bytes.fill_(POISON_BYTES[which])
        return True


class _Raw:
    """Device memory at an address, for ``torch.as_tensor`` (the CUDA array interface)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def _device_bytes(address: int, nbytes: int, index: int) -> torch.Tensor:
    return torch.as_tensor(_Raw(address, nbytes), device=torch.device("cuda", index))
