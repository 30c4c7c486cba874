"""How the state a training step leaves is held to eager's.

Bit for bit where eager reproduces itself from the same start; else each tensor within
``FLOOR_FACTOR`` times what eager differed from itself by (kernels that accumulate in no fixed
order). Shared by the checks that hold a replayed step to an eager one (``checks.py``); apart from
them because it knows nothing of replicas or graphs, only of the tensors a step leaves by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..checks.compare import Difference, first_difference, largest_difference
from ..checks.report import Finding


def _up_to_gradients(key: str) -> bool:
    """What a step has made before its optimizer runs: the loss, the gradients, the buffers."""
    return key == "loss" or key.startswith(("grad of ", "buffer "))


def _difference(
    got: Mapping[str, Any], expected: Mapping[str, Any], *, tolerance: bool = False
) -> tuple[str, Finding] | None:
    keys = [k for k in expected if k in got]
    missing = sorted(set(expected) ^ set(got))
    if missing:
        return f"the graph's step leaves {missing[0]!r} where eager's does not (or the reverse)", Finding(
            output=missing[0]
        )
    bound = None if tolerance else 0.0  # None: each dtype's default tolerance
    diff = first_difference({k: got[k] for k in keys}, {k: expected[k] for k in keys}, rtol=bound, atol=bound)
    if diff is None:
        return None
    return _found(diff.path.strip("[]'") if diff.path else "", diff)


def _found(where: str, diff: Difference, why: str = "") -> tuple[str, Finding]:
    """What a check says of a difference in the tensor ``where``, and its finding."""
    return f"{where}: {diff.reason}{why}", Finding(
        output=where, index=diff.index, got=diff.got, expected=diff.expected, max_abs=diff.max_abs
    )


#: Where eager differs from itself, the graph may differ from eager by this many times as much.
FLOOR_FACTOR = 4


def _held(
    got: Mapping[str, Any], want: Mapping[str, Any], again: Mapping[str, Any]
) -> tuple[str, Finding] | None:
    """``got`` against ``want``: bit for bit where ``want`` reproduced itself (``again``, the same
    step run again from the same start); else each tensor within FLOOR_FACTOR times what it differed
    from itself by, or its dtype's tolerance where it did not differ (the step is not reproducible:
    kernels that accumulate in no fixed order, as an embedding's backward on a GPU does)."""
    if _difference(again, want) is None:
        return _difference(got, want)
    for key, w in want.items():
        g, a = got.get(key), again.get(key)
        if not (
            isinstance(w, torch.Tensor)
            and isinstance(g, torch.Tensor)
            and isinstance(a, torch.Tensor)
            and w.is_floating_point()
            and w.shape == a.shape
        ):
            found = _difference({key: g}, {key: w})
        else:
            drift = largest_difference(a, w, ulp=False)[0]
            if drift > 0:
                diff = first_difference(g, w, rtol=0.0, atol=FLOOR_FACTOR * drift)
                why = f"eager differs from itself here by up to {drift:.3g}; held within {FLOOR_FACTOR}x that"
            else:
                diff = first_difference(g, w, rtol=None, atol=None)
                why = "eager is not reproducible elsewhere in the step; held within the dtype's tolerance"
            found = None if diff is None else _found(key, diff, f" ({why})")
        if found is not None:
            return found
    return None
