"""The floor's noise: which tensors carry rounding that can differ between batch shapes (set on a
product's or reduction's result and on what is computed from it, ``_mark_noisy``), and the ops
whose result is exact in float64, on which the floor's run puts none."""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

#: Ops whose result is exact in float64 (a selection, a sign, an integer part): the floor's run puts
#: no noise on them. Noise there would be rounding no op does, and would move an integer-valued
#: result off its integer, which a cast to int8 after it then truncates a whole step down.
_ROUNDS_NOTHING = frozenset(
    getattr(aten, n)
    for n in (
        "round",
        "floor",
        "ceil",
        "trunc",
        "sign",
        "abs",
        "neg",
        "clamp",
        "clamp_min",
        "clamp_max",
        "amax",
        "amin",
        "max",
        "min",
        "maximum",
        "minimum",
        "where",
        "relu",
        "_to_copy",
        "clone",
    )
)


# Set on the floor's tensors that carry noise (rounding that can differ between shapes) and on what
# is computed from them. A pointwise op on values that carry none (the caller's inputs, the weights,
# an exact scale made from them) rounds the same at every shape: noise there would be rounding no
# two shapes differ by, and at a tie (x / scale exactly k + 0.5, before a cast to int8) it moves a
# quantized value a whole step.
_NOISY = "_pytest_cudagraph_noisy"


def _carries_noise(values: Any) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if getattr(v, _NOISY, False):
                return True
        elif isinstance(v, (list, tuple)) and _carries_noise(v):
            return True
    return False


def _mark_noisy(out: Any) -> None:
    if isinstance(out, torch.Tensor):
        setattr(out, _NOISY, True)
    elif isinstance(out, (list, tuple)):
        for o in out:
            _mark_noisy(o)
