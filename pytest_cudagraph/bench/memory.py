"""Graph memory: measured per descriptor, and vLLM's estimate from a sample.

vLLM does not capture every FULL graph to learn what they cost: it captures
the two largest into a throwaway pool and extrapolates. The first capture
pays for the pool's baseline; later graphs mostly reuse it, so the second
sample stands for every further graph, floored at 1 MiB of driver overhead.

That floor and a single sample are coarse for small graphs: the driver hands
out memory in 2 MiB chunks, so one sample reads 0 or 2 MiB, and a graph of a
small model costs far less than 1 MiB. Averaging more samples does not cure
it: what a later graph costs is mostly the outputs it keeps alive in the pool,
which shrink with the batch, so the largest graphs are the worst sample.

``estimate_pool_replica`` estimates from what actually drives the cost: it
captures only the largest graph (pool set-up, cuBLAS workspace, the driver's
share) and then replays the allocation pattern of every other FULL graph with
eager forwards inside a throwaway ``torch.cuda.MemPool``, outputs kept alive,
as a shared graph pool keeps them. The caching allocator rounds and packs
those blocks exactly as it does under capture. What it leaves out is the
driver's memory for each further instantiated graph (tens of KB for small
graphs), so it errs low by about that much.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..context import running
from ..manager import GraphManager
from ..observe import buffers_restored
from ..plan import BatchDescriptor, GraphMode

__all__ = ["MemoryEstimate", "estimate_full_graph_memory", "estimate_pool_replica", "extrapolate"]

MIN_PER_GRAPH_BYTES = 1 << 20
SAMPLES = 2


def extrapolate(samples: list[int], total_graphs: int, *, floor: int = MIN_PER_GRAPH_BYTES) -> int:
    """First sample, plus the mean of the later ones (at least ``floor``) for every further graph.

    With two samples and the 1 MiB floor this is vLLM's estimate.
    """
    if not samples or total_graphs < 1:
        return 0
    later = samples[1:]
    per_graph = max(sum(later) / len(later), floor) if later else 0
    return samples[0] + round((total_graphs - 1) * per_graph)


@dataclass(frozen=True)
class MemoryEstimate:
    full_graphs: int
    samples: tuple[int, ...]
    estimate: int
    measured: int | None  # every FULL graph captured, device-wide, when known
    method: str = "vllm"

    @property
    def error(self) -> float | None:
        """Relative error of the estimate against the measurement."""
        if not self.measured:
            return None
        return (self.estimate - self.measured) / self.measured


def estimate_full_graph_memory(
    manager: GraphManager,
    *,
    samples: int = SAMPLES,
    floor: int = MIN_PER_GRAPH_BYTES,
    measured: int | None = None,
) -> MemoryEstimate:
    """Capture the ``samples`` largest FULL graphs in a fresh pool and extrapolate to all.

    The defaults are vLLM's (two samples, 1 MiB floor). ``manager`` is not
    touched: the samples are captured by a sibling manager and released.
    ``measured`` is the device-wide total of every FULL graph, for comparison.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1; got {samples}")
    full = list(manager.plan.capture_descriptors.get(GraphMode.FULL, ()))
    if not full:
        return MemoryEstimate(0, (), 0, measured)
    sample = full[:samples]  # capture order: largest first
    probe = manager.sibling()
    try:
        probe.capture(sample)
        taken = probe.device_memory
        taken_samples = tuple(taken[d] for d in sample)
    finally:
        probe.release()
    return MemoryEstimate(
        len(full), taken_samples, extrapolate(list(taken_samples), len(full), floor=floor), measured
    )


def _pool_growth_of_eager_forwards(manager: GraphManager, order: list[BatchDescriptor]) -> int:
    """Reserved bytes that eager forwards of ``order[1:]`` add to a pool that
    already holds ``order[0]``'s forward, every output kept alive."""
    device = manager.device
    pool = torch.cuda.MemPool()  # type: ignore[no-untyped-call]
    kept: list[Any] = []
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = 0
        with torch.no_grad(), torch.cuda.use_mem_pool(pool, device=device):
            for i, desc in enumerate(order):
                _, kwargs = manager.stage_sample(desc)
                with running(desc):
                    kept.append(manager.module(**kwargs))
                if i == 0:
                    torch.cuda.synchronize(device)
                    base = int(torch.cuda.memory_reserved(device))
        torch.cuda.synchronize(device)
        return max(int(torch.cuda.memory_reserved(device)) - base, 0)
    finally:
        kept.clear()
        del pool
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def estimate_pool_replica(
    manager: GraphManager, *, measured: int | None = None, device_wide: bool = True
) -> MemoryEstimate:
    """Capture the largest FULL graph, replay the others' allocations eagerly; add up.

    ``device_wide=True`` counts the sample graph device-wide (the driver's
    share included), to compare with ``device_memory``; False counts only
    the pool, to compare with ``graph_memory``, which other processes on the
    same GPU (pytest-xdist workers, say) cannot disturb.

    CUDA only (``torch.cuda.MemPool``). ``manager`` is not touched: the sample
    is captured by a sibling manager and released; the eager forwards write
    the static input buffers, which the next ``run`` overwrites anyway.
    Module buffers a forward updates in place are restored afterwards.
    """
    if manager.backend != "cuda":
        raise ValueError(
            f"estimate_pool_replica needs the cuda backend; this manager uses {manager.backend!r}"
        )
    full = list(manager.plan.capture_descriptors.get(GraphMode.FULL, ()))
    if not full:
        return MemoryEstimate(0, (), 0, measured, "replica")
    probe = manager.sibling()
    probe.state.backend.measure_device_memory = device_wide
    try:
        probe.capture(full[:1])
        first = (probe.device_memory if device_wide else probe.graph_memory)[full[0]]
    finally:
        probe.release()
    with buffers_restored(manager.module):
        later = _pool_growth_of_eager_forwards(manager, full) if len(full) > 1 else 0
    return MemoryEstimate(len(full), (first, later), first + later, measured, "replica")
