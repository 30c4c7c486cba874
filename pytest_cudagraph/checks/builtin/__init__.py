"""The built-in checks, each beside its code in a module of its family, registered here in the
order they run, as a downstream suite registers its own.

The words of each ``Check`` (``compares``, ``catches``, ``applies``) are the checks table of
docs/checks.md (``scripts/refresh_docs.py`` writes it from ``BUILTIN.markdown_table()``).
"""

from __future__ import annotations

from typing import Any

from ..registry import Check, CheckRegistry
from .addresses import ADDRESS_STABILITY
from .capture_safety import CAPTURE_CHECK, CAPTURE_SAFETY
from .cross_shape import REAL_BATCHES
from .determinism import DETERMINISM, RNG
from .lifetime import OUTPUT_LIFETIME
from .padded_size import PADDED_SIZE
from .padding import PADDING_ISOLATION
from .replay import FRESH_INPUTS, REPLAY_MATCHES_EAGER
from .side_outputs import SIDE_OUTPUTS
from .state import STATE

__all__ = ["BUILTIN", "CAPTURE_CHECK", "DISPATCH_CHECK"]

#: Property-tests the manager's dispatch; runs in exhaustive verification.
DISPATCH_CHECK = "dispatch"


def _dispatch(ctx: Any, descs: Any) -> Any:
    """Every dispatch property, for generated real batches, against the manager's dispatch."""
    from ..dispatch import dispatch_check  # hypothesis is imported only when the check runs

    return dispatch_check(ctx, descs)


DISPATCH = Check(
    DISPATCH_CHECK,
    _dispatch,
    scope="module",
    compares="the manager's dispatch, property-tested with hypothesis over the graphs captured: every real "
    "batch goes to the smallest captured graph that can serve it, or runs eagerly",
    catches="a dispatcher that picks a graph too small, of the wrong mode or LoRA case, or none where one "
    "serves",
    applies="quick verification (`exhaustive=False`) or a subset of the plan captured; in a verification "
    "split by descriptor it runs in the item of the plan's first descriptor",
)

BUILTIN = CheckRegistry(
    [
        CAPTURE_SAFETY,
        REPLAY_MATCHES_EAGER,
        FRESH_INPUTS,
        REAL_BATCHES,
        PADDED_SIZE,
        PADDING_ISOLATION,
        STATE,
        SIDE_OUTPUTS,
        DETERMINISM,
        RNG,
        OUTPUT_LIFETIME,
        ADDRESS_STABILITY,
        DISPATCH,
    ]
)
