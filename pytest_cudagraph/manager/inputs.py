"""Calling ``make_inputs``: one batch of keyword inputs, or an error that says which call failed and why.

Every part of the manager that builds a sample (the layout's probes, the
capture's staging, the memory estimate's forwards) and the checks and runners
above it call ``make_inputs`` through ``call_make_inputs``. It sits below
``layout.py`` and ``estimate.py``, which both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import InternalError
from ..plan.validate import UsageError, short

__all__ = ["MakeInputsError", "call_make_inputs", "unreadable"]

#: Python values an input may be: frozen into every graph as they are at capture.
_SCALARS = (bool, int, float, complex, type(None))
#: Devices a tensor input may be on: the emulator's, CUDA's, and meta (told apart by the layout).
_DEVICES = ("cpu", "cuda", "meta")


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
    call = f"make_inputs(num_tokens={num_tokens}, num_reqs={num_reqs})"
    if not isinstance(inputs, Mapping):
        raise MakeInputsError(
            f"make_inputs must return a dict of keyword inputs for module.forward, such as "
            f"{{'x': torch.randn(num_tokens, hidden)}}; {call} returned {type(inputs).__name__}"
        )
    for key, value in inputs.items():
        if not isinstance(key, str):
            raise MakeInputsError(
                f"{call} returned a dict with the key {short(key)} ({type(key).__name__}); its keys are "
                "module.forward's argument names, strings such as 'input_ids'"
            )
        why = unreadable(value)
        if why is not None:
            raise MakeInputsError(f"{call} returned input {key!r} as {why}")
    return dict(inputs)


def unreadable(value: Any) -> str | None:
    """Why the harness cannot take ``value`` as an input (None: it can). It takes a dense tensor
    (copied into a static buffer, compared, padded) and a Python number, bool or None, or a tuple
    or list of them (frozen into every graph as they are at capture); anything else it could
    neither copy nor compare, and would fail on deep inside."""
    if isinstance(value, torch.Tensor):
        if value.is_sparse or value.layout != torch.strided:
            return (
                f"a {value.layout} tensor, which has no static buffer a graph can read by address; "
                "make it dense (.to_dense()), or build the dense form in make_inputs"
            )
        if value.is_nested:
            return "a nested tensor, which has no static buffer a graph can read by address; pass padded dense tensors"
        if value.is_quantized:
            return "a quantized tensor; pass its dense values (.dequantize()) or its integer data as a tensor"
        if value.device.type not in _DEVICES:
            return f"a tensor on {value.device}; pytest-cudagraph runs on the CPU (the emulator) or on CUDA"
        return None
    if isinstance(value, _SCALARS):
        return None
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
        return None
    kind = type(value)
    if kind.__module__.split(".")[0] == "numpy":
        return (
            f"a numpy {kind.__name__}, which the harness can neither copy into a static buffer nor compare; "
            "pass torch.from_numpy(...) (a tensor)"
        )
    if isinstance(value, str):
        return (
            f"a string ({short(value, 40)}); inputs are tensors, or numbers, bools and None a graph freezes; "
            "turn it into a tensor of ids, or bind it into the module (functools.partial, an attribute)"
        )
    if isinstance(value, (Mapping, tuple, list)):
        items = value.values() if isinstance(value, Mapping) else value
        inner = next(type(v).__name__ for v in items if not isinstance(v, _SCALARS))
        return (
            f"a {kind.__name__} holding a {inner}; the harness reads each input as one tensor (or a number, or a "
            "list of numbers): pass each tensor as an input of its own"
        )
    return (
        f"an object of type {kind.__name__}, which the harness can neither copy into a static buffer nor compare; pass a "
        "tensor, or a number, bool or None"
    )
