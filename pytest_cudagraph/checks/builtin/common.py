"""What the built-in checks share: where a difference is, the hints a failure adds, outcomes that
say why nothing could be compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...plan import Batch, BatchDescriptor
from ...plan.validate import short
from ..compare import Difference, first_difference
from ..report import Finding, Outcome
from ..verify_context import VerifyContext, clone_tree


# The seams other layers build their checks with (runner/'s checks): where a difference is
# (``finding_of``, ``where_of``) and fresh values for an input (``drawn_value``).
def finding_of(
    diff: Difference, batch: Batch | None = None, submodule: str | None = None, segment: str | None = None
) -> Finding:
    return Finding(
        output=diff.path,
        index=diff.index,
        got=diff.got,
        expected=diff.expected,
        real_batch=batch.shape() if batch is not None else None,
        submodule=None if submodule is None else str(submodule),
        segment=segment,
        # locate_divergence's Located: where the graph's program and eager's part, when looked for.
        branch=getattr(submodule, "branch", None),
        max_abs=diff.max_abs,
        max_ulp=diff.max_ulp,
    )


def where_of(diff: Difference) -> str:
    path = diff.path or "the output"
    return f"{path}: {diff.reason}"


def batch_norm_hint(ctx: VerifyContext) -> str:
    """Why padded rows reach real ones when a BatchNorm is in train mode (the module is verified as it is)."""
    names = [
        name
        for name, m in ctx.module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if not names:
        return ""
    return (
        f". '{names[0] or type(ctx.module).__name__}' is a BatchNorm in train mode: it normalises with the "
        "statistics of the whole batch, padded rows included (call module.eval() to verify inference)"
    )


def quantization_fix(ctx: VerifyContext) -> str:
    """How to fix padding that reaches real rows when the forward quantizes (a cast to int8 or
    float8 seen): with a reduction over every element of a tensor seen too, a per-tensor scale, which
    padded rows enter; "" when the forward quantizes nothing."""
    observer = ctx.observer
    if not observer.quantized:
        return ""
    to = " and ".join(observer.quantized)
    if observer.whole_reduction:
        return (
            f"the forward quantizes to {to} with a scale over every element of a tensor "
            f"({observer.whole_reduction}): over activations that is one scale for the whole batch, "
            "which padded rows set for the real ones; quantize per token (one scale per row, "
            "x.abs().amax(dim=-1, keepdim=True)), or mask the padded rows out of the scale"
        )
    return (
        f"the forward quantizes to {to}: if its scale spans the batch's rows, padded rows set it for "
        "the real ones; quantize per token (one scale per row)"
    )


def nothing_to_compare(check: str, desc: BatchDescriptor, output: Any, batch: Batch) -> Outcome:
    what = "None" if output is None else f"a {type(output).__name__} with no tensor in it"
    return Outcome(
        check,
        desc,
        False,
        f"forward returned {what}: there is nothing to compare between replay and eager, so no check can "
        "tell whether the graph is right. Return the output tensor(s) from forward (a module that writes "
        "its result into a buffer: return that buffer)",
        Finding(output="the output", real_batch=batch.shape()),
    )


def opaque_output(check: str, desc: BatchDescriptor, diff: Difference, batch: Batch) -> Outcome:
    return Outcome(
        check,
        desc,
        False,
        f"forward returns {diff.reason} at {diff.path or 'the output'}: a graph runs Python only at capture, so "
        "every replay hands back the object made then, holding graph memory of the capture's shape. Return "
        "tensors instead (a transformers model: use_cache=False, or a static cache passed in)",
        Finding(output=diff.path, real_batch=batch.shape()),
    )


def python_hint(ctx: VerifyContext) -> str:
    """Where forwards change Python state, that is the likelier cause of a difference than the padding."""
    if not ctx.python_written:
        return ""
    return (
        f". Forward changes Python state ({', '.join(ctx.python_written[:3])}) on every call, which a graph "
        "freezes at capture: replay_matches_eager names it"
    )


def outside_hint(ctx: VerifyContext, desc: BatchDescriptor) -> str:
    """Where forward reads values from outside the module that move from batch to batch (a forward
    context make_inputs fills per step), which a graph holds at its capture: the likelier cause of
    what a check of the graph saw. ``""`` where none moves."""
    moving = ctx.python.outside_moving(desc)
    if not moving:
        return ""
    listed = "; ".join(
        f"{ctx.python.describe(n)}: {short(a)} at capture, {short(b)} now"
        for n, (a, b) in list(moving.items())[:3]
    )
    return (
        f". Forward reads values from outside the module that move from batch to batch ({listed}), which a "
        "graph holds at its capture: fresh_inputs and real_batches say whether that is the cause"
    )


#: At most this many changed attributes are each put back alone, to name only those that matter.
_ONE_BY_ONE = 8


def explaining(
    ctx: VerifyContext,
    desc: BatchDescriptor,
    padded: dict[str, Any],
    state0: Any,
    graph: Any,
    changed: dict[str, tuple[Any, Any]],
    cut: Callable[[Any], Any] = lambda out: out,
) -> tuple[bool, dict[str, tuple[Any, Any]]]:
    """Whether the module's Python values put back to what they were at ``desc``'s capture
    (``changed``: name -> (at capture, now)) give eager on ``padded`` the graph's result (``graph``,
    which eager's output, ``cut``, is compared with bit for bit), and which of them do: those that
    alone do, where any does (a counter make_inputs moves beside the scale forward reads is not
    named), else all. Each try runs from ``state0`` and seed."""

    def eager_with(values: dict[str, tuple[Any, Any]]) -> bool:
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        try:
            with ctx.python.set({name: at for name, (at, _) in values.items()}):
                held = cut(ctx.eager(clone_tree(padded), desc))
        except LookupError:  # a tensor held at capture is gone: it cannot be put back
            return False
        return first_difference(graph, held) is None

    if not eager_with(changed):
        return False, changed
    if 1 < len(changed) <= _ONE_BY_ONE:
        alone = {name: values for name, values in changed.items() if eager_with({name: values})}
        if alone:
            return True, alone
    return True, changed
