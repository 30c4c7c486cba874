"""``side_outputs``: tensors a forward stores on plain attributes; and the walk over such
attributes the engine restores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...observe import MODULE_INTERNALS
from ...plan import BatchDescriptor
from ..compare import first_difference
from ..registry import Check
from ..report import Outcome
from ..verify_context import VerifyContext, clone_tree
from .common import finding_of


def tensor_attributes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Plain tensor attributes of the module tree (not parameters or buffers), by dotted name."""
    found: dict[str, torch.Tensor] = {}
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr not in MODULE_INTERNALS and isinstance(value, torch.Tensor):
                found[f"{path}.{attr}" if path else attr] = value
    return found


def _set_attribute(module: torch.nn.Module, dotted: str, value: Any) -> None:
    path, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(path) if path else module
    if value is None:
        owner.__dict__.pop(attr, None)
    else:
        owner.__dict__[attr] = value


@contextlib.contextmanager
def attributes_restored(module: torch.nn.Module) -> Iterator[None]:
    """Put the module tree's tensor attributes back (the objects themselves) when the block ends."""
    saved = tensor_attributes(module)
    try:
        yield
    finally:
        now = tensor_attributes(module)
        for name in set(saved) | set(now):
            if saved.get(name) is not now.get(name):
                _set_attribute(module, name, saved.get(name))


def _rebound_attributes(ctx: VerifyContext, desc: BatchDescriptor) -> list[str]:
    """Tensor attributes that forward binds to a new tensor on every call (two eager calls, once a
    verification, at the first descriptor's captured shape: one the device has run already)."""
    if ctx.rebound_attributes is None:
        batch = ctx.exact_batch(desc)
        inputs = ctx.make(batch)
        module = ctx.module
        with ctx.preserved_state() as state0, attributes_restored(module):
            seen = [tensor_attributes(module)]
            for _ in range(2):
                ctx.restore(state0)
                ctx.seed_all(ctx.seed)
                ctx.eager_real(clone_tree(inputs), batch)
                seen.append(tensor_attributes(module))
        before, first, second = seen
        ctx.rebound_attributes = [
            name
            for name, value in second.items()
            if first.get(name) is not value and before.get(name) is not first.get(name)
        ]
    return ctx.rebound_attributes


def _shape(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "nothing"


def side_outputs(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    """A tensor that forward stores on the module (``self.hidden = h``) is stale after replay.

    Python runs only at capture: after a replay the attribute still holds the
    tensor stored while capturing, padded to the capture size and in graph
    memory that later replays overwrite. Compared with what eager leaves there
    for the same real batch, with the attributes as capture left them.
    """
    rebound = _rebound_attributes(ctx, desc)
    if not rebound:
        return Outcome("side_outputs", desc, True, figures={"rebound_attributes": 0})
    batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
    inputs = ctx.make(batch)
    module = ctx.module
    with ctx.preserved_state() as state0, attributes_restored(module):
        ctx.seed_all(ctx.seed)
        ctx.eager_real(clone_tree(inputs), batch)
        attrs = tensor_attributes(module)
        expected = {name: clone_tree(attrs.get(name)) for name in rebound}
        # As a serving loop has them: what the last capture stored.
        for name in rebound:
            _set_attribute(module, name, ctx.captured_attributes.get(name))
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        ctx.run(clone_tree(inputs), batch)
        ctx.manager.synchronize()
        attrs = tensor_attributes(module)
        got = {name: clone_tree(attrs.get(name)) for name in rebound}
    for name in rebound:
        # Within tolerance: the attribute is compared with unpadded eager.
        diff = first_difference(got[name], expected[name], rtol=ctx.rtol, atol=ctx.atol)
        if diff is None:
            continue
        diff.path = f"module attribute '{name}'"
        return Outcome(
            "side_outputs",
            desc,
            False,
            f"forward stores a new tensor in the plain attribute '{name}' on every call, but a graph runs "
            f"Python only at capture: after replay '{name}' still holds the tensor stored at capture "
            f"({_shape(got[name])}, in graph memory that later replays overwrite) where eager leaves "
            f"{_shape(expected[name])}{'' if diff.reason.startswith('shape') else f' ({diff.reason})'}. "
            f"Return it from forward, or copy it into a "
            f"registered buffer in place (self.{name.rpartition('.')[2]}.copy_(...))",
            finding_of(diff, batch),
            figures={"rebound_attributes": len(rebound)},
        )
    return Outcome("side_outputs", desc, True, figures={"rebound_attributes": len(rebound)})


SIDE_OUTPUTS = Check(
    "side_outputs",
    side_outputs,
    compares="a tensor that `forward` stores on a plain attribute on every call (`self.hidden = h`) holds "
    "after `run()` what eager leaves there, with the attributes as capture left them",
    catches="side outputs kept on the module (hidden states for a drafter): after replay the attribute is "
    "the capture-time tensor, padded and in graph memory that later replays overwrite; named with "
    "its shape and the fix (return it, or copy into a registered buffer)",
    applies="never (a module that stores nothing passes)",
)
