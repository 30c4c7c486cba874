"""What the module under capture may ask: which descriptor is running.

A module that specialises on the batch shape (a LoRA layer looping over the
active adapters of its case, say) reads ``current_descriptor()`` while it is
warmed up, captured, or run eagerly. Whatever Python reads from it during
capture is frozen into that descriptor's graph, which is exactly right for
shape-level facts and wrong for anything that changes per batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from .plan import BatchDescriptor

__all__ = ["current_descriptor"]

_CURRENT: ContextVar[BatchDescriptor | None] = ContextVar("pytest_cudagraph_descriptor", default=None)


def current_descriptor() -> BatchDescriptor | None:
    """The descriptor being captured or run eagerly, or None outside the manager."""
    return _CURRENT.get()


@contextlib.contextmanager
def running(desc: BatchDescriptor) -> Iterator[None]:
    token = _CURRENT.set(desc)
    try:
        yield
    finally:
        _CURRENT.reset(token)
