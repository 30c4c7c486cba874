"""A linear layer with LoRA adapters selected per token, graphed per active-adapter count.

The batch's active adapters sit in ``active_ids`` (fixed length, padded with
the all-zero adapter ``NO_ADAPTER``), each token names its adapter in
``token_adapter``. A graph is captured per LoRA case (0, 1, 2, 4 active
adapters): the case, read from ``current_descriptor()`` while capturing, is
how many adapter products the graph computes. A batch with 3 active adapters
dispatches to the case-4 graph; one with none to the case-0 graph, which
launches no adapter work at all.
"""

from __future__ import annotations

import torch
from torch import nn

from pytest_cudagraph import current_descriptor

D = 32
RANK = 4
NUM_ADAPTERS = 6
NO_ADAPTER = NUM_ADAPTERS  # an extra adapter of zeros
MAX_LORAS = 4
LORA_CASES = (0, 1, 2, 4)


class LoraLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(D, D)
        a = torch.randn(NUM_ADAPTERS + 1, D, RANK) * 0.1
        b = torch.randn(NUM_ADAPTERS + 1, RANK, D) * 0.1
        a[NO_ADAPTER] = 0
        b[NO_ADAPTER] = 0
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(b)

    def forward(self, x: torch.Tensor, token_adapter: torch.Tensor, active_ids: torch.Tensor) -> torch.Tensor:
        desc = current_descriptor()
        cases = desc.num_active_loras if desc is not None else MAX_LORAS
        y = self.base(x)
        # A Python loop over the LoRA case: frozen per graph, which is the point
        # of capturing one graph per case.
        for i in range(min(cases, MAX_LORAS)):
            # index_select, not lora_a[active_ids[i]]: indexing by a 0-dim
            # tensor reads it on the host (capture_safety caught exactly that).
            adapter = active_ids[i : i + 1]
            a = self.lora_a.index_select(0, adapter)[0]
            b = self.lora_b.index_select(0, adapter)[0]
            y = y + torch.where((token_adapter == adapter)[:, None], x @ a @ b, 0.0)
        return y


def make_inputs(
    num_tokens: int, num_reqs: int, *, active: int = 1, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """A batch whose requests use ``active`` adapters (0 to MAX_LORAS)."""
    ids = torch.full((MAX_LORAS,), NO_ADAPTER)
    ids[:active] = torch.randperm(NUM_ADAPTERS)[:active]
    per_req = (
        ids[torch.randint(0, max(active, 1), (num_reqs,))] if active else torch.full((num_reqs,), NO_ADAPTER)
    )
    sizes = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
    token_adapter = torch.repeat_interleave(per_req, torch.tensor(sizes))
    return {
        "x": torch.randn(num_tokens, D, device=device),
        "token_adapter": token_adapter.to(device),
        "active_ids": ids.to(device),
    }
