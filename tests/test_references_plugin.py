"""``references=`` through the plugin (#56): the ``cudagraph`` marker, every verify fixture
(inference, runner, training, distributed's keywords) and ``register_reference`` in a conftest.
In-process ``pytester`` runs: the kernels and modules come from ``tests/test_references.py``, whose
custom ops are registered once per process."""

from __future__ import annotations

import pytest

import tests.test_references  # noqa: F401  (registers the custom ops before pytester snapshots sys.modules)
from pytest_cudagraph.launch_env import from_environment
from tests.conftest import isolate_plugins

# An inner pytest session runs in this process: under torchrun or srun it would join the launcher's
# ranks (their process group is this process's), so each rank's inner verdicts would merge.
pytestmark = pytest.mark.skipif(
    from_environment() is not None,
    reason="runs a pytest session of its own in this process, which under a launcher joins its ranks",
)

HEADER = """
import pytest
import torch
from tests.test_references import Tiny, attention, attention_reference, make_ids, scaled, tiny


class Runner:
    '''A runner someone else wrote: eager, for the references' sake.'''

    def __init__(self, module):
        self.module = module

    def __call__(self, x):
        with torch.no_grad():
            return self.module(x)
"""


@pytest.fixture
def inner(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None
) -> pytest.Pytester:
    isolate_plugins(monkeypatch)
    return pytester


def _run(inner: pytest.Pytester, body: str, conftest: str = "") -> pytest.RunResult:
    if conftest:
        inner.makeconftest(conftest)
    inner.makepyfile(test_inner=HEADER + body)
    return inner.runpytest("--cudagraph-backend=emulate", "-p", "no:cacheprovider", "-rA")


def test_the_marker_and_the_fixtures_take_references(inner: pytest.Pytester) -> None:
    result = _run(
        inner,
        """
SIZES = dict(capture_sizes=[1, 2, 4, 8, 16], max_num_reqs=16)


@pytest.mark.cudagraph(references={attention: attention_reference}, **SIZES)
def test_marker_catches_the_bug(cudagraph_verify):
    cudagraph_verify(tiny(error=1e-3), make_ids)


@pytest.mark.cudagraph(references={attention: attention_reference}, **SIZES)
def test_marker_passes_the_twin(cudagraph_verify):
    report = cudagraph_verify(tiny(), make_ids)
    assert report.references[0]["stood_in"] is True


def test_fixture_keyword_names_a_wrong_reference(cudagraph_verify):
    cudagraph_verify(tiny(), make_ids, references={"tref::attention": scaled(0.05)}, **SIZES)


def test_runner_fixture_holds_the_reference(cudagraph_verify_runner):
    module = tiny()
    report = cudagraph_verify_runner(
        Runner(module), module, make_ids, references={attention: attention_reference}, **SIZES
    )
    assert report.references[0]["held"] == "agrees"
    assert any("verify_runner asks no float64 question" in n for n in report.notes)


def test_runner_fixture_names_a_wrong_reference(cudagraph_verify_runner):
    module = tiny()
    cudagraph_verify_runner(Runner(module), module, make_ids, references={attention: scaled(0.05)}, **SIZES)


def test_training_fixture_holds_the_reference(cudagraph_verify_training):
    torch.manual_seed(0)
    module = Tiny().to(torch.bfloat16).train()
    report = cudagraph_verify_training(
        module,
        lambda t, r: {**make_ids(t, r), "weight": torch.ones(t)},
        lambda out, inputs: (out.float().square().mean(-1) * inputs["weight"]).sum(),
        capture_sizes=[1, 2, 4],
        pad_values={"weight": 0.0},
        references={attention: attention_reference},
    )
    assert report.references[0]["held"] == "agrees"
    assert any("verify_training asks no float64 question" in n for n in report.notes)


@pytest.mark.cudagraph(references={attention: attention_reference}, capture_sizes=[1, 2, 4, 8])
def test_distributed_fixture_takes_the_markers_references(cudagraph_verify_distributed):
    from tests.test_references import build_buggy

    cudagraph_verify_distributed(build_buggy, make_ids, world_size=2)


def test_a_bad_key_is_one_line(cudagraph_verify):
    cudagraph_verify(tiny(), make_ids, references={"tref::nope": attention_reference}, **SIZES)
""",
    )
    outcomes = {
        r.nodeid.split("::")[-1]: r.outcome
        for r in result.reprec.getreports("pytest_runtest_logreport")
        if r.when == "call"
    }  # type: ignore[attr-defined]
    assert outcomes == {
        "test_marker_catches_the_bug": "failed",
        "test_marker_passes_the_twin": "passed",
        "test_fixture_keyword_names_a_wrong_reference": "failed",
        "test_runner_fixture_holds_the_reference": "passed",
        "test_runner_fixture_names_a_wrong_reference": "failed",
        "test_training_fixture_holds_the_reference": "passed",
        "test_distributed_fixture_takes_the_markers_references": "failed",
        "test_a_bad_key_is_one_line": "failed",
    }, result.stdout.str()[-4000:]
    out = result.stdout.str()
    assert "FAIL padded_size" in out
    assert "FAIL padded_size            FULL-T8-R8 rank 0" in out and "FULL-T8-R8 rank 1" in out  # the ranks
    assert out.count("the reference for tref::attention") >= 2 and "disagrees with the kernel" in out
    assert "cudagraph_verify: references: no op 'tref::nope' is registered with torch" in out


def test_a_conftest_registers_a_reference_for_the_suite(inner: pytest.Pytester) -> None:
    result = _run(
        inner,
        """
@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8, 16], max_num_reqs=16)
def test_bug(cudagraph_verify):
    cudagraph_verify(tiny(error=1e-3), make_ids)


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8, 16], max_num_reqs=16)
def test_twin(cudagraph_verify):
    report = cudagraph_verify(tiny(), make_ids)
    assert [r["op"] for r in report.references] == ["tref::attention"]
""",
        conftest="""
import pytest
from pytest_cudagraph import register_reference
from pytest_cudagraph.references import clear_registered
from tests.test_references import attention, attention_reference

register_reference(attention, attention_reference)


def pytest_unconfigure(config):
    clear_registered()
""",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAIL padded_size*"])
