"""Expert loads counted by token id, padded rows included: every padded step counts the pad id.

A router that sends each token to an expert by its id (hash routing) and counts the load per
expert in a buffer, for a load balancer to read (expert-parallel load balancing keeps such
counts). In a graph padded to more rows than the batch has, the padded rows carry the pad id,
and their counts go into the buffer with the real ones. Caught by ``padding_isolation``, which
fills padded integer rows with other ids within make_inputs' range, and by ``state``, which
compares the buffer after a padded batch with what eager leaves on the real rows. The plugin
prints:

    HashRoutedLoad on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 23 real batches, 4 failure(s) in padding_isolation, state, 2 skipped; capture 4 ms, graph memory 2.5 KiB, peak memory 323.2 MiB (321.3 MiB before)
    FAIL padding_isolation      FULL-T8-R4
         module state 'load' changes when padded rows of 'ids' hold the largest value make_inputs gives instead of their pad value: padded rows write into state (mask them out through is_padding, or route them to a scratch slot and name it in scratch_state)
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1); output load at index [0]; graph gave 6.0, eager gave 9.0; max abs diff 3, max ULP 5242880

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the padding_isolation failure shown; also failed: state)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .common import D

EXPERTS = 4
VOCAB = 64


def id_inputs(device: str | torch.device = "cpu") -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Token ids (1 to VOCAB - 1: 0 is the pad id)."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"ids": torch.randint(1, VOCAB, (num_tokens,), device=device)}

    return make_inputs


class HashRoutedLoad(nn.Module):
    """Routes token ``i`` to expert ``i % EXPERTS`` and counts every row's expert, padded ones too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.lin = nn.Linear(D, D)
        self.register_buffer("load", torch.zeros(EXPERTS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.load.index_add_(0, ids % EXPERTS, torch.ones(ids.shape[0], device=ids.device))
        return self.lin(self.embed(ids))


class MaskedHashRoutedLoad(HashRoutedLoad):
    """Counts real rows only: the manager's ``is_padding`` mask weighs padded rows 0."""

    def forward(self, ids: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.load.index_add_(0, ids % EXPERTS, (~is_padding).to(self.load.dtype))
        return self.lin(self.embed(ids))
