"""A one-hot of labels whose count the forward reads from the data: ``F.one_hot(labels)``.

Without ``num_classes``, ``one_hot`` reads the largest label back to the host to size its
output, a sync no CUDA capture holds; with it, CUDA's kernel never leaves the device. On the
CPU both run ``.item()`` (the CPU also checks the labels' range on the host), so the emulator
answers as CUDA's code does, which the H200 confirmed (``scripts/value_rules.py``). Caught by
``capture_safety``. The plugin prints:

    CountsClasses on emulate (cpu) in train mode: 0/4 descriptors captured and verified (every descriptor), 0 real batches, 4 failure(s) in capture_safety, 35 skipped; capture 7 ms, graph memory 0 B, peak memory 305.5 MiB (227.0 MiB before)
    FAIL capture_safety         FULL-T8-R8
         1 op(s) cannot be captured in a graph; the first is torch.nn.functional.one_hot(num_classes=-1) (host sync: without num_classes it reads the largest label back to size its output; pass num_classes) in the top-level module, at examples/buggy/class_count.py:29 in forward

    (CPU emulator, `verify(...)`, capture sizes 1, 2, 4, 8; `CountsClassesGiven` passes every
    check, where the CPU's own range check alone would have been refused as a sync)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import Base, D


class CountsClasses(Base):
    """Adds a learned vector per feature group, picked by a one-hot of the group labels."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("groups", torch.arange(D) % 4)
        self.group_bias = torch.nn.Parameter(torch.randn(4, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picks = F.one_hot(self.groups).to(x.dtype)  # num_classes read from the labels: a sync
        return self.lin(x) + (picks @ self.group_bias).diagonal()


class CountsClassesGiven(CountsClasses):
    """The same one-hot with its class count given: nothing read back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picks = F.one_hot(self.groups, num_classes=4).to(x.dtype)
        return self.lin(x) + (picks @ self.group_bias).diagonal()
