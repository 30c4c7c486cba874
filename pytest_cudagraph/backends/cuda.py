"""Real CUDA graphs: ``torch.cuda.CUDAGraph`` captured into one shared pool."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .base import Backend, CapturedGraph
from .guard import CaptureGuard, GuardDispatchMode

__all__ = ["CudaBackend", "CudaGraph"]


class CudaGraph(CapturedGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph, output: Any, nbytes: int,
                 reads: list[torch.Tensor]) -> None:
        self.graph = graph
        self.output = output
        self.nbytes = nbytes
        # Tensors from outside the graph that it reads: kept alive with it.
        self._reads = reads

    def replay(self) -> None:
        self.graph.replay()


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Any = None
        # Separate streams for warm-up and capture. PyTorch caches one cuBLAS
        # workspace per stream, and destroying *any* graph captured on a
        # stream drops that stream's workspace. A workspace first allocated
        # during capture comes from this manager's private pool, where no
        # eager tensor can ever be handed its memory; one allocated by an
        # eager warm-up on the same stream would not.
        self._warmup_stream: torch.cuda.Stream | None = None
        self._capture_stream: torch.cuda.Stream | None = None

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._warmup_stream is None or self._capture_stream is None:
            self._warmup_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            self._capture_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return self._warmup_stream, self._capture_stream

    def begin(self) -> None:
        # Graphs another manager left to the garbage collector die now, not
        # in the middle of this capture sequence (torch.cuda.graph collects
        # garbage on entry), and stale cuBLAS workspaces are dropped so the
        # capture stream's workspace is allocated inside this pool.
        gc.collect()
        torch.cuda.synchronize(self.device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()

    def warmup(self, fn: Callable[[], Any]) -> Any:
        # Warm up on the side stream the capture uses, as PyTorch advises:
        # lazy initialisation (cuBLAS handles, workspaces) must not happen
        # inside the capture.
        with torch.cuda.device(self.device):
            stream = self._streams()[0]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.no_grad(), torch.cuda.stream(stream):
                out = fn()
            torch.cuda.current_stream().wait_stream(stream)
            return out

    def capture(self, fn: Callable[[], Any], guard: CaptureGuard) -> CapturedGraph:
        with torch.cuda.device(self.device):
            if self._pool is None:
                # One pool for every graph of this manager: smaller graphs,
                # captured after larger ones, reuse the larger ones' memory.
                self._pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize(self.device)
            # Return cached blocks first so that growth of reserved memory is
            # the pool's growth for this graph alone.
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            reads: list[torch.Tensor] = []
            first_error: BaseException | None = None
            try:
                with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool, stream=self._streams()[1]):
                    with guard.function_mode(), GuardDispatchMode(guard, reads):
                        try:
                            output = fn()
                        except BaseException as exc:
                            first_error = exc
                            raise
            except BaseException as exc:
                del graph
                self._recover()
                # Ending an invalidated capture raises its own, vaguer error;
                # the error inside the forward is the one that says why.
                if first_error is not None and first_error is not exc:
                    raise first_error from exc
                raise
            torch.cuda.synchronize(self.device)
            grown = torch.cuda.memory_reserved(self.device) - before
        return CudaGraph(graph, output, max(grown, 0), reads)

    def _recover(self) -> None:
        """Leave the device fit for another capture after a failed one.

        When a capture is invalidated (a host sync the guard could not see,
        say), ending it fails before the default generator leaves capture
        mode, and every later random op then fails. An empty capture on the
        same stream runs the generator's prologue and epilogue again.
        """
        try:
            torch.cuda.synchronize(self.device)
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
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
