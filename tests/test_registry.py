"""Checks are registered in one place: the built-ins as a user's, selected by name, extended downstream."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pytest_cudagraph.checks import (
    BUILTIN,
    CHECKS,
    DISPATCH_CHECK,
    Check,
    CheckRegistry,
    VerifyContext,
    failed,
    passed,
    skipped,
    verify,
)
from pytest_cudagraph.plan import BatchDescriptor
from tests.bugs import NoMemo, token_inputs

SIZES = (1, 2, 4)


def _verify(module: torch.nn.Module | None = None, **kwargs):
    torch.manual_seed(0)
    return verify(module or NoMemo(), token_inputs(), capture_sizes=SIZES, backend="emulate", **kwargs)


def test_the_builtins_are_registered_like_any_check():
    assert isinstance(BUILTIN, CheckRegistry)
    assert set(BUILTIN.names()) == {*CHECKS, DISPATCH_CHECK} and len(BUILTIN) == len(CHECKS) + 1
    assert all(isinstance(c, Check) and c.compares and c.catches for c in BUILTIN)
    # The engine runs them in the order of their scopes: before capture, per descriptor, once, after release.
    scopes = [c.scope for c in BUILTIN]
    assert scopes == sorted(scopes, key=("before_capture", "descriptor", "module", "after_release").index)


def test_the_registry_is_the_table_help_lists_without_torch():
    """``--help`` names the checks from ``options.BUILTIN_CHECKS`` (loading the plugin imports no torch):
    the registry holds those checks, no other, in that order."""
    from pytest_cudagraph.options import BUILTIN_CHECKS

    assert BUILTIN.names() == BUILTIN_CHECKS, (
        "a built-in check was added, removed or moved: give pytest_cudagraph.options.BUILTIN_CHECKS the "
        f"registry's names in its order, {BUILTIN.names()}"
    )


def test_the_docs_table_is_the_registrys():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "checks.md").read_text()
    assert BUILTIN.markdown_table() in text
    for check in BUILTIN:
        assert f"| `{check.name}` |" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "Bad Name"}, "lower_snake_case"),
        ({"scope": "sometimes"}, "scope must be one of"),
        ({"run": 3}, "run must be a function"),
        ({"compares": ""}, "compares must say"),
    ],
)
def test_a_malformed_check_is_told(kwargs, message):
    base = {"name": "mine", "run": lambda ctx, desc: None, "compares": "something"}
    with pytest.raises(ValueError, match=message):
        Check(**{**base, **kwargs})


def test_a_registry_refuses_a_second_check_of_one_name_and_non_checks():
    registry = CheckRegistry([Check("mine", lambda ctx, desc: None, compares="x")])
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Check("mine", lambda ctx, desc: None, compares="y"))
    with pytest.raises(ValueError, match=r"register a pytest_cudagraph\.checks\.Check"):
        registry.register("mine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        _verify(extra_checks=[Check("state", lambda ctx, desc: None, compares="x")])


def _counts(ctx: VerifyContext, desc: BatchDescriptor):
    batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
    out = ctx.run(ctx.make(batch), batch)
    return passed(rows=int(out.shape[0]))


def test_an_extra_check_runs_on_every_descriptor_and_is_selected_by_name():
    mine = Check("row_count", _counts, compares="the rows run() returns")
    report = _verify(extra_checks=[mine])
    outcomes = [o for o in report.outcomes if o.check == "row_count"]
    assert [o.descriptor for o in outcomes] == list(report.descriptors)
    assert all(o.passed and o.figures["rows"] >= 1 for o in outcomes)
    # After the built-in descriptor checks, before the checks that run once.
    assert report.checks.index("row_count") == report.checks.index("rng") + 1
    only = _verify(extra_checks=[mine], checks=["row_count"])
    assert {o.check for o in only.outcomes} == {"row_count"}
    data = json.loads(only.to_json())
    assert {o["check"] for o in data["outcomes"]} == {"row_count"}
    with pytest.raises(ValueError, match=r"unknown check\(s\) \['row_count'\]; the checks are .*rng"):
        _verify(checks=["row_count"])  # not registered without extra_checks


def test_an_extra_check_that_fails_is_a_failure_with_its_finding():
    def never(ctx, desc):
        return failed("the cache moved", row=3)

    report = _verify(extra_checks=Check("never_ok", never, compares="nothing"))
    fails = [o for o in report.failures if o.check == "never_ok"]
    assert len(fails) == len(report.descriptors) and not report.ok
    assert "FAIL never_ok" in report.format() and "the cache moved" in report.format()


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (RuntimeError("boom"), r"the check could not run: RuntimeError: boom"),
        ("text", r"the check could not run: TypeError: check 'odd' returned str"),
    ],
)
def test_a_check_that_cannot_run_fails_never_passes(result, message):
    def odd(ctx, desc):
        if isinstance(result, Exception):
            raise result
        return result

    report = _verify(extra_checks=[Check("odd", odd, compares="x")])
    fails = [o for o in report.failures if o.check == "odd"]
    assert fails and all(re.search(message, o.message) for o in fails)


def test_a_module_scope_check_runs_once_with_every_captured_descriptor_and_prepare_runs_before_capture():
    seen: dict[str, object] = {}

    def prepare(ctx):
        seen["captured_then"] = ctx.manager.captured_descriptors

    def once(ctx, descs):
        seen["descs"] = list(descs)
        return skipped("nothing to say")

    report = _verify(extra_checks=[Check("once", once, compares="x", scope="module", prepare=prepare)])
    assert seen["captured_then"] == () and seen["descs"] == list(report.descriptors)
    (outcome,) = [o for o in report.outcomes if o.check == "once"]
    assert outcome.skipped and outcome.descriptor is None
    assert ("once", "nothing to say", ["module"]) in report.skipped_reasons()
    assert "SKIP once" in report.format() and report.ok


def test_extra_checks_must_be_checks():
    with pytest.raises(ValueError, match=r"extra_checks must be a list of pytest_cudagraph\.checks\.Check"):
        _verify(extra_checks="row_count")
    with pytest.raises(ValueError, match=r"register a pytest_cudagraph\.checks\.Check"):
        _verify(extra_checks=[lambda ctx, desc: None])


def test_verify_takes_a_config_or_its_keywords_and_names_unknown_ones():
    from pytest_cudagraph import CaptureConfig

    cfg = CaptureConfig(capture_sizes=SIZES, max_num_reqs=4)
    report = verify(NoMemo(), token_inputs(), config=cfg, backend="emulate", checks=["replay_matches_eager"])
    assert report.ok and report.config == cfg.to_dict()
    with pytest.raises(
        ValueError,
        match=r"unknown keyword 'capture_size' \(did you mean 'capture_sizes'\?\); verify\(\) takes only",
    ):
        verify(NoMemo(), token_inputs(), capture_size=SIZES, backend="emulate")
    with pytest.raises(ValueError, match="not both"):
        verify(NoMemo(), token_inputs(), config=cfg, capture_sizes=SIZES, backend="emulate")
    with pytest.raises(ValueError, match="needs capture_sizes"):
        verify(NoMemo(), token_inputs(), backend="emulate")


HOOK_CONFTEST = """
from pytest_cudagraph.checks import Check, failed


def never(ctx, desc):
    return failed("the engine's invariant broke")


def pytest_cudagraph_checks(config):
    return [Check("engine_invariant", never, compares="the engine's invariant")]
"""

HOOK_TEST = """
import torch
from tests.bugs import NoMemo, token_inputs


def test_verified(cudagraph_verify):
    cudagraph_verify(NoMemo(), token_inputs(), capture_sizes=[1, 2], backend="emulate")
"""


def test_a_conftest_adds_checks_to_the_tests_beneath_it_only(pytester):
    from pathlib import Path

    pytester.syspathinsert(str(Path(__file__).resolve().parents[1]))
    sub = pytester.mkpydir("engine")
    (sub / "conftest.py").write_text(HOOK_CONFTEST)
    (sub / "test_engine.py").write_text(HOOK_TEST)
    (pytester.path / "test_plain.py").write_text(HOOK_TEST)
    result = pytester.runpytest("--cudagraph-report=report.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAIL engine_invariant*", "*the engine's invariant broke*"])
    data = json.loads((pytester.path / "report.json").read_text())
    checks = {
        nodeid: {o["check"] for v in test["verifications"] for o in v["report"]["outcomes"]}
        for nodeid, test in data["tests"].items()
    }
    assert "engine_invariant" in checks["engine/test_engine.py::test_verified"]
    assert "engine_invariant" not in checks["test_plain.py::test_verified"]


def test_a_hook_that_returns_no_checks_is_told(pytester):
    from pathlib import Path

    pytester.syspathinsert(str(Path(__file__).resolve().parents[1]))
    pytester.makeconftest("def pytest_cudagraph_checks(config):\n    return ['engine_invariant']\n")
    pytester.makepyfile(test_x=HOOK_TEST)
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*pytest_cudagraph_checks returned 'engine_invariant'; it returns a list of*"]
    )


def test_a_leading_minus_deselects_a_check() -> None:
    from pytest_cudagraph.checks.builtin import BUILTIN

    default = BUILTIN.select(None)
    assert BUILTIN.select("-determinism") == tuple(c for c in default if c != "determinism")
    assert BUILTIN.select(["real_batches", "state", "-state"]) == ("real_batches",)
    with pytest.raises(ValueError, match="at least one"):
        BUILTIN.select("real_batches,-real_batches")
    with pytest.raises(ValueError, match=r"unknown check\(s\) \['determinizm'\]"):
        BUILTIN.select("-determinizm")
