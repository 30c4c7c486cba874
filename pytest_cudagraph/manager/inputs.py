"""Calling ``make_inputs``: one batch of keyword inputs, or an error that says which call failed and why.

Every part of the manager that builds a sample (the layout's probes, the
capture's staging, the memory estimate's forwards) and the checks and runners
above it call ``make_inputs`` through ``call_make_inputs``. It sits below
``layout.py`` and ``estimate.py``, which both use it. ``check_forward_takes``
holds ``make_inputs``' keys to ``forward``'s arguments before anything runs, for
``verify`` and ``verify_training`` alike; ``forward_mismatch`` says how a call
of ``forward`` misses its arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ..errors import InternalError
from ..plan.validate import UsageError, short

__all__ = [
    "MakeInputsError",
    "call_make_inputs",
    "check_forward_takes",
    "forward_mismatch",
    "forward_signature",
    "unreadable",
]

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


def forward_signature(module: torch.nn.Module) -> Mapping[str, inspect.Parameter] | None:
    """``forward``'s parameters; None where Python cannot describe it (its own call will say).
    ``DistributedDataParallel`` hands every input on to the module it wraps: that one's."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None


def forward_mismatch(
    module: torch.nn.Module, keywords: Collection[str], positional: int = 0
) -> tuple[list[str], list[str], list[str]] | None:
    """How a call of ``module.forward`` with ``positional`` arguments and ``keywords`` misses its
    parameters: (the names it takes by keyword, the keywords it does not take, the arguments without
    a default that the call leaves out). None where its signature cannot be read. A forward that
    takes ``**kwargs`` takes every keyword."""
    params = forward_signature(module)
    if params is None:
        return None
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    anything = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [] if anything else [n for n in keywords if n not in takes]
    by_position = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = set(by_position[:positional]) | {n for n in keywords if n in takes}
    missing = [
        n
        for n, p in params.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in given
    ]
    return takes, unknown, missing


def check_forward_takes(
    module: torch.nn.Module, names: Collection[str], *, rest_to_loss: bool = False
) -> None:
    """``make_inputs``' keys against ``forward``'s arguments: one line before anything runs.

    ``verify`` passes ``forward`` every input, so every key must be one of its arguments.
    ``rest_to_loss`` (``verify_training``'s default step): ``forward`` gets the inputs it names and
    the loss all of them, so a key ``forward`` does not take is the loss's (a per-token weight,
    labels), and what must hold is that every argument ``forward`` needs is among the keys."""
    found = forward_mismatch(module, names)
    if found is None:
        return
    takes, unknown, missing = found
    forward = f"{type(module).__name__}.forward"
    if unknown and not rest_to_loss:
        raise UsageError(
            f"make_inputs returns key(s) {unknown} that {forward} does not take (its "
            f"arguments: {', '.join(takes) or 'none'}); make_inputs' keys must be forward's argument names"
        )
    if missing and rest_to_loss:
        raise UsageError(
            f"{forward} needs argument(s) {missing}, which no key of make_inputs gives (its keys: "
            f"{list(names)}; forward's arguments: {', '.join(takes) or 'none'}): the training step passes "
            "forward the inputs named after its arguments and the others to loss_fn alone; name make_inputs' "
            "keys after forward's arguments"
        )


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
