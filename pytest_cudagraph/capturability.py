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

__all__ = ["HELD", "REFUSED", "TABLE_PATH", "Table", "Verdict", "load_table", "pattern"]

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
