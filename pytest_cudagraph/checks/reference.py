"""The float64 reference's state and arithmetic: what ``real_batches`` leaves to ``padded_size``.

``real_batches`` holds a graph's real rows to eager at its padded shape, bit
for bit (the same program). Whether eager at the padded shape, cut to the
real rows, equals eager on the real batch is a question about eager alone;
``padded_size`` asks it in float64 once the graphs are released, on the
batches ``real_batches`` queued here (``Reference``). The comparison is a
relative rms per output leaf (``leaf_differences``), held to the reference's
own floor: how far rounding at its precision moves the output, measured at
one shape (``precision.raised(noise=...)``), so a computation that depends on
the padded size cannot hide in it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..manager import tree
from ..manager.types import OutCut
from ..plan import Batch, BatchDescriptor
from ..precision import Record
from ..references import References
from .compare import CHUNK, leaves

__all__ = [
    "REFERENCE_CAP",
    "LeafDifference",
    "PendingDifferences",
    "Queued",
    "Reference",
    "landed",
    "leaf_differences",
    "on_cpu",
    "pending_differences",
]

#: Eager across shapes may differ in float64 by this many times the reference's floor (the same
#: forward with noise of one unit roundoff at every op whose rounding can differ between shapes, at one
#: shape). Measured on an H200
#: (docs/scale.md): the difference across shapes of a correct Llama of 1B and 8B parameters is at
#: most 0.6 times its floor (1.9e-13 at 8B), and a shape-dependent error of 1e-6 moves the logits by
#: 1.7e-7 or more, six orders of magnitude above it.
REFERENCE_CAP = 64.0


def on_cpu(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (queued batches hold no device memory).

    From a GPU into pinned memory without waiting: a blocking copy waits for everything the device
    was given, and quick mode queues a batch after each size's two forwards, so the host would wait
    for them at every size instead of launching the next. A copy back to the device is ordered
    after this one on the stream; a read on the host waits for ``landed`` first."""

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        if t.device.type == "cuda":
            out = torch.empty_like(t, device="cpu", pin_memory=True)
            out.copy_(t, non_blocking=True)
            return out
        return t.to("cpu", copy=True)

    return tree.tree_map(copy, value)


def landed(value: Any) -> Any:
    """``value``, once the copies ``on_cpu`` made of it reached the host (it waits for the device
    where any came from one)."""
    if any(isinstance(t, torch.Tensor) and t.is_pinned() for t in tree.leaves(value)):
        torch.cuda.current_stream().synchronize()
    return value


@dataclass
class Queued:
    """A real batch ``real_batches`` ran, kept for the reference: the real rows and, padding
    included, the inputs the graph read (both on the CPU), and how the graph's output is cut."""

    desc: BatchDescriptor
    batch: Batch
    inputs: dict[str, Any]
    padded: dict[str, Any]
    out_dims: list[OutCut]
    #: The fast route's two forwards, where they ran already (quick mode's sizes it did not capture:
    #: the forward that learns how the output is cut is the padded one), not yet read.
    fast: Any = None
    #: What forward reads from outside the module as make_inputs left it for this batch (a forward
    #: context filled per step): put back around the batch's runs, which come after other batches'.
    outside: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reference:
    """One verification's float64 reference: whether the module runs there (``ready``, else
    ``why_not``), what its runs did (``record``), and the batches queued for it."""

    ready: bool = False
    why_not: str = ""
    record: Record = field(default_factory=Record)
    #: The precision the reference runs in: float64, or float32 where the forward cannot run in
    #: float64 (``float64_refused`` says why).
    tier: str = "float64"
    float64_refused: str = ""
    queued: dict[BatchDescriptor, list[Queued]] = field(default_factory=dict)
    #: The references that stand in for kernels (``references=`` over ``register_reference``'s).
    references: References = field(default_factory=References)
    #: Each reference held against its kernel (``kernel_references``): outcomes of ``references``.
    held: list[Any] = field(default_factory=list)

    def queue(
        self,
        desc: BatchDescriptor,
        batch: Batch,
        inputs: Mapping[str, Any],
        padded: Mapping[str, Any],
        out_dims: list[OutCut],
        *,
        first: bool,
    ) -> Queued | None:
        """Keep ``batch`` for the reference when it has padded rows, or is the descriptor's first
        (a descriptor that serves only its own size still has its capture path compared)."""
        # Decided before the copies to the CPU: a batch that is not kept costs no transfer.
        if batch.num_tokens < desc.num_tokens or first:
            item = Queued(desc, batch, on_cpu(dict(inputs)), on_cpu(dict(padded)), list(out_dims))
            self.queued.setdefault(desc, []).append(item)
            return item
        return None


@dataclass
class LeafDifference:
    """One output leaf of eager at the padded shape (cut) against eager on the real batch."""

    path: str
    relative: float  # rms of the difference over rms of eager on the real batch (finite elements)
    why: str = ""  # a difference no tolerance excuses (shape, non-finite places, integer values); "" if none
    index: tuple[int, ...] | None = None  # the largest difference
    got: Any = None
    expected: Any = None


def _relative_sums(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """What ``_relative`` reads of two flattened leaves of one shape (``g.numel() > 0``), left on the
    device: the sum of d*d and of e*e over finite elements, the largest |d| and its index, the index
    of the first non-finite mismatch (-1: none), and both values at the index a finding names (that
    mismatch, else the largest difference). Made in pieces of rows; read with one synchronization,
    when the caller is ready to wait (``PendingDifferences.read``)."""
    sums = torch.zeros(2, dtype=torch.float64, device=g.device)  # sum of d*d, sum of e*e
    worst = torch.full((2,), -1.0, dtype=torch.float64, device=g.device)  # largest |d|, its index
    mismatch = torch.full((1,), -1, dtype=torch.int64, device=g.device)  # first non-finite mismatch
    for start in range(0, g.numel(), CHUNK):
        gd = g[start : start + CHUNK].to(torch.float64)
        ed = e[start : start + CHUNK].to(torch.float64)
        fg, fe = torch.isfinite(gd), torch.isfinite(ed)
        # Non-finite where the other is finite, or another non-finite value (NaN equals NaN).
        bad = (fg != fe) | (~fg & ~fe & (gd != ed) & ~(torch.isnan(gd) & torch.isnan(ed)))
        first_bad = torch.where(bad, torch.arange(start, start + gd.numel(), device=g.device), g.numel())
        mismatch = torch.where((mismatch < 0) & bad.any(), first_bad.min().reshape(1), mismatch)
        d = torch.where(fg & fe, gd - ed, 0.0)
        ez = torch.where(fe, ed, 0.0)
        sums += torch.stack(((d * d).sum(), (ez * ez).sum()))
        if d.numel():
            m, i = d.abs().max(0)
            better = m > worst[0]
            worst = torch.where(better, torch.stack((m, (i + start).double())), worst)
    at = torch.where(mismatch >= 0, mismatch, worst[1:].long().clamp(min=0))
    return torch.cat((sums, worst, mismatch.double(), g[at].double(), e[at].double()))


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _relative(sums: list[float], shape: torch.Size) -> tuple[float, tuple[int, ...] | None, str, Any, Any]:
    """(relative rms over finite elements, index of the largest difference, why, and the two values
    there) from ``_relative_sums`` read off the device."""
    dd, ee, largest, where, first, got, expected = sums
    if first >= 0:
        finite = math.isfinite(got) or math.isfinite(expected)
        return (
            float("inf"),
            _unravel(int(first), shape),
            "non-finite where the other is finite" if finite else "another non-finite value",
            got,
            expected,
        )
    index = _unravel(int(where), shape) if largest >= 0 else None
    if ee == 0.0:
        return (0.0 if dd == 0.0 else float("inf")), index, "", got, expected
    return (dd / ee) ** 0.5, index, "", got, expected


class PendingDifferences:
    """``leaf_differences``' answer before it is read off the device: the floating leaves' sums still
    there (no synchronization yet, so the next forward can be queued behind them), every other leaf
    decided. ``read()`` waits for the sums once."""

    def __init__(self) -> None:
        self._items: list[tuple[str, LeafDifference | tuple[torch.Tensor, torch.Size]]] = []

    def add(self, path: str, found: LeafDifference | tuple[torch.Tensor, torch.Size]) -> None:
        self._items.append((path, found))

    def read(self) -> list[LeafDifference]:
        found = []
        for path, item in self._items:
            if isinstance(item, LeafDifference):
                found.append(item)
                continue
            sums, shape = item
            relative, index, why, got, expected = _relative(sums.tolist(), shape)
            diff = LeafDifference(path, relative, why, index)
            if index is not None:
                diff.got, diff.expected = got, expected
            found.append(diff)
        return found


def leaf_differences(got: Any, expected: Any) -> list[LeafDifference]:
    """Per tensor leaf of ``expected``, how far ``got`` is from it (floating leaves: the relative
    rms; integer and bool leaves: equal or not)."""
    return pending_differences(got, expected).read()


def pending_differences(got: Any, expected: Any) -> PendingDifferences:
    """``leaf_differences`` without waiting for the device on floating leaves: read them with
    ``.read()`` (the leaves themselves need not be kept)."""
    found = PendingDifferences()
    got_leaves = dict(leaves(got))
    for path, e in leaves(expected):
        if not isinstance(e, torch.Tensor):
            continue
        g = got_leaves.get(path)
        if not isinstance(g, torch.Tensor):
            found.add(
                path, LeafDifference(path, float("inf"), "missing where eager on the real batch has a tensor")
            )
            continue
        if tuple(g.shape) != tuple(e.shape):
            found.add(
                path,
                LeafDifference(
                    path,
                    float("inf"),
                    f"shape {list(g.shape)} where eager on the real batch has {list(e.shape)}: the output is "
                    "cut to the real rows wrongly",
                ),
            )
            continue
        if not (e.is_floating_point() or e.is_complex()):
            off = g.to(e.device) != e
            if bool(off.any()):
                at = tuple(int(i) for i in torch.unravel_index(off.reshape(-1).nonzero()[0, 0], e.shape))
                found.add(
                    path,
                    LeafDifference(
                        path,
                        float("inf"),
                        f"{int(off.sum())} of {e.numel()} integer values differ",
                        at,
                        g[at].item(),
                        e[at].item(),
                    ),
                )
            else:
                found.add(path, LeafDifference(path, 0.0))
            continue
        if e.is_complex():
            g, e = torch.view_as_real(g), torch.view_as_real(e)
        if not g.numel():
            found.add(path, LeafDifference(path, 0.0))
            continue
        flat_g = g.detach().reshape(-1)
        found.add(path, (_relative_sums(flat_g, e.detach().reshape(-1).to(flat_g.device)), g.shape))
    return found
