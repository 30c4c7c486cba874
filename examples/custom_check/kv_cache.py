"""A paged KV-cache writer, as an attention layer of an engine has one, and its off-by-one twin.

Each token's key goes to the cache slot ``slot_mapping`` gives it; padded
tokens go to the engine's pad slot, a scratch region no request owns. The
buggy twin writes one slot past the right one. Eager and replay agree on
that, so no graph check can tell: it breaks an invariant of the engine,
which the engine's own check states (``check.py``).
"""

from __future__ import annotations

import torch

HIDDEN = 16
NUM_SLOTS = 64
#: Padded tokens write here; the slot after it takes the buggy twin's overflow.
PAD_SLOT = NUM_SLOTS - 2
SCRATCH = slice(PAD_SLOT, NUM_SLOTS)
PAD_VALUES = {"slot_mapping": PAD_SLOT}


class PagedKVWriter(torch.nn.Module):
    """Writes each token's key into its slot of the cache and attends to it (a one-slot stand-in)."""

    def __init__(self) -> None:
        super().__init__()
        self.key = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("kv", torch.zeros(NUM_SLOTS, HIDDEN))

    def slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        return slot_mapping

    def forward(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        k = self.key(x)
        self.kv.index_copy_(0, self.slots(slot_mapping), k)
        return self.out(x * torch.sigmoid(self.kv.index_select(0, slot_mapping)))


class OffByOneKVWriter(PagedKVWriter):
    """Writes each key one slot too far: into a slot another request owns."""

    def slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        return slot_mapping + 1


def make_inputs(
    num_tokens: int, num_reqs: int, *, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Hidden states and distinct slots for the real tokens, none of them in the scratch region."""
    slots = torch.randperm(PAD_SLOT - 1)[:num_tokens]
    return {"x": torch.randn(num_tokens, HIDDEN, device=device), "slot_mapping": slots.to(device)}
