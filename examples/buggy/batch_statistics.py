"""Statistics over the whole batch: padded rows change the real rows.

Caught by ``real_batches``. The plugin prints:

    BatchStatistics on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 18 real batches, 4 failure(s) in padding_isolation, real_batches, 2 skipped; capture 2 ms, graph memory 2.5 KiB, peak memory 321.3 MiB (319.6 MiB before)
    FAIL real_batches           FULL-T8-R4
         real rows are off systematically: 100% of their difference from eager on the unpadded batch is one offset per feature, the same in every row (statistics over the rows of the batch) (the output; graph vs unpadded eager: max 0.0995, rms 0.0575; eager vs itself across shapes (at the graph's padded shape): max 0.0995, rms 0.0575). Rounding across batch shapes is random in sign; a systematic difference comes from a computation that depends on the padded batch size (a Python branch on the token count, a scale computed from it, statistics over the padded rows)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave -0.3697471618652344, eager gave -0.30576443672180176; max abs diff 0.0995, max ULP 27354708; first divergent submodule: 'lin'

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the real_batches failure shown; also failed: padding_isolation)
"""

from __future__ import annotations

import torch

from .common import Base


class BatchStatistics(Base):
    """Centres by the mean over all tokens, padded rows included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(0, keepdim=True))


class TokenStatistics(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(-1, keepdim=True))


def _float32_kernel(h: torch.Tensor) -> torch.Tensor:
    """A kernel written for float32 alone (an extension called directly, say): it refuses float64."""
    if h.dtype != torch.float32:
        raise TypeError(f"this kernel takes float32 tensors, got {h.dtype}")
    return torch.tanh(h)


class BatchStatisticsInFloat32Kernel(Base):
    """The same statistics through a kernel for float32 alone: the float64 reference cannot run it,
    so ``padded_size`` asks its question in float32 with TF32 off, held to that precision's floor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _float32_kernel(self.lin(x - x.mean(0, keepdim=True)))


class TokenStatisticsInFloat32Kernel(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _float32_kernel(self.lin(x - x.mean(-1, keepdim=True)))


def _bf16_kernel(h: torch.Tensor) -> torch.Tensor:
    """A kernel written for bfloat16 alone (a fused attention extension, say): it refuses every
    other dtype, float32 included."""
    if h.dtype != torch.bfloat16:
        raise TypeError(f"this kernel takes bfloat16 tensors, got {h.dtype}")
    return torch.tanh(h)


class BatchStatisticsInBf16Kernel(Base):
    """The same statistics, in bf16 through a kernel for bf16 alone: no reference can run it, in
    float64 or in float32, so ``real_batches`` holds the real rows to unpadded eager within the
    floor it measures in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        return _bf16_kernel(self.lin(x - x.mean(0, keepdim=True)))


class TokenStatisticsInBf16Kernel(BatchStatisticsInBf16Kernel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        return _bf16_kernel(self.lin(x - x.mean(-1, keepdim=True)))
