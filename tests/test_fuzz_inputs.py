"""Fuzzed bad input: through every door, one clear line or a verification that verified something.

Hypothesis draws keywords (names near the real ones too) and odd values for ``verify()``, every
fixture (their classes, in process), the ``cudagraph`` marker, the options and the ini file (a real
pytest configuration, ``pytester.parseconfigure``), the environment, and ``make_inputs``' results;
and modules no fixture can run (a Module class for an instance, a function, a forward that raises).
Each case must end one way:

- refused with one ``UsageError`` line (pytest's for an option, the ini or the environment; the
  fixtures fail the test with ``pytest.fail(..., pytrace=False)``);
- or accepted, and then it verified at least one descriptor (never "0 of 0 ... passed").

A case fails the test when anything else escapes (a traceback through the package or torch, a
``TypeError``, a ``MemoryError``), when a value no keyword takes is accepted (``ALWAYS_BAD``: NaN,
inf, 2**70, bytes, an endless range, an object; an empty or non-regular output path; ...),
and when the correct verification that follows every case in the same process does not pass.
The number of cases is fixed and derandomized (``CASES``), so CI runs the same ones each time;
docs/reliability.md gives the count and the time of a run.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from pytest_cudagraph import environment, verify
from pytest_cudagraph.bench.fixture import BenchmarkRunner
from pytest_cudagraph.checks.report import VerifyReport
from pytest_cudagraph.errors import UsageError
from pytest_cudagraph.options import verify_keyword_names
from pytest_cudagraph.plugin import settings as cg_settings
from pytest_cudagraph.plugin.harness import (
    MANAGER_KEYWORDS,
    RUNNER_KEYWORDS,
    Benchmark,
    DistributedVerifier,
    ManagerFactory,
    RunnerVerifier,
    TrainingVerifier,
    Verifier,
    _training_keywords,
)
from pytest_cudagraph.plugin.option_table import OWN_OPTIONS
from tests.conftest import isolate_plugins
from tests.test_bad_input import _Raises  # the module whose forward raises, with its user's line

#: Cases per door: fixed, derandomized, small enough for CI (docs/reliability.md: the run's time).
CASES = {"verify": 60, "fixtures": 60, "modules": 25, "marker": 60, "inputs": 40, "session": 40}


def _fuzz(door: str) -> Any:
    return settings(
        max_examples=CASES[door],
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# -- the pools ----------------------------------------------------------------------------------


class _Odd:
    """A value no keyword takes (and its repr, for hypothesis' report)."""

    def __repr__(self) -> str:
        return "<an object>"


#: Values no keyword, marker value or config field takes: each must be refused wherever it goes.
ALWAYS_BAD: tuple[Any, ...] = (
    float("nan"),
    float("inf"),
    2**70,
    b"1,2",
    range(1, 2**40),
    _Odd(),
)
#: Values some keywords take and others refuse: refused in one line or accepted, never a traceback.
ODD: tuple[Any, ...] = (
    None,
    0,
    1,
    2,
    -1,
    1.5,
    True,
    2**40,
    "",
    "abc",
    "1,2",
    "FULL",
    "NONE",
    "PIECEWISE",
    "emulate",
    "cpu",
    "tpu",
    "cuda:0",
    [],
    [0],
    [1, 2],
    [1.5],
    ["x"],
    ("FULL-T1-R1",),
    {},
    {"input": 0},
    {"input": "x"},
    {"nope": 1},
    {0: 1},
    frozenset({1}),
    torch.tensor([1, 2]),
)


def _typos(names: tuple[str, ...]) -> st.SearchStrategy[str]:
    """Names near the real ones: a letter dropped, doubled or cased, a word cut."""

    def near(name: str, how: int) -> str:
        cut = max(1, len(name) // 2)
        return [name[:-1], name + name[-1], name.upper(), name[:cut], name.replace("_", "-")][how % 5]

    return st.builds(near, st.sampled_from(names), st.integers(0, 4))


def _keywords(names: tuple[str, ...], *, max_size: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(
        st.one_of(st.sampled_from(names), _typos(names)),
        st.one_of(st.sampled_from(ODD), st.sampled_from(ALWAYS_BAD)),
        min_size=1,
        max_size=max_size,
    )


#: The one keyword that takes a value of ``ALWAYS_BAD``: an absolute tolerance's scale is the
#: outputs', so 2**70 is a tolerance (if a loose one).
TAKES = {("atol", 2**70)}


def _always_bad(keywords: Mapping[str, Any], known: tuple[str, ...]) -> bool:
    """The keywords hold a name not known or a value no keyword takes: they must be refused."""
    return any(name not in known for name in keywords) or any(
        any(v is bad for bad in ALWAYS_BAD) and (k, v) not in TAKES for k, v in keywords.items()
    )


# -- the outcome of one case ---------------------------------------------------------------------


def _lin() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


def _make(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"input": torch.randn(num_tokens, 4)}


def _correct() -> None:
    """The verification every case is followed by, in the same process: it must pass."""
    report = verify(_lin(), _make, capture_sizes=[1, 2], backend="emulate", exhaustive=False)
    assert report.ok and report.descriptors, report.format()


def _one_line(message: str, case: object) -> None:
    assert message.strip() and "\n" not in message.strip(), f"{case!r}: not one line: {message!r}"
    assert "Traceback" not in message and not re.search(r"pytest_cudagraph/\S+\.py:\d+", message), message


def _case(run: Callable[[], Any], *, must_refuse: bool, case: object, door: str = "") -> None:
    """Run one case: refused in one line, or accepted having verified something; then a correct
    verification. Anything else that escapes fails the test with its own traceback."""
    try:
        result = run()
    except (UsageError, pytest.UsageError) as exc:
        _one_line(str(exc), case)
        event(f"{door}: refused")
    except pytest.fail.Exception as exc:  # a fixture failed the test: its message alone, no traceback
        assert not exc.pytrace, f"{case!r}: failed with a traceback: {exc.msg}"
        if must_refuse:  # refused in one line (not a verification that ran and failed)
            _one_line(exc.msg, case)
        event(f"{door}: refused" if "\n" not in exc.msg.strip() else f"{door}: verified, failed")
    else:
        assert not must_refuse, f"{case!r} was accepted, where it must be refused: {result!r}"[:2000]
        if isinstance(result, VerifyReport):
            assert result.descriptors, f"{case!r}: passed having verified nothing: {result.format()}"
        event(f"{door}: accepted")
    _correct()


# -- verify() ------------------------------------------------------------------------------------

VERIFY_NAMES = verify_keyword_names()[2:]  # config and options are not drawn


@_fuzz("verify")
@given(keywords=_keywords(VERIFY_NAMES, max_size=1))
@example(keywords={"scratch_state": {"nope": 0}})  # a name the module has no buffer or parameter of
def test_verify_refuses_bad_keywords_in_one_line(keywords: dict[str, Any]) -> None:
    given_keywords = {"capture_sizes": [1, 2], "backend": "emulate", **keywords}
    _case(
        lambda: verify(_lin(), _make, **given_keywords),
        must_refuse=_always_bad(keywords, VERIFY_NAMES),
        case=keywords,
        door="verify()",
    )


# -- the fixtures, in process ----------------------------------------------------------------------

RUN = cg_settings.Settings(options={"exhaustive": False, "backend": "emulate", "checks": None})


def _loss(output: Any, inputs: Any) -> torch.Tensor:
    return output.sum()


def _fixture_call(
    which: str, keywords: dict[str, Any], module: Callable[[], Any] = _lin
) -> Callable[[], Any]:
    """The fixture's call with ``keywords``, on the module ``module()`` makes (the distributed
    fixture's ranks build theirs)."""
    sink: list[Any] = []
    if which == "cudagraph_verify":
        return lambda: Verifier(RUN, {}, sink.append)(
            module(), _make, **{"capture_sizes": [1, 2], **keywords}
        )
    if which == "cudagraph_verify_runner":
        given = module()
        runner = given if isinstance(given, torch.nn.Module) else _lin()
        return lambda: RunnerVerifier(RUN, {}, sink.append)(
            runner, given, _make, **{"capture_sizes": [1, 2], **keywords}
        )
    if which == "cudagraph_verify_training":
        return lambda: TrainingVerifier(RUN, {}, sink.append)(
            module(), _make, _loss, **{"capture_sizes": [1, 2], "steps": 1, **keywords}
        )
    if which == "cudagraph_verify_distributed":
        return lambda: _launched(keywords)
    if which == "cudagraph_benchmark":
        bench = BenchmarkRunner(_Node(), _Session(), backend="emulate", device=None, record=sink.append)
        return lambda: Benchmark(bench)(module(), _make, **{"capture_sizes": [1, 2], **keywords})
    return lambda: _released(
        ManagerFactory(RUN, {})(module(), _make, **{"capture_sizes": [1, 2], **keywords})
    )


class _Launched(Exception):
    """The ranks would have started: every check before them passed."""


def _build(rank: int, world_size: int) -> torch.nn.Module:
    return _lin()


def _launched(keywords: dict[str, Any]) -> str:
    """The distributed fixture's call, up to where its ranks start (they are not started: a
    process each costs seconds). "launched" when it got there."""

    def launch(*args: Any, **kwargs: Any) -> Any:
        raise _Launched

    call = {"capture_sizes": [1, 2], "world_size": 1, **keywords}
    with patch("pytest_cudagraph.distributed.verify.launch", launch):
        try:
            DistributedVerifier(RUN, {}, [].append)(_build, _make, **call)
        except _Launched:
            return "launched"
    raise AssertionError("the distributed fixture neither refused nor launched")


class _Node:
    nodeid = "test_x.py::test_x"
    name = "test_x"


class _Session:
    """pytest-benchmark's session, disabled (as under xdist): each graph runs once, untimed."""

    disabled = True


def _released(manager: Any) -> Any:
    manager.release()
    return manager


#: Each fixture (its class) and the keywords it takes: drawn from, and typos of them.
FIXTURE_NAMES = {
    "cudagraph_verify": cg_settings.VERIFY_KEYWORDS,
    "cudagraph_verify_runner": RUNNER_KEYWORDS,
    "cudagraph_verify_training": _training_keywords(),
    "cudagraph_manager": cg_settings.CONFIG_KEYWORDS + MANAGER_KEYWORDS,
    "cudagraph_verify_distributed": (*cg_settings.VERIFY_KEYWORDS, "world_size", "timeout", "replicated"),
    "cudagraph_benchmark": (
        "rounds",
        "calls_per_round",
        "warmup",
        "pad_values",
        *cg_settings.CONFIG_KEYWORDS,
    ),
}


@_fuzz("fixtures")
@given(data=st.data(), which=st.sampled_from(sorted(FIXTURE_NAMES)))
def test_every_fixture_fails_a_bad_keyword_with_one_line(data: st.DataObject, which: str) -> None:
    names = FIXTURE_NAMES[which]
    keywords = data.draw(_keywords(names, max_size=1), label="keywords")
    _case(
        _fixture_call(which, keywords),
        must_refuse=_always_bad(keywords, names),
        case=(which, keywords),
        door=which,
    )


# -- the module each fixture is given ------------------------------------------------------------------


#: What a test may hand a fixture for its module, none of which any fixture can run: each is refused
#: in one line (a module that cannot be run, or the forward's own exception at the user's line), but
#: by cudagraph_manager the forward that raises, which runs only when the test captures.
MODULES: dict[str, Callable[[], Any]] = {
    "a Module class": lambda: torch.nn.Linear,
    "a function": lambda: lambda input: input * 2,
    "an object": _Odd,
    "a TorchScript module": lambda: torch.jit.script(torch.nn.Linear(4, 4)),
    "a forward that raises": _Raises,
}
#: The fixtures that take a module (the distributed one takes a function that builds one per rank).
TAKE_A_MODULE = tuple(sorted(set(FIXTURE_NAMES) - {"cudagraph_verify_distributed"}))


@_fuzz("modules")
@given(which=st.sampled_from(TAKE_A_MODULE), kind=st.sampled_from(sorted(MODULES)))
def test_every_fixture_refuses_a_module_it_cannot_run_in_one_line(which: str, kind: str) -> None:
    accepted = which == "cudagraph_manager" and kind == "a forward that raises"
    _case(
        _fixture_call(which, {}, MODULES[kind]),
        must_refuse=not accepted,
        case=(which, kind),
        door=f"{which} module",
    )


# -- the marker ----------------------------------------------------------------------------------------


@_fuzz("marker")
@given(keywords=_keywords(cg_settings.MARKER_KEYWORDS, max_size=1), positional=st.booleans())
def test_a_bad_marker_is_one_line_and_a_good_one_verifies(keywords: dict[str, Any], positional: bool) -> None:
    mark = (pytest.mark.cudagraph(1, **keywords) if positional else pytest.mark.cudagraph(**keywords)).mark

    def run() -> Any:
        cg_settings._check_marker(mark, "test_x.py::test_x")
        # Accepted: the fixture's resolution and verify() take it from here (the run's sizes when
        # the marker gives none), as cudagraph_verify does.
        marker = dict(mark.kwargs)
        call = {} if "capture_sizes" in marker else {"capture_sizes": [1, 2]}
        return Verifier(RUN, marker, [].append)(_lin(), _make, **call)

    must = positional or _always_bad(keywords, cg_settings.MARKER_KEYWORDS)
    _case(run, must_refuse=must, case=keywords, door="marker")


# -- make_inputs' results ------------------------------------------------------------------------------

#: What make_inputs may put under a key: (the value at (num_tokens, num_reqs), whether no verification
#: can read it, so that it must be refused).
INPUTS: dict[str, tuple[Callable[[int, int], Any], bool]] = {
    "randn": (lambda n, r: torch.randn(n, 4), False),
    "per request": (lambda n, r: torch.randn(r, 4), False),
    "int": (lambda n, r: torch.randint(0, 9, (n,)), False),
    "python int": (lambda n, r: 3, False),
    "None": (lambda n, r: None, False),
    "floats": (lambda n, r: [0.5, 1.5], False),
    "all NaN": (lambda n, r: torch.full((n, 4), float("nan")), True),
    "all inf": (lambda n, r: torch.full((n, 4), float("inf")), True),
    "sparse": (lambda n, r: torch.randn(n, 4).to_sparse(), True),
    "meta": (lambda n, r: torch.empty(n, 4, device="meta"), True),
    "numpy": (lambda n, r: np.zeros((n, 4), dtype=np.float32), True),
    "dict": (lambda n, r: {"x": torch.randn(n, 4)}, True),
    "list of tensors": (lambda n, r: [torch.randn(n, 4)], True),
    "string": (lambda n, r: "text", True),
    "object": (lambda n, r: _Odd(), True),
    "no batch dimension": (lambda n, r: torch.randn(4, 4), False),
    "wrong width": (lambda n, r: torch.randn(n, 5), False),
}


class _Extra(torch.nn.Module):
    """A Linear whose forward takes any other input and ignores it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input: torch.Tensor, **others: Any) -> torch.Tensor:
        return self.lin(input)


@_fuzz("inputs")
@given(
    # The input forward computes from: a good one (the others decide) or any.
    first=st.tuples(st.booleans(), st.sampled_from(sorted(INPUTS))).map(lambda p: "randn" if p[0] else p[1]),
    others=st.dictionaries(
        st.sampled_from(["extra", "more", 0, None]), st.sampled_from(sorted(INPUTS)), max_size=2
    ),
)
def test_make_inputs_results_the_harness_cannot_read_are_one_line(first: str, others: dict[Any, str]) -> None:
    entries = {"input": first, **others}

    def make(num_tokens: int, num_reqs: int) -> dict[Any, Any]:
        return {key: INPUTS[kind][0](num_tokens, num_reqs) for key, kind in entries.items()}

    # Unreadable anywhere, or as the input forward computes from (NaN and inf: nothing to compare);
    # the other odd inputs under "extra" are the module's to ignore.
    must = any(not isinstance(k, str) for k in entries) or any(
        INPUTS[kind][1] and (key == "input" or kind not in ("all NaN", "all inf"))
        for key, kind in entries.items()
    )
    _case(
        lambda: verify(_Extra(), make, capture_sizes=[1, 2], backend="emulate"),
        must_refuse=must,
        case=entries,
        door="make_inputs",
    )


# -- options, the ini file and the environment: a real pytest configuration --------------------------------

#: Texts an option, an ini key or an environment variable may be given.
TEXTS = (
    "",
    " ",
    "abc",
    "0",
    "-1",
    "1",
    "2",
    "1,2",
    "1 2 4",
    "99999999999999",
    "1e300",
    "nan",
    "inf",
    "emulate",
    "auto",
    "gpu",
    "descriptor",
    "real_batches",
    "-determinism",
    "yes",
    "false",
    "maybe",
    "{fifo}",
    "{dir}",
    "new/out.json",
)
#: The options whose values the plugin reads (flags and the run's verify() keywords among them).
SETTING_NAMES = tuple(
    sorted({o.name for o in OWN_OPTIONS} | {"verify", "backend", "checks", "nonfinite_padding"})
)
_PATHS = {o.name for o in OWN_OPTIONS if o.kind == "path"}
_FLAGS = {o.name for o in OWN_OPTIONS if o.kind == "flag"} | {"verify", "nonfinite_padding"}
#: Texts each kind of setting must refuse (the checks named are told at collection: not here).
_BAD_VALUE = {
    "",
    " ",
    "abc",
    "-1",
    "99999999999999",
    "1e300",
    "nan",
    "inf",
    "{fifo}",
    "{dir}",
    "maybe",
    "gpu",
}
_BAD_FLAG = {"abc", "-1", "99999999999999", "1e300", "nan", "inf", "maybe", "gpu", "2", "{fifo}", "{dir}"}
_BAD_PATH = {"", " ", "{fifo}", "{dir}"}


def _must_refuse_setting(name: str, text: str, how: str) -> bool:
    if name == "checks":
        return False
    if name in _FLAGS:
        return how == "ini" and text.strip() in _BAD_FLAG
    if name in _PATHS:
        return text in _BAD_PATH and not (how == "ini" and not text.strip())  # an empty ini key is unset
    if how == "ini" and not text.strip():
        return False
    return text in _BAD_VALUE


def _must_refuse_env(var: environment.EnvVar, text: str) -> bool:
    word = text.strip().lower()
    if not word:
        return False
    if var is environment.THREADS:
        return not (word.isdigit() and int(word) <= environment.MAX_THREADS)
    if var is environment.CAPTURE:
        return word not in ("checked", "fast")
    return word not in ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0")


@pytest.fixture
def configured(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``configure(args, ini, env)``: pytest configured as a run would be (the plugin's
    ``pytest_configure`` included), then unconfigured; what it raises goes up."""
    isolate_plugins(monkeypatch)
    fifo = pytester.path / "fifo"
    os.mkfifo(fifo)
    (pytester.path / "dir").mkdir()

    def configure(args: list[str], ini: str | None, env: Mapping[str, str]) -> None:
        (pytester.path / "pytest.ini").write_text(f"[pytest]\n{ini}\n" if ini else "[pytest]\n")
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            config = pytester.parseconfigure(*args)
            config._ensure_unconfigure()
        assert fifo.is_fifo(), "the FIFO was replaced"

    yield configure


def _filled(text: str, root: Path) -> str:
    return text.replace("{fifo}", str(root / "fifo")).replace("{dir}", str(root / "dir"))


@_fuzz("session")
@given(
    how=st.sampled_from(["option", "ini", "env"]),
    name=st.sampled_from(SETTING_NAMES),
    var=st.sampled_from([environment.THREADS, environment.CAPTURE, environment.MEMORY_CHECK]),
    text=st.sampled_from(TEXTS),
)
def test_a_bad_option_ini_value_or_environment_stops_the_run_in_one_line(
    configured: Callable[..., None],
    pytester: pytest.Pytester,
    how: str,
    name: str,
    var: environment.EnvVar,
    text: str,
) -> None:
    value = _filled(text, pytester.path)
    flag = "--cudagraph-" + name.replace("_", "-")
    if how == "env":
        args: list[str] = []
        ini, env, must, case = None, {var.name: value}, _must_refuse_env(var, text), (var.name, text)
    elif how == "ini":
        args, ini, env = [], f"cudagraph_{name} = {value}", {}
        must, case = _must_refuse_setting(name, text, how), (f"ini cudagraph_{name}", text)
    elif name in _FLAGS:
        args, ini, env, must, case = [flag], None, {}, False, flag  # a flag takes no value
    else:
        args, ini, env = [f"{flag}={value}"], None, {}
        must, case = _must_refuse_setting(name, text, how), (flag, text)
    _case(lambda: configured(args, ini, env), must_refuse=must, case=case, door=how)


def test_the_pools_hold_what_they_say() -> None:
    """The oracle's own facts: every always-bad value is refused by a keyword that takes most things."""
    for bad in ALWAYS_BAD:
        with pytest.raises(UsageError):
            verify(_lin(), _make, capture_sizes=[1, 2], backend="emulate", seed=bad)
    assert math.isnan(ALWAYS_BAD[0])
