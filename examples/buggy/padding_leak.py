"""Padded rows that reach real ones: pooling over them, and masking by multiplication.

``PoolsPaddedRows`` pools over every row. With zero padding the sum is right,
so the unpadded comparison (``real_batches``) cannot see it; an engine's
padded rows hold whatever an earlier batch left there. Caught by
``padding_isolation``. The plugin prints:

    PoolsPaddedRows on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 20 real batches, 2 failure(s) in padding_isolation, 2 skipped; capture 2 ms, graph memory 2.5 KiB, peak memory 324.3 MiB (323.2 MiB before)
    FAIL padding_isolation      FULL-T8-R4
         real rows change when padded rows of 'x' hold random values instead of zeros: padding leaks into real rows (the output: values differ)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave -3.6182351112365723, eager gave -1.329487919807434; max abs diff 2.29, max ULP 54856980

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the padding_isolation failure shown)

``MaskByMultiply`` masks padded rows by multiplying by 0: exact for every
finite value, so it passes by default; ``0 * NaN`` is NaN, which the strict
``nonfinite_padding=True`` (``--cudagraph-nonfinite-padding``) finds and
says so. The plugin prints:

    MaskByMultiply on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 20 real batches, 2 failure(s) in padding_isolation, 2 skipped; capture 3 ms, graph memory 2.5 KiB, peak memory 325.5 MiB (324.3 MiB before)
    FAIL padding_isolation      FULL-T8-R4
         real rows change when padded rows of 'x' hold NaN instead of zeros: padding leaks into real rows (the output: values differ) (found by nonfinite_padding=True, a strictness beyond engines, which pad with finite values: every finite padding tried left the real rows unchanged; typically 0 * NaN where a weight is 0)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave nan, eager gave -1.329487919807434

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8, nonfinite_padding=True; the padding_isolation failure shown)

``MaskBySelect`` masks with ``torch.where`` and passes both.
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


class PoolsPaddedRows(Base):
    """Pools over every row, padded ones included: right only while padding is zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x.sum(0, keepdim=True)
        return self.lin(x + pooled)


class MaskBySelect(Base):
    def forward(self, x: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:
        pooled = torch.where(is_padding[:, None], 0.0, x).sum(0, keepdim=True)
        return self.lin(x + pooled)
