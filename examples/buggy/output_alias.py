"""An output that is the module's own buffer: later calls overwrite what the caller holds.

Caught by ``output_lifetime``. The plugin prints:

    ReturnsStatsBuffer on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 23 real batches, 1 failure(s) in output_lifetime, 2 skipped; capture 2 ms, graph memory 2.0 KiB, peak memory 329.1 MiB (329.1 MiB before)
    FAIL output_lifetime        NONE-T9-R4
         an output returned by run() on the eager (NONE) path changed when later batches ran ([1]: values differ): it aliases memory the module or the graph reuses; return a fresh tensor
         real batch (num_reqs=4, num_tokens=9, num_active_loras=0, num_ubatches=1); output [1] at index [0]; graph gave 0.3106235861778259, eager gave -0.5920254588127136; max abs diff 2.31, max ULP 54225398

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the output_lifetime failure shown)
"""

from __future__ import annotations

import torch

from .common import Base, D


class ReturnsStatsBuffer(Base):
    """Returns its statistics buffer itself: later calls overwrite what the caller holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        self.stats.copy_(y[0])  # row 0 is always a real row
        return y, self.stats


class ReturnsStatsCopy(ReturnsStatsBuffer):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, stats = super().forward(x)
        return y, stats.clone()
