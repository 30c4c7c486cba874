"""A Python number written into a device tensor: a host-to-device copy, which a graph cannot record.

Caught by ``capture_safety``. The plugin prints:

    WritesPythonCount on emulate (cpu) in train mode: 0/4 descriptors captured and verified (every descriptor), 0 real batches, 4 failure(s) in capture_safety, 35 skipped; capture 3 ms, graph memory 0 B, peak memory 306.8 MiB (303.5 MiB before)
    FAIL capture_safety         FULL-T8-R4
         1 op(s) cannot be captured in a graph; the first is aten.copy_.default (host-to-device copy: a value made on the host (a Python number, or torch.tensor data) is written into a graph tensor, which a graph cannot record; write it with fill_/torch.where from a device tensor, or keep it in a registered buffer updated on the device) in the top-level module, at examples/buggy/host_value.py:37 in forward

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the capture_safety failure shown)

On a GPU the capture itself fails ("Cannot copy between CPU and CUDA tensors
during CUDA graph capture unless the CPU tensor is pinned"): indexing makes a
CPU tensor of the number and copies it into ``bump``. On the emulator every
tensor is on the CPU, so the guard tells host values from the graph's by where
they were made (from Python data, inside the forward) and refuses the same
write. The fix keeps the count on the device and updates it with a kernel.
"""

from __future__ import annotations

import torch

from .common import Base


class WritesPythonCount(Base):
    """Counts calls in Python and writes the count into a buffer by indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.register_buffer("bump", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.bump[0] = float(self.calls)  # a host-to-device copy of a Python number
        return self.lin(x) + self.bump


class CountsOnDevice(Base):
    """The same count kept on the device: an in-place add is a kernel the graph replays."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bump", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.bump.add_(1)
        return self.lin(x) + self.bump
