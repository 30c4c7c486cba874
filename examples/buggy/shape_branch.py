"""A Python branch on the batch size: in a graph the padded size decides, not the real one.

Caught by ``real_batches``. The plugin prints:

    ShapeBranch on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 19 real batches, 1 failure(s) in real_batches, 2 skipped; capture 2 ms, graph memory 2.0 KiB, peak memory 329.2 MiB (329.1 MiB before)
    FAIL real_batches           FULL-T4-R4
         real rows are off systematically: 100% of their difference from eager on the unpadded batch is a scale of +100.00% (the output; graph vs unpadded eager: max 1.49, rms 0.543; eager vs itself across shapes (at the graph's padded shape): max 1.49, rms 0.543). Rounding across batch shapes is random in sign; a systematic difference comes from a computation that depends on the padded batch size (a Python branch on the token count, a scale computed from it, statistics over the padded rows)
         real batch (num_reqs=2, num_tokens=3, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave -0.9527701139450073, eager gave -0.47638505697250366; max abs diff 1.49, max ULP 8388608; first divergent submodule: the top-level module

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the real_batches failure shown)
"""

from __future__ import annotations

import torch

from .common import Base


class ShapeBranch(Base):
    """Takes another path for batches of 4 tokens or more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 4:  # a batch of 3 padded to 4 takes this path in the graph
            return self.lin(x) * 2
        return self.lin(x)


class NoShapeBranch(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2
