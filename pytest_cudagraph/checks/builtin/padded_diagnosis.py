"""``padded_size``'s diagnosis of a failure: which Python input the graph holds decides, whether the
capture path computes something else, the first divergent submodule and the first differing call;
and, past the first ``DIAGNOSED`` failures, the figures alone with where the cause was diagnosed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ...units import counted
from .. import causes
from ..divergence import first_differing_call, first_divergent_submodule, where_runs_part
from ..floor import cut_leaf
from ..reference import REFERENCE_CAP, LeafDifference, Queued, landed, leaf_differences
from ..report import Finding, Outcome
from ..verify_context import VerifyContext
from .common import batch_norm_hint, python_hint
from .padded_runs import CHECK, _fmt, _Runs, _worst

__all__ = ["DIAGNOSED"]

#: The failures diagnosed in full (first divergent submodule, first differing call, the branch):
#: each costs several float64 forwards, and an error on every padded size fails every descriptor
#: with one cause; the rest give their figures and name where the cause was diagnosed.
DIAGNOSED = 2


def _what(ctx: VerifyContext, q: Queued, bad: LeafDifference, limit: float, floors: dict[str, float]) -> str:
    """The sentence every failure of this check leads with: how eager at the padded size differs
    from eager on the real batch, with the floor and the limit it was held to."""
    where = bad.path or "the output"
    n, big = q.batch.num_tokens, q.desc.num_tokens
    shape = (
        f"eager at the graph's padded size ({counted(big, 'token')}), cut to the {counted(n, 'real row')},"
    )
    those = "that token" if n == 1 else f"those {n} tokens"
    if bad.why:
        return f"{shape} differs from eager on {those} at {where}: {bad.why}"
    return (
        f"{shape} differs from eager on {those} by {_fmt(bad.relative)} (relative rms of {where}), "
        f"in {ctx.reference.record.described if ctx.reference else 'float64'}, where rounding moves it by "
        f"{_fmt(floors.get(bad.path, 0.0))} (the floor: this forward with noise of one unit roundoff at "
        f"every op whose rounding can differ between shapes, at one shape; the limit is {REFERENCE_CAP:g}x "
        f"that, {_fmt(limit)})"
    )


def _failure(
    ctx: VerifyContext,
    runs: _Runs,
    q: Queued,
    bad: LeafDifference,
    expected: Any,
    got: Any,
    limits: dict[str, float],
    floors: dict[str, float],
    roundoff: float,
) -> Outcome:
    limit = limits.get(bad.path, REFERENCE_CAP * roundoff)
    what = _what(ctx, q, bad, limit, floors)
    # A Python input the graph holds at its capture's value (not the batch's): does that value decide?
    held = ctx.python.held_values(landed(q.padded), landed(q.inputs))
    if held:
        with_batch_values = runs.padded(
            replace(q, padded={**q.padded, **{n: b for n, (_, b) in held.items()}})
        )
        if _worst(leaf_differences(with_batch_values, got), limits, roundoff) is not None:
            explains = _worst(leaf_differences(with_batch_values, expected), limits, roundoff) is None
            cause = causes.held_python_input(
                q.desc.label(), held, explains=explains, per_shape=ctx.python.values_per_shape(q.desc, held)
            )
            del with_batch_values
            return _failed(ctx, runs, q, bad, limit, what, cause)
        del with_batch_values
    # Which path: the capture path on the real batch itself, or the padding?
    on_path = runs.real(q, captured_path=True)
    path_diffs = leaf_differences(on_path, expected)
    path_differs = _worst(path_diffs, limits, roundoff) is not None
    path_explains = _worst(leaf_differences(got, on_path), limits, roundoff) is None
    del on_path
    if path_differs and path_explains:
        cause = (
            "the module computes something else when it is captured: on the real batch itself, eager on its "
            "capture path (torch.cuda.is_current_stream_capturing() answering True) differs from eager as "
            "users run it, and the padded run agrees with the capture path. Look for a branch on capturing, or "
            "state kept for captures (metadata planned per request count or per token count)"
        )
    else:
        cause = (
            "a computation depends on the padded batch size: a Python branch on the token count, a scale, "
            "table or cache made for that size, statistics over the padded rows"
        )
    return _failed(ctx, runs, q, bad, limit, what, cause)


def _failed(
    ctx: VerifyContext, runs: _Runs, q: Queued, bad: LeafDifference, limit: float, what: str, cause: str
) -> Outcome:
    """The failure, with where the two runs first differ: the call, its line and the submodule whose
    code made it, and, at the top level, where their control flow parts (context, where the call
    was found: a library's branch on the shape parts the runs of a correct module too)."""
    submodule = _first_divergent(runs, q, limit)

    def differs(padded: torch.Tensor, real: torch.Tensor) -> bool:
        found = leaf_differences(padded, real)
        return bool(found) and (bool(found[0].why) or found[0].relative > limit)

    first_call = first_differing_call(
        ctx.module, submodule or "", lambda: runs.padded(q), lambda: runs.real(q), differs
    )
    # At the top level (or where control flow itself parts): the line of the branch, where one is found.
    branch = (
        where_runs_part(
            lambda: runs.padded(q),
            lambda: runs.real(q),
            ("eager at the padded shape", "eager on the real batch"),
            ctx.module,
        )
        if not submodule
        else None
    )
    finding = Finding(
        output=bad.path,
        index=bad.index,
        got=bad.got,
        expected=bad.expected,
        real_batch=q.batch.shape(),
        submodule=submodule,
        branch=branch,
        sides=("eager at the padded shape", "eager on the real batch"),
        first_call=first_call,
    )
    return Outcome(CHECK, q.desc, False, f"{what}: {cause}{batch_norm_hint(ctx)}{python_hint(ctx)}", finding)


def _first_divergent(runs: _Runs, q: Queued, limit: float) -> str | None:
    """The first submodule (in the order forwards finish) whose output, in float64, differs between
    the padded run (cut to the real rows) and the real batch beyond ``limit``; None where none does
    (or the module's structure differs between the two runs from the start)."""

    def differs(p: torch.Tensor, e: torch.Tensor) -> bool:
        cut = cut_leaf(p, e.shape)
        if cut is None or not (e.is_floating_point() or e.is_complex()):
            return False
        diffs = leaf_differences(cut, e)
        return bool(diffs) and (bool(diffs[0].why) or diffs[0].relative > limit)

    return first_divergent_submodule(runs.ctx.module, lambda: runs.real(q), lambda: runs.padded(q), differs)


def _undiagnosed(
    ctx: VerifyContext,
    q: Queued,
    bad: LeafDifference,
    limits: dict[str, float],
    floors: dict[str, float],
    roundoff: float,
    diagnosed: list[str],
) -> Outcome:
    """A failure past the first ``DIAGNOSED``: its figures, and where the diagnosis was made."""
    what = _what(ctx, q, bad, limits.get(bad.path, REFERENCE_CAP * roundoff), floors)
    cause = (
        f"a computation depends on the padded batch size; the cause is diagnosed at {' and '.join(diagnosed)} "
        f"(the first {len(diagnosed)} failures of this check are diagnosed in full)"
    )
    finding = Finding(
        output=bad.path,
        index=bad.index,
        got=bad.got,
        expected=bad.expected,
        real_batch=q.batch.shape(),
        sides=("eager at the padded shape", "eager on the real batch"),
    )
    return Outcome(CHECK, q.desc, False, f"{what}: {cause}", finding)
