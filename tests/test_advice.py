"""Each finding says how to fix what it found, a message several failures share is printed once, and
the report points to the page that explains its words (issue #45, point 3).

The gallery's modules (examples/buggy, tests/bugs.py) on the emulator, at small capture sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import pytest_cudagraph
from examples.buggy.batch_statistics import BatchStatistics
from examples.buggy.common import Base, token_inputs
from examples.buggy.expert_load import HashRoutedLoad, id_inputs
from examples.buggy.host_sync import HostSync
from examples.buggy.padding_leak import MaskByMultiply, PoolsPaddedRows
from examples.buggy.shape_branch import ShapeBranch
from pytest_cudagraph.checks.divergence import parting, where_runs_part
from pytest_cudagraph.checks.report import TERMS, Finding, Outcome, VerifyReport
from pytest_cudagraph.plan import BatchDescriptor, GraphMode

ROOT = Path(__file__).resolve().parents[1]
CONFIG: dict[str, Any] = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "backend": "emulate"}


def _verify(module: torch.nn.Module, make_inputs: Any = None, **kwargs: Any) -> VerifyReport:
    torch.manual_seed(0)
    return pytest_cudagraph.verify(module, make_inputs or token_inputs("cpu"), **CONFIG, **kwargs)


def _failed(report: VerifyReport, check: str) -> list[Outcome]:
    failed = [o for o in report.failures if o.check == check]
    assert failed, report.format(verbose=True)
    return failed


def test_padding_leak_says_mask_the_padded_rows_or_keep_statistics_per_row() -> None:
    report = _verify(PoolsPaddedRows())
    failed = _failed(report, "padding_isolation")
    finding = failed[0].finding
    assert finding is not None and finding.fix is not None
    assert "mask the padded rows before anything mixes rows" in finding.fix
    assert "statistics per row/token" in finding.fix
    # The message keeps its words (tests/bugs.py's regex), the fix is its own line of the report.
    assert failed[0].message.startswith("real rows change when padded rows of 'x' hold random values")
    assert f"     fix: {finding.fix}" in report.format()


def test_nonfinite_padding_leak_says_mask_by_selection() -> None:
    failed = _failed(_verify(MaskByMultiply(), nonfinite_padding=True), "padding_isolation")
    finding = failed[0].finding
    assert finding is not None and finding.fix is not None
    assert "mask by selection, not by multiplication" in finding.fix and "torch.where" in finding.fix


def test_state_written_by_padded_rows_says_mask_the_write() -> None:
    failed = _failed(_verify(HashRoutedLoad(), id_inputs("cpu")), "padding_isolation")
    state = [o for o in failed if o.message.startswith("module state 'load' changes")]
    assert state, [o.message for o in failed]
    finding = state[0].finding
    assert finding is not None and finding.fix is not None
    assert finding.fix.startswith("mask the write") and "scratch_state" in finding.fix


def test_host_sync_says_keep_the_value_on_the_device_or_move_the_read_out_of_forward() -> None:
    report = _verify(HostSync())
    failed = _failed(report, "capture_safety")
    finding = failed[0].finding
    assert finding is not None and finding.fix is not None
    assert "keep the value on the device" in finding.fix and "torch.where" in finding.fix
    assert "move the read out of forward" in finding.fix and "make_inputs" in finding.fix
    text = report.format()
    assert "fix: keep the value on the device" in text
    # The same failure at every descriptor: its message and its fix are printed once.
    assert text.count("cannot be captured in a graph") == 1, text
    assert text.count("fix: keep the value on the device") == 1, text
    assert "the same message as capture_safety FULL-T8-R4 above" in text and "fix: as above" in text


def test_host_sync_rule_reasons_say_how_to_fix() -> None:
    from pytest_cudagraph.guard.rules import check_op

    aten = torch.ops.aten
    found = check_op(aten._local_scalar_dense.default, (torch.ones(()),), {}, torch.device("cpu"))
    assert found is not None
    assert found[1].startswith("host sync: reads a device value on the host; keep it on the device")
    found = check_op(aten.is_nonzero.default, (torch.ones(()),), {}, torch.device("cpu"))
    assert found is not None and "torch.where" in found[1]


def test_shape_branch_names_the_lines_where_the_runs_part() -> None:
    # padded_size (not run here) catches it first; real_batches, which locate_divergence serves, too.
    report = _verify(ShapeBranch(), checks=["-padded_size"])
    failed = _failed(report, "real_batches")
    finding = failed[0].finding
    assert finding is not None and finding.submodule == "" and finding.branch
    source = [line.strip() for line in (ROOT / "examples/buggy/shape_branch.py").read_text().splitlines()]
    lines = {
        "if": next(i + 1 for i, line in enumerate(source) if line.startswith("if x.shape[0] >= 4:")),
        "graph": source.index("return self.lin(x) * 2") + 1,
        "eager": source.index("return self.lin(x)") + 1,
    }
    assert f"shape_branch.py:{lines['graph']} in forward" in finding.branch  # the graph's path
    assert f"shape_branch.py:{lines['eager']} in forward" in finding.branch  # eager's path on the real batch
    assert f"shape_branch.py:{lines['if']} in forward" in finding.branch  # the last call both made
    text = report.format()
    assert "first divergent submodule: the top-level module; the two runs part at call" in text


class MeansOverTheBatch(Base):
    """Statistics over every row in the top-level forward, no branch: where the runs part is not known."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) - self.lin(x).mean(0, keepdim=True)


def test_no_branch_says_the_line_is_not_known() -> None:
    report = _verify(MeansOverTheBatch(), checks=["-padded_size"])
    failed = _failed(report, "real_batches")
    finding = failed[0].finding
    assert finding is not None and finding.submodule == "" and finding.branch == ""
    assert "the line of a branch is not known" in report.format()


def test_a_submodule_found_claims_no_branch() -> None:
    report = _verify(BatchStatistics(), checks=["-padded_size"])
    finding = _failed(report, "real_batches")[0].finding
    assert finding is not None and finding.submodule == "lin" and finding.branch is None
    assert "two runs part" not in report.format() and "branch is not known" not in report.format()


def test_parting_names_both_calls_and_the_last_common_one() -> None:
    common = [("torch.Tensor.shape.__get__", "m.py:3 in forward")]
    said = parting([*common, ("f", "m.py:4 in forward")], [*common, ("f", "m.py:5 in forward")])
    assert "call 2" in said and "m.py:4 in forward" in said and "m.py:5 in forward" in said
    assert "after their last common call, torch.Tensor.shape.__get__ at m.py:3 in forward" in said
    said = parting([*common, ("g", "m.py:7 in forward")], common)
    assert "the graph calls g at m.py:7 in forward where eager on the real batch has finished" in said
    assert parting(common, common) == ""


def test_where_runs_part_records_call_sites() -> None:
    x = torch.ones(3)

    def one() -> None:
        torch.sin(x)  # this line

    def two() -> None:
        torch.cos(x)

    said = where_runs_part(one, two)
    assert "torch.sin at tests/test_advice.py:" in said and "torch.cos at tests/test_advice.py:" in said


class Cache:
    """A Python object forward makes, as transformers' DynamicCache."""


class ReturnsCache(Base):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        return self.lin(x), Cache()


def test_a_message_many_failures_share_is_printed_once() -> None:
    report = _verify(ReturnsCache(), exhaustive=False)
    opaque = [o for o in report.failures if "a Cache object, not a tensor" in o.message]
    assert len(opaque) > 1, report.format(verbose=True)
    text = report.format()
    assert text.count("a Cache object, not a tensor") == 1, text
    assert text.count("the same message as") == len(opaque) - 1, text


def test_same_message_and_notes_once_in_a_synthetic_report() -> None:
    descs = [BatchDescriptor(GraphMode.FULL, n, 4) for n in (8, 4)]
    report = VerifyReport("M", "emulate", "cpu", "FULL", True, ("replay_matches_eager",), tuple(descs), 2)
    report.notes = ["a note", "a note"]
    report.add(
        Outcome("replay_matches_eager", d, False, "the same words", Finding(fix="do this")) for d in descs
    )
    text = report.format()
    assert text.count("the same words") == 1 and text.count("NOTE a note") == 1
    assert "the same message as replay_matches_eager FULL-T8-R4 above" in text
    assert text.count("fix: do this") == 1 and "fix: as above" in text


def test_the_report_points_to_the_terms_page() -> None:
    report = _verify(PoolsPaddedRows())
    assert "docs/terms.md in the pytest-cudagraph repository" in report.format()
    assert report.format().splitlines()[-1] == TERMS


@pytest.mark.parametrize(
    "term",
    [
        "FULL-T8-R4",
        "`R4`",
        "`U1`",
        "`Q4`",
        "`L2`",
        "`B2`",
        "max ULP",
        "max abs diff",
        "floor",
        "limit",
        "relative rms",
        "reference precision",
        "quick mode",
        "Quick mode and every descriptor",
        "SKIP",
        "first divergent submodule",
        "the two runs part",
        "fix:",
        "the same message as",
        "(checks.md)",
    ],
)
def test_the_terms_page_explains_the_words(term: str) -> None:
    assert term in (ROOT / "docs" / "terms.md").read_text()
