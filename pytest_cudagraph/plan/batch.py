"""A real batch, as dispatch sees it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Batch"]


@dataclass(frozen=True)
class Batch:
    """The shape of one real batch and what dispatch needs to know of it.

    ``uniform_token_count``: tokens per request when every request has the
    same count (a uniform decode batch), else None. ``max_query_len``: the
    longest request's tokens, or None when the batch may hold a prefill.
    ``num_active_loras``: adapters the batch uses. ``num_ubatches``: how many
    microbatches it is split into.
    """

    num_tokens: int
    num_reqs: int
    uniform_token_count: int | None = None
    num_active_loras: int = 0
    max_query_len: int | None = None
    num_ubatches: int = 1

    def dispatch_args(self) -> dict[str, Any]:
        """Keyword arguments for ``CapturePlan.dispatch``."""
        return {
            "num_reqs": self.num_reqs,
            "num_tokens": self.num_tokens,
            "uniform_token_count": self.uniform_token_count,
            "num_active_loras": self.num_active_loras,
            "max_query_len": self.max_query_len,
            "num_ubatches": self.num_ubatches,
        }

    def shape(self) -> dict[str, Any]:
        """The same, for reports."""
        return self.dispatch_args()

    def __str__(self) -> str:
        parts = [f"tokens={self.num_tokens}", f"reqs={self.num_reqs}"]
        if self.uniform_token_count is not None:
            parts.append(f"uniform={self.uniform_token_count}")
        parts.append(f"max_query_len={self.max_query_len if self.max_query_len is not None else 'prefill'}")
        parts.append(f"loras={self.num_active_loras}")
        if self.num_ubatches != 1:
            parts.append(f"ubatches={self.num_ubatches}")
        return "Batch(" + ", ".join(parts) + ")"
