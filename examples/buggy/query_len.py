"""Attention metadata planned once per request count: a graph of one query length replays another's.

Under dynamic speculative decoding there are several uniform decode graphs with the same
request count: four requests of one token, and of two. Attention backends keep what they
planned for a graph (a wrapper, its block size) per batch size, that is per request count; kept
so, the first graph captured for four requests hands its query length to every later one, and
those replay with a per-request length frozen at capture, mixing tokens of different requests.
Eager, which plans every call afresh, is right, so the bug lives in the graphs alone. Caught by
``real_batches``, which names the cause when eager on the capture path differs from eager as
users run it. The plugin prints (trimmed):

    FAIL real_batches           FULL-T6-R2-U3
         the module computes something else when it is captured: on the unpadded batch itself, eager on its capture path (torch.cuda.is_current_stream_capturing() answering True) differs from eager as users run it (the output: values differ), and the graph agrees with the capture path. Look for a branch on capturing, or state kept for captures (metadata planned per request count or per token count, shared by graphs of several query lengths). What the check saw: real rows are off systematically: ...

    (CPU emulator, `verify(...)` with capture sizes 1, 2, 4, 8, FULL_DECODE_ONLY, decode_query_lens
    (1, 2, 3, 4); 4 of its 10 graphs fail: those that share a request count with a graph captured
    before them)
"""

from __future__ import annotations

import torch

from ..speculative import SpecDecoder


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # a CPU-only torch has no stream to capture (under the emulator it answers)
        return False


def _blocks(n: int, q: int, is_padding: torch.Tensor) -> torch.Tensor:
    """Requests of ``q`` tokens each, causal within a request, padded rows never a key."""
    i = torch.arange(n, device=is_padding.device)
    return (i[:, None] // q == i[None, :] // q) & (i[None, :] % q <= i[:, None] % q) & ~is_padding[None, :]


class PlannedPerRequestCount(SpecDecoder):
    """Under capture, reuses the block size planned for the first graph of each request count."""

    def __init__(self) -> None:
        super().__init__()
        self.planned: dict[int, int] = {}

    def draft_mask(
        self, req: torch.Tensor, pos: torch.Tensor, is_padding: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        n, reqs = req.shape[0], starts.shape[0]
        if _capturing():
            q = self.planned.setdefault(reqs, n // reqs)  # kept by request count alone
        else:
            q = n // reqs
        return _blocks(n, q, is_padding)


class PlannedPerGraph(SpecDecoder):
    """The same blocks, planned for each call's own token and request counts."""

    def draft_mask(
        self, req: torch.Tensor, pos: torch.Tensor, is_padding: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        n, reqs = req.shape[0], starts.shape[0]
        return _blocks(n, n // reqs, is_padding)
