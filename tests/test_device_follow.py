"""The same test on both backends: on CUDA the fixtures move a CPU module (in place) and the tensors
``make_inputs`` returns to the test's device, so a suite written on a laptop runs unchanged on a GPU."""

from __future__ import annotations

import pytest
import torch

from pytest_cudagraph.manager.devices import follow_device
from tests.conftest import isolate_plugins

# The README's short example, and a bug-free twin: CPU modules, CPU tensors, no device anywhere.
README_SUITE = """
import pytest
import torch


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1          # Python state: frozen into the graph at capture
        return self.proj(x) * self.calls


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 2.0))

    def forward(self, x, bias):
        return self.proj(x) * self.scale + bias


def make_inputs(num_tokens, num_reqs):
    return {"x": torch.randn(num_tokens, 16), "bias": torch.ones(16)}


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8], max_num_reqs=4)
def test_scaled(cudagraph_verify):
    cudagraph_verify(Scaled(), lambda num_tokens, num_reqs: {"x": torch.randn(num_tokens, 16)})


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4, 8], max_num_reqs=4)
def test_plain(cudagraph_verify, cudagraph_device):
    module = Plain()
    report = cudagraph_verify(module, make_inputs)
    assert report.ok
    assert module.proj.weight.device == cudagraph_device  # moved in place


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4], max_num_reqs=4)
def test_manager(cudagraph_manager, cudagraph_device):
    manager = cudagraph_manager(Plain(), make_inputs)
    manager.capture()
    out = manager.run(x=torch.randn(3, 16, device=cudagraph_device), bias=torch.ones(16, device=cudagraph_device))
    assert out.device == cudagraph_device and out.shape == (3, 16)
"""


@pytest.fixture
def suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None
) -> pytest.Pytester:
    isolate_plugins(monkeypatch)
    pytester.makepyfile(test_readme=README_SUITE)
    return pytester


@pytest.mark.cuda
def test_a_cpu_written_suite_runs_unchanged_on_cuda(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--cudagraph-backend=cuda")
    # the README's example fails as on the CPU, naming its bug, and not for its device
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*Python state changes on every forward (calls:*"])
    result.stdout.no_fnmatch_line("*move the module*")
    result.stdout.no_fnmatch_line("*move it with*")


def test_the_same_suite_on_the_emulator(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--cudagraph-backend=emulate")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*Python state changes on every forward (calls:*"])


def test_nothing_moves_off_cuda() -> None:
    module = torch.nn.Linear(2, 2)

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"input": torch.randn(num_tokens, 2)}

    assert follow_device(module, make_inputs, "cpu") is make_inputs
    assert follow_device(module, make_inputs, None) is make_inputs
    assert module.weight.device.type == "cpu"


@pytest.mark.cuda
def test_follow_device_moves_module_and_inputs() -> None:
    module = torch.nn.Linear(2, 2)
    device = torch.device("cuda", torch.cuda.current_device())
    moved = follow_device(
        module, lambda t, r: {"input": torch.randn(t, 2), "pair": (torch.ones(1), 3)}, device
    )
    assert module.weight.device == device
    inputs = moved(3, 2)
    assert inputs["input"].device == device and inputs["pair"][0].device == device and inputs["pair"][1] == 3
