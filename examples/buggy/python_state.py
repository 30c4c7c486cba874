"""Python state changed by every forward: a graph runs Python only at capture.

Caught by ``replay_matches_eager``. The plugin prints:

    PythonCounter on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 18 real batches, 12 failure(s) in fresh_inputs, real_batches, replay_matches_eager, 2 skipped; capture 2 ms, graph memory 2.5 KiB, peak memory 317.9 MiB (306.8 MiB before)
    FAIL replay_matches_eager   FULL-T8-R4
         Python state changes on every forward (calls: 11 -> 12), but a graph runs Python only at capture, so replay keeps the capture-time value (the output: values differ); keep such state in a registered buffer updated in place
         real batch (num_reqs=4, num_tokens=8, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave 3.7313127517700195, eager gave 8.955150604248047; max abs diff 7.85, max ULP 11155068

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the replay_matches_eager failure shown; also failed: fresh_inputs, real_batches)
"""

from __future__ import annotations

import torch

from .common import Base


class PythonCounter(Base):
    """Counts calls in a Python int: frozen at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class BufferCounter(Base):
    """The same counter in a buffer updated in place: graph-safe."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x) * self.calls
