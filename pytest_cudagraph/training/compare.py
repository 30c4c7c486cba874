"""How the state a training step leaves is held to eager's.

Bit for bit where eager reproduces itself from the same start and rounding does not move it; else
each tensor within ``FLOOR_FACTOR`` times what eager differed from itself by (kernels that
accumulate in no fixed order) or what one unit of rounding at its products moves it by
(``rounding.py``: the device may run another kernel under capture). Shared by the checks that hold a replayed step to an eager one (``checks.py``); apart from
them because it knows nothing of replicas or graphs, only of the tensors a step leaves by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


#: Where eager differs from itself, or rounding moves it, the graph may differ by this many times as much.
FLOOR_FACTOR = 4


@dataclass(frozen=True)
class Drift:
    """A tensor the graph's step left other than eager's, within what eager moves by there."""

    tensor: str
    graph: float  # the graph's largest difference from eager
    eager: float  # eager's from itself, run again from the same start (0: it reproduced itself)
    rounding: float  # eager's with one unit of rounding at each op that rounds in a kernel's order

    def describe(self) -> str:
        return (
            f"{self.tensor} (graph {self.graph:.3g} from eager; eager {self.eager:.3g} from itself, "
            f"{self.rounding:.3g} with its rounding moved)"
        )


def _held(
    got: Mapping[str, Any],
    want: Mapping[str, Any],
    again: Mapping[str, Any],
    rounding: Callable[[str], float] | None = None,
    drifts: list[Drift] | None = None,
) -> tuple[str, Finding] | None:
    """``got`` against ``want``, each tensor bit for bit where it is the same, else within
    FLOOR_FACTOR times the most eager moves there: from itself (``again``, the same step run again
    from the same start: kernels that accumulate in no fixed order) or, given ``rounding``, with one
    unit of rounding at each op whose rounding depends on the kernel (``rounding(key)``, measured
    once asked: the device may run another kernel under capture than eagerly). Where neither moves
    it, bit for bit; without ``rounding``, where eager reproduced itself everywhere, bit for bit, and
    a tensor that did not drift in a step that did elsewhere within its dtype's tolerance. The
    tensors held within a floor are appended to ``drifts``."""
    if rounding is None and _difference(again, want) is None:
        return _difference(got, want)
    missing = sorted(set(want) ^ set(got))
    if missing:
        return _difference(got, want)
    for key, w in want.items():
        g, a = got.get(key), again.get(key)
        if not (
            isinstance(w, torch.Tensor)
            and isinstance(g, torch.Tensor)
            and isinstance(a, torch.Tensor)
            and w.is_floating_point()
            and w.shape == a.shape == g.shape
            and w.dtype == g.dtype
        ):
            found = _difference({key: g}, {key: w})
            if found is not None:
                return found
            continue
        moved = largest_difference(g, w, ulp=False)[0]
        if moved == 0:
            continue
        drift = largest_difference(a, w, ulp=False)[0]
        floor = rounding(key) if rounding is not None else 0.0
        bound = FLOOR_FACTOR * max(drift, floor)
        if bound > 0:
            diff = first_difference(g, w, rtol=0.0, atol=bound)
            why = (
                f"eager differs from itself here by up to {drift:.3g}"
                + (f", and by {floor:.3g} with one unit of rounding at each product" if rounding else "")
                + f"; held within {FLOOR_FACTOR}x that"
            )
        elif rounding is not None:
            diff = first_difference(g, w)
            why = "eager reproduces itself here, and rounding at its products does not move it: held bit for bit"
        else:
            diff = first_difference(g, w, rtol=None, atol=None)
            why = "eager is not reproducible elsewhere in the step; held within the dtype's tolerance"
        if diff is not None:
            return _found(key, diff, f" ({why})")
        if drifts is not None:
            drifts.append(Drift(key, moved, drift, floor))
    return None
