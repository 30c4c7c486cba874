"""A Python number among the inputs (a max_seq_len, as engines pass attention metadata) that decides
the result: each graph holds the value its capture was given, and replays it for every smaller batch.

Caught by ``padded_size``, which names the input and both values. The plugin prints:

    ScalesByMaxSeqLen on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 10 real batches, 2 failure(s) in padded_size, 2 skipped; capture 9 ms, graph memory 2.5 KiB, peak memory 393.1 MiB (391.8 MiB before); float64 reference: floor 1.6e-16, limit 1e-14, peak 394.8 MiB
    FAIL padded_size            FULL-T8-R4
         eager at the graph's padded size (8 tokens), cut to the 5 real rows, differs from eager on those 5 tokens by 0.27 (relative rms of the output), in float64, where rounding moves it by 1.6e-16 (the floor: this forward with noise of one unit roundoff at every op whose rounding can differ between shapes, at one shape; the limit is 64x that, 1e-14): input 'max_seq_len' is a Python value, which a graph holds at the value its capture was given: FULL-T8-R4 holds max_seq_len=11, this batch has max_seq_len=8, and the graph's result depends on it (eager at the graph's shape computes other values with the batch's value). Pass it as a tensor input (the graph then reads each batch's value from its static buffer), or give it one value for every size (the largest, as engines pass max_seq_len)
         values first differ at torch.Tensor.div at examples/buggy/python_input.py:33 in forward, in the top-level module; real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); the output at index [2, 4]; eager at the padded shape gave -0.15691784356462612, eager on the real batch gave -0.21576203490136092; first divergent submodule: the top-level module

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the padded_size failure shown)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .common import Base, D


def seq_len_inputs(device: str | torch.device = "cpu") -> Callable[[int, int], dict[str, object]]:
    """Token rows and the batch's longest sequence as a Python int, as an engine's metadata gives it."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, object]:
        return {"x": torch.randn(num_tokens, D, device=device), "max_seq_len": num_tokens + 3}

    return make_inputs


class ScalesByMaxSeqLen(Base):
    """Normalises by the Python value: the graph divides by the capture's, whatever the batch."""

    def forward(self, x: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        return self.lin(x) / max_seq_len


class BoundedByMaxSeqLen(Base):
    """Uses the value as a bound every real position is within: any value of at least the batch's
    own gives the real rows the same result, so the capture's serves every smaller batch."""

    def forward(self, x: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        positions = torch.arange(x.shape[0], device=x.device).clamp(max=max_seq_len - 1)
        return self.lin(x) * (1.0 + positions[:, None] / 64.0)
