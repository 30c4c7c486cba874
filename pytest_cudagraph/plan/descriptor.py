"""The batch descriptor: the shape a graph was captured for, or a batch runs at."""

from __future__ import annotations

from dataclasses import dataclass, field

from .modes import GraphMode

__all__ = ["BatchDescriptor"]


@dataclass(frozen=True)
class BatchDescriptor:
    """Describes one padded batch shape and the graph mode that runs it.

    A captured graph is keyed by its descriptor; ``CapturePlan.dispatch``
    answers with the descriptor whose graph serves a real batch (or a ``NONE``
    descriptor: run eagerly).

    ``num_reqs`` is ``None`` for graphs that need no request padding
    (PIECEWISE). ``uniform_token_count`` is set on graphs that only serve
    batches in which every request has exactly that many tokens (uniform
    decode). ``max_query_len`` bounds each request's tokens (varlen decode
    graphs, which must never see a prefill). ``num_ubatches`` > 1 marks a graph
    captured for a batch split into that many microbatches.
    """

    mode: GraphMode
    num_tokens: int
    num_reqs: int | None = None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1
    # Descriptors key every graph lookup on the replay path: hash once.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    self.mode,
                    self.num_tokens,
                    self.num_reqs,
                    self.uniform_token_count,
                    self.max_query_len,
                    self.num_active_loras,
                    self.num_ubatches,
                )
            ),
        )

    def __hash__(self) -> int:
        return self._hash

    def is_compatible(
        self,
        *,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> bool:
        """Whether a graph captured for this descriptor can serve the batch.

        ``num_active_loras`` must already be mapped onto a captured LoRA case
        (``CapturePlan.effective_loras``): a graph serves exactly its own case.
        """
        # A graph without a uniform count serves any mix of query lengths.
        if self.uniform_token_count is not None and self.uniform_token_count != uniform_token_count:
            return False
        # A graph that bounds query length cannot serve a caller that does not
        # say its longest query (None means "may hold a prefill").
        if self.max_query_len is not None and (max_query_len is None or max_query_len > self.max_query_len):
            return False
        if self.num_reqs is not None and num_reqs > self.num_reqs:
            return False
        return (
            num_tokens <= self.num_tokens
            and self.num_active_loras == num_active_loras
            and self.num_ubatches == num_ubatches
        )

    @property
    def is_graphed(self) -> bool:
        """False for the eager (``NONE``) descriptor."""
        return self.mode is not GraphMode.NONE

    def label(self) -> str:
        """A short, stable name for reports and test ids."""
        parts = [f"{self.mode.name}", f"T{self.num_tokens}"]
        if self.num_reqs is not None:
            parts.append(f"R{self.num_reqs}")
        if self.uniform_token_count is not None:
            parts.append(f"U{self.uniform_token_count}")
        if self.max_query_len is not None:
            parts.append(f"Q{self.max_query_len}")
        if self.num_active_loras:
            parts.append(f"L{self.num_active_loras}")
        if self.num_ubatches != 1:
            parts.append(f"B{self.num_ubatches}")
        return "-".join(parts)

    def __str__(self) -> str:
        fields = [f"mode={self.mode.name}", f"tokens={self.num_tokens}"]
        fields.append(f"reqs={self.num_reqs if self.num_reqs is not None else 'any'}")
        if self.uniform_token_count is not None:
            fields.append(f"uniform={self.uniform_token_count}")
        if self.max_query_len is not None:
            fields.append(f"max_query_len={self.max_query_len}")
        fields.append(f"loras={self.num_active_loras}")
        if self.num_ubatches != 1:
            fields.append(f"ubatches={self.num_ubatches}")
        return "BatchDescriptor(" + ", ".join(fields) + ")"
