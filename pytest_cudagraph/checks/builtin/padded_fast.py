"""``padded_size``'s fast route: the two forwards of a queued batch in the module's own precision,
under ``invariant``, held to each other bit for bit and call for call.

Eager at the graph's padded size (cut to the real rows) and eager on the real batch run with every
product, row-wise reduction and causal attention on rows padded to a multiple of 8
(``pytest_cudagraph.invariant``): one program for both sizes wherever the module computes alike.
Two things are read, nothing off the device until every batch is queued:

- whether the outputs agree bit for bit (a flag on the device per batch);
- whether the two forwards made the same torch calls with the same float, bool and string
  arguments (the trace): a branch on the token count that adds a call or changes a constant shows
  here even where its effect rounds away in bf16 (a scale of 1.001 on bf16 logits changes no bit
  of them);
- whether every padded call kept its rows independent (``Invariance.not_row_local``): where one did
  not, padding changed what it computes, and the two forwards prove nothing.

A batch that agrees both ways is settled: its real rows do not depend on the padded size. Any other
goes to the float64 route, which decides (a kernel passed through, fused attention with a mask or a
custom op, may round per size; a branch on the token count may be harmless, as transformers' own
for one token is), and the report says which route each verdict took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ... import faults
from ...invariant import Invariance
from ..compare import leaves

__all__ = ["Fast", "bits_differ", "fast_pair", "traces_part"]

#: What the fast route's figures call it in the report.
ROUTE = "bit for bit"


@dataclass
class Fast:
    """One batch's fast route, not yet read: the flag (on the device) or why it could not run, and
    where the two traces part ("" where they do not)."""

    flag: torch.Tensor | None
    parted: str = ""
    why: str = ""
    ops: frozenset[str] = frozenset()

    def read(self) -> str:
        """ "" where the batch is settled; else why it goes to the float64 route."""
        if self.why:
            return self.why
        if self.flag is not None and bool(self.flag.item()):
            return "the two forwards differ bit for bit in the module's own precision"
        if self.parted:
            return f"the two forwards run other ops ({self.parted})"
        return ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width, so that NaN equals NaN and -0.0 differs from 0.0."""
    if t.is_floating_point() and t.element_size() in (1, 2, 4, 8):
        return t.contiguous().view(
            {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        )
    if t.is_complex():
        return _bits(torch.view_as_real(t))
    return t


def bits_differ(got: Any, expected: Any) -> torch.Tensor | None:
    """A flag on the device: whether any leaf of ``got`` differs from ``expected``'s in one bit; None
    where the trees differ in structure, shape or a leaf that is not a tensor (they differ)."""
    a, b = leaves(got), leaves(expected)
    if [p for p, _ in a] != [p for p, _ in b]:
        return None
    flag: torch.Tensor | None = None
    for (_, x), (_, y) in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return None
            if not x.numel():
                continue
            one = (_bits(x) != _bits(y.to(x.device))).any()
            flag = one if flag is None else flag | one
        elif x != y:
            return None
    return flag if flag is not None else torch.zeros((), dtype=torch.bool)


def traces_part(real: list[tuple[Any, ...]], padded: list[tuple[Any, ...]]) -> str:
    """Where two traces part, in words; "" where they are the same."""
    if real == padded:
        return ""
    for i, (r, p) in enumerate(zip(real, padded, strict=False)):
        if r != p:
            return f"op {i + 1}: {_op(p)} at the padded size, {_op(r)} on the real batch"
    longer, which = (padded, "at the padded size") if len(padded) > len(real) else (real, "on the real batch")
    i = min(len(real), len(padded))
    return f"op {i + 1}: {_op(longer[i])} {which} alone"


def _op(entry: tuple[Any, ...]) -> str:
    func, *constants = entry
    name = str(getattr(func, "__name__", func))
    return f"{name}({', '.join(repr(c) for c in constants)})" if constants else name


def fast_pair(real: Callable[[Invariance], Any], padded: Callable[[Invariance], Any]) -> Fast:
    """Both forwards under ``invariant`` (each callable runs one inside the state it is handed, from
    the same module state and seed), compared bit for bit and call for call; not read off the device."""
    try:
        r = Invariance(trace=[])
        expected = real(r)
        p = Invariance(trace=[])
        got = padded(p)
    except Exception as exc:  # a batch eager cannot take alone: float64 says what
        if faults.is_sticky(exc):
            raise
        return Fast(
            None, why=f"eager raised under the fast route ({faults.described(exc).strip().splitlines()[0]})"
        )
    flag = bits_differ(got, expected)
    parted = traces_part(r.trace or [], p.trace or [])
    ops = frozenset(r.padded | p.padded)
    mixed = r.not_row_local + [c for c in p.not_row_local if c not in r.not_row_local]
    if mixed:  # padding changed what such a call computes: the two forwards settle nothing
        return Fast(None, parted, f"a padded call's rows depend on each other ({mixed[0]})", ops)
    if flag is None:
        return Fast(None, parted, "the two forwards give outputs of another structure or shape", ops)
    return Fast(flag, parted, "", ops)
