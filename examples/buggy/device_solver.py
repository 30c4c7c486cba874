"""A solver that checks its result on the host: ``torch.linalg.inv`` in the forward.

``torch.linalg.inv`` runs ``linalg_inv_ex`` and then checks its error codes on the host
(``_linalg_check_errors``), a sync no CUDA capture holds; ``torch.linalg.inv_ex`` returns the
codes as a tensor and checks nothing. On the CPU nothing refuses a sync: the emulator knows it
from the table of what CUDA captures, learned op by op on a GPU (``scripts/capturability.py``).
Caught by ``capture_safety``. The plugin prints:

    InvertsInForward on emulate (cpu) in train mode: 0/4 descriptors captured and verified (every descriptor), 0 real batches, 4 failure(s) in capture_safety, 35 skipped; capture 14 ms, graph memory 0 B, peak memory 309.3 MiB (226.3 MiB before)
    FAIL capture_safety         FULL-T8-R4
         1 op(s) cannot be captured in a graph; the first is aten._linalg_check_errors.default (a CUDA graph capture refuses it: CUDA error: operation not permitted when stream is capturing, learned on NVIDIA H200, torch 2.11.0+cu130, 2026-12-01 19:55 UTC) in the top-level module, at examples/buggy/device_solver.py:28 in forward

    (CPU emulator, `verify(...)`, capture sizes 1, 2, 4, 8; on an H200 the guard stops the same op
    before the device runs it, and without the table CUDA's own error names it)
"""

from __future__ import annotations

import torch

from .common import Base


class InvertsInForward(Base):
    """Mixes the features through the inverse of a learned, well-conditioned matrix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = torch.linalg.inv(self.lin.weight + 4 * torch.eye(self.lin.weight.shape[0], device=x.device))
        return self.lin(x) @ mix


class InvertsWithoutCheck(Base):
    """The same inverse from ``inv_ex``: its error codes stay on the device, unread."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = torch.linalg.inv_ex(
            self.lin.weight + 4 * torch.eye(self.lin.weight.shape[0], device=x.device)
        ).inverse
        return self.lin(x) @ mix
