"""Which ATen ops a CUDA graph capture holds, learned on a GPU.

The table ships with the package (``data/capturability.json``) and is made by
``scripts/capturability.py`` from PyTorch's own OpInfo samples: each sample
is run eagerly, then captured into a raw ``torch.cuda.CUDAGraph`` while a
dispatch mode records every ATen op with the pattern of its arguments. An op
seen in a capture that held is *held* for that pattern; the op a failed
capture was running when it failed is *refused*, with CUDA's own error.

The emulator's guard asks it about every op its hand-written rules pass (on
the CPU nothing refuses a host sync, so without it a suite without a GPU
would pass ops no GPU captures), and names an op the table does not cover as
not known rather than passing it in silence.

A pattern is one letter per tensor or Python number among the op's
arguments, in order: ``T`` a tensor, ``0`` a 0-dim tensor, ``b`` a boolean
tensor, ``e`` an empty tensor, ``s`` a Python number, ``h`` a host tensor (on a
GPU a CPU tensor, on the emulator one made on the host inside the forward). It
is what tells ``masked_fill(mask, 0.5)`` from ``masked_fill(mask, tensor(0.5))``,
a boolean-mask ``index_put`` from an integer-index one, and an empty matrix
(for which CUDA's solvers return before they read anything back) from a full one.

Where sizes or values decide (an ``isin``'s sizes, an LU's shape and batch, ``equal`` of one
shape or two), a value rule (``VALUE_RULES``) says which branch CUDA's kernel takes, ahead of
the pattern's verdict; each was held call for call to a GPU (``scripts/value_rules.py``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "HELD",
    "REFUSED",
    "TABLE_PATH",
    "VALUE_RULES",
    "VALUE_RULES_SOURCE",
    "Table",
    "Verdict",
    "load_table",
    "pattern",
    "value_rule",
]

TABLE_PATH = Path(__file__).parent / "data" / "capturability.json"

HELD = "held"
REFUSED = "refused"
#: Held by some samples and refused by others of the same pattern (shapes or values decide).
DEPENDS = "depends"


def pattern(args: Any, kwargs: Any, is_host: Callable[[torch.Tensor], bool] | None = None) -> str:
    """The letters of an op's arguments (see the module's docstring); a tensor ``is_host`` tells
    apart reads ``h`` (on a GPU: a CPU tensor; on the emulator: one made on the host)."""
    letters = []
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.Tensor):
            if is_host is not None and is_host(value):
                letters.append("h")
            elif value.numel() == 0:
                letters.append("e")
            elif value.dtype == torch.bool:
                letters.append("b")
            else:
                letters.append("0" if value.dim() == 0 else "T")
        elif isinstance(value, (bool, int, float, complex)):
            letters.append("s")
    return "".join(letters)


@dataclass(frozen=True)
class Verdict:
    """What the table says of one op with one pattern."""

    #: HELD, REFUSED or DEPENDS.
    kind: str
    #: CUDA's error when refused; what the samples showed otherwise.
    reason: str
    #: Given by a value rule (``VALUE_RULES``), not learned for a pattern.
    by_rule: bool = False


@dataclass(frozen=True)
class Table:
    """The capturability table and where it was learned."""

    torch_version: str
    device: str
    date: str
    cases: int
    #: overload name (``aten.linalg_inv_ex.default``) -> pattern -> verdict.
    ops: dict[str, dict[str, Verdict]] = field(repr=False)
    #: What the guard derives per op from this table, memoised (see guard.CaptureGuard._decisive).
    memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def source(self) -> str:
        """Where the table was learned, for messages."""
        return f"{self.device}, torch {self.torch_version}, {self.date}"

    def verdict(self, op: str, letters: str, *, exact: bool = False) -> Verdict | None:
        """The verdict for ``op`` called with arguments of pattern ``letters``; None when not known:
        the op was never seen, or seen only with other tensor arguments and not one answer for all.
        ``exact``: only a verdict learned for this very pattern."""
        found = self._verdict(op, letters, exact)
        if found is None and not exact and "e" in letters:
            # An empty tensor does less than a full one: what a capture holds with full tensors it
            # holds with empty ones. Not the other way: CUDA's solvers refuse a full matrix and
            # return early on an empty one.
            full = self._verdict(op, letters.replace("e", "T"), exact)
            if full is not None and full.kind == HELD:
                return full
        return found

    def _verdict(self, op: str, letters: str, exact: bool) -> Verdict | None:
        entry = self.ops.get(op)
        if entry is None:
            if exact:
                return None
            # An overload never seen (div_.Scalar where div_.Tensor was): its siblings' one answer.
            entry = self._packets.get(op.rpartition(".")[0])
            if entry is None:
                return None
        found = entry.get(letters)
        if found is not None or exact:
            return None if found is None or found.kind == DEPENDS else found
        # Another count of Python numbers (a dim, an alpha) changes nothing a capture cares about.
        tensors = letters.replace("s", "")
        alike = [v for p, v in entry.items() if p.replace("s", "") == tensors]
        if not alike:
            # Other tensor arguments: the op's one answer, if every kind of tensor asked about (a
            # boolean mask, a host tensor, a 0-dim value) was among those it was seen with.
            seen = "".join(entry)
            if all(letter in seen for letter in tensors):
                alike = [v for p, v in entry.items() if "h" not in p]
        kinds = {v.kind for v in alike}
        return alike[0] if len(kinds) == 1 and DEPENDS not in kinds else None

    @functools.cached_property
    def _packets(self) -> dict[str, dict[str, Verdict]]:
        """Every pattern of every overload, by op packet (``aten.div_``)."""
        found: dict[str, dict[str, Verdict]] = {}
        for op, patterns in self.ops.items():
            merged = found.setdefault(op.rpartition(".")[0], {})
            for p, v in patterns.items():
                merged[p] = v if merged.get(p, v) == v or v.kind == DEPENDS else Verdict(DEPENDS, v.reason)
        return found

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Table:
        ops = {
            op: {p: Verdict(kind, reason) for p, (kind, reason) in patterns.items()}
            for op, patterns in data["ops"].items()
        }
        return cls(str(data["torch"]), str(data["device"]), str(data["date"]), int(data["cases"]), ops)

    def to_json(self) -> dict[str, Any]:
        return {
            "torch": self.torch_version,
            "device": self.device,
            "date": self.date,
            "cases": self.cases,
            "ops": {
                op: {p: [v.kind, v.reason] for p, v in sorted(patterns.items())}
                for op, patterns in sorted(self.ops.items())
            },
        }


@functools.cache
def load_table(path: Path | None = None) -> Table | None:
    """The shipped table (or the one at ``path``); None when there is none."""
    target = path or TABLE_PATH
    if not target.exists():
        return None
    return Table.from_json(json.loads(target.read_text()))


# -- value rules -------------------------------------------------------------------------
# For a few ops CUDA decides by shapes or values what a pattern cannot tell: the branch its
# kernel takes. Each rule says which branch a call takes, as PyTorch's CUDA code chooses it,
# and whether that branch reads anything back to the host. They were held call for call to a
# GPU (scripts/value_rules.py; the answers in docs/data/capturability_h200_value_rules.json, and
# tests/test_capturability.py runs the same calls on the emulator).

#: Where the value rules were held to a GPU, for messages (a test keeps it the probe's).
VALUE_RULES_SOURCE = "NVIDIA H200, torch 2.11.0+cu130"

ValueRule = Callable[[tuple[Any, ...], dict[str, Any]], "Verdict | None"]


def _held(reason: str) -> Verdict:
    return Verdict(HELD, reason, by_rule=True)


def _refused_by_rule(reason: str) -> Verdict:
    return Verdict(REFUSED, reason, by_rule=True)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


def _equal_rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict | None:
    a, b = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "other")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.shape != b.shape:
        return _held("torch.equal of two shapes answers False before it reads anything")
    if a.numel() == 0:
        return _held("torch.equal of empty tensors answers True before it reads anything")
    if (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    ):
        return _held("torch.equal of a tensor with itself answers True before it reads anything")
    return _refused_by_rule(
        "torch.equal of two tensors of one shape reads its answer back to the host (a host sync)"
    )


def _isin_rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict | None:
    elements, tests = _arg(args, kwargs, 0, "elements"), _arg(args, kwargs, 1, "test_elements")
    if not isinstance(tests, torch.Tensor):
        return _held("isin of one test value is an elementwise comparison")
    n = elements.numel() if isinstance(elements, torch.Tensor) else 1
    if n == 0:
        return _held("isin of no elements writes nothing")
    # NumPy's heuristic, which PyTorch's kernel keeps: few test values are compared pair by pair,
    # many are sorted together with the elements, which syncs (torch.unique's output size; with
    # assume_unique, a write of a host value into the sorted mask).
    few = int(10.0 * n**0.145)
    if tests.numel() < few:
        return _held("isin compares each element with each of few test values")
    return _refused_by_rule(
        f"isin of {n} element(s) in {tests.numel()} test values sorts them together, which syncs "
        f"with the host; it compares pair by pair (and a capture holds it) below {few} test values "
        f"for {n} element(s)"
    )


def _lu_rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict | None:
    a = _arg(args, kwargs, 0, "A")
    if not isinstance(a, torch.Tensor) or a.dim() < 2:
        return None
    if a.numel() == 0:
        return _held("LU of an empty matrix returns before it factors anything")
    m, n = a.shape[-2], a.shape[-1]
    batch = a.numel() // (m * n)
    # CUDA takes cuSOLVER (or cuBLAS's batched LU) for a square matrix alone, or a batch of small
    # ones; MAGMA otherwise, whose LU copies its pivots and infos through the host.
    if m == n and (batch == 1 or m <= 16 or (m <= 128 and batch <= 16)):
        return _held("LU of these square matrices takes cuSOLVER or cuBLAS, which stay on the device")
    shape = "a non-square matrix" if m != n else f"a batch of {batch} matrices of {m} x {n}"
    return _refused_by_rule(
        f"LU of {shape} takes MAGMA, which syncs with the host; cuSOLVER is taken for a square "
        "matrix alone, or for a batch of matrices of at most 16 x 16 (at most 128 x 128 in batches "
        "of 16 or fewer)"
    )


def _segment_reduce_rule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict | None:
    lengths = _arg(args, kwargs, 2, "lengths")
    if not isinstance(lengths, torch.Tensor):
        return _held("segment_reduce by offsets does not check them on the host")
    if _arg(args, kwargs, 6, "unsafe"):
        return _held("segment_reduce(unsafe=True) does not check its lengths on the host")
    return _refused_by_rule(
        "segment_reduce by lengths checks them on the host (their minimum and sum read back); "
        "pass offsets, or unsafe=True once the lengths are known to be right"
    )


#: Op packet -> the rule for its calls (None: the table's pattern decides).
VALUE_RULES: dict[str, ValueRule] = {
    "aten.equal": _equal_rule,
    "aten.isin": _isin_rule,
    "aten.linalg_lu_factor_ex": _lu_rule,
    "aten.linalg_lu": _lu_rule,
    "aten.segment_reduce": _segment_reduce_rule,
}


def value_rule(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Verdict | None:
    """What the value rule of ``op`` (an overload name) says of this call; None where none
    applies."""
    rule = VALUE_RULES.get(op.rpartition(".")[0])
    return None if rule is None else rule(args, kwargs)
