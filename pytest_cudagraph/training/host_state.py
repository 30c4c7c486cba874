"""What a training step holds on the host, outside its tensors, which a graph freezes or runs no
code for: torch's generators' state (``_random_state``), the module's plain Python values and the
optimizer's settings a captured step reads as constants (``python_values``), and the sentences
that say where they changed (the step changed one, which a graph never does; one changed since
capture, which every replay still runs with)."""

from __future__ import annotations

from typing import Any

import torch

from ..observe import MODULE_INTERNALS
from .replicas import _Replica, _Sides


def _random_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Torch's generators' state: the CPU's, and each CUDA device's where CUDA is in use."""
    used = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if used else None
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _python_state(module: torch.nn.Module) -> dict[str, Any]:
    """The plain Python values the module keeps on itself (counters, flags), by dotted name."""
    return {
        f"{prefix}.{key}" if prefix else key: value
        for prefix, sub in module.named_modules()
        for key, value in vars(sub).items()
        if key not in MODULE_INTERNALS and isinstance(value, (bool, int, float, str))
    }


def _python_state_differs(graphed: torch.nn.Module, eager: torch.nn.Module) -> str:
    """Why, where a Python value of the module differs: the step changed it, and a graph runs no Python."""
    got, want = _python_state(graphed), _python_state(eager)
    changed = [k for k in want if got.get(k) != want[k]]
    if not changed:
        return ""
    name = changed[0]
    return (
        f"; the module's Python state differs too: {name!r} is {got.get(name)!r} after the replays and "
        f"{want[name]!r} in eager (Python runs at capture only: a value the step changes belongs in a buffer "
        "it updates in place, and a branch on it, such as an optimizer step every k micro-steps of gradient "
        "accumulation, in the loop's code between replays)"
    )


def _plain(value: Any) -> bool:
    """A Python value a graph freezes where it is read: a number, a flag, a string, a tuple of them."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, (bool, int, float, str))


def python_values(replica: _Replica) -> dict[str, Any]:
    """The copy's Python values a captured step reads as constants: the module's counters and flags,
    and each setting of the optimizer's parameter groups (a float learning rate), by what they are."""
    out = {f"the module's {name!r}": value for name, value in _python_state(replica.module).items()}
    groups = replica.optimizer.param_groups if replica.optimizer is not None else []
    for i, group in enumerate(groups):
        which = f" (parameter group {i})" if len(groups) > 1 else ""
        for key, value in group.items():
            if key != "params" and _plain(value):
                out[f"the optimizer's {key!r}{which}"] = value
    return out


def _frozen_since_capture(sides: _Sides) -> str:
    """Where a Python value the graph froze at capture has changed since, on the graphed copy (an
    LR scheduler, a counter the code between replays moves): named, with its value then and now,
    since every replay still runs with the value it had at capture."""
    if not sides.frozen:
        return ""
    now = python_values(sides.graphed)
    changed = [(name, then, now.get(name)) for name, then in sides.frozen.items() if now.get(name) != then]
    if not changed:
        return ""
    name, then, current = changed[0]
    others = [n for n, _, _ in changed[1:]]
    also = f" (so have {', '.join(others)})" if others else ""
    opt = sides.graphed.optimizer
    takes_tensor = opt is not None and all("capturable" in g for g in opt.param_groups)
    if name.startswith("the optimizer's 'lr'") and isinstance(then, float) and takes_tensor:
        device = next((str(p.device) for _, p in sides.graphed.params()), "cpu")
        # What the scheduler started from, where one keeps it: the rate the caller gave.
        given = sides.frozen.get(name.replace("'lr'", "'initial_lr'"), then)
        fix = (
            f"give the optimizer a tensor learning rate on the device (lr=torch.tensor({given!r}, "
            f"device={device!r}), with capturable=True), which the step reads where it lies and torch's LR "
            "schedulers set in place"
        )
    elif name.startswith("the optimizer's"):
        fix = "leave the optimizer's settings as they are at capture, or capture again once they change"
    else:
        fix = "keep the value in a buffer the code updates in place (fill_, copy_), which the step reads on the device"
    # The optimizer reads each of its settings at every step; whether forward reads a module's
    # attribute is not known here.
    read = "" if name.startswith("the optimizer's") else "where the step reads it, "
    return (
        f"; {name} was {then!r} at capture and is {current!r} now{also}: a graph keeps what the step read at "
        f"capture, so {read}every replay runs with {then!r}; {fix}"
    )
