"""A buffer rebound in forward: graphs keep reading the old memory.

Caught by ``address_stability``. The plugin prints:

    RebindsBuffer on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 18 real batches, 17 failure(s) in address_stability, fresh_inputs, real_batches, replay_matches_eager, state, 2 skipped; capture 3 ms, graph memory 3.0 KiB, peak memory 329.1 MiB (329.1 MiB before)
    FAIL address_stability      module
         module tensor 'running' moved: it was rebound to another tensor (address 0x5581f7ec8dc0 -> 0x5581f7ffe140), and graphs keep reading the old memory. Update it in place (copy_, mul_, add_) instead of rebinding the attribute
         output module tensor 'running'

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the address_stability failure shown; also failed: fresh_inputs, real_batches, replay_matches_eager, state)
"""

from __future__ import annotations

import torch

from .common import Base, D


class RebindsBuffer(Base):
    """Updates a running average by rebinding the buffer: graphs keep the old memory."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running = self.running * 0.5 + x[0]
        return self.lin(x) + self.running


class UpdatesBufferInPlace(RebindsBuffer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running.mul_(0.5).add_(x[0])
        return self.lin(x) + self.running
