"""An input written in place: eager changes the caller's tensor, the graph only its static copy.

Caught by ``state``. The plugin prints:

    MutatesInput on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 20 real batches, 4 failure(s) in state, 2 skipped; capture 2 ms, graph memory 2.0 KiB, peak memory 326.7 MiB (325.5 MiB before)
    FAIL state                  FULL-T8-R4
         input ['x'] is mutated in place by eager but not by run(): the graph writes into its static copy, never the caller's tensor (return the result instead of writing into an input)
         real batch (num_reqs=4, num_tokens=8, num_active_loras=0, num_ubatches=1); output ['x'] at index [0, 0]; graph gave -0.06614404916763306, eager gave -0.1322880983352661; max abs diff 1.76, max ULP 8388608

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the state failure shown)
"""

from __future__ import annotations

import torch

from .common import Base


class MutatesInput(Base):
    """Scales its input in place: eager changes the caller's tensor, the graph its own copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


class CopiesInput(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * 2)
