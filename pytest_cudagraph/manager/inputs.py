"""Calling ``make_inputs``: one batch of keyword inputs, or an error that says which call failed and why.

Every part of the manager that builds a sample (the layout's probes, the
capture's staging, the memory estimate's forwards) and the checks and runners
above it call ``make_inputs`` through ``call_make_inputs``. It sits below
``layout.py`` and ``estimate.py``, which both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InternalError
from ..plan.validate import UsageError

__all__ = ["MakeInputsError", "call_make_inputs"]


class MakeInputsError(UsageError):
    """``make_inputs`` returned something unusable; the message names the call and the fix."""


def call_make_inputs(
    make_inputs: Callable[[int, int], Mapping[str, Any]], num_tokens: int, num_reqs: int
) -> dict[str, Any]:
    try:
        inputs = make_inputs(num_tokens, num_reqs)
    except (MakeInputsError, InternalError):  # already says which call and what to do, or that it is ours
        raise
    except Exception as exc:  # the user's code: say which call failed
        InternalError.raise_if_in(exc)  # make_inputs raised because the harness's bookkeeping under it failed
        raise MakeInputsError(
            f"make_inputs(num_tokens={num_tokens}, num_reqs={num_reqs}) raised "
            f"{type(exc).__name__}: {exc}. make_inputs must build inputs for any "
            "1 <= num_reqs <= num_tokens (the manager probes small shapes to learn "
            "which dimension follows which count)"
        ) from exc
    if not isinstance(inputs, Mapping) or not all(isinstance(k, str) for k in inputs):
        raise MakeInputsError(
            f"make_inputs must return a dict of keyword inputs for module.forward, such as "
            f"{{'x': torch.randn(num_tokens, hidden)}}; make_inputs(num_tokens={num_tokens}, "
            f"num_reqs={num_reqs}) returned {type(inputs).__name__}"
        )
    return dict(inputs)
