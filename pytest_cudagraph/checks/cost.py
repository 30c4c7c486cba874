"""What a verification spends: seconds, forwards and replays per step, and its peak memory.

At real size a verification must stay near the cost of the capture it
verifies, so the report says where the time went (each check, the capture,
the first pass that learns what forwards write) and how much memory the
process held at its peak: on CUDA the caching allocator's reserved bytes, the
figure ``nvidia-smi`` moves with; on the CPU the process's resident set.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .. import peers
from .report import StepCost

__all__ = ["Meter", "StepCost", "peak_memory", "start_peak"]


@dataclass
class Meter:
    """Counts the module's forwards (a pre-hook on the module) and reads a replay
    counter, per named step."""

    module: torch.nn.Module
    replays: Callable[[], int]
    costs: dict[str, StepCost] = field(default_factory=dict)
    forwards: int = 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count the module's forwards while the block runs."""

        def count(*_: object) -> None:
            self.forwards += 1

        handle = self.module.register_forward_pre_hook(count)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def step(self, name: str, where: str = "") -> Iterator[None]:
        """Add the block's seconds, forwards and replays to step ``name``; on a rank of several, the
        block is a step of the verification its peers run in step (``peers.step``; ``where``: the
        descriptor it runs on, in words)."""
        peers.step(f"{name} at {where}" if where else name)
        started, forwards, replays = time.perf_counter(), self.forwards, self.replays()
        try:
            yield
        finally:
            cost = self.costs.setdefault(name, StepCost())
            cost.seconds += time.perf_counter() - started
            cost.forwards += self.forwards - forwards
            cost.replays += self.replays() - replays


def _rss_peak() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def start_peak(device: torch.device) -> int:
    """Start counting the peak afresh where the platform allows; the memory held now.

    CUDA: the allocator's peak statistics are reset. CPU (Linux): the
    process's high-water mark is reset through ``/proc/self/clear_refs``; where
    that is refused the peak is the process's since it started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_reserved(device))
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return _rss_peak() or 0


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are) at the peak since ``start_peak``."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device)), f"reserved on {device}"
    return _rss_peak() or 0, "process RSS"
