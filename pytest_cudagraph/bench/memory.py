"""Graph memory: measured per descriptor, and vLLM's estimate from a sample.

vLLM does not capture every FULL graph to learn what they cost: it captures
the two largest into a throwaway pool and extrapolates. The first capture
pays for the pool's baseline; later graphs mostly reuse it, so the second
sample stands for every further graph, floored at 1 MiB of driver overhead.

That floor and a single sample are coarse for small graphs: the driver hands
out memory in 2 MiB chunks, so one sample reads 0 or 2 MiB, and a graph of a
small model costs far less than 1 MiB. ``samples=8, floor=0`` (the
``sampled`` estimate) averages the later samples instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..manager import GraphManager
from ..plan import GraphMode

__all__ = ["MemoryEstimate", "estimate_full_graph_memory", "extrapolate"]

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
    return MemoryEstimate(len(full), taken_samples, extrapolate(list(taken_samples), len(full), floor=floor),
                          measured)
