"""``padded_size``'s runs: eager on the real batch and at the padded shape, from one state and seed,
in float64 (``precision.raised``) or in the module's own precision under ``invariant`` (the fast
route), and the arithmetic both routes' verdicts share (the limits, the leaf furthest beyond one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import faults
from ...invariant import Invariance, invariant
from ...manager import tree
from ...manager.types import cut_to_real
from ...precision import Record, raised
from ...units import counted
from ..reference import REFERENCE_CAP, LeafDifference, Queued
from ..verify_context import VerifyContext
from .padded_fast import Fast, fast_pair

__all__ = ["CHECK"]

CHECK = "padded_size"


def _on(value: Any, device: torch.device) -> Any:
    """A fresh copy of queued inputs on ``device``: each run gets its own (a forward may write them).
    To a GPU through pinned memory, without waiting: a copy from pageable memory waits for the
    device to finish what it was given, and the reference's forwards are queued back to back."""

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device, copy=True)

    return tree.tree_map(copy, value)


def _first_line(exc: BaseException) -> str:
    """The error's type and first line (an out-of-memory error: what it asked for and found free)."""
    return faults.described(exc).strip().splitlines()[0]


class _Runs:
    """Eager runs in float64 from one state and seed: on the real batch as users run it, or at the
    graph's padded shape on the path a capture takes, cut to the real rows."""

    def __init__(self, ctx: VerifyContext, state0: Any, record: Record) -> None:
        self.ctx, self.state0, self.record = ctx, state0, record

    def _raised(self, run: Callable[[], Any], noise: float = 0.0) -> Any:
        ctx = self.ctx
        ctx.restore(self.state0)
        ctx.seed_all(ctx.seed)
        tier = ctx.reference.tier if ctx.reference is not None else "float64"
        refs = ctx.reference.references if ctx.reference is not None else None
        with raised(noise=noise, seed=ctx.seed, to=getattr(torch, tier), references=refs) as record:
            out = run()
        self.record.merge(record)
        return out

    def real(self, q: Queued, *, captured_path: bool = False, noise: float = 0.0) -> Any:
        ctx = self.ctx
        inputs = _on(q.inputs, ctx.manager.device)
        with ctx.python.as_made(q.outside):
            return self._raised(lambda: ctx.eager_real(inputs, q.batch, captured_path=captured_path), noise)

    def padded(self, q: Queued) -> Any:
        ctx = self.ctx
        padded = _on(q.padded, ctx.manager.device)
        with ctx.python.as_made(q.outside):
            return self._raised(lambda: cut_to_real(ctx.eager(padded, q.desc), q.out_dims, q.batch))

    def under_invariant(self, run: Callable[[], Any]) -> Callable[[Invariance], Any]:
        """``run`` as ``fast_pair`` takes it: from the state and seed, under ``invariant``."""

        def call(state: Invariance) -> Any:
            ctx = self.ctx
            ctx.restore(self.state0)
            ctx.seed_all(ctx.seed)
            with invariant(state):
                return run()

        return call

    def fast(self, q: Queued) -> Fast:
        """The fast route of ``q``: both forwards in the module's own precision under ``invariant``, both
        on the path a capture takes (the graph's program at two sizes; transformers builds its mask
        another way there). Whether that path computes what users' path computes is float64's
        question, asked at the largest batch and wherever this route leaves a batch open."""
        ctx = self.ctx
        inputs = _on(q.inputs, ctx.manager.device)
        padded = _on(q.padded, ctx.manager.device)
        with ctx.python.as_made(q.outside):
            return fast_pair(
                self.under_invariant(lambda: ctx.eager_real(inputs, q.batch, captured_path=True)),
                self.under_invariant(lambda: cut_to_real(ctx.eager(padded, q.desc), q.out_dims, q.batch)),
            )


def _limits(floors: dict[str, float], roundoff: float) -> dict[str, float]:
    return {path: REFERENCE_CAP * max(floor, roundoff) for path, floor in floors.items()}


def _worst(diffs: list[LeafDifference], limits: dict[str, float], roundoff: float) -> LeafDifference | None:
    """The leaf furthest beyond its limit, or None when every leaf is within it."""
    over = [d for d in diffs if d.why or d.relative > limits.get(d.path, REFERENCE_CAP * roundoff)]
    if not over:
        return None
    return max(over, key=lambda d: d.relative / limits.get(d.path, REFERENCE_CAP * roundoff))


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2g}"


def _attempt(run: Callable[[], Any], q: Queued, *, padded: bool = False) -> tuple[Any, str]:
    """(the run's output, "") or (None, why eager cannot run this batch in float64): a batch eager cannot
    take alone (a BatchNorm in train mode over one row), an op with no float64 or float32 kernel at
    this shape. A lost CUDA context is no batch's matter: it goes up."""
    try:
        return run(), ""
    except Exception as exc:
        if faults.is_sticky(exc):
            raise
        where = (
            f"at the padded shape of {counted(q.desc.num_tokens, 'token')}"
            if padded
            else f"on the real batch of {counted(q.batch.num_tokens, 'token')} alone"
        )
        return None, f"eager cannot run in float64 {where} ({_first_line(exc)})"
