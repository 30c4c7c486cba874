"""A seed set inside forward: eager repeats its noise, replays do not.

Caught by ``rng``. The plugin prints:

    ReseedsInForward on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 14 real batches, 12 failure(s) in fresh_inputs, replay_matches_eager, rng, 6 skipped; capture 7 ms, graph memory 3.0 KiB, peak memory 329.2 MiB (329.1 MiB before)
    FAIL rng                    FULL-T8-R4
         under the same seed, replay draws differ from eager draws (the output: values differ): the graph does not read the seeded generator the way eager does (a seed set inside forward, or a private generator)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave -0.872553288936615, eager gave 0.14156797528266907; max abs diff 3.7, max ULP 57797744

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the rng failure shown; also failed: fresh_inputs, replay_matches_eager)
"""

from __future__ import annotations

import torch

from .common import Base


class ReseedsInForward(Base):
    """Seeds the generator inside forward: eager repeats its noise, replays do not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1234)
        return self.lin(x) + torch.randn_like(x)


class DrawsNoise(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.randn_like(x)
