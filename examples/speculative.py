"""A speculative-decoding target model: each request scores its last token and k draft tokens at once.

Under dynamic speculative decoding the scheduler picks fewer draft tokens for larger batches,
so decode batches come with 1 to 1 + k tokens a request, and an engine captures a uniform
decode graph for each query length it may use (``decode_query_lens``). Each token attends to
its request's cached context (one slot a request in a registered buffer) and to the tokens of
its own request up to its position; padded rows are masked out as keys through the manager's
``is_padding``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB = 32
DIM = 16
CONTEXT = 3  # cached positions a request
MAX_REQS = 4


def spec_inputs(device: str | torch.device = "cpu") -> Callable[[int, int], dict[str, torch.Tensor]]:
    """``num_tokens`` split over ``num_reqs`` requests as evenly as they go (a uniform decode batch
    when they divide): token ids, each token's request and its position within the request, and
    each request's first token (``starts``, a row a request)."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        per, extra = divmod(num_tokens, num_reqs)
        lengths = torch.tensor([per + (1 if r < extra else 0) for r in range(num_reqs)])
        req = torch.repeat_interleave(torch.arange(num_reqs), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(num_tokens) - starts[req]
        ids = torch.randint(1, VOCAB, (num_tokens,))
        return {
            "ids": ids.to(device),
            "req": req.to(device),
            "pos": pos.to(device),
            "starts": starts.to(device),
        }

    return make_inputs


class SpecDecoder(nn.Module):
    """Scores 1 + k tokens a request against its cached context and its earlier tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("context", torch.randn(MAX_REQS, CONTEXT, DIM))

    def draft_mask(
        self, req: torch.Tensor, pos: torch.Tensor, is_padding: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        """Which tokens each token may attend to: its own request's, up to its position, no padding."""
        return (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None]) & ~is_padding[None, :]

    def forward(
        self,
        ids: torch.Tensor,
        req: torch.Tensor,
        pos: torch.Tensor,
        starts: torch.Tensor,
        is_padding: torch.Tensor,
    ) -> torch.Tensor:
        q = self.embed(ids)
        cached = self.context[req]  # (tokens, CONTEXT, DIM)
        scale = DIM**-0.5
        to_context = (q[:, None, :] * cached).sum(-1) * scale
        mask = self.draft_mask(req, pos, is_padding, starts)
        to_drafts = (q @ q.T * scale).masked_fill(~mask, float("-inf"))
        weights = torch.softmax(torch.cat([to_context, to_drafts], 1), 1)
        mixed = (weights[:, :CONTEXT, None] * cached).sum(1) + weights[:, CONTEXT:] @ q
        return self.head(mixed)
