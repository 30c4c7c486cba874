"""State in a tensor attribute that is not a registered buffer: replays drift.

Caught by ``determinism``. The plugin prints:

    UnregisteredState on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 14 real batches, 14 failure(s) in determinism, fresh_inputs, padding_isolation, replay_matches_eager, 10 skipped; capture 2 ms, graph memory 2.5 KiB, peak memory 326.9 MiB (325.7 MiB before)
    FAIL determinism            FULL-T8-R4
         two replays of the same inputs, from the same module state and seed, differ (the output: values differ): the module keeps state outside its registered buffers, or uses nondeterministic kernels
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); output <the output> at index [0, 0]; graph gave 29.52361488342285, eager gave 28.52361488342285; max abs diff 1, max ULP 524288

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the determinism failure shown; also failed: fresh_inputs, padding_isolation, replay_matches_eager)
"""

from __future__ import annotations

import torch

from .common import Base, D


class UnregisteredState(Base):
    """Accumulates into a tensor attribute that is not a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.acc: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.acc is None:
            self.acc = torch.zeros(D, device=x.device)
        self.acc.add_(1.0)
        return self.lin(x) + self.acc


class RegisteredState(Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(1.0)
        return self.lin(x) + self.acc
