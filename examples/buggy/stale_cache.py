"""A tensor memoised by the identity of its input: computed at warm-up, frozen into the graph.

Caught by ``fresh_inputs``. The plugin prints:

    IdentityMemo on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 22 real batches, 12 failure(s) in fresh_inputs, real_batches, side_outputs, 2 skipped; capture 2 ms, graph memory 2.0 KiB, peak memory 319.6 MiB (317.9 MiB before)
    FAIL fresh_inputs           FULL-T8-R4
         with fresh inputs after capture, replay differs from eager: values or tensors computed at capture were frozen into the graph (the output: values differ)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [0, 0]; graph gave 0.5652138590812683, eager gave 0.2572774291038513; max abs diff 1.35, max ULP 41310797; first divergent submodule: 'lin'

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the fresh_inputs failure shown; also failed: real_batches, side_outputs)
"""

from __future__ import annotations

import torch

from .common import Base


class IdentityMemo(Base):
    """Memoises a feature by the identity of its input tensor.

    The manager passes the same static views to warm-up and capture, so the
    feature is computed at warm-up, outside the graph, and frozen.
    """

    def __init__(self) -> None:
        super().__init__()
        self._last: torch.Tensor | None = None
        self._feature: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self._last:
            self._feature = torch.tanh(x)
            self._last = x
        assert self._feature is not None
        return self.lin(self._feature)


class NoMemo(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(x))
