# ruff: noqa: F811  (the imported pytester fixture ``inner``, used as an argument)
"""Every mistake is told once, early and plainly: at session start, on its own test, or as an error
that names the input and what to do."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_cudagraph import GraphManager, verify
from pytest_cudagraph.manager.devices import inputs_on, move_to
from pytest_cudagraph.manager.layout import MakeInputsError
from tests.test_plugin import CONFTEST, CPU_ONLY, MODULES, inner  # noqa: F401  (the pytester fixture)

CONFIG = {"capture_sizes": [1, 2, 4], "max_num_reqs": 4}


def _make(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"input": torch.randn(num_tokens, 4)}


# -- session start: options and report paths ----------------------------------
NEVER_RUNS = """
def test_x():
    open("ran", "w").close()
"""


@pytest.mark.parametrize("option", ["--cudagraph-report", "--cudagraph-bench-report"])
def test_report_path_under_a_file_is_a_usage_error_before_any_test(
    inner: pytest.Pytester, option: str
) -> None:
    inner.makepyfile(NEVER_RUNS)
    (inner.path / "afile").write_text("")
    result = inner.runpytest(f"{option}=afile/out.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: {option}: cannot create *afile*out.json: *afile is a file, not a folder*"]
    )
    assert not (inner.path / "ran").exists()


def test_report_path_that_is_a_directory_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile(NEVER_RUNS)
    (inner.path / "out").mkdir()
    inner.makeini("[pytest]\ncudagraph_report = out\n")
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: ini option cudagraph_report: *out is a directory; give a file path*"]
    )
    assert not (inner.path / "ran").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_report_in_a_read_only_folder_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile(NEVER_RUNS)
    locked = inner.path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result = inner.runpytest("--cudagraph-report=locked/sub/report.json")
    finally:
        locked.chmod(0o700)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --cudagraph-report: cannot create *the folder *locked is not writable*"]
    )


def test_a_report_in_folders_yet_to_make_is_fine(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_x():\n    pass\n")
    inner.runpytest("--cudagraph-report=new/dir/report.json").assert_outcomes(passed=1)
    assert (inner.path / "new" / "dir" / "report.json").exists()


@CPU_ONLY
@pytest.mark.parametrize("how", ["option", "ini"])
def test_cuda_backend_without_cuda_is_a_usage_error_at_start(inner: pytest.Pytester, how: str) -> None:
    inner.makepyfile(NEVER_RUNS)
    if how == "ini":
        inner.makeini("[pytest]\ncudagraph_backend = cuda\n")
        result = inner.runpytest()
        source = "ini option cudagraph_backend"
    else:
        result = inner.runpytest("--cudagraph-backend=cuda")
        source = "--cudagraph-backend"
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: {source}: cuda asks for real CUDA graphs, but "
            "torch.cuda.is_available() is False here*--cudagraph-backend=auto*"
        ]
    )
    assert not (inner.path / "ran").exists()


@CPU_ONLY
def test_help_works_whatever_the_backend(inner: pytest.Pytester) -> None:
    result = inner.runpytest("--cudagraph-backend=cuda", "--help")
    assert result.ret == pytest.ExitCode.OK


@CPU_ONLY
def test_a_markers_cuda_backend_fails_that_test_only(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs

        @pytest.mark.cudagraph(capture_sizes=(1, 2), backend="cuda")
        def test_pinned(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs)

        @pytest.mark.cudagraph(capture_sizes=(1, 2))
        def test_free(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs)
        """
    )
    result = inner.runpytest()
    # an error at set-up here: the inner conftest asks for cudagraph_device in every test
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*backend 'cuda' was asked for*marked @pytest.mark.cuda, which skips it*"])
    result.stdout.no_fnmatch_line("*Traceback*")


# -- the marker: its own test only; sizes as a string --------------------------
def test_a_bad_marker_fails_its_own_test_and_the_rest_run(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs

        @pytest.mark.cudagraph(capture_sizes=(1, 2), rtoll=1e-3)
        def test_typo(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs)

        @pytest.mark.cudagraph(capture_sizes=(1, 2))
        def test_fine(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs)
        """
    )
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_typo: unknown keyword 'rtoll' (did you mean 'rtol'?)*"])


def test_capture_sizes_as_a_string_work_end_to_end(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import Tiny, make_inputs

        @pytest.mark.cudagraph(capture_sizes="1,2,4", max_num_reqs=4)
        def test_marker(cudagraph_verify):
            report = cudagraph_verify(Tiny(), make_inputs, exhaustive=True)
            assert report.planned == 3

        def test_keyword(cudagraph_verify, cudagraph_manager):
            assert cudagraph_verify(Tiny(), make_inputs, capture_sizes="1 2 4 8", exhaustive=True).planned == 4
            manager = cudagraph_manager(Tiny(), make_inputs, capture_sizes="2,4")
            assert manager.config.capture_sizes == (2, 4) or list(manager.config.capture_sizes) == [2, 4]

        def test_bad_keyword(cudagraph_verify):
            cudagraph_verify(Tiny(), make_inputs, capture_sizes="1,two")
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*capture_sizes: expected a comma-separated list*'two' is not a whole number*"]
    )


# -- the module, the inputs, the output ----------------------------------------
def test_a_function_instead_of_a_module_is_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"module must be a torch.nn.Module; got a function \(function '.*<lambda>'\)"
        r".*wrap the code in a Module",
    ):
        GraphManager(lambda x: x * 2, _make, CONFIG)  # type: ignore[arg-type]


def test_a_function_given_to_the_fixtures_fails_the_test_plainly(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from cgmods import make_inputs

        @pytest.mark.cudagraph(capture_sizes=(1, 2))
        def test_verify(cudagraph_verify):
            cudagraph_verify(lambda x: x * 2, make_inputs)

        @pytest.mark.cudagraph(capture_sizes=(1, 2))
        def test_manager(cudagraph_manager):
            cudagraph_manager(lambda x: x * 2, make_inputs)
        """
    )
    result = inner.runpytest()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "cudagraph_verify: module must be a torch.nn.Module; got a function*",
            "cudagraph_manager: module must be a torch.nn.Module; got a function*",
        ],
        consecutive=False,
    )
    result.stdout.no_fnmatch_line("*AttributeError*")


def test_inputs_on_the_meta_device_are_named() -> None:
    def on_meta(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"input": torch.empty(num_tokens, 4, device="meta")}

    with pytest.raises(ValueError, match="input 'input' on the meta device, which holds no data"):
        GraphManager(torch.nn.Linear(4, 4), on_meta, CONFIG)


def test_a_module_on_the_meta_device_is_named() -> None:
    with pytest.raises(ValueError, match=r"module tensor 'weight' is on meta.*materialise the module"):
        GraphManager(torch.nn.Linear(4, 4, device="meta"), _make, CONFIG)


def test_make_inputs_whose_keys_change_with_the_shape_is_named() -> None:
    def shifty(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        # the probes (7 and 11 tokens) and the largest shape (4) agree; the capture of 2 tokens does not
        name = "input" if num_tokens in (7, 11, 4) else "x"
        return {name: torch.randn(num_tokens, 4)}

    manager = GraphManager(torch.nn.Linear(4, 4), shifty, CONFIG)
    with pytest.raises(
        MakeInputsError,
        match=r"make_inputs\(num_tokens=2, num_reqs=2\) returned inputs \['x'\], "
        r"but at the probe and largest shapes it returned \['input'\].*same keys at every shape",
    ):
        manager.capture()
    with pytest.raises(MakeInputsError, match="same keys at every shape"):
        verify(torch.nn.Linear(4, 4), shifty, capture_sizes=[1, 2, 4])


class ReturnsNothing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input: torch.Tensor) -> Any:
        self.lin(input)
        return None


class ReturnsNoTensor(ReturnsNothing):
    def forward(self, input: torch.Tensor) -> Any:
        self.lin(input)
        return {"done": True}


@pytest.mark.parametrize(
    ("module", "said"), [(ReturnsNothing(), "None"), (ReturnsNoTensor(), "a dict with no tensor in it")]
)
def test_a_module_with_nothing_to_compare_fails(module: torch.nn.Module, said: str) -> None:
    report = verify(module, _make, capture_sizes=[1, 2, 4])
    assert not report.ok
    failed = [o for o in report.outcomes if not o.passed and not o.skipped]
    assert failed and {o.check for o in failed} == {"replay_matches_eager"}  # told once per descriptor
    assert f"forward returned {said}: there is nothing to compare" in failed[0].message
    assert "nothing to compare" in report.format()


def test_run_before_capture_is_told() -> None:
    manager = GraphManager(torch.nn.Linear(4, 4), _make, CONFIG)
    with pytest.raises(
        RuntimeError,
        match=r"GraphManager.run\(\) was called before capture\(\).*call "
        r"manager.capture\(\) first",
    ):
        manager.run(input=torch.randn(3, 4))
    with pytest.raises(RuntimeError, match=r"run_batch\(\) was called before capture\(\)"):
        manager.run_batch({"input": torch.randn(3, 4)})
    assert manager.eager(input=torch.randn(3, 4)).shape == (3, 4)  # eager on purpose still works
    manager.capture()
    assert manager.run(input=torch.randn(3, 4)).shape == (3, 4)
    manager.release()  # released: batches run eagerly until the next capture, as documented
    assert manager.run(input=torch.randn(3, 4)).shape == (3, 4)


# -- --cudagraph-split=descriptor never drops a descriptor silently ------------
def test_a_split_call_planning_more_descriptors_names_them(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_x="""
import pytest
from cgmods import Tiny, make_inputs


@pytest.mark.cudagraph(capture_sizes=(1, 2))
def test_more(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, capture_sizes=(1, 2, 4))


@pytest.mark.cudagraph(capture_sizes=(1, 2))
def test_same(cudagraph_verify):
    cudagraph_verify(Tiny(), make_inputs, seed=3)
"""
    )
    result = inner.runpytest("--cudagraph-split=descriptor")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*plan descriptor(s) FULL-T4-R4 too, which no item would verify*"])


# -- moving inputs to the test's device (pure functions; CUDA: test_device_follow) --
def test_move_to_moves_every_tensor_in_dicts_lists_and_tuples() -> None:
    value = {"a": torch.ones(2), "b": [torch.ones(1), (torch.zeros(1), 3)], "c": "text"}
    moved = move_to(value, torch.device("meta"))
    assert moved["a"].is_meta and moved["b"][0].is_meta and moved["b"][1][0].is_meta
    assert moved["b"][1][1] == 3 and moved["c"] == "text"
    assert isinstance(moved["b"], list) and isinstance(moved["b"][1], tuple)


def test_inputs_on_wraps_make_inputs() -> None:
    moved = inputs_on(lambda t, r: {"x": torch.ones(t, 2), "n": r}, torch.device("meta"))
    inputs = moved(3, 2)
    assert inputs["x"].is_meta and tuple(inputs["x"].shape) == (3, 2) and inputs["n"] == 2


@pytest.mark.skipif(
    not Path("/proc/self").exists(), reason="needs Linux's /proc, which refuses new files even to root"
)
def test_report_path_is_tried_not_guessed_from_permissions(inner: pytest.Pytester) -> None:
    # Permission bits say root may write anywhere; /proc refuses all the same.
    inner.makepyfile(NEVER_RUNS)
    result = inner.runpytest("--cudagraph-report=/proc/cudagraph-nowhere/out.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --cudagraph-report: cannot write /proc/cudagraph-nowhere/out.json *"]
    )
    assert not (inner.path / "ran").exists()


@pytest.mark.parametrize("key", ["cudagraph_verify", "cudagraph_isolate", "cudagraph_nonfinite_padding"])
def test_a_bad_ini_boolean_names_its_key(inner: pytest.Pytester, key: str) -> None:
    inner.makepyfile(NEVER_RUNS)
    inner.makeini(f"[pytest]\n{key} = maybe\n")
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: ini option {key}: expected true or false; *maybe*"])
    assert not (inner.path / "ran").exists()


# -- the first hour: each mistake is one line, before any capture ---------------
def _lin() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


MISTAKES = {
    "make_inputs returns a tensor": (
        _lin,
        lambda n, r: torch.randn(n, 4),
        {},
        r"make_inputs must return a dict of keyword inputs for module\.forward, such as .* returned Tensor",
    ),
    "an input is a long Python list": (
        _lin,
        lambda n, r: {"input": [0.5] * n * 50},
        {},
        r"input 'input' is a Python value that changes .*\.\.\. \(\d+ characters\) at 7 tokens",
    ),
    "an input is a list of lists": (
        _lin,
        lambda n, r: {"input": [[0.5] * 4] * n},
        {},
        r"make_inputs\(num_tokens=7, num_reqs=3\) returned input 'input' as a list holding a list; the harness "
        r"reads each input as one tensor",
    ),
    "a key forward does not take": (
        _lin,
        lambda n, r: {"x": torch.randn(n, 4)},
        {},
        r"make_inputs returns key\(s\) \['x'\] that Linear\.forward does not take \(its arguments: input\)",
    ),
    "make_inputs takes one argument": (
        _lin,
        lambda n: {"input": torch.randn(n, 4)},
        {},
        r"make_inputs\(num_tokens=7, num_reqs=3\) raised TypeError: .* make_inputs must build inputs for any",
    ),
    "a float64 module given float32 inputs": (
        lambda: _lin().double(),
        _make,
        {},
        r"make_inputs' floating inputs are float32 and the module's parameters float64: build the inputs in "
        r"float64",
    ),
    "no input follows num_tokens": (
        _lin,
        lambda n, r: {"input": torch.randn(8, 4)},
        {},
        r"no input of make_inputs follows num_tokens or num_reqs .*'input' \(8, 4\)",
    ),
    "max_num_reqs=0": (_lin, _make, {"max_num_reqs": 0}, r"max_num_reqs must be an integer >= 1; got 0"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_is_one_usage_error_before_any_capture(mistake: str) -> None:
    from pytest_cudagraph.errors import UsageError

    build, make_inputs, keywords, said = MISTAKES[mistake]
    with pytest.raises(UsageError, match=said) as raised:
        verify(build(), make_inputs, backend="emulate", **{**CONFIG, **keywords})
    assert "\n" not in str(raised.value)
    assert len(str(raised.value)) < 700  # long values are cut


FIXTURE_MISTAKES = """
import pytest, torch

def test_tensor(cudagraph_verify):
    cudagraph_verify(torch.nn.Linear(4, 4), lambda n, r: torch.randn(n, 4), capture_sizes=[1, 2])

def test_key(cudagraph_verify):
    cudagraph_verify(torch.nn.Linear(4, 4), lambda n, r: {"x": torch.randn(n, 4)}, capture_sizes=[1, 2])

@pytest.mark.cudagraph(capture_sizes=[1, 2], max_num_reqs=0)
def test_marker(cudagraph_verify):
    cudagraph_verify(torch.nn.Linear(4, 4), lambda n, r: {"input": torch.randn(n, 4)})
"""


def test_the_fixture_fails_a_mistake_with_its_one_line_and_no_traceback(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_mistakes=FIXTURE_MISTAKES)
    result = inner.runpytest("--cudagraph-backend=emulate")
    result.assert_outcomes(failed=2, errors=1)
    # Errors (the marker, at set-up) are listed before failures.
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.cudagraph on test_mistakes.py::test_marker: max_num_reqs must be an integer >= 1; got 0",
            "cudagraph_verify: make_inputs must return a dict of keyword inputs*",
            "cudagraph_verify: make_inputs returns key(s) [[]'x'[]] that Linear.forward does not take*",
        ]
    )
    # No frame of the package: the message alone.
    assert "pytest_cudagraph/" not in result.stdout.str()


def test_sizes_below_one_are_said_the_same_way_by_the_option_and_the_marker(inner: pytest.Pytester) -> None:
    inner.makepyfile(NEVER_RUNS)
    result = inner.runpytest("--cudagraph-sizes=-1,2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*got '-1,2' (-1 is less than 1)"])
