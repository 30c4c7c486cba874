"""State in a tensor attribute that is not a registered buffer: replays drift.

Caught by ``determinism``. The plugin prints:

    UnregisteredState on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 18 real batches, 18 failure(s) in determinism, fresh_inputs, padding_isolation, real_batches, replay_matches_eager, 6 skipped; capture 2 ms, graph memory 2.5 KiB, peak memory 329.1 MiB (329.1 MiB before)
    FAIL determinism            FULL-T8-R4
         two replays of the same inputs, from the same module state and seed, differ (the output: values differ): the module keeps state outside its registered buffers, or uses nondeterministic kernels
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave 38.523616790771484, eager gave 37.523616790771484; max abs diff 1, max ULP 262144

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the determinism failure shown; also failed: fresh_inputs, padding_isolation, real_batches, replay_matches_eager)
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
