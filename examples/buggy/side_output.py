"""A tensor stored on the module in forward: after replay it is the capture-time tensor.

Caught by ``side_outputs``. The plugin prints:

    StoresHidden on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 24 real batches, 3 failure(s) in side_outputs, 2 skipped; capture 2 ms, graph memory 2.5 KiB, peak memory 327.8 MiB (326.7 MiB before)
    FAIL side_outputs           FULL-T8-R4
         forward stores a new tensor in the plain attribute 'hidden' on every call, but a graph runs Python only at capture: after replay 'hidden' still holds the tensor stored at capture (a tensor of shape (1, 8), in graph memory that later replays overwrite) where eager leaves a tensor of shape (5, 8). Return it from forward, or copy it into a registered buffer in place (self.hidden.copy_(...))
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); output module attribute 'hidden'

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the side_outputs failure shown)
"""

from __future__ import annotations

import torch

from .common import Base


class StoresHidden(Base):
    """Keeps its hidden states for a drafter on a plain attribute, as speculative decoding does.

    A graph runs Python only at capture: after a replay ``self.hidden`` is
    still the tensor stored while capturing, padded to the capture size and in
    graph memory that the next replay overwrites.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.lin(x)
        self.hidden = hidden
        return hidden.relu()


class ReturnsHidden(Base):
    """Returns the hidden states beside the output: run() cuts and copies both."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.lin(x)
        return hidden.relu(), hidden
