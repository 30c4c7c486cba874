"""The device a backend runs on, and a module and its inputs moved there, as the fixtures do.

Shared by the pytest side's fixtures and ``cudagraph-plan --estimate-memory``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..backends.factory import as_device
from ..options import concrete_backend
from ..plan.validate import UsageError

__all__ = ["default_device", "follow_device", "inputs_on", "move_to"]


def default_device(backend: str) -> torch.device:
    """The device a backend runs on: the current CUDA device for 'cuda', the CPU for 'emulate'."""
    backend = concrete_backend(backend)
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "backend 'cuda' was asked for, but torch.cuda.is_available() is False here (no GPU, or a CPU "
                "build of torch); use 'emulate' or 'auto'"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def move_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (dict values, list and tuple items, recursively) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: move_to(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(move_to(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    return value


def inputs_on(
    make_inputs: Callable[[int, int], Mapping[str, Any]], device: torch.device
) -> Callable[[int, int], Mapping[str, Any]]:
    """``make_inputs`` whose tensors (dict values, and inside lists and tuples) are moved to ``device``."""

    def moved(num_tokens: int, num_reqs: int) -> Mapping[str, Any]:
        # The manager's call_make_inputs around this says what a failing call or a non-dict means.
        inputs = make_inputs(num_tokens, num_reqs)
        if not isinstance(inputs, Mapping):
            return inputs
        return {name: move_to(value, device) for name, value in inputs.items()}

    return moved


def follow_device(
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    device: torch.device | str | None,
) -> Callable[[int, int], Mapping[str, Any]]:
    """On a CUDA device, the same test as on the CPU: the module moves there (in place,
    ``module.to(device)``) when it has CPU parameters or buffers, and the tensors
    ``make_inputs`` returns are moved there; elsewhere both are left as they are."""
    target = as_device(device)  # a UsageError for a device this torch lacks, before anything moves
    if target is None or target.type != "cuda":
        return make_inputs
    if any(t.device.type == "cpu" for t in (*module.parameters(), *module.buffers())):
        module.to(target)
    return inputs_on(make_inputs, target)
