"""The pytest plugin layer: options and ini twins, marker, fixtures, header, summary, JSON report."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_cudagraph.checks import CHECKS, verify
from pytest_cudagraph.checks.builtin import BUILTIN
from pytest_cudagraph.plan import CaptureConfig
from pytest_cudagraph.plugin import settings as cg_settings
from pytest_cudagraph.plugin.settings import Settings, parse_backend, parse_sizes, resolve, verify_keywords
from tests.conftest import isolate_plugins

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="what happens without a GPU")
AUTO_BACKEND = "cuda" if torch.cuda.is_available() else "emulate"

# Tiny modules for the inner test runs: a correct one and one with a host sync.
# They are built on, and make inputs on, the test's device (``cudagraph_device``,
# set by the inner conftest), so the inner tests run on a GPU as well as on CPU.
MODULES = """
import torch

DEVICE = torch.device("cpu")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, device=DEVICE)

    def forward(self, x):
        return self.lin(x)


class ItemInForward(Tiny):
    def forward(self, x):
        if x.abs().max().item() > 1e9:  # a host sync: cannot be captured
            return x
        return self.lin(x)


def make_inputs(num_tokens, num_reqs):
    return {"x": torch.randn(num_tokens, 4, device=DEVICE)}
"""

CONFTEST = """
import pytest

import cgmods


@pytest.fixture(autouse=True)
def _on_the_test_device(cudagraph_device):
    cgmods.DEVICE = cudagraph_device
"""


@pytest.fixture
def inner(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None
) -> pytest.Pytester:
    """A pytester directory with the tiny modules (``cgmods``) and fixtures using them.

    Inner runs load only this plugin (xdist workers too, through the
    environment): other installed plugins would be imported afresh by every
    in-process run, which costs ~0.7 s a run. ``test_help_shows_every_option``
    runs with the entry points, as users do.
    """
    isolate_plugins(monkeypatch)
    pytester.makepyfile(cgmods=MODULES)
    pytester.makeconftest(CONFTEST)
    pytester.syspathinsert()
    return pytester


def _report(pytester: pytest.Pytester, name: str = "report.json") -> dict[str, Any]:
    data: dict[str, Any] = json.loads((pytester.path / name).read_text())
    return data


def _valid(document: dict[str, Any]) -> None:
    """The report holds to the schema the package ships."""
    jsonschema = pytest.importorskip("jsonschema")
    from pytest_cudagraph.plugin.report import REPORT_SCHEMA

    jsonschema.validate(document, json.loads(REPORT_SCHEMA.read_text()))


def _planned(data: dict[str, Any], test: str) -> list[int]:
    """Planned descriptors of each verify call of ``test``."""
    (nodeid,) = [n for n in data["tests"] if n.endswith(f"::{test}")]
    return [v["report"]["planned_descriptors"] for v in data["tests"][nodeid]["verifications"]]


def _verified(data: dict[str, Any], test: str) -> list[int]:
    """Verified (captured) descriptors of each verify call of ``test``."""
    (nodeid,) = [n for n in data["tests"] if n.endswith(f"::{test}")]
    return [len(v["report"]["descriptors"]) for v in data["tests"][nodeid]["verifications"]]


# -- import time and --help ---------------------------------------------------
def test_importing_the_plugin_does_not_import_torch() -> None:
    code = (
        "import sys, pytest_cudagraph.plugin, pytest_cudagraph.plugin.settings, pytest_cudagraph.plugin.report; "
        "sys.exit(1 if 'torch' in sys.modules or 'hypothesis' in sys.modules else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, "importing the plugin imported torch or hypothesis" + done.stderr


def test_the_profiles_load_by_name_and_the_plugin_knows_them_without_hypothesis(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_cudagraph.plugin import HYPOTHESIS_PROFILES
    from pytest_cudagraph.plugin.profiles import CI_PROFILE, THOROUGH_PROFILE

    assert HYPOTHESIS_PROFILES == (CI_PROFILE, THOROUGH_PROFILE)
    isolate_plugins(monkeypatch)
    pytester.makepyfile(
        test_profile="""
        from hypothesis import settings

        def test_loaded():
            assert settings.get_current_profile_name() == "cudagraph-thorough"
    """
    )
    result = pytester.runpytest_subprocess(
        "-p", "_hypothesis_pytestplugin", "--hypothesis-profile=cudagraph-thorough"
    )
    assert result.ret == 0, result.stdout.str()[-2000:]


def test_help_shows_every_option_and_ini_twin(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "CUDA-graph verification (pytest-cudagraph). Environment:",
            "  PYTEST_CUDAGRAPH_THREADS: *",
            "Options:",
            "*--cudagraph-verify*",
            "*--cudagraph-backend=auto|cuda|emulate*",
            "*--cudagraph-sizes=1,2,4,...*",
            "*--cudagraph-report=PATH*",
            "*--cudagraph-nonfinite-padding*",
        ]
    )
    for ini, kind in (
        ("verify", "bool"),
        ("backend", "string"),
        ("sizes", "string"),
        ("report", "string"),
        ("nonfinite_padding", "bool"),
    ):
        result.stdout.fnmatch_lines([f"*cudagraph_{ini} ({kind}):*"])


def test_help_lists_the_builtin_checks_under_the_checks_option(pytester: pytest.Pytester) -> None:
    """``--cudagraph-checks``' help names every built-in check, in the order they run, from the
    registry's torch-free table (tests/test_registry.py holds the registry to it)."""
    import re

    result = pytester.runpytest("--help")
    assert result.ret == 0
    text = result.stdout.str()
    block = text.split("--cudagraph-checks=NAME,-NAME", 1)[1].split("--cudagraph-", 1)[0]
    said = re.sub(r"\s+", " ", block)
    assert f"The checks: {', '.join(BUILTIN.names())}, and those a conftest's" in said, said


def test_help_works_with_a_bad_ini_value(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ncudagraph_sizes = 1,x\n")
    assert pytester.runpytest("--help").ret == 0


def test_marker_is_registered_with_its_full_signature(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines([f"@pytest.mark.{cg_settings.MARKER_SIGNATURE}:*"])
    result.stdout.fnmatch_lines(["@pytest.mark.cuda: the test needs a CUDA device*"])


def test_marker_keywords_are_exactly_verifys_keywords() -> None:
    params = inspect.signature(verify).parameters
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    # verify's own keywords, then CaptureConfig's (its **config_keywords); a config object is not a marker's.
    own = [n for n in keyword_only if n not in ("exhaustive", "config", "options")]
    fields = CaptureConfig.field_names()
    assert cg_settings.MARKER_KEYWORDS == (*fields, *own)
    assert set(cg_settings.VERIFY_KEYWORDS) == {*fields, *own, "exhaustive"}
    shown = dict(cg_settings._MARKER_DEFAULTS)
    for name in own:
        assert shown[name] == repr(params[name].default), name
    defaults = CaptureConfig.defaults()
    for name in fields:
        if name in (
            "capture_sizes",
            "max_num_reqs",
        ):  # None in the marker: from the settings / the largest size
            assert shown[name] == "None", name
        else:
            value = defaults[name]
            assert shown[name] == repr(getattr(value, "name", value)), name


# -- settings: parsing and precedence (no pytest run) ------------------------
def test_parse_sizes_accepts_commas_and_spaces() -> None:
    assert parse_sizes("4, 1,2 2", "x") == (1, 2, 4)
    assert parse_sizes((8, 1), "x") == (1, 8)


@pytest.mark.parametrize(
    ("text", "why"),
    [("1,x", "'x' is not a whole number"), ("0,2", "0 is less than 1"), (" , ", "no size"), ("1.5", "'1.5'")],
)
def test_parse_sizes_rejects_with_what_was_expected(text: str, why: str) -> None:
    with pytest.raises(pytest.UsageError) as info:
        parse_sizes(text, "--cudagraph-sizes")
    message = str(info.value)
    assert message.startswith("--cudagraph-sizes: expected a comma-separated list of token counts >= 1")
    assert why in message


def test_parse_backend() -> None:
    assert parse_backend(" Emulate ", "x") == "emulate"
    with pytest.raises(
        pytest.UsageError, match=r"--cudagraph-backend: backend must be one of auto, cuda, emulate; got 'gpu'"
    ):
        parse_backend("gpu", "--cudagraph-backend")


def test_resolve_precedence_call_marker_run() -> None:
    run = Settings(options={"exhaustive": False, "backend": "auto", "nonfinite_padding": False}, sizes=(1, 2))
    assert resolve(run) == run
    marker = {"capture_sizes": (1, 2, 4), "backend": "emulate"}
    assert resolve(run, marker) == Settings(
        options={"exhaustive": False, "backend": "emulate", "nonfinite_padding": False}, sizes=(1, 2, 4)
    )
    call = {"capture_sizes": [8], "exhaustive": True, "backend": None}  # None: not given
    test = resolve(run, marker, call)
    assert (test.verify, test.backend, test.sizes) == (True, "emulate", (8,))
    keywords = verify_keywords(run, {**marker, "seed": 3}, {"seed": 5, "rtol": None})
    assert keywords == {
        "capture_sizes": (1, 2, 4),
        "backend": "emulate",
        "exhaustive": False,
        "seed": 5,
        "nonfinite_padding": False,
    }
    # A run's checks reach every call that gives none, as VerifyOptions normalises them.
    checked = Settings(options={**run.options, "checks": ("-determinism",)})
    assert verify_keywords(checked)["checks"] == ("-determinism",)
    assert verify_keywords(checked, None, {"checks": "real_batches"})["checks"] == ("real_batches",)
    with pytest.raises(ValueError, match="checks: checks must be check names"):
        resolve(run, None, {"checks": "Not A Check"})


# -- usage errors -------------------------------------------------------------
def test_bad_sizes_option_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_x():\n    pass\n")
    result = inner.runpytest("--cudagraph-sizes=1,x")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --cudagraph-sizes: expected a comma-separated list of token counts >= 1, such as 1,2,4,8; "
            "got '1,x' ('x' is not a whole number)"
        ]
    )


def test_bad_ini_backend_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makeini("[pytest]\ncudagraph_backend = gpu\n")
    inner.makepyfile("def test_x():\n    pass\n")
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: ini option cudagraph_backend: backend must be one of auto, cuda, emulate; got 'gpu'"]
    )


def test_unknown_marker_keyword_fails_its_own_test_naming_it(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.cudagraph(capture_size=(1, 2))
        def test_x():
            pass

        def test_other():
            pass
        """
    )
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, errors=1)
    allowed = ", ".join(cg_settings.MARKER_KEYWORDS)
    result.stdout.fnmatch_lines(
        [
            f"@pytest.mark.cudagraph on test_unknown_marker_keyword_fails_its_own_test_naming_it.py::test_x: "
            f"unknown keyword 'capture_size' (did you mean 'capture_sizes'?); the marker takes only these keywords: {allowed}"
        ]
    )


def test_positional_marker_arguments_and_bad_marker_values_fail_their_own_test(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.cudagraph((1, 2))
        def test_x():
            pass

        def test_other():
            pass
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_x: takes keywords only, got positional argument(s) ((1, 2),)*"])
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.cudagraph(capture_sizes="1,two")
        def test_x():
            pass
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_x: capture_sizes: expected a comma-separated list*'two'*"])


# -- precedence, ini twins, quick vs exhaustive -------------------------------
PRECEDENCE_TESTS = """
import pytest
from cgmods import Tiny, make_inputs


def test_plain(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8))
def test_marked(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4, 8))
def test_call(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1,))
"""


def test_precedence_call_beats_marker_beats_option_beats_ini(inner: pytest.Pytester) -> None:
    inner.makeini("[pytest]\ncudagraph_sizes = 1,2\ncudagraph_report = report.json\n")
    inner.makepyfile(PRECEDENCE_TESTS)
    inner.runpytest("--cudagraph-verify").assert_outcomes(passed=3)
    data = _report(inner)
    assert data["settings"]["sizes"] == [1, 2]
    assert (_planned(data, "test_plain"), _planned(data, "test_marked"), _planned(data, "test_call")) == (
        [2],
        [4],
        [1],
    )

    inner.runpytest("--cudagraph-verify", "--cudagraph-sizes=1,2,4").assert_outcomes(passed=3)
    data = _report(inner)
    assert data["settings"]["sizes"] == [1, 2, 4]
    assert (_planned(data, "test_plain"), _planned(data, "test_marked"), _planned(data, "test_call")) == (
        [3],
        [4],
        [1],
    )


def test_marker_backend_beats_option(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs

        @pytest.mark.cudagraph(capture_sizes=(1, 2), backend="emulate")
        def test_x(cudagraph_verify, cudagraph_backend, cudagraph_device):
            assert cudagraph_backend == "emulate"
            assert str(cudagraph_device) == "cpu"
            assert cudagraph_verify(Tiny(), make_inputs).backend == "emulate"
        """
    )
    # with CUDA, the option's 'cuda' loses to the marker; without it, that option is a usage
    # error at start (test_cuda_option_without_cuda_is_a_usage_error), so 'auto' stands in
    option = "cuda" if torch.cuda.is_available() else "auto"
    inner.runpytest(f"--cudagraph-backend={option}").assert_outcomes(passed=1)


def test_ini_twins(inner: pytest.Pytester) -> None:
    inner.makeini(
        "[pytest]\ncudagraph_verify = true\ncudagraph_backend = emulate\n"
        "cudagraph_sizes = 4 2 1\ncudagraph_report = out/cg.json\ncudagraph_split = test\ncudagraph_devices = 0\n"
        "cudagraph_world_size = 2\ncudagraph_trace = traces/t.csv\ncudagraph_isolate_timeout = 90\n"
        "cudagraph_checks = -rng\n"
    )
    # Batches the plan of 1, 2, 4 tokens serves: each descriptor gets one.
    (inner.path / "traces").mkdir()
    (inner.path / "traces" / "t.csv").write_text("num_tokens,num_reqs\n1,1\n2,1\n3,2\n3,2\n")
    inner.makepyfile(
        """
        def test_x(cudagraph_verify, cudagraph_backend):
            from cgmods import Tiny, make_inputs
            assert cudagraph_backend == "emulate"
            report = cudagraph_verify(Tiny(), make_inputs)
            assert report.exhaustive and len(report.descriptors) == report.planned == 3
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(passed=1)
    path = inner.path / "out" / "cg.json"
    result.stdout.fnmatch_lines(
        [
            f"cudagraph: backend=emulate, verify=every descriptor and every check, sizes=1,2,4, report={path}, "
            # (then ", threads ..." where the plugin set torch's threads: a machine without OMP_NUM_THREADS)
            f"devices=0, checks=-rng, trace={inner.path / 'traces' / 't.csv'} (3 batch shapes)*"
        ]
    )
    data = json.loads(path.read_text())
    assert data["settings"] == {
        "verify": True,
        "backend": "emulate",
        "sizes": [1, 2, 4],
        "report": str(path),
        "devices": [0],
        "split": "test",
        "nonfinite_padding": False,
        "world_size": 2,
        "rank_timeout": None,
        "all_ranks": False,
        "trace": str(inner.path / "traces" / "t.csv"),
        "isolate": False,
        "isolate_timeout": 90.0,
        "checks": ["-rng"],
        "progress": "auto",
        "compare": None,
        "compare_threshold": None,
        "compare_fail": False,
        "bench_report": None,
    }
    # the options beat their ini twins
    result = inner.runpytest("--cudagraph-sizes=1,2", "--cudagraph-report=other.json")
    result.assert_outcomes(failed=1)  # 2 descriptors planned now, not 3
    assert json.loads((inner.path / "other.json").read_text())["settings"]["sizes"] == [1, 2]


NONFINITE_TESTS = """
import pytest
import torch
import cgmods


class Causal(torch.nn.Module):
    # Each row sums the rows before it: exact under finite padding, 0 * NaN under NaN padding.
    def forward(self, x):
        n = x.shape[0]
        return torch.ones(n, n, device=x.device).tril() @ x


def make_inputs(num_tokens, num_reqs):
    return {"x": torch.randn(num_tokens, 4, device=cgmods.DEVICE)}


@pytest.mark.cudagraph(capture_sizes=(2, 4))
def test_default(cudagraph_verify):
    cudagraph_verify(Causal(), make_inputs)


@pytest.mark.cudagraph(capture_sizes=(2, 4), nonfinite_padding=False)
def test_marker_off(cudagraph_verify):
    cudagraph_verify(Causal(), make_inputs)
"""


def test_nonfinite_padding_option_ini_and_marker(inner: pytest.Pytester) -> None:
    inner.makepyfile(NONFINITE_TESTS)
    inner.runpytest("--cudagraph-verify").assert_outcomes(passed=2)
    result = inner.runpytest("--cudagraph-verify", "--cudagraph-nonfinite-padding")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "cudagraph: *, nonfinite_padding*",
            "*FAIL padding_isolation*",
            "*found by nonfinite_padding=True*",
        ]
    )
    assert "test_marker_off FAILED" not in result.stdout.str()
    inner.makeini("[pytest]\ncudagraph_nonfinite_padding = true\n")
    result = inner.runpytest("--cudagraph-verify", "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*::test_default FAILED*", "*::test_marker_off PASSED*"])


def test_nonfinite_padding_marker_value_is_checked(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.cudagraph(nonfinite_padding="yes")
        def test_x():
            pass
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(errors=1)  # the bad marker fails its own test
    result.stdout.fnmatch_lines(["*nonfinite_padding must be True or False; got 'yes'*"])


QUICK_TESTS = """
import pytest
from cgmods import Tiny, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4))
def test_full(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4), mode="FULL_AND_PIECEWISE")
def test_two_modes(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)
"""


def test_quick_mode_vs_cudagraph_verify(inner: pytest.Pytester) -> None:
    inner.makepyfile(QUICK_TESTS)
    inner.runpytest("--cudagraph-report=report.json").assert_outcomes(passed=2)
    quick = _report(inner)
    inner.runpytest("--cudagraph-report=report.json", "--cudagraph-verify").assert_outcomes(passed=2)
    full = _report(inner)
    # quick: the smallest and largest descriptor of each mode; --cudagraph-verify: all of them
    assert (_verified(quick, "test_full"), _verified(full, "test_full")) == ([2], [3])
    assert (_verified(quick, "test_two_modes"), _verified(full, "test_two_modes")) == ([4], [6])
    assert _planned(quick, "test_two_modes") == _planned(full, "test_two_modes") == [6]
    assert quick["settings"]["verify"] is False and full["settings"]["verify"] is True
    for data, exhaustive in ((quick, False), (full, True)):
        for entry in data["tests"].values():
            assert entry["verifications"][0]["report"]["exhaustive"] is exhaustive
            assert entry["verifications"][0]["keywords"]["exhaustive"] is exhaustive


# -- the JSON report, the header and the terminal summary ---------------------
REPORT_TESTS = """
import pytest
from cgmods import Tiny, ItemInForward, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4))
def test_twice(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)
    cudagraph_verify(Tiny(), make_inputs, mode="PIECEWISE", checks=["capture_safety", "replay_matches_eager"])


@pytest.mark.cudagraph(capture_sizes=(1, 2, 4))
def test_buggy(cudagraph_verify):
    cudagraph_verify(ItemInForward(), make_inputs)


def test_not_verifying(cudagraph_manager):
    cudagraph_manager(Tiny(), make_inputs, capture_sizes=(1, 2)).capture()
"""


def test_json_report_content(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_rep=REPORT_TESTS)
    result = inner.runpytest("--cudagraph-report=sub/dir/report.json")
    result.assert_outcomes(passed=2, failed=1)
    path = inner.path / "sub" / "dir" / "report.json"
    result.stdout.fnmatch_lines(
        [f"cudagraph: backend=auto ran {AUTO_BACKEND}", f"cudagraph: JSON report written to {path}"]
    )
    data = json.loads(path.read_text())
    assert data["version"] == 3
    assert (data["complete"], data["exitstatus"], data["passed"]) == (True, 1, False)
    assert data["outcomes"] == {"passed": 2, "failed": 1}
    assert data["settings"] == {
        "verify": False,
        "backend": "auto",
        "sizes": None,
        "report": str(path),
        "devices": None,
        "split": "test",
        "nonfinite_padding": False,
        "world_size": None,
        "rank_timeout": None,
        "all_ranks": False,
        "trace": None,
        "isolate": False,
        "isolate_timeout": None,
        "checks": None,
        "progress": "auto",
        "compare": None,
        "compare_threshold": None,
        "compare_fail": False,
        "bench_report": None,
    }
    # every test that used the plugin: test_not_verifying made a manager, and verified nothing
    assert set(data["tests"]) == {
        "test_rep.py::test_twice",
        "test_rep.py::test_buggy",
        "test_rep.py::test_not_verifying",
    }
    assert data["tests"]["test_rep.py::test_not_verifying"] == {"outcome": "passed", "verifications": []}

    twice = data["tests"]["test_rep.py::test_twice"]
    assert twice["outcome"] == "passed"
    first, second = twice["verifications"]
    assert first["keywords"] == {
        "capture_sizes": [1, 2, 4],
        "backend": AUTO_BACKEND,
        "exhaustive": False,
        "nonfinite_padding": False,
        "device": f"cuda:{torch.cuda.current_device()}" if AUTO_BACKEND == "cuda" else "cpu",
    }
    rep = first["report"]
    assert (rep["module"], rep["backend"], rep["mode"], rep["passed"]) == ("Tiny", AUTO_BACKEND, "FULL", True)
    assert rep["training"] == "train"  # verified in the mode it is in: a new Module is in train mode
    assert rep["planned_descriptors"] == 3
    assert [d["label"] for d in rep["descriptors"]] == ["FULL-T4-R4", "FULL-T1-R1"]
    assert rep["checks"] == list(BUILTIN.names())  # every default check, in the order they run
    # Quick mode: dispatch is not property-tested, and the outcome says so.
    assert {o["check"] for o in rep["outcomes"]} == {*CHECKS, "dispatch"}
    assert {s["check"] for s in rep["skipped"]} >= {"dispatch"}
    assert all(o["status"] in ("passed", "skipped") for o in rep["outcomes"])
    # A skipped check neither passed nor failed.
    assert all(o["passed"] is None for o in rep["outcomes"] if o["status"] == "skipped")
    assert any(o["status"] == "skipped" for o in rep["outcomes"])
    _valid(data)
    assert (
        data["machine"]["packages"]["pytest-cudagraph"]
        and data["machine"]["torch"]["version"] == torch.__version__
    )
    assert data["started"] <= data["finished"] and "id" in data["commit"]
    assert rep["real_batches"] > 0 and rep["capture_seconds"] >= 0
    assert set(rep["graph_memory_bytes"]) == {"FULL-T4-R4", "FULL-T1-R1"}
    assert second["keywords"]["mode"] == "PIECEWISE"
    assert second["report"]["checks"] == ["capture_safety", "replay_matches_eager"]

    buggy = data["tests"]["test_rep.py::test_buggy"]
    assert buggy["outcome"] == "failed"
    (bad,) = buggy["verifications"]
    assert bad["report"]["passed"] is False
    failed = [o for o in bad["report"]["outcomes"] if not o["passed"] and not o["skipped"]]
    assert {o["check"] for o in failed} == {"capture_safety"}
    assert any("Tensor.item()" in op for o in failed for op in o["finding"]["ops"])


def test_no_report_file_unless_asked(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_rep=REPORT_TESTS)
    result = inner.runpytest("-k", "twice")
    result.assert_outcomes(passed=1, deselected=2)
    assert not list(inner.path.rglob("*.json"))
    result.stdout.no_fnmatch_line("*JSON report*")


def test_header_line(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_x():\n    pass\n")
    inner.runpytest().stdout.fnmatch_lines(
        # The setting as given, torch imported or not; the summary says what "auto" became.
        [
            "cudagraph: backend=auto, verify=quick (smallest and largest descriptor per mode), sizes=per test, report=none*"
        ]
    )
    inner.runpytest(
        "--cudagraph-backend=emulate", "--cudagraph-verify", "--cudagraph-sizes=8,1"
    ).stdout.fnmatch_lines(
        ["cudagraph: backend=emulate, verify=every descriptor and every check, sizes=1,8, report=none*"]
    )


def test_terminal_summary_section(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_rep=REPORT_TESTS)
    result = inner.runpytest()
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*= cudagraph =*",
            "test_rep.py::test_twice: *4 of 6 descriptors verified (quick mode), * checks passed, 0 failed*, capture *s, "
            "graph memory * (2 verify calls)",
            "test_rep.py::test_buggy: *0 of 3 descriptors verified (quick mode), 0 checks passed, 2 failed*; "
            "failures: capture_safety (FULL-T4-R4), capture_safety (FULL-T1-R1) [[]failed]",
        ]
    )
    result.stdout.no_fnmatch_line("test_rep.py::test_not_verifying:*")


def test_no_summary_section_without_cudagraph_verify(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_rep=REPORT_TESTS)
    result = inner.runpytest("-k", "not_verifying")
    result.assert_outcomes(passed=1, deselected=2)
    result.stdout.no_fnmatch_line("*= cudagraph =*")


# -- fixtures -------------------------------------------------------------------
def test_cudagraph_manager_releases_every_manager_at_teardown(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs
        from pytest_cudagraph import CaptureConfig

        MADE = []

        @pytest.mark.cudagraph(capture_sizes=(1, 2, 4), mode="PIECEWISE")
        def test_make(cudagraph_manager, cudagraph_backend):
            a = cudagraph_manager(Tiny(), make_inputs)  # sizes and mode from the marker
            b = cudagraph_manager(Tiny(), make_inputs, CaptureConfig(capture_sizes=[1, 2], max_num_reqs=2))
            for manager in (a, b):
                manager.capture()
                assert manager.captured and manager.backend == cudagraph_backend
            assert [d.label() for d in a.captured_descriptors] == ["PIECEWISE-T4", "PIECEWISE-T2", "PIECEWISE-T1"]
            assert len(b.captured_descriptors) == 2
            MADE.extend([a, b])

        def test_fails_after_capture(cudagraph_manager):
            manager = cudagraph_manager(Tiny(), make_inputs, capture_sizes=(1, 2))
            manager.capture()
            MADE.append(manager)
            assert False, "fails on purpose"

        def test_all_released():
            assert len(MADE) == 3
            assert [m.captured for m in MADE] == [False, False, False]
        """
    )
    inner.runpytest().assert_outcomes(passed=2, failed=1)


def test_cudagraph_manager_keyword_errors(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs
        from pytest_cudagraph import CaptureConfig

        def test_unknown(cudagraph_manager):
            cudagraph_manager(Tiny(), make_inputs, capture_size=(1,))

        def test_both(cudagraph_manager):
            config = CaptureConfig(capture_sizes=[1], max_num_reqs=1)
            cudagraph_manager(Tiny(), make_inputs, config, mode="FULL")

        def test_no_sizes(cudagraph_manager):
            cudagraph_manager(Tiny(), make_inputs)
        """
    )
    result = inner.runpytest()
    # Each mistake fails its test with one line: no traceback through the plugin.
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(
        [
            "cudagraph_manager: unknown keyword 'capture_size' (did you mean 'capture_sizes'?); cudagraph_manager "
            "takes only*",
            "cudagraph_manager: pass config or its keywords (mode), not both",
            "*cudagraph_manager needs capture_sizes: pass capture_sizes=*--cudagraph-sizes*",
        ]
    )
    result.stdout.no_fnmatch_line("*harness.py*")


def test_backend_and_device_fixtures(inner: pytest.Pytester) -> None:
    cuda = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else None
    for args, (backend, device) in (
        ((), (AUTO_BACKEND, cuda or "cpu")),
        (("--cudagraph-backend=emulate",), ("emulate", "cpu")),
        (("--cudagraph-backend=cuda",), ("cuda", cuda)),
    ):
        inner.makepyfile(
            test_fixtures=f"""
            import torch

            def test_x(cudagraph_backend, cudagraph_device):
                assert cudagraph_backend == {backend!r}
                assert cudagraph_device == torch.device({device!r})
            """
        )
        result = inner.runpytest(*args)
        if device is not None:
            result.assert_outcomes(passed=1)
        else:  # cuda asked for, but there is no GPU: a usage error at start, before any test
            assert result.ret == pytest.ExitCode.USAGE_ERROR
            result.stderr.fnmatch_lines(["ERROR: --cudagraph-backend: cuda asks for real CUDA graphs*"])


@CPU_ONLY
def test_cuda_marker_still_skips(inner: pytest.Pytester) -> None:
    inner.makepyfile("import pytest\n\n@pytest.mark.cuda\ndef test_x():\n    pass\n")
    result = inner.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs a CUDA device*"])


def test_a_real_bug_fails_with_the_readable_report(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import ItemInForward, make_inputs

        @pytest.mark.cudagraph(capture_sizes=(1, 2, 4))
        def test_bug(cudagraph_verify):
            cudagraph_verify(ItemInForward(), make_inputs)
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_bug _*",
            "ItemInForward on *: 0 of 3 descriptors verified (quick mode: *), 0 real batches, "
            "2 failure(s) in capture_safety*",
            "FAIL capture_safety * FULL-T4-R4",
            "*cannot be captured in a graph; the first is Tensor.item() (host sync) in the top-level module, "
            "at cgmods.py:* in forward",
        ]
    )
    # The one op is in the message: it is not listed again below it (issue #57).
    result.stdout.no_fnmatch_line("*- Tensor.item() (host sync)*")
    # pytrace=False: the report, not a traceback through the plugin
    result.stdout.no_fnmatch_line("*harness.py*")
    result.stdout.no_fnmatch_line("*pytest.fail(*")


def test_cudagraph_verify_returns_the_report_and_checks_its_keywords(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs

        @pytest.mark.cudagraph(capture_sizes=(1, 2, 4), checks=["capture_safety"])
        def test_ok(cudagraph_verify):
            report = cudagraph_verify(Tiny(), make_inputs, exhaustive=True)  # the call beats the settings
            assert report.ok and report.exhaustive and len(report.descriptors) == 3
            assert report.checks == ("capture_safety",)

        def test_unknown_keyword(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs, sizes=(1,))

        def test_no_sizes(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs)
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "cudagraph_verify: unknown keyword 'sizes'; cudagraph_verify takes only*",
            "*cudagraph_verify needs capture_sizes: pass capture_sizes=*",
        ]
    )
    result.stdout.no_fnmatch_line("*harness.py*")


def test_marker_levels_merge_closest_first(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs

        pytestmark = pytest.mark.cudagraph(capture_sizes=(1, 2, 4), mode="PIECEWISE")

        @pytest.mark.cudagraph(mode="FULL")
        def test_x(cudagraph_verify):
            report = cudagraph_verify(Tiny(), make_inputs, exhaustive=True)
            assert report.mode == "FULL" and report.planned == 3
        """
    )
    inner.runpytest().assert_outcomes(passed=1)


def test_results_travel_on_the_test_report(inner: pytest.Pytester) -> None:
    """Records ride on each phase's TestReport: what pytest-xdist and pytest-reportlog serialise."""
    inner.makepyfile(test_rep=REPORT_TESTS)
    reprec = inner.inline_run("-k", "twice")
    (call,) = [r for r in reprec.getreports("pytest_runtest_logreport") if r.when == "call"]
    records = call.cudagraph_records
    assert len(records) == 2 and records[0]["report"]["module"] == "Tiny"
    data = call._to_json()  # what xdist sends from a worker
    assert json.loads(json.dumps(data))["cudagraph_records"] == records
    assert pytest.TestReport._from_json(data).cudagraph_records == records


BAD_MARKER = """
import pytest

@pytest.mark.cudagraph(sizes=(1,))
def test_x():
    pass
"""


def test_xdist_workers_results_reach_the_summary_and_report(inner: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    inner.makepyfile(test_rep=REPORT_TESTS, test_bad_marker=BAD_MARKER)
    result = inner.runpytest("-p", "xdist.plugin", "-n", "2", "--cudagraph-report=report.json")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    # a malformed marker: a worker cannot raise a usage error, so that test errors with the message
    result.stdout.fnmatch_lines(["*ERROR at setup of test_x*", "*unknown keyword 'sizes'*"])
    result.stdout.fnmatch_lines(["*= cudagraph =*"])
    result.stdout.fnmatch_lines(["test_rep.py::test_twice: *4 of 6 descriptors verified (quick mode)*"])
    result.stdout.fnmatch_lines(["test_rep.py::test_buggy: *0 of 3 descriptors verified (quick mode)*"])
    data = _report(inner)
    assert set(data["tests"]) == {
        "test_rep.py::test_twice",
        "test_rep.py::test_buggy",
        "test_rep.py::test_not_verifying",
        "test_bad_marker.py::test_x",
    }
    assert data["tests"]["test_rep.py::test_buggy"]["outcome"] == "failed"
    assert data["tests"]["test_bad_marker.py::test_x"]["outcome"] == "error"
    assert len(data["tests"]["test_rep.py::test_twice"]["verifications"]) == 2


def test_report_accepts_an_absolute_path(inner: pytest.Pytester, tmp_path: Path) -> None:
    inner.makepyfile(test_rep=REPORT_TESTS)
    inner.runpytest("-k", "twice", f"--cudagraph-report={tmp_path / 'abs.json'}")
    assert json.loads((tmp_path / "abs.json").read_text())["tests"]


def test_a_suite_that_does_not_use_the_plugin_never_imports_torch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the plugin costs a suite that does not use it no torch import: not at start, not at
    collection, not on an xdist worker, not for --help."""
    isolate_plugins(monkeypatch)
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_torch_is_not_loaded():
            assert "torch" not in sys.modules
            assert "hypothesis" not in sys.modules
    """
    )
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider").ret == 0
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "xdist", "-n", "2").ret == 0
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, pytest; pytest.main(['--help']); print('TORCH', 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd=pytester.path,
        env={
            **os.environ,
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "PYTEST_PLUGINS": "pytest_cudagraph.plugin",
        },
    )
    assert "--cudagraph-verify" in done.stdout and done.stdout.strip().endswith("TORCH False"), done.stdout[
        -300:
    ]


def test_every_environment_variable_the_plugin_reads_is_in_help() -> None:
    import re
    from pathlib import Path

    from pytest_cudagraph.backends.base import CAPTURE_ENV
    from pytest_cudagraph.manager.estimate import CHECK_ENV
    from pytest_cudagraph.plugin import ENVIRONMENT
    from pytest_cudagraph.plugin.isolate import CHILD_ENV
    from pytest_cudagraph.plugin.threads import THREADS_ENV

    listed = {name for name, _ in ENVIRONMENT}
    assert listed == {CAPTURE_ENV, CHILD_ENV, CHECK_ENV, THREADS_ENV}
    package = Path(__file__).resolve().parents[1] / "pytest_cudagraph"
    named = {
        m for p in package.rglob("*.py") for m in re.findall(r'"(PYTEST_CUDAGRAPH_[A-Z_]+)"', p.read_text())
    }
    assert named <= listed, named - listed
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--help"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "PYTEST_PLUGINS": "pytest_cudagraph.plugin",
        },
    )
    assert all(f"  {name}: " in done.stdout for name in listed), done.stdout[-2000:]


# -- --cudagraph-checks ------------------------------------------------------------------
CHOSEN_CHECKS = """
import pytest

from cgmods import Tiny, make_inputs


@pytest.mark.cudagraph(capture_sizes=[1, 2])
def test_by_option(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)


@pytest.mark.cudagraph(capture_sizes=[1, 2], checks=["capture_safety", "state"])
def test_by_marker(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs)
"""


def _checks_run(data: dict[str, Any], test: str) -> list[list[str]]:
    (nodeid,) = [n for n in data["tests"] if n.endswith(f"::{test}")]
    return [v["report"]["checks"] for v in data["tests"][nodeid]["verifications"]]


def test_checks_option_and_ini_select_and_deselect_and_the_marker_wins(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_chosen=CHOSEN_CHECKS)
    result = inner.runpytest("--cudagraph-checks=-determinism,-rng", "--cudagraph-report=report.json")
    result.assert_outcomes(passed=2)
    data = _report(inner)
    (by_option,) = _checks_run(data, "test_by_option")
    assert "determinism" not in by_option and "rng" not in by_option and "real_batches" in by_option
    assert _checks_run(data, "test_by_marker") == [["capture_safety", "state"]]
    assert data["settings"]["checks"] == ["-determinism", "-rng"]
    inner.makeini("[pytest]\ncudagraph_checks = real_batches, capture_safety\n")
    result = inner.runpytest("--cudagraph-report=report.json")
    result.assert_outcomes(passed=2)
    assert _checks_run(_report(inner), "test_by_option") == [["capture_safety", "real_batches"]]


def test_bad_checks_option_and_an_unknown_check_are_usage_errors_before_any_test(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(test_chosen=CHOSEN_CHECKS)
    result = inner.runpytest("--cudagraph-checks=real batches!")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --cudagraph-checks: checks must be check names separated by commas*"]
    )
    # A name no check has: known once every conftest is loaded, still before any test runs.
    result = inner.runpytest("--cudagraph-checks=real_batchez", "-k", "by_option")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.assert_outcomes()
    result.stderr.fnmatch_lines(
        [
            "ERROR: --cudagraph-checks (ini cudagraph_checks): unknown check(s) ?'real_batchez'? (did you mean 'real_batches'?); the checks are capture_safety, *"
        ]
    )


def test_every_option_has_its_ini_twin(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfig()
    options = [o.dest for o in config._parser.getgroup("cudagraph").options]
    assert len(options) >= 12
    missing = [name for name in options if name not in config._parser._inidict]
    assert not missing, missing


def test_the_schema_holds_the_reports_fields_and_fails_a_report_without_them(inner: pytest.Pytester) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from pytest_cudagraph.plugin.report import REPORT_SCHEMA

    inner.makepyfile(test_rep=REPORT_TESTS)
    inner.runpytest("--cudagraph-report=report.json", "--junitxml=junit.xml")
    data = _report(inner)
    schema = json.loads(REPORT_SCHEMA.read_text())
    jsonschema.validate(data, schema)
    outcome = data["tests"]["test_rep.py::test_twice"]["verifications"][0]["report"]["outcomes"][0]
    del outcome["status"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)
    outcome["status"], outcome["new_field"] = "passed", 1  # a field the schema does not document
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)
    # junit XML: the figures of each test as properties.
    import xml.etree.ElementTree as ET

    cases = {c.get("name"): c for c in ET.parse(inner.path / "junit.xml").iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_buggy"].iter("property")}
    assert int(props["cudagraph_checks_failed"]) >= 1 and int(props["cudagraph_descriptors_verified"]) == 0
    props = {p.get("name"): p.get("value") for p in cases["test_twice"].iter("property")}
    assert props["cudagraph_checks_failed"] == "0" and int(props["cudagraph_descriptors_verified"]) == 4
    assert int(props["cudagraph_checks_passed"]) > 0 and int(props["cudagraph_peak_memory_bytes"]) > 0


COMPARED = """
import os

import pytest
import torch

from cgmods import ItemInForward, Tiny, make_inputs


@pytest.mark.cudagraph(capture_sizes=[1, 2])
def test_one(cudagraph_verify):
    module = ItemInForward() if os.environ.get("CG_BREAK") else Tiny()
    cudagraph_verify(module, make_inputs)


@pytest.mark.cudagraph(capture_sizes=[1, 2])
def test_two(cudagraph_verify):
    module = Tiny() if os.environ.get("CG_BREAK") else ItemInForward()
    cudagraph_verify(module, make_inputs)


@pytest.mark.xfail(strict=False, reason="a known problem: its failure does not fail the run")
@pytest.mark.cudagraph(capture_sizes=[1, 2])
def test_known(cudagraph_verify):
    cudagraph_verify(ItemInForward() if os.environ.get("CG_BREAK") else Tiny(), make_inputs)
"""


def test_compare_names_new_failures_and_new_passes_and_can_fail_the_run(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner.makepyfile(test_cmp=COMPARED)
    inner.runpytest("--cudagraph-report=base.json", "-k", "not known").assert_outcomes(passed=1, failed=1)
    monkeypatch.setenv("CG_BREAK", "1")
    result = inner.runpytest("--cudagraph-compare=base.json", "-k", "not known")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "cudagraph: compared with *base.json: * new failure(s), * newly passing, *",
            "  new failure: test_cmp.py::test_one: verification 1 (ItemInForward) capture_safety FULL-T2-R2 (was passed)",
        ]
    )
    result.stdout.fnmatch_lines(["  new failure: test_cmp.py::test_one: the test failed (was passed)"])
    result.stdout.fnmatch_lines(["  newly passing: test_cmp.py::test_two: the test passed (was failed)"])
    assert "new failure: test_cmp.py::test_two" not in result.stdout.str()
    # A test that failed before and fails the same way now is no new failure: the run's exit status
    # is pytest's, unless --cudagraph-compare-fail finds a new one.
    monkeypatch.delenv("CG_BREAK")
    result = inner.runpytest("--cudagraph-compare=base.json", "--cudagraph-compare-fail", "-k", "test_one")
    assert result.ret == pytest.ExitCode.OK
    # Only where pytest itself passes the run does the comparison decide: a check that newly fails
    # in a test whose failure is expected (xfail).
    inner.runpytest("--cudagraph-report=known.json", "-k", "test_known").assert_outcomes(xpassed=1)
    monkeypatch.setenv("CG_BREAK", "1")
    result = inner.runpytest("--cudagraph-compare=known.json", "-k", "test_known")
    result.assert_outcomes(xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    result = inner.runpytest(
        "--cudagraph-compare=known.json",
        "--cudagraph-compare-fail",
        "-k",
        "test_known",
        "--cudagraph-report=after.json",
    )
    result.assert_outcomes(xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["cudagraph: the run fails on its new failure(s) (--cudagraph-compare-fail)"])
    assert _report(inner, "after.json")["passed"] is False
    for bad, why in (("missing.json", "cannot read"), ("test_cmp.py", "is not JSON")):
        result = inner.runpytest(f"--cudagraph-compare={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"ERROR: --cudagraph-compare: *{why}*"])


def test_compare_holds_figures_to_the_spread_of_several_kept_reports(inner: pytest.Pytester) -> None:
    """--cudagraph-compare=a,b: each figure's noise is its spread over the kept reports (made from a
    real run's report, their timings set so that the verdict cannot depend on this run's own); one
    kept report's timings are judged by --cudagraph-compare-threshold (or its ini twin) only."""
    inner.makepyfile(test_cmp=COMPARED)
    inner.runpytest("--cudagraph-report=run.json", "-k", "test_two").assert_outcomes(failed=1)
    run = _report(inner, "run.json")

    def kept(name: str, capture: float, check: float, memory: int | None = None) -> None:
        data = json.loads(json.dumps(run))
        for record in data["tests"]["test_cmp.py::test_two"]["verifications"]:
            record["report"]["capture_seconds"], record["report"]["check_seconds"] = capture, check
            if memory is not None:
                record["report"]["peak_memory_bytes"] = memory
        (inner.path / name).write_text(json.dumps(data))

    # The capture between 0 s and 1000 s (any run lies within), the checks at 1000 s and 1001 s.
    kept("a.json", 0.0, 1000.0, memory=0)
    kept("b.json", 1000.0, 1001.0, memory=1 << 50)
    result = inner.runpytest("--cudagraph-compare=a.json,b.json", "-k", "test_two")
    result.stdout.fnmatch_lines(
        [
            "cudagraph: compared with *a.json, *b.json: 0 new failure(s), 0 newly passing, *",
            "cudagraph: 1 figure(s) moved beyond their run-to-run spread over the 2 kept reports *",
            "  moved: test_cmp.py::test_two: verification 1 check_seconds: 1000.50 s -> * (x0.00; kept *)",
        ]
    )
    assert "capture_seconds" not in result.stdout.str()
    # One kept report: its timings are not judged without a threshold, and the summary says so ...
    result = inner.runpytest("--cudagraph-compare=a.json", "-k", "test_two")
    result.stdout.fnmatch_lines(["cudagraph: * timing(s) changed, not judged: one kept report gives no *"])
    assert "check_seconds" not in result.stdout.str()
    # ... and with one (the option or its ini twin), a timing beyond it moved.
    for given in (["--cudagraph-compare-threshold=50%"], ["-o", "cudagraph_compare_threshold=0.5"]):
        result = inner.runpytest("--cudagraph-compare=a.json", *given, "-k", "test_two")
        result.stdout.fnmatch_lines(
            ["cudagraph: * figure(s) moved beyond 50% (--cudagraph-compare-threshold)", "*check_seconds*"]
        )
    for bad in ("0", "-5%", "lots"):
        result = inner.runpytest("--cudagraph-compare=a.json", f"--cudagraph-compare-threshold={bad}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["ERROR: --cudagraph-compare-threshold: expected a fraction *"])
    result = inner.runpytest("--cudagraph-compare=a.json,missing.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --cudagraph-compare: cannot read *missing.json*"])


def test_one_options_object_is_the_source_of_every_keyword_list() -> None:
    """A new verification keyword is one field of VerifyOptions: verify's signature, the marker's, the
    fixture's and verify_runner's keywords all follow from its fields."""
    from pytest_cudagraph import VerifyOptions, verify_runner
    from pytest_cudagraph.plugin.harness import RUNNER_KEYWORDS

    fields = VerifyOptions.field_names()
    params = inspect.signature(verify).parameters
    assert [n for n in params if n in fields] == list(fields)
    assert set(cg_settings.VERIFY_KEYWORDS) == {*CaptureConfig.field_names(), *fields}
    runner = [
        n
        for n, p in inspect.signature(verify_runner).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert set(runner) == set(RUNNER_KEYWORDS)
    assert set(VerifyOptions.runner_field_names()) <= set(fields)
    with pytest.raises(ValueError, match="rtol must be a finite number from 0 to 1"):
        VerifyOptions(rtol=-1)
    with pytest.raises(ValueError, match="backend must be one of auto, cuda, emulate"):
        verify(
            torch.nn.Linear(2, 2), lambda t, r: {"input": torch.randn(t, 2)}, capture_sizes=[1], backend="gpu"
        )
    # options and keywords: the keywords win.
    options = VerifyOptions(checks=["capture_safety"], exhaustive=False)
    report = verify(
        torch.nn.Linear(2, 2),
        lambda t, r: {"input": torch.randn(t, 2)},
        capture_sizes=[1, 2],
        options=options,
        checks=["state"],
        backend="emulate",
    )
    assert report.checks == ("state",) and not report.exhaustive
