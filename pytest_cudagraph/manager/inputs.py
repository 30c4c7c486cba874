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
from ..plan.validate import UsageError

__all__ = [
    "MakeInputsError",
    "call_make_inputs",
    "check_forward_takes",
    "forward_mismatch",
    "forward_signature",
]


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
