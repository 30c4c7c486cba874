"""The default (quick) run asks the cross-shape question at every capture size.

Quick mode captures the smallest and largest descriptor of each mode; a branch, table or scale keyed
on the token count between them showed at no captured size. ``padded_size`` now holds eager at
every other size (its most padded real batch, eager only) to the reference as well.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from pytest_cudagraph import verify

SIZES = (1, 2, 4, 8)
D = 8


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)


class BranchBetween(_Lin):
    """A Python branch on the token count that splits 3 real tokens from their graph of 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * 1.5 if x.shape[0] > 3 else h


class TableBetween(_Lin):
    """A scale looked up by token count (a table made per size)."""

    TABLE: ClassVar[dict[int, float]] = {4: 1.01}  # 1.0 at every other size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.TABLE.get(x.shape[0], 1.0)


class NoBranch(_Lin):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 1.5


def _inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, D)}


def _quick(module: nn.Module):
    torch.manual_seed(0)
    return verify(module, _inputs, capture_sizes=SIZES, max_num_reqs=4, backend="emulate", exhaustive=False)


@pytest.mark.parametrize("buggy", [BranchBetween, TableBetween], ids=lambda c: c.__name__)
def test_a_computation_keyed_on_a_size_between_is_caught_in_quick_mode(buggy):
    report = _quick(buggy())
    assert not report.ok
    (failure,) = report.failures
    assert failure.check == "padded_size" and failure.descriptor is not None
    assert failure.descriptor.num_tokens == 4  # neither the smallest nor the largest size
    assert "a computation depends on the padded batch size" in failure.message
    # Quick mode all the same: only the smallest and largest were captured.
    assert [d.num_tokens for d in report.descriptors] == [8, 1]


def test_a_correct_module_passes_quick_mode_with_every_size_asked():
    report = _quick(NoBranch())
    assert report.ok
    asked = sorted(
        o.descriptor.num_tokens for o in report.outcomes if o.check == "padded_size" and not o.skipped
    )
    assert asked == [1, 2, 4, 8]  # every size, captured or not
