# ruff: noqa: F811  (the imported pytester fixture ``inner``, used as an argument)
"""Bad input, one rule at a time (issue #58): each is refused in one line before anything heavy
runs, or verified as not verifiable; each correct twin still passes. ``tests/test_fuzz_inputs.py``
draws many more; these are the cases the mutants of scripts/mutants/tables/usage.py must fail."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pytest_cudagraph import environment, verify
from pytest_cudagraph.errors import UsageError
from pytest_cudagraph.files import atomic_write_text, check_output_path
from pytest_cudagraph.plan import Batch
from pytest_cudagraph.plugin.threads import plan_threads
from tests.test_plugin import inner  # noqa: F401  (the pytester fixture)


def _lin() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


def _make(num_tokens: int, num_reqs: int) -> dict[str, Any]:
    return {"input": torch.randn(num_tokens, 4)}


def _verify(module: Any = None, make: Any = None, **keywords: Any) -> Any:
    keywords = {"capture_sizes": [1, 2], "backend": "emulate", **keywords}
    return verify(module if module is not None else _lin(), make or _make, **keywords)


def _refused(said: str, module: Any = None, make: Any = None, **keywords: Any) -> None:
    """One UsageError line matching ``said``, raised before make_inputs runs (when it is ours)."""
    with pytest.raises(UsageError, match=said) as raised:
        _verify(module, make, **keywords)
    assert "\n" not in str(raised.value)


# -- verify()'s keywords ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keywords", "said"),
    [
        ({"atol": float("nan")}, r"atol must be a finite number >= 0"),
        ({"atol": float("inf")}, r"atol must be a finite number >= 0"),
        ({"rtol": float("inf")}, r"rtol must be a finite number from 0 to 1"),
        ({"rtol": 2.0}, r"rtol must be a finite number from 0 to 1"),
        ({"seed": 2**70}, r"seed must be an integer from -2\*\*63 to 2\*\*64 - 1"),
        ({"descriptors": 5}, r"descriptors must be descriptor labels"),
        ({"pad_values": 5}, r"pad_values must map input names"),
        ({"scratch_state": 5}, r"scratch_state must map module state names"),
        ({"batches": []}, r"batches is empty: the checks that run real batches would run none"),
        (
            {"capture_sizes": b"1,2"},
            r"capture_sizes must be a list of integers such as \[1, 2, 4, 8\]; got b'1,2'",
        ),
        ({"capture_sizes": range(1, 2**40)}, r"capture_sizes holds more than 16384 values"),
        ({"ubatch_min_tokens": 2**40}, r"ubatch_min_tokens must be <= 1048576"),
        ({"mode": "FUL"}, r"mode must be .*; got 'FUL' \(did you mean 'FULL'\?\)"),
        (
            {"capture_size": [1]},
            r"unknown keyword 'capture_size' \(did you mean 'capture_sizes'\?\); verify\(\) takes",
        ),
        ({"device": "tpu"}, r"device 'tpu' is not a device torch knows"),
        ({"device": 5}, r"device must be a torch.device or a string"),
        (
            {"eager_submodules": range(1, 2**40)},
            r"eager_submodules must be a list of module types or dotted names",
        ),
        (
            {"extra_checks": range(1, 2**40)},
            r"extra_checks must be a list of pytest_cudagraph.checks.Check; got more",
        ),
    ],
)
def test_a_bad_keyword_is_one_line(keywords: dict[str, Any], said: str) -> None:
    _refused(said, **keywords)


def test_capture_sizes_as_text_are_read_as_the_options_read_them() -> None:
    report = _verify(capture_sizes="1,2", exhaustive=False)
    assert report.ok and report.config["capture_sizes"] == [1, 2]


def test_a_plan_with_no_graph_is_refused_not_passed() -> None:
    _refused(r"the plan NONE .* holds no graph: mode NONE runs every batch eagerly", mode="NONE")
    _refused(
        r"the plan FULL_DECODE_ONLY .* holds no graph: no capture size is a uniform decode batch",
        mode="FULL_DECODE_ONLY",
        decode_query_len=4,
    )
    # The twin: a decode plan whose sizes hold a uniform decode batch verifies.
    assert _verify(mode="FULL_DECODE_ONLY", decode_query_len=2, capture_sizes=[2, 4], exhaustive=False).ok


def test_batches_that_no_graph_serves_are_refused() -> None:
    far = [Batch(num_tokens=100, num_reqs=1)]  # beyond the largest graph (2): eager
    _refused(r"none of the 1 batches given is served by a graph of the plan", batches=far)
    assert _verify(batches=[Batch(num_tokens=2, num_reqs=1)], exhaustive=False).ok


def test_a_torchscript_module_is_told_as_such() -> None:
    _refused(r"module is a TorchScript module", module=torch.jit.script(_lin()))


def test_a_module_class_for_an_instance_is_named() -> None:
    from pytest_cudagraph import GraphManager

    said = (
        r"module must be a torch.nn.Module instance; got the class Linear itself, not an instance of it: "
        r"pass Linear\(\) \(with its constructor's arguments\), not Linear$"
    )
    _refused(said, module=torch.nn.Linear)
    with pytest.raises(UsageError, match=said):
        GraphManager(torch.nn.Linear, _make, {"capture_sizes": [1], "max_num_reqs": 1})  # type: ignore[arg-type]
    # A class that is no Module is still told as what it is, with the wrapper to write.
    _refused(r"module must be a torch.nn.Module; got a class \(type 'Batch'\).*wrap the code", module=Batch)
    assert _verify(_lin(), exhaustive=False).ok  # the twin: an instance


class _Slots(torch.nn.Module):
    """A module with a buffer, where a scratch region lives."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("slots", torch.zeros(4))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.lin(input) + self.slots


def test_a_scratch_state_that_names_no_buffer_is_one_line() -> None:
    _refused(
        r"^scratch_state names 'nope', which is not a buffer or parameter of Linear; it has no buffers \(its "
        r"parameters: weight, bias\)\. Key scratch_state by the name module.named_buffers\(\) gives the buffer "
        r"forward may leave changed \(a submodule's dotted, such as 'cache.slots'\)$",
        scratch_state={"nope": 0},
    )
    _refused(
        r"^scratch_state names 'slot', 'x', which are not buffers or parameters of _Slots \(did you mean "
        r"'slots'\?\); its buffers are slots\. Key scratch_state",
        module=_Slots(),
        scratch_state={"x": 0, "slot": 0},
    )
    from pytest_cudagraph.runner import verify_runner

    with pytest.raises(UsageError, match=r"^scratch_state names 'nope', which is not a buffer") as raised:
        verify_runner(_lin(), _lin(), _make, capture_sizes=[1, 2], scratch_state={"nope": 0})
    assert "\n" not in str(raised.value)
    assert _verify(_Slots(), scratch_state={"slots": 0}, exhaustive=False).ok  # the twin: a buffer it has


class _Raises(torch.nn.Module):
    """A module whose forward raises: the user's bug, told with their line."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this forward raises on purpose")


def test_a_forward_that_raises_under_verify_runner_is_one_line_at_the_users_line() -> None:
    from pytest_cudagraph.errors import EagerFailure
    from pytest_cudagraph.runner import verify_runner

    line = _Raises.forward.__code__.co_firstlineno + 1
    with pytest.raises(EagerFailure) as raised:
        verify_runner(_lin(), _Raises(), _make, capture_sizes=[1, 2])
    assert re.fullmatch(
        rf"_Raises's forward raises at \S*test_bad_input\.py:{line} in forward, eagerly at \(num_tokens=1, "
        r"num_reqs=1\), before anything is compared: RuntimeError: this forward raises on purpose\. Nothing can "
        r"be compared with the runner; run module\(\*\*make_inputs\(1, 1\)\) eagerly to see it",
        str(raised.value),
    ), str(raised.value)
    lin = _lin()
    assert verify_runner(lin, lin, _make, capture_sizes=[1, 2]).ok  # the twin: a forward that runs


def test_a_graph_manager_refuses_a_flag_that_is_not_a_bool() -> None:
    from pytest_cudagraph import GraphManager

    with pytest.raises(UsageError, match=r"output_views must be True or False; got nan"):
        GraphManager(_lin(), _make, {"capture_sizes": [1], "max_num_reqs": 1}, output_views=float("nan"))


# -- make_inputs' results ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (lambda n: np.zeros((n, 4), dtype=np.float32), r"returned input 'input' as a numpy ndarray"),
        (lambda n: torch.randn(n, 4).to_sparse(), r"returned input 'input' as a torch.sparse_coo tensor"),
        (lambda n: {"x": torch.randn(n, 4)}, r"returned input 'input' as a dict holding a Tensor"),
        (lambda n: [torch.randn(n, 4)], r"returned input 'input' as a list holding a Tensor"),
        (lambda n: "tokens", r"returned input 'input' as a string \('tokens'\)"),
    ],
)
def test_an_input_the_harness_cannot_read_is_one_line(value: Any, said: str) -> None:
    _refused(said, make=lambda n, r: {"input": value(n)})


def test_a_key_that_is_not_a_string_is_named() -> None:
    _refused(
        r"returned a dict with the key 0 \(int\); its keys are module.forward's argument names",
        make=lambda n, r: {0: torch.randn(n, 4)},
    )


class _Leaky(torch.nn.Module):
    """Real rows read the padded ones (a sum over every row): caught with finite inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.lin(input) + input.sum(0, keepdim=True)


def test_outputs_nan_everywhere_are_not_verified_and_a_leak_is_caught_on_finite_inputs() -> None:
    nan = lambda n, r: {"input": torch.full((n, 4), float("nan"))}  # noqa: E731
    _refused(
        r"outputs are NaN or inf in every element .*make_inputs' floating inputs are NaN or inf", make=nan
    )
    _refused(r"outputs are NaN or inf in every element", module=_Leaky(), make=nan)
    assert not _verify(_Leaky(), capture_sizes=[1, 2, 4, 8]).ok  # the leak, seen on random inputs
    # Some NaN is fine where other outputs stay finite (an elementwise module): those are compared.
    part = lambda n, r: {"input": torch.cat([torch.randn(n, 3), torch.full((n, 1), float("nan"))], 1)}  # noqa: E731
    assert _verify(torch.nn.PReLU(), make=part, exhaustive=False).ok


# -- files the plugin writes -----------------------------------------------------------------------------


def test_an_output_path_that_is_not_a_regular_file_is_never_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, said in ((fifo, r"exists and is not a regular file \(a FIFO\)"), (tmp_path, "is a directory")):
        with pytest.raises(UsageError, match=said):
            atomic_write_text(path, "x")
    assert fifo.is_fifo()
    with pytest.raises(UsageError, match="an empty path"):
        check_output_path("")
    assert atomic_write_text(tmp_path / "new.json", "{}").read_text() == "{}"  # the twin


def test_a_report_path_that_is_a_fifo_stops_the_run(inner: pytest.Pytester) -> None:
    os.mkfifo(inner.path / "fifo")
    inner.makepyfile("def test_x():\n    open('ran', 'w').close()\n")
    result = inner.runpytest("--cudagraph-report=fifo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --cudagraph-report: *fifo exists and is not a regular file (a FIFO)*"]
    )
    assert not (inner.path / "ran").exists() and (inner.path / "fifo").is_fifo()


@pytest.mark.parametrize("option", ["--cudagraph-report", "--cudagraph-trace", "--cudagraph-compare"])
def test_an_empty_path_option_is_a_usage_error(inner: pytest.Pytester, option: str) -> None:
    inner.makepyfile("def test_x():\n    pass\n")
    result = inner.runpytest(f"{option}=")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {option}: an empty path; give a file path*"])


# -- options and the environment ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--cudagraph-sizes=99999999999999"],
            "*99999999999999 is more than 1048576, far beyond any device*",
        ),
        (["--cudagraph-world-size=100000000"], "*expected a number of ranks from 1 to 64*"),
        (["--cudagraph-isolate-timeout=1e300"], "*expected a positive number of seconds up to 604800*"),
        (["--cudagraph-devices=99999999999"], "*CUDA device indices from 0 to 1023*"),
    ],
)
def test_a_numeric_option_beyond_its_bound_stops_the_run(
    inner: pytest.Pytester, args: list[str], said: str
) -> None:
    inner.makepyfile("def test_x():\n    pass\n")
    result = inner.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([said])


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("PYTEST_CUDAGRAPH_CAPTURE", "bogus", "expected checked or fast"),
        ("PYTEST_CUDAGRAPH_THREADS", "abc", "expected a number of torch threads from 1 to 1024"),
        ("PYTEST_CUDAGRAPH_THREADS", "100000", "expected a number of torch threads from 1 to 1024"),
        ("PYTEST_CUDAGRAPH_MEMORY_CHECK", "bogus", "expected true or false"),
    ],
)
def test_a_bad_environment_value_stops_the_run_before_collection(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, value: str, said: str
) -> None:
    inner.makepyfile("def test_x():\n    open('ran', 'w').close()\n")
    monkeypatch.setenv(name, value)
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {name}={value!r}: {said}*"])
    result.stdout.no_fnmatch_line("*collected*")
    assert not (inner.path / "ran").exists()


def test_the_thread_count_is_bounded_where_torch_would_crash() -> None:
    # 100000 threads: libgomp puts each new thread's start data on the caller's stack, which overflows.
    with pytest.raises(UsageError, match="PYTEST_CUDAGRAPH_THREADS='100000'"):
        plan_threads(cores=2, workers=1, env={"PYTEST_CUDAGRAPH_THREADS": "100000"})
    assert plan_threads(cores=2, workers=1, env={"PYTEST_CUDAGRAPH_THREADS": "1024"}) == 1024


@pytest.mark.parametrize(
    ("text", "on"),
    [("false", False), ("No", False), ("off", False), ("0", False), ("yes", True), ("1", True), ("", True)],
)
def test_booleans_in_the_environment_read_as_the_ini_reads_them(text: str, on: bool) -> None:
    assert environment.read(environment.MEMORY_CHECK, {"PYTEST_CUDAGRAPH_MEMORY_CHECK": text}) is on


# -- the marker and the fixtures -------------------------------------------------------------------------------

MARKED = """
import pytest, torch

def make(n, r):
    return {"input": torch.randn(n, 4)}

@pytest.mark.cudagraph(capture_sizes=[1, 2], descriptors=5)
def test_descriptors(cudagraph_verify):
    cudagraph_verify(torch.nn.Linear(4, 4), make)

@pytest.mark.cudagraph(capture_sizes=[1, 2], mode="BOGUS")
def test_mode(cudagraph_verify):
    cudagraph_verify(torch.nn.Linear(4, 4), make)

@pytest.mark.cudagraph(capture_sizes=[1, 2], rtol=float("nan"))
def test_rtol(cudagraph_verify):
    cudagraph_verify(torch.nn.Linear(4, 4), make)

def test_benchmark(cudagraph_benchmark):
    cudagraph_benchmark(torch.nn.Linear(4, 4), make, roundz=3, capture_sizes=[1])

def test_training(cudagraph_verify_training):
    cudagraph_verify_training(torch.nn.Linear(4, 4), make, None, capture_sizes=[1])

@pytest.mark.cudagraph(capture_sizes=[1, 2])
def test_fine(cudagraph_verify):
    cudagraph_verify(torch.nn.Linear(4, 4), make)
"""


def test_a_malformed_marker_or_keyword_fails_its_own_test_in_one_line(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_marked=MARKED)
    result = inner.runpytest("--cudagraph-backend=emulate", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=2, errors=3)
    result.stdout.fnmatch_lines(
        [
            "*test_descriptors: descriptors must be descriptor labels such as 'FULL-T8-R4'; got 5",
            "*test_mode: mode must be a GraphMode or one of *; got 'BOGUS'",
            "*test_rtol: rtol must be a finite number from 0 to 1, or None for the dtype's default; got nan",
            "cudagraph_benchmark: unknown keyword 'roundz' (did you mean 'rounds'?)*",
            "cudagraph_verify_training: loss_fn must be a callable loss_fn(output, inputs) -> scalar loss; got None",
        ],
        consecutive=False,
    )
    assert "pytest_cudagraph/" not in result.stdout.str()  # no frame of the package


MODULE_MISTAKES = """
import torch
from cgmods import Tiny, make_inputs


class Raises(Tiny):
    def forward(self, x):
        raise RuntimeError("this forward raises on purpose")


def loss(out, inputs):
    return out.sum()


def test_verify_class(cudagraph_verify):
    cudagraph_verify(Tiny, make_inputs, capture_sizes=[1, 2])

def test_manager_class(cudagraph_manager):
    cudagraph_manager(Tiny, make_inputs, capture_sizes=[1, 2])

def test_runner_class(cudagraph_verify_runner):
    cudagraph_verify_runner(Tiny(), Tiny, make_inputs, capture_sizes=[1, 2])

def test_training_class(cudagraph_verify_training):
    cudagraph_verify_training(Tiny, make_inputs, loss, capture_sizes=[1, 2])

def test_verify_scratch(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=[1, 2], scratch_state={"lin.wieght": 0})

def test_runner_scratch(cudagraph_verify_runner):
    module = Tiny()
    cudagraph_verify_runner(module, module, make_inputs, capture_sizes=[1, 2], scratch_state={"nope": 0})

def test_runner_raises(cudagraph_verify_runner):
    cudagraph_verify_runner(Tiny(), Raises(), make_inputs, capture_sizes=[1, 2])

def test_fine(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=[1, 2])
"""


def test_a_module_the_fixtures_cannot_run_fails_its_test_in_one_line(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_modules=MODULE_MISTAKES)
    written = (inner.path / "test_modules.py").read_text().splitlines()
    raises_line = written.index('        raise RuntimeError("this forward raises on purpose")') + 1
    result = inner.runpytest("--cudagraph-backend=emulate", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=7)
    instance = "module must be a torch.nn.Module instance; got the class Tiny itself, not an instance of it"
    result.stdout.fnmatch_lines(
        [
            f"cudagraph_verify: {instance}: pass Tiny() (with its constructor's arguments), not Tiny",
            f"cudagraph_manager: {instance}: pass Tiny() *",
            f"cudagraph_verify_runner: {instance}: pass Tiny() *",
            f"cudagraph_verify_training: {instance}: pass Tiny() *",
            "cudagraph_verify: scratch_state names 'lin.wieght', which is not a buffer or parameter of Tiny "
            "(did you mean 'lin.weight'?); it has no buffers (its parameters: lin.weight, lin.bias). Key "
            "scratch_state by the name module.named_buffers() gives *",
            "cudagraph_verify_runner: scratch_state names 'nope', which is not a buffer or parameter of Tiny*",
            f"cudagraph_verify_runner: Raises's forward raises at test_modules.py:{raises_line} in forward, eagerly "
            "at (num_tokens=1, num_reqs=1), before anything is compared: RuntimeError: this forward raises on "
            "purpose. Nothing can be compared with the runner; run module(**make_inputs(1, 1)) eagerly to see it",
        ],
        consecutive=False,
    )
    assert "pytest_cudagraph/" not in result.stdout.str()  # no frame of the package
    assert "Traceback" not in result.stdout.str()
