"""Weights synced between batches: in place, or by rebinding the parameter.

An RL rollout engine syncs new weights from the trainer between batches. A
graph reads each parameter by its address, so the sync must write into the
memory the graph captured (``param.copy_(new)``); ``param.data = new`` moves
the parameter to new memory and every graph keeps reading the old weights.

Here ``make_inputs`` does the sync, as a rollout loop does between batches:
the in-place sync passes every check (the state each run starts from is what
``make_inputs`` wrote; no forward is held to have written it), the rebinding
one is caught by ``address_stability`` (and by every check that compares a
replay with eager).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .common import Base, D


class Synced(Base):
    """A linear layer whose weights a trainer replaces between batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def syncing_inputs(
    module: Synced, *, in_place: bool, device: str | torch.device = "cpu"
) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """make_inputs that syncs new weights into ``module`` first: ``param.copy_(new)`` when
    ``in_place``, else ``param.data = new`` (the bug)."""
    step = [0]

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        step[0] += 1
        new = torch.randn(D, D, generator=torch.Generator().manual_seed(step[0])).to(device)
        with torch.no_grad():
            if in_place:
                module.lin.weight.copy_(new)
            else:
                module.lin.weight.data = new
        return {"x": torch.randn(num_tokens, D, device=device)}

    return make_inputs
