"""Statistics over the whole batch: padded rows change the real rows.

Caught by ``real_batches``. The plugin prints:

    BatchStatistics on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 23 real batches, 4 failure(s) in padding_isolation, real_batches, 2 skipped; capture 3 ms, graph memory 2.5 KiB
    FAIL real_batches           FULL-T8-R4
         real rows differ from eager on the unpadded batch within tolerance (the output: values differ)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); output <the output> at index [0, 0]; graph gave 0.24637103080749512, eager gave 0.2882392406463623; max abs diff 0.0747, max ULP 2017253320; first divergent submodule: 'lin'

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the real_batches failure shown; also failed: padding_isolation)
"""

from __future__ import annotations

import torch

from .common import Base


class BatchStatistics(Base):
    """Centres by the mean over all tokens, padded rows included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(0, keepdim=True))


class TokenStatistics(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(-1, keepdim=True))
