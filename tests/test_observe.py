"""What a forward writes and at which precision it computes (``observe/``), and what verification
copies because of it: only what forwards write, never the weights; the module left as it was found;
a write no op shows found by its fingerprint; the report's peak memory and costs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph import verify
from pytest_cudagraph.checks.registry import Check, passed
from pytest_cudagraph.observe import (
    TF32,
    ForwardObserver,
    _fp32_roundoff,
    buffers_restored,
    fingerprint,
    observing,
    restoring,
    roundoff,
    unit_roundoff,
)


class Counter(nn.Module):
    """A linear layer and a step counter updated in place (a graph-safe counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(1))
        self.register_buffer("table", torch.arange(4.0))  # read, never written

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return self.lin(x) + self.table.sum() + self.steps


def _inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
    return {"x": torch.randn(num_tokens, 8)}


def test_the_observer_sees_in_place_writes_and_nothing_read() -> None:
    module = Counter()
    observer = ForwardObserver(module)
    with observing(observer), torch.no_grad():
        module(torch.randn(3, 8))
    assert list(observer.written) == ["steps"]
    assert [name for name, _ in observer.written_items()] == ["steps"]


def test_batch_norm_statistics_are_writes_though_its_op_does_not_mark_them() -> None:
    bn = nn.BatchNorm1d(4).train()
    observer = ForwardObserver(bn)
    before = bn.running_mean.clone()
    with restoring(observer):
        bn(torch.randn(8, 4))
    assert set(observer.written) == {"running_mean", "running_var", "num_batches_tracked"}
    assert torch.equal(bn.running_mean, before)  # put back


def test_restoring_copies_nothing_when_nothing_is_written_and_puts_back_what_is() -> None:
    module = Counter()
    observer = ForwardObserver(module)
    with restoring(observer) as copies, torch.no_grad():
        module.lin(torch.randn(2, 8))
    assert copies == {}
    with restoring(observer) as copies, torch.no_grad():
        module(torch.randn(2, 8))
        module(torch.randn(2, 8))
        assert float(module.steps) == 2
    assert list(copies) == ["steps"] and float(module.steps) == 0
    with buffers_restored(module), torch.no_grad():
        module(torch.randn(2, 8))
    assert float(module.steps) == 0


def test_the_precision_is_the_coarsest_of_the_products() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    observer = ForwardObserver(module)
    with observing(observer), torch.no_grad():
        module[1](module[0](torch.randn(2, 4)).to(torch.bfloat16))
    assert observer.roundoff == unit_roundoff(torch.bfloat16) == 2.0**-8


def test_fp32_on_a_gpu_rounds_as_tf32_where_torch_allows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's settings are read by two small functions (setting torch's own flags here would mix its
    # legacy and new precision APIs for the rest of the process, which torch then refuses to read).
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for tf32 in (True, False):
        monkeypatch.setattr(roundoff, "_tf32_convolutions", lambda tf32=tf32: tf32)
        assert _fp32_roundoff(cuda, conv=True) == (TF32 if tf32 else 2.0**-24)
        assert _fp32_roundoff(cpu, conv=True) == 2.0**-24
    monkeypatch.setattr(roundoff, "_fp32_products", lambda device: TF32)
    assert _fp32_roundoff(cuda, conv=False) == TF32


def test_a_precision_torch_refuses_to_tell_is_taken_as_the_looser(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(*_: object) -> float:
        raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(roundoff, "_fp32_products", refuses)
    monkeypatch.setattr(roundoff, "_tf32_convolutions", refuses)
    assert _fp32_roundoff(torch.device("cuda", 0), conv=False) == TF32
    assert _fp32_roundoff(torch.device("cuda", 0), conv=True) == TF32
    assert _fp32_roundoff(torch.device("cpu"), conv=False) == 2.0**-24


@pytest.mark.parametrize("shape", [(100, 30), (300, 1000)], ids=["short", "rows-of-65521-and-a-tail"])
def test_a_fingerprint_changes_with_any_element_and_with_a_swap(shape: tuple[int, int]) -> None:
    # 300 x 1000 is summed as four rows of 65521 and a partial row: a swap in each part.
    t = torch.randn(*shape).to(torch.bfloat16)
    base = fingerprint(t)
    assert fingerprint(t.clone()) == base
    changed = t.clone()
    changed[7, 3] = changed[7, 3] + 1
    assert fingerprint(changed) != base
    for row in {0, shape[0] - 1}:
        swapped = t.clone()
        swapped[row, 0], swapped[row, 1] = t[row, 1], t[row, 0]
        assert not torch.equal(swapped, t) and fingerprint(swapped) != base


def _copied(ctx: Any, desc: Any) -> Any:
    _copied.seen = sorted(ctx.snapshot())  # type: ignore[attr-defined]
    return passed()


def test_verification_copies_only_what_forwards_write_and_leaves_the_module_as_found() -> None:
    torch.manual_seed(0)
    module = Counter()
    before = {n: t.clone() for n, t in module.state_dict().items()}
    report = verify(
        module,
        _inputs,
        capture_sizes=[1, 2, 4],
        max_num_reqs=4,
        backend="emulate",
        extra_checks=[Check("copied", _copied, compares="what a snapshot holds")],
    )
    assert report.ok, report.format()
    assert _copied.seen == ["steps"]  # type: ignore[attr-defined]  # not the weights, not the read-only table
    assert all(torch.equal(before[n], t) for n, t in module.state_dict().items())
    assert report.notes == []


class HiddenWrite(Counter):
    """Writes its counter where no op shows it to a dispatch mode (as a Triton kernel called directly does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C._DisableTorchDispatch():
            self.steps.add_(1)
        return self.lin(x) + self.steps


def test_a_write_no_op_shows_is_found_by_its_fingerprint_and_said() -> None:
    torch.manual_seed(0)
    report = verify(
        HiddenWrite(), _inputs, capture_sizes=[1, 2], max_num_reqs=2, backend="emulate", checks=["state"]
    )
    assert any("'steps'" in note and "fingerprint" in note for note in report.notes), report.format()


def test_the_report_says_where_the_time_went_and_the_peak() -> None:
    torch.manual_seed(0)
    report = verify(
        Counter(),
        _inputs,
        capture_sizes=[1, 2, 4],
        max_num_reqs=4,
        backend="emulate",
        checks=["replay_matches_eager", "real_batches", "determinism"],
    )
    costs = report.costs
    assert {"learn", "capture", "replay_matches_eager", "real_batches", "determinism"} <= set(costs)
    assert costs["learn"].forwards == 2  # the smallest and largest shapes
    assert costs["replay_matches_eager"].forwards == 3 and costs["replay_matches_eager"].replays == 3
    # Per descriptor: two replays with the graph memory poisoned (0, then 1), which agree here: no third.
    assert costs["determinism"].forwards == 0 and costs["determinism"].replays == 6
    assert costs["real_batches"].forwards >= 3
    assert all(c.seconds > 0 for c in costs.values())
    assert report.peak_memory > 0 and report.memory_kind
    assert "peak memory" in report.summary()
    assert report.to_dict()["costs"]["determinism"]["replays"] == 6
    assert "Where the time went" in report.format(verbose=True)


def _first_unwritten_read(fn: Any) -> Any:
    observer = ForwardObserver(nn.Linear(2, 2))
    with observing(observer):
        fn()
    return observer.unwritten_read


def test_a_read_of_memory_nobody_wrote_is_seen_with_the_op_that_made_it() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)

    def split_k() -> None:
        out = torch.empty(3, 5)
        out += a[:, :2] @ b[:2]

    assert _first_unwritten_read(split_k) == ("aten.add_.Tensor", "aten.empty.memory_format")

    def cloned() -> None:
        torch.empty_like(a).clone()

    assert _first_unwritten_read(cloned) == ("aten.clone.default", "aten.empty_like.default")


@pytest.mark.parametrize("name", ["copy_then_add", "out_argument", "a_view_then_copy", "metadata_only"])
def test_memory_written_before_it_is_read_is_not_a_finding(name: str) -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)

    def copy_then_add() -> None:
        out = torch.empty(3, 5)
        out.copy_(a[:, :2] @ b[:2])
        out += a[:, 2:] @ b[2:]

    def out_argument() -> None:
        out = torch.empty(3, 5)
        torch.mm(a, b, out=out)
        out.relu()

    def a_view_then_copy() -> None:
        out = torch.empty(15).view(3, 5)
        out.t()
        out.fill_(1.0)
        out.sum()

    def metadata_only() -> None:
        out = torch.empty(3, 5)
        torch.zeros_like(out)
        torch.empty_like(out).zero_()

    assert _first_unwritten_read(locals()[name]) is None
