"""A split-K sum into ``torch.empty``: the first ``+=`` reads memory nobody wrote.

A product computed in two halves of its inner dimension and summed into a buffer made with
``torch.empty`` (as split-K kernels and their hand-written stand-ins do): the buffer holds
whatever the allocator left there, so eager differs from itself, and a graph reads whatever
its pool held. Caught by ``determinism``, which names the op that read the memory and the op
that made it. The plugin prints:

    SplitKIntoEmpty on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 19 real batches, 18 failure(s) in determinism, fresh_inputs, padding_isolation, real_batches, replay_matches_eager, 6 skipped; capture 4 ms, graph memory 2.5 KiB, peak memory 329.1 MiB (327.8 MiB before)
    FAIL determinism            FULL-T8-R4
         forward reads memory nobody wrote: aten.add_.Tensor reads what aten.empty.memory_format handed back before anything wrote it, so its results are whatever the allocator left there (eager differs from itself, and a graph reads other memory again). Write it fully first, or make it with torch.zeros
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave -3.9440464973449707, eager gave -3.2735707759857178; max abs diff 1.28, max ULP 15075629

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the determinism failure shown; also failed: fresh_inputs, padding_isolation, real_batches, replay_matches_eager)
"""

from __future__ import annotations

import torch

from .common import Base, D

HALF = D // 2


class SplitKIntoEmpty(Base):
    """Adds both halves into ``torch.empty``: the first ``+=`` reads its garbage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        out = torch.empty(x.shape[0], D, device=x.device, dtype=x.dtype)
        out += x[:, :HALF] @ w[:, :HALF].T
        out += x[:, HALF:] @ w[:, HALF:].T
        return out + self.lin.bias


class SplitKIntoWritten(Base):
    """Writes the first half into the buffer, then adds the second: every element written first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        out = torch.empty(x.shape[0], D, device=x.device, dtype=x.dtype)
        out.copy_(x[:, :HALF] @ w[:, :HALF].T)
        out += x[:, HALF:] @ w[:, HALF:].T
        return out + self.lin.bias
