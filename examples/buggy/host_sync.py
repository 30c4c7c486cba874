"""A host sync: the module reads a device value as a Python number.

Caught by ``capture_safety``. The plugin prints:

    HostSync on emulate (cpu) in train mode: 0/4 descriptors captured and verified (every descriptor), 0 real batches, 4 failure(s) in capture_safety, 35 skipped; capture 3 ms, graph memory 0 B, peak memory 303.5 MiB (226.4 MiB before)
    FAIL capture_safety         FULL-T8-R4
         1 op(s) cannot be captured in a graph; the first is Tensor.item() (host sync) in the top-level module, at examples/buggy/host_sync.py:24 in forward

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the capture_safety failure shown)
"""

from __future__ import annotations

import torch

from .common import Base


class HostSync(Base):
    """Scales by a Python float read from the device: a host sync."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.lin.weight.abs().max().item()


class HostSyncFixed(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.lin.weight.abs().max()
