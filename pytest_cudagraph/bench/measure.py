"""Measuring a captured manager: eager, ``run()`` and bare replay per descriptor."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..context import running
from ..manager import GraphManager
from ..manager.inputs import call_make_inputs
from ..plan import Batch, BatchDescriptor
from ..plan.properties import exact_batch
from .timing import Timing, time_interleaved

__all__ = ["DescriptorBench", "measure_manager"]


@dataclass
class DescriptorBench:
    """What one descriptor's graph buys: times per call (median) and memory."""

    descriptor: BatchDescriptor
    batch: Batch
    eager: Timing
    run: Timing
    replay: Timing
    graph_memory: int
    emulated: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def padding(self) -> int:
        return self.descriptor.num_tokens - self.batch.num_tokens

    @property
    def speedup(self) -> float | None:
        """Eager time over ``run()`` time; None on the emulator (no claim)."""
        if self.emulated:
            return None
        return self.eager.median / self.run.median

    @property
    def replay_speedup(self) -> float | None:
        if self.emulated:
            return None
        return self.eager.median / self.replay.median

    def row(self) -> dict[str, Any]:
        return {
            "descriptor": self.descriptor.label(),
            "tokens": self.descriptor.num_tokens,
            "real_tokens": self.batch.num_tokens,
            "padding": self.padding,
            "eager_s": self.eager.median,
            "run_s": self.run.median,
            "replay_s": self.replay.median,
            "speedup": self.speedup,
            "replay_speedup": self.replay_speedup,
            "graph_memory_bytes": self.graph_memory,
            "emulated": self.emulated,
        }


def measure_manager(
    manager: GraphManager,
    *,
    descriptors: Iterable[BatchDescriptor] | None = None,
    rounds: int = 30,
    calls_per_round: int = 20,
    warmup: int = 10,
) -> list[DescriptorBench]:
    """Time eager, ``run()`` and bare replay for each captured descriptor.

    Each descriptor is measured on a real batch of exactly its shape, so the
    three times compare the same work. The manager must be captured.
    """
    if not manager.captured:
        raise ValueError("measure_manager needs a captured manager: call manager.capture() first")
    results = []
    device = manager.device
    for desc in descriptors if descriptors is not None else manager.captured_descriptors:
        batch = exact_batch(manager.plan, desc)
        inputs = call_make_inputs(manager.make_inputs, batch.num_tokens, batch.num_reqs)
        kwargs = manager.eager_kwargs(inputs, batch.num_tokens)
        eager_desc = BatchDescriptor(
            mode=desc.mode.NONE,
            num_tokens=batch.num_tokens,
            num_reqs=batch.num_reqs,
            num_active_loras=desc.num_active_loras,
        )

        def eager(kwargs: dict[str, Any] = kwargs, marker: BatchDescriptor = eager_desc) -> Any:
            with running(marker):
                return manager.module(**kwargs)

        def run(inputs: dict[str, Any] = inputs, batch: Batch = batch) -> Any:
            return manager.run_batch(inputs, batch)

        def replay(desc: BatchDescriptor = desc) -> None:
            manager.graph(desc).replay()

        timing = {"rounds": rounds, "calls_per_round": calls_per_round, "warmup": warmup, "device": device}
        # In turn, so that the speedup (eager over replay) compares rounds
        # taken under the same conditions.
        timed = time_interleaved({"eager": eager, "run": run, "replay": replay}, **timing)  # type: ignore[arg-type]
        results.append(
            DescriptorBench(
                descriptor=desc,
                batch=batch,
                eager=timed["eager"],
                run=timed["run"],
                replay=timed["replay"],
                graph_memory=manager.graph_memory.get(desc, 0),
                emulated=manager.backend == "emulate",
            )
        )
    return results
