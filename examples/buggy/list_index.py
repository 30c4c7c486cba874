"""Features reordered with a Python list index: ``y[:, [1, 0, 3, 2, ...]]`` in the forward.

torch turns the list into an index tensor in C++, on the host, and copies it to the device
from pageable memory: a raw capture fails ("Cannot copy between CPU and CUDA tensors during CUDA
graph capture unless the CPU tensor is pinned", learned on an H200 from OpInfo's ``__getitem__``
samples). On a GPU the guard stops at the ``aten.lift_fresh`` that makes the tensor of the list
(Python data copied into a new device tensor); on the emulator, where that tensor stays on the
host, it sees the Python call. Caught by ``capture_safety``. The plugin prints (emulator):

    PermutesWithList on emulate (cpu) in train mode: 0/4 descriptors captured and verified (every descriptor), 0 real batches, 4 failure(s) in capture_safety, 35 skipped; capture 6 ms, graph memory 0 B, peak memory 305.3 MiB (226.4 MiB before)
    FAIL capture_safety         FULL-T8-R4
         1 op(s) cannot be captured in a graph; the first is Tensor.__getitem__ with a Python list index (host-to-device copy: torch turns a Python list index into a host tensor and copies it to the device below every dispatcher, which a graph cannot record; index with a tensor kept on the device (a registered buffer), or with slices) in the top-level module, at examples/buggy/list_index.py:30 in forward

    (CPU emulator, `verify(...)`, capture sizes 1, 2, 4, 8)
"""

from __future__ import annotations

import torch

from .common import Base, D

_SWAPPED = [i ^ 1 for i in range(D)]  # neighbouring features swapped


class PermutesWithList(Base):
    """Swaps neighbouring features with a list index."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, _SWAPPED]


class PermutesWithBuffer(Base):
    """The same swap through an index tensor kept on the module's device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("swapped", torch.tensor(_SWAPPED), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, self.swapped]
