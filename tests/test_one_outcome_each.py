"""One outcome per check and descriptor: a failed capture is its descriptor's failure, nothing is skipped in silence."""

from __future__ import annotations

import collections

import pytest
import torch

from pytest_cudagraph import CaptureError, verify
from pytest_cudagraph.checks import CHECKS
from pytest_cudagraph.checks.builtin import BUILTIN
from pytest_cudagraph.checks.registry import Check
from pytest_cudagraph.checks.report import Outcome
from pytest_cudagraph.manager.capture import Capture
from tests.bugs import D, IdentityMemo, NoMemo, token_inputs

SIZES = (1, 2, 4, 8)


class SyncsAtEight(NoMemo):
    """A host sync at 8 tokens only: one descriptor cannot be captured, the others can."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8 and float(x.sum()) > 1e9:
            x = x * 2
        return self.lin(torch.tanh(x))


def _one_each(report) -> None:
    counts = collections.Counter((o.check, o.descriptor) for o in report.outcomes)
    assert all(n == 1 for n in counts.values()), [k for k, n in counts.items() if n > 1]


def _labels(outcomes) -> set[str]:
    return {o.descriptor.label() for o in outcomes if o.descriptor is not None}


def test_a_descriptor_that_capture_safety_fails_is_its_own_failure(backend, device):
    torch.manual_seed(0)
    report = verify(
        SyncsAtEight().to(device), token_inputs(device), capture_sizes=SIZES, max_num_reqs=4, backend=backend
    )
    _one_each(report)
    assert {o.check for o in report.failures} == {"capture_safety"}
    assert _labels(report.failures) == {"FULL-T8-R4"}
    # The others are captured and every check ran on them.
    assert {d.label() for d in report.descriptors} == {"FULL-T4-R4", "FULL-T2-R2", "FULL-T1-R1"}
    for check in CHECKS:
        ran = [o for o in report.outcomes if o.check == check and not o.skipped]
        assert ran, check
    skipped_t8 = [
        o for o in report.skips if o.descriptor is not None and o.descriptor.label() == "FULL-T8-R4"
    ]
    # Every check of a descriptor: those run on each captured one, and those after the graphs are released.
    assert {o.check for o in skipped_t8} == {
        c.name for c in BUILTIN if c.scope in ("descriptor", "after_release")
    }
    # capture_safety's guard runs in the capture: the capture stopped at the op, before the device ran it.
    assert all("not captured: its capture failed (capture_safety says why)" in o.message for o in skipped_t8)
    (t8,) = [o for o in report.failures if o.check == "capture_safety"]
    assert t8.message.startswith("1 op(s) cannot be captured in a graph; the first is float(tensor)"), (
        t8.message
    )


def _refuses_four(ctx, descs):
    return [
        Outcome("refuse_four", d, d.num_tokens != 4, "" if d.num_tokens != 4 else "four tokens refused")
        for d in descs
    ]


def test_a_descriptor_a_suites_before_capture_check_fails_is_not_captured(backend, device):
    """A downstream check of scope before_capture blocks the descriptors it fails, as capture_safety's did."""
    torch.manual_seed(0)
    refuse = Check("refuse_four", _refuses_four, compares="four tokens are refused", scope="before_capture")
    report = verify(
        NoMemo().to(device),
        token_inputs(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        extra_checks=[refuse],
    )
    _one_each(report)
    assert [(o.check, o.descriptor.label()) for o in report.failures] == [("refuse_four", "FULL-T4-R4")]
    assert {d.label() for d in report.descriptors} == {"FULL-T8-R4", "FULL-T2-R2", "FULL-T1-R1"}
    skipped = [o for o in report.skips if o.descriptor is not None and o.descriptor.label() == "FULL-T4-R4"]
    assert skipped and all(
        "not captured: refuse_four failed for this descriptor" in o.message for o in skipped
    )


def test_a_failed_capture_is_that_descriptors_failure_and_replaces_its_pass(backend, device, monkeypatch):
    """capture_safety passed at every shape, then one capture failed: one outcome, FAIL, for that descriptor."""
    honest = Capture._capture_one

    def fails_at_two(self, desc, *args):
        if desc.num_tokens == 2:
            raise CaptureError(
                f"capture of {desc} failed: injected", descriptor=desc, backend=self.state.backend.name
            )
        return honest(self, desc, *args)

    monkeypatch.setattr(Capture, "_capture_one", fails_at_two)
    torch.manual_seed(0)
    report = verify(
        NoMemo().to(device), token_inputs(device), capture_sizes=SIZES, max_num_reqs=4, backend=backend
    )
    _one_each(report)
    (fail,) = report.failures
    assert (fail.check, fail.descriptor.label()) == (
        "capture_safety",
        "FULL-T2-R2",
    ) and "injected" in fail.message
    assert "ok   capture_safety         FULL-T2-R2" not in report.format(verbose=True)
    assert {d.label() for d in report.descriptors} == {"FULL-T8-R4", "FULL-T4-R4", "FULL-T1-R1"}
    passed = [o for o in report.outcomes if o.passed and not o.skipped and o.check == "replay_matches_eager"]
    assert _labels(passed) == {"FULL-T8-R4", "FULL-T4-R4", "FULL-T1-R1"}
    # The plan is not whole: dispatch says so instead of passing.
    (dispatch,) = [o for o in report.outcomes if o.check == "dispatch"]
    assert dispatch.skipped and "a capture failed" in dispatch.message


def test_when_nothing_is_captured_every_check_says_why(device, backend):
    class AlwaysSyncs(NoMemo):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if float(x.sum()) > 1e9:
                x = x * 2
            return self.lin(x)

    report = verify(
        AlwaysSyncs().to(device), token_inputs(device), capture_sizes=SIZES, max_num_reqs=4, backend=backend
    )
    _one_each(report)
    assert not report.descriptors and {o.check for o in report.failures} == {"capture_safety"}
    assert all(o.message for o in report.skips)
    assert {o.check for o in report.skips} == {*CHECKS, "dispatch"} - {"capture_safety"}


# -- fresh inputs where make_inputs gives the same values every call ---------------------------
def _ones(device):
    return lambda num_tokens, num_reqs: {"x": torch.ones(num_tokens, D, device=device)}


def test_a_deterministic_make_inputs_gets_fresh_values_from_the_harness(backend, device):
    torch.manual_seed(0)
    buggy = verify(
        IdentityMemo().to(device),
        _ones(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        checks=["fresh_inputs"],
    )
    assert not buggy.ok
    assert all(
        "the harness drew these inputs: fresh floating values in 'x'" in o.message for o in buggy.failures
    )
    # Where no row is padded, only the harness's fresh values can show the frozen memo.
    assert {"FULL-T1-R1", "FULL-T2-R2"} <= {o.descriptor.label() for o in buggy.failures}
    torch.manual_seed(0)
    correct = verify(
        NoMemo().to(device),
        _ones(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        checks=["fresh_inputs"],
    )
    assert correct.ok and not correct.skips
    assert all(o.figures["harness_inputs"] == "fresh floating values in 'x'" for o in correct.outcomes)


class Embeds(torch.nn.Module):
    def __init__(self, memo: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, D)
        self.memo = memo
        self._last: torch.Tensor | None = None
        self._cached: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.memo or ids is not self._last:
            self._cached, self._last = self.emb(ids), ids
        assert self._cached is not None
        return self._cached * 2


def test_integer_inputs_are_permuted_within_their_range(backend, device):
    def arange_ids(num_tokens, num_reqs):
        return {"ids": torch.arange(num_tokens, device=device) % 32}

    for memo, ok in ((True, False), (False, True)):
        torch.manual_seed(0)
        report = verify(
            Embeds(memo).to(device),
            arange_ids,
            capture_sizes=SIZES,
            max_num_reqs=4,
            backend=backend,
            checks=["fresh_inputs"],
        )
        assert report.ok is ok, report.format()
        ran = {o.descriptor.num_tokens: o for o in report.outcomes if not o.skipped}
        assert sorted(ran) == sorted(SIZES)
        how = {n: o.figures.get("harness_inputs", o.message) for n, o in ran.items()}
        # One token cannot be permuted: integers drawn in the range make_inputs gives at 8 tokens.
        assert "integers of 'ids' drawn in [0, 7]" in how[1]
        assert all("integers of 'ids' rows permuted" in how[n] for n in SIZES if n > 1)


def test_inputs_the_harness_cannot_change_fail_saying_the_check_could_not_run(backend, device):
    def zeros(num_tokens, num_reqs):
        return {"ids": torch.zeros(num_tokens, dtype=torch.long, device=device)}

    report = verify(
        Embeds(False).to(device),
        zeros,
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend=backend,
        checks=["fresh_inputs"],
    )
    assert not report.ok
    assert all("the check could not run" in o.message for o in report.failures)
    # What that means for the user's input, named (#66: no "integer inputs hold one value each").
    assert all(
        "no input can be given other values by the harness (no floating input, and 'ids' holds one value "
        "in every row, the only one make_inputs gives, so neither permuting rows nor drawing in its range "
        "changes it)" in o.message
        for o in report.failures
    ), report.format()


def test_the_report_lists_every_skip_with_its_reason():
    torch.manual_seed(0)
    report = verify(
        NoMemo(), token_inputs(), capture_sizes=SIZES, max_num_reqs=4, backend="emulate", exhaustive=False
    )
    assert report.skips  # quick mode: dispatch is not property-tested
    text = report.format()
    for check, reason, _ in report.skipped_reasons():
        assert f"SKIP {check}" in text and reason in text
    assert f"{len(report.skips)} skipped" in report.summary()


@pytest.mark.parametrize("verbose", [False, True])
def test_the_terminal_summary_counts_skipped_checks(pytester, verbose):
    pytester.makepyfile(
        test_s="""
        import torch
        from tests.bugs import NoMemo, token_inputs

        def test_quick(cudagraph_verify):
            cudagraph_verify(NoMemo(), token_inputs(), capture_sizes=[1, 2, 4], backend="emulate")
    """
    )
    import pathlib
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[1])
    pytester.syspathinsert(root)
    sys.path.insert(0, root)
    result = pytester.runpytest(*(["-v"] if verbose else []))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "cudagraph: * checks skipped, by reason:",
            "* x quick verification (exhaustive=False) does not property-test dispatch (dispatch)",
        ]
    )
