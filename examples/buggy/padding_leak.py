"""Masking padded rows by multiplying by 0: exact for zero padding, NaN for NaN padding.

Caught by ``padding_isolation``. The plugin prints:

    MaskByMultiply on emulate (cpu): 4/4 descriptors captured and verified (every descriptor), 27 real batches, 2 failure(s) in padding_isolation; capture 2 ms, graph memory 1.6 KiB
    FAIL padding_isolation      FULL-T8-R4
         real rows change when padded rows hold NaN instead of zeros: padding leaks into real rows (the output: values differ)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); output <the output> at index [0, 0]; graph gave nan, eager gave -1.329487919807434

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the padding_isolation failure shown)
"""

from __future__ import annotations

import torch

from .common import Base


class MaskByMultiply(Base):
    """Masks padded rows by multiplying by 0: exact for zero padding, NaN for NaN."""

    def forward(self, x: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:
        keep = (~is_padding).to(x.dtype)[:, None]
        pooled = (x * keep).sum(0, keepdim=True)
        return self.lin(x + pooled)


class MaskBySelect(Base):
    def forward(self, x: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:
        pooled = torch.where(is_padding[:, None], 0.0, x).sum(0, keepdim=True)
        return self.lin(x + pooled)
