"""Every check, through the plugin: its buggy module fails with the expected
message and its correct twin passes (``pytester`` runs of ``cudagraph_verify``)."""

from __future__ import annotations

import pytest

from tests.bugs import PAIRS, Pair
from tests.conftest import isolate_plugins

TEST_FILE = """
import pytest
from tests.bugs import {cls}, {inputs}


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8), max_num_reqs=4{extra})
def test_module(cudagraph_verify, cudagraph_device):
    cudagraph_verify({cls}().to(cudagraph_device), {inputs}(cudagraph_device))
"""


@pytest.fixture
def run_inner(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None, backend: str
):
    isolate_plugins(monkeypatch)

    def run(cls: type, kwargs: dict[str, object], inputs: str = "token_inputs") -> pytest.RunResult:
        # A pair caught under a strictness passes it through the marker, as a user would.
        extra = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        pytester.makepyfile(test_pair=TEST_FILE.format(cls=cls.__name__, extra=extra, inputs=inputs))
        return pytester.runpytest(
            f"--cudagraph-backend={backend}", "--cudagraph-verify", "-p", "no:cacheprovider"
        )

    return run


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.buggy.__name__)
def test_buggy_module_fails_through_the_plugin(pair: Pair, run_inner) -> None:
    result = run_inner(pair.buggy, pair.kwargs, pair.inputs)
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert f"FAIL {pair.check}" in output
    result.stdout.re_match_lines([rf".*{pair.message}.*"])
    assert "Traceback" not in output  # a readable report, not a trace through the plugin


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p.correct.__name__}-{p.buggy.__name__}")
def test_correct_twin_passes_through_the_plugin(pair: Pair, run_inner) -> None:
    result = run_inner(pair.correct, pair.kwargs, pair.inputs)
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines(
        [
            r".*test_module: (on cuda:\d+, )?(\d+/\d+ descriptors captured|\d+ of \d+ descriptors verified \(quick mode\)), "
            r"\d+ checks passed, 0 failed.*"
        ]
    )
