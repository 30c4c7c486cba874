"""A lost CUDA context told as such, and the run that goes on after it (#19).

The sticky errors themselves need a GPU (tests marked cuda, and
docs/reliability.md's H200 run); here a stand-in exception carries the same
numeric ``error_code`` that ``torch.AcceleratorError`` has, which is all the
plugin reads.
"""

from __future__ import annotations

import pytest
import torch

from pytest_cudagraph import faults

from .conftest import isolate_plugins


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first lost context is the process's: each test starts without one (and leaves none behind)."""
    monkeypatch.setattr(faults, "_first", None)


class FakeAcceleratorError(torch.AcceleratorError):
    """A ``torch.AcceleratorError`` raised without a GPU, with the CUDA error code PyTorch gives it."""

    def __init__(self, code: int) -> None:
        super().__init__(f"CUDA error: stand-in for code {code}")
        self.error_code = code


def test_error_codes_are_read_through_causes_and_contexts() -> None:
    try:
        try:
            raise FakeAcceleratorError(710)
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as exc:
        assert faults.cuda_error_code(exc) == 710
        lost = faults.context_lost_error(exc)
    assert lost is not None and lost.code == 710 and "device-side assert" in str(lost)
    assert "CUDA said: CUDA error: stand-in for code 710" in str(lost)
    assert faults.cuda_error_code(ValueError("plain")) is None

    class OtherLibraryError(RuntimeError):  # an error_code of its own is no CUDA error
        error_code = 710

    assert faults.cuda_error_code(OtherLibraryError()) is None


@pytest.mark.parametrize(
    ("code", "sticky"), [(700, True), (710, True), (719, True), (2, False), (901, False), (900, False)]
)
def test_only_sticky_codes_lose_the_context(code: int, sticky: bool) -> None:
    # Out of memory (2) and an invalidated capture (901) leave the context usable.
    assert (faults.context_lost_error(FakeAcceleratorError(code)) is not None) is sticky


def test_a_phase_tags_the_sticky_error_with_where_it_showed() -> None:
    from pytest_cudagraph.plan import BatchDescriptor, GraphMode

    desc = BatchDescriptor(mode=GraphMode.FULL, num_tokens=8, num_reqs=8)
    with pytest.raises(FakeAcceleratorError) as info:
        with faults.phase("eager", "Outer", None, torch.device("cpu")):
            with faults.phase("warm-up", "OutOfRange", desc, torch.device("cpu")):
                raise FakeAcceleratorError(710)
    where = info.value.cudagraph_where  # type: ignore[attr-defined]
    assert (where.module, where.descriptor, where.phase) == (
        "OutOfRange",
        "FULL-T8-R8",
        "warm-up",
    )  # innermost
    lost = faults.context_lost_error(info.value)
    assert lost is not None and "in OutOfRange, warm-up of FULL-T8-R8" in str(lost)
    with pytest.raises(ValueError):  # anything else passes through untagged
        with faults.phase("eager", "M", None, torch.device("cpu")):
            raise ValueError("no")


def test_verify_tells_a_lost_context_without_its_frames() -> None:
    """A sticky error in the module's forward leaves verify() as ContextLost, not as a check's failure."""
    from pytest_cudagraph import verify

    class Asserts(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] >= 4:
                raise FakeAcceleratorError(710)
            return x * 2

    with pytest.raises(faults.ContextLost) as info:
        verify(Asserts(), lambda t, r: {"x": torch.randn(t, 4)}, capture_sizes=[1, 2, 4], backend="emulate")
    lost = info.value
    assert lost.code == 710 and lost.where is not None and lost.where.module == "Asserts"
    # The first pass (what forward writes) and capture_safety run each shape eagerly first: the fault
    # shows there, before any capture.
    assert (lost.where.descriptor, lost.where.phase) == ("FULL-T4-R4", "eager")
    assert lost.__cause__ is None and lost.__suppress_context__


SUITE = """
import pytest, torch


class FakeAcceleratorError(torch.AcceleratorError):
    def __init__(self, code):
        super().__init__(f"CUDA error: stand-in for code {code}")
        self.error_code = code


class Asserts(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] >= 4:
            raise FakeAcceleratorError(710)
        return x * 2


def make_inputs(t, r):
    return {"x": torch.randn(t, 4)}


@pytest.mark.cuda
def test_a_fine():
    pass


@pytest.mark.cuda
@pytest.mark.cudagraph(capture_sizes=[1, 2, 4])
def test_b_asserts(cudagraph_verify):
    cudagraph_verify(Asserts(), make_inputs)


@pytest.mark.cuda
def test_c_after():
    pass


def test_d_cpu_only():
    pass
"""

# The suite's CUDA-marked tests run here without a GPU: CUDA is said to be available, for the
# inner run only (an in-process run shares the plugin module with this session).
CONFTEST = """
import pytest_cudagraph.plugin as plugin

_saved = plugin._cuda_available


def pytest_configure(config):
    plugin._cuda_available = lambda: True


def pytest_unconfigure(config):
    plugin._cuda_available = _saved
"""


def test_serially_the_gpu_tests_after_a_lost_context_are_not_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None
) -> None:
    isolate_plugins(monkeypatch)
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest("--cudagraph-backend=emulate", "-rs")
    result.assert_outcomes(passed=2, failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*CUDA context lost: a device-side assert (cudaErrorAssert) in Asserts, eager of FULL-T4-R4*",
            "cudagraph: test_suite.py::test_b_asserts lost the CUDA context of its process; 1 GPU test(s) after it "
            "were not run in this process",
            "SKIPPED*not run: an earlier test lost this process's CUDA context (a sticky CUDA error); -n N "
            "(pytest-xdist) or --cudagraph-isolate confines a fault to one test",
        ]
    )
    # The failure is told in words: no frame of the harness in it.
    assert "pytest_cudagraph/" not in result.stdout.str().split("FAILURES")[1].split("short test summary")[0]


def test_under_xdist_the_worker_is_replaced_and_the_run_goes_on(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate_plugins(monkeypatch)
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest_subprocess("--cudagraph-backend=emulate", "-n", "1", "-p", "xdist", "-rA")
    # The test after the fault runs in a fresh worker and passes; the fault is one failure, not two.
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*replacing crashed worker*",
            "cudagraph: test_suite.py::test_b_asserts lost the CUDA context of its process; its worker ended after "
            "its report, and a fresh one ran the tests after it",
            "PASSED test_suite.py::test_c_after",
        ]
    )
    assert "crashed while running" not in result.stdout.str()


class AsksTooMuch(torch.nn.Module):
    """Runs out of memory at the largest shape only (a stand-in for the allocator's refusal)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 4:
            # What the CUDA allocator does: tell its observer (device 0, 256 GiB asked, 140 GiB in
            # all, 139 free), then raise.
            faults._observe(0, 256 << 30, 140 << 30, 139 << 30)
            raise torch.OutOfMemoryError("stand-in: CUDA out of memory")
        return x * 2


def test_out_of_memory_in_capture_is_a_finding_naming_what_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_cudagraph import verify

    monkeypatch.setattr(faults, "_last_oom", (0, 1, 1, 1))  # an earlier phase's reading: not this one's
    report = verify(
        AsksTooMuch(), lambda t, r: {"x": torch.randn(t, 4)}, capture_sizes=[1, 2, 4], backend="emulate"
    )
    failed = [f for f in report.failures if f.check == "capture_safety"]
    assert [f.descriptor.label() for f in failed] == ["FULL-T4-R4"], report.format()
    assert (
        "out of device memory: an allocation of 256.0 GiB was asked for with 139.0 GiB free of 140.0 GiB "
        "on cuda:0 (OutOfMemoryError)"
    ) in failed[0].message
    # The other descriptors were captured and verified: the process goes on. (A check that runs
    # the module at 4 rows eagerly meets the same refusal, and says so in the same words.)
    assert len(report.descriptors) == 2
    assert all("an allocation of 256.0 GiB was asked for" in f.message for f in report.failures), (
        report.format()
    )


def test_out_of_memory_detail_without_the_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_last_oom", None)
    assert faults.oom_detail(ValueError("x")) is None
    detail = faults.oom_detail(torch.OutOfMemoryError("stand-in"), torch.device("cpu"))
    assert detail == "out of memory: an allocation larger than what was free was asked for"


def test_with_isolation_the_fault_costs_its_child_only(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate_plugins(monkeypatch)
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest_subprocess("--cudagraph-backend=emulate", "--cudagraph-isolate", "-rA")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*CUDA context lost: a device-side assert (cudaErrorAssert) in Asserts, eager of FULL-T4-R4*",
            "cudagraph: test_suite.py::test_b_asserts lost the CUDA context of its process (its own child process: "
            "--cudagraph-isolate); the tests after it ran",
            "PASSED test_suite.py::test_c_after",
        ]
    )


def test_a_check_that_runs_out_of_memory_fails_and_says_what_was_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_cudagraph.checks.builtin import BUILTIN
    from pytest_cudagraph.checks.engine import could_not_run

    monkeypatch.setattr(faults, "_last_oom", (0, 3 << 30, 140 << 30, 1 << 30))
    check = next(iter(BUILTIN))
    outcome = could_not_run(check, None, torch.OutOfMemoryError("stand-in"))
    assert not outcome.passed and not outcome.skipped
    assert outcome.message == (
        "the check could not run: out of device memory: an allocation of 3.0 GiB was asked "
        "for with 1.0 GiB free of 140.0 GiB on cuda:0 (OutOfMemoryError)"
    )
