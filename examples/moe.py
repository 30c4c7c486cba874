"""A mixture-of-experts layer whose routing a graph can hold.

Routing usually sizes each expert's batch from the data (``nonzero``, counts
read on the host), which a graph cannot do. Here every shape is static: each
expert gets a fixed capacity of one slot per token, so no token is ever
dropped and nothing is counted on the host; tokens are placed by a one-hot
dispatch built from comparisons and a cumulative sum. Padded tokens take no
slot, so they cannot crowd out real ones.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

D = 32
EXPERTS = 4


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, D, 2 * D) * D**-0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, 2 * D, D) * (2 * D) ** -0.5)
        self.register_buffer("expert_ids", torch.arange(EXPERTS))

    def forward(self, x: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]  # the capacity: one slot per token (static per graph)
        gate, expert = F.softmax(self.router(x), dim=-1).max(dim=-1)
        # One-hot by comparison (F.one_hot checks its input on the host).
        assign = (expert[:, None] == self.expert_ids[None, :]) & ~is_padding[:, None]  # [T, E]
        slot = torch.cumsum(assign.to(torch.int64), dim=0) - 1  # each token's place in its expert
        slots = torch.arange(t, device=x.device)
        dispatch = (assign[:, :, None] & (slot[:, :, None] == slots[None, None, :])).to(x.dtype)  # [T, E, C]
        # Zero padded rows first: the dispatch weights them by 0, but 0 * NaN
        # is NaN (padding_isolation caught exactly that).
        expert_in = torch.einsum("tec,td->ecd", dispatch, torch.where(is_padding[:, None], 0.0, x))
        expert_out = torch.bmm(F.gelu(torch.bmm(expert_in, self.w_in)), self.w_out)
        y = torch.einsum("tec,ecd->td", dispatch, expert_out)
        return x + y * gate[:, None]


def make_inputs(
    num_tokens: int, num_reqs: int, *, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, D, device=device)}
