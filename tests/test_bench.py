"""Benchmarks on the CPU: timing, the memory estimate, the fixture through pytest-benchmark, the report."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_cudagraph import CaptureConfig, GraphManager
from pytest_cudagraph.bench import extrapolate, measure_manager, time_interleaved, time_rounds
from pytest_cudagraph.bench.memory import (
    MIN_PER_GRAPH_BYTES,
    estimate_full_graph_memory,
    estimate_pool_replica,
)
from tests import models
from tests.conftest import isolate_plugins

MIB = 1 << 20


def test_time_rounds_counts_rounds_and_calls() -> None:
    calls = []
    timing = time_rounds(
        lambda: calls.append(1), device=torch.device("cpu"), rounds=4, calls_per_round=3, warmup=2
    )
    assert len(calls) == 2 + 4 * 3
    assert len(timing.rounds) == 4 and timing.per_round_calls == 3
    assert timing.minimum <= timing.median
    with pytest.raises(ValueError, match="rounds and calls_per_round must be >= 1"):
        time_rounds(lambda: None, device=torch.device("cpu"), rounds=0)


def test_time_interleaved_takes_rounds_in_turn_with_the_first_rotating() -> None:
    order: list[str] = []
    timed = time_interleaved(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b"), "c": lambda: order.append("c")},
        device=torch.device("cpu"),
        rounds=3,
        calls_per_round=2,
        warmup=1,
    )
    # warm-up once each, then per round a turn of each function, each turn starting one later
    assert order == ["a", "b", "c", *"aabbcc", *"bbccaa", *"ccaabb"]
    assert {name: len(t.rounds) for name, t in timed.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError, match="at least one function"):
        time_interleaved({}, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="got rounds=1, calls_per_round=0"):
        time_interleaved({"a": lambda: None}, device=torch.device("cpu"), rounds=1, calls_per_round=0)


def test_extrapolate_is_vllms_estimate_with_two_samples() -> None:
    # first capture, then the second sample (floored at 1 MiB) for every further graph
    assert extrapolate([50 * MIB, 3 * MIB], 67) == 50 * MIB + 66 * 3 * MIB
    assert extrapolate([50 * MIB, 0], 67) == 50 * MIB + 66 * MIN_PER_GRAPH_BYTES
    assert extrapolate([50 * MIB], 67) == 50 * MIB
    assert extrapolate([], 67) == 0
    # the sampled variant: mean of the later samples, no floor
    assert extrapolate([50 * MIB, 0, 2 * MIB, 0], 10, floor=0) == 50 * MIB + round(9 * (2 * MIB / 3))


def test_measure_manager_on_the_emulator_makes_no_speedup_claim() -> None:
    module = models.MLP()
    manager = GraphManager(
        module, models.mlp_inputs(), CaptureConfig(capture_sizes=[1, 4], max_num_reqs=4), backend="emulate"
    )
    with pytest.raises(ValueError, match="needs a captured manager"):
        measure_manager(manager)
    manager.capture()
    results = measure_manager(manager, rounds=3, calls_per_round=2, warmup=1)
    assert [r.descriptor.num_tokens for r in results] == [4, 1]
    for r in results:
        assert r.emulated and r.speedup is None and r.replay_speedup is None
        assert r.padding == 0 and r.eager.median > 0 and r.run.median > 0 and r.replay.median > 0
        assert r.row()["graph_memory_bytes"] == manager.graph_memory[r.descriptor]


def test_memory_estimate_on_the_emulator() -> None:
    manager = GraphManager(
        models.MLP(),
        models.mlp_inputs(),
        CaptureConfig(capture_sizes=[1, 2, 4, 8], max_num_reqs=8),
        backend="emulate",
    )
    manager.capture()
    measured = sum(manager.device_memory.values())
    estimate = estimate_full_graph_memory(manager, measured=measured)
    assert estimate.full_graphs == 4 and len(estimate.samples) == 2
    assert estimate.samples[0] == manager.device_memory[manager.plan.capture_order[0]]
    assert estimate.error is not None
    with pytest.raises(ValueError, match="samples must be >= 1"):
        estimate_full_graph_memory(manager, samples=0)


def test_pool_replica_needs_cuda() -> None:
    manager = GraphManager(
        models.MLP(),
        models.mlp_inputs(),
        CaptureConfig(capture_sizes=[1, 2], max_num_reqs=2),
        backend="emulate",
    )
    with pytest.raises(ValueError, match="needs the cuda backend; this manager uses 'emulate'"):
        estimate_pool_replica(manager)


@pytest.mark.cuda
def test_pool_replica_estimate_is_close_to_capturing_every_graph() -> None:
    # Outputs kept alive dominate what later graphs cost; vLLM's floor of
    # 1 MiB a graph does not see that, the replica does.
    device = torch.device("cuda")
    sizes = [1, 2, 4, *range(8, 257, 8)]
    manager = GraphManager(
        models.MLP(d=256).to(device).eval(),
        models.mlp_inputs(d=256, device=device),
        CaptureConfig(capture_sizes=sizes, max_num_reqs=256),
        backend="cuda",
        progress=False,
    )
    manager.capture()
    try:
        # Pool memory, which other xdist workers on the same GPU cannot disturb.
        measured = sum(manager.graph_memory.values())
        before = {n: t.clone() for n, t in manager.module.state_dict().items()}
        replica = estimate_pool_replica(manager, measured=measured, device_wide=False)
        assert replica.method == "replica" and replica.full_graphs == len(sizes)
        assert replica.samples[0] > 0 and replica.error is not None
        assert abs(replica.error) < 0.25, replica
        assert all(torch.equal(before[n], t) for n, t in manager.module.state_dict().items())
        x = torch.randn(5, 256, device=device)
        models.assert_matches_unpadded(manager.run(x=x), manager.eager(x=x))  # the manager is untouched
    finally:
        manager.release()


BENCH_TEST = """
import torch
from tests import models


def test_mlp(cudagraph_benchmark, cudagraph_device):
    results = cudagraph_benchmark(models.MLP().to(cudagraph_device), models.mlp_inputs(device=cudagraph_device),
                                  capture_sizes=[1, 8], rounds=3, calls_per_round=2, warmup=1)
    assert results is None or len(results) == 2
"""


@pytest.fixture
def bench_pytester(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None
) -> pytest.Pytester:
    isolate_plugins(monkeypatch)
    monkeypatch.setenv("PYTEST_PLUGINS", "pytest_cudagraph.plugin,pytest_benchmark.plugin,xdist.plugin")
    # When this suite itself runs under xdist, the inner run must not think it does.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makepyfile(test_bench_inner=BENCH_TEST)
    return pytester


def test_fixture_makes_one_benchmark_entry_per_descriptor_and_kind(bench_pytester: pytest.Pytester) -> None:
    result = bench_pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "--benchmark-json=bench.json",
        "--cudagraph-bench-report=bench.md",
        "--cudagraph-backend=emulate",
    )
    result.assert_outcomes(passed=1)
    data = json.loads((bench_pytester.path / "bench.json").read_text())
    names = sorted(b["name"] for b in data["benchmarks"])
    assert names == sorted(
        f"test_mlp[{kind}-FULL-{shape}]"
        for kind in ("eager", "run", "replay")
        for shape in ("T8-R8", "T1-R1")
    )
    for bench in data["benchmarks"]:
        assert bench["group"] == "MLP"
        info = bench["extra_info"]
        assert info["emulated"] is True and info["speedup_over_eager"] is None
        assert {"descriptor", "padding", "graph_memory_bytes", "kind"} <= set(info)
        assert bench["stats"]["rounds"] == 3
    table = (bench_pytester.path / "bench.md").read_text()
    assert "| test_bench_inner.py::test_mlp | MLP | emulate | FULL-T8-R8 | 8 |" in table
    assert "no speedup is claimed" in table
    assert "| test_bench_inner.py::test_mlp | 2 |" in table  # memory: measured beside vLLM's estimate
    assert all(b["extra_info"]["full_graphs"] == 2 for b in data["benchmarks"])
    result.stdout.fnmatch_lines(["*cudagraph: benchmark report written to*bench.md"])


def test_fixture_under_xdist_warns_and_times_nothing(bench_pytester: pytest.Pytester) -> None:
    result = bench_pytester.runpytest(
        "-p", "no:cacheprovider", "-n", "2", "--cudagraph-backend=emulate", "-W", "always"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*benchmarks are disabled*nothing was timed*"])


BENCH_MISTAKES = """
import torch
from tests import models


class Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input):
        return self.lin(input[:, :3])  # the user's bug: torch raises inside the call on this line


def make(n, r):
    return {"input": torch.randn(n, 4)}


def test_class(cudagraph_benchmark):
    cudagraph_benchmark(models.MLP, models.mlp_inputs(), capture_sizes=[1, 8])


def test_raises(cudagraph_benchmark):
    cudagraph_benchmark(Raises(), make, capture_sizes=[1, 8])


def test_fine(cudagraph_benchmark, cudagraph_device):
    results = cudagraph_benchmark(models.MLP().to(cudagraph_device), models.mlp_inputs(device=cudagraph_device),
                                  capture_sizes=[1, 8], rounds=2, calls_per_round=1, warmup=0)
    assert len(results) == 2
"""


def test_fixture_given_a_module_class_or_a_forward_that_raises_fails_in_one_line(
    bench_pytester: pytest.Pytester,
) -> None:
    """The class for an instance is told as such; a forward that raises with the user's exception and the
    line of their code it left (torch's frames and the package's left out), never the capture's traceback."""
    bench_pytester.makepyfile(test_bench_mistakes=BENCH_MISTAKES)
    written = (bench_pytester.path / "test_bench_mistakes.py").read_text().splitlines()
    line = next(n for n, text in enumerate(written, 1) if "the user's bug" in text)
    result = bench_pytester.runpytest(
        "-p", "no:cacheprovider", "--cudagraph-backend=emulate", "test_bench_mistakes.py"
    )
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "cudagraph_benchmark: module must be a torch.nn.Module instance; got the class MLP itself, not an "
            "instance of it: pass MLP() (with its constructor's arguments), not MLP",
            f"cudagraph_benchmark: Raises's forward raises at test_bench_mistakes.py:{line} in forward, eagerly at "
            "(num_tokens=8, num_reqs=8), before anything is captured: RuntimeError: mat1 and mat2 shapes *. "
            "Nothing can be captured or timed; run module(**make_inputs(8, 8)) eagerly to see it",
        ],
        consecutive=False,
    )
    text = result.stdout.str()
    assert "Traceback" not in text and "pytest_cudagraph/" not in text and "CaptureError" not in text


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU build of torch has no such query outside the guard
        return False


class _FailsInCapture(torch.nn.Module):
    """Runs eagerly; raises only while it is captured: the capture failed, not the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _capturing():
            raise RuntimeError("raises only while capturing")
        return self.lin(input)


def test_a_capture_that_fails_where_eager_runs_stays_a_capture_error() -> None:
    from pytest_cudagraph.bench.fixture import BenchmarkRunner
    from pytest_cudagraph.errors import CaptureError

    class Node:
        nodeid, name = "t.py::t", "t"

    class Disabled:
        disabled = True

    runner = BenchmarkRunner(Node(), Disabled(), backend="emulate", device=None, record=[].append)  # type: ignore[arg-type]
    with pytest.raises(
        CaptureError, match=r"failed on the emulate backend: RuntimeError: raises only while capturing"
    ):
        runner(_FailsInCapture(), lambda n, r: {"input": torch.randn(n, 4)}, capture_sizes=[1, 2])


def test_report_plots_speedup_per_test_when_matplotlib_is_installed(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from pytest_cudagraph.bench.markdown import write_bench_report

    rows = [
        {
            "test": f"t.py::test[{d}]",
            "module": "Stack",
            "backend": "cuda",
            "descriptor": f"FULL-T{n}",
            "tokens": n,
            "real_tokens": n,
            "eager_s": 3e-4,
            "run_s": 1e-4 * d,
            "replay_s": 1e-4,
            "speedup": 3.0 / d,
            "graph_memory_bytes": 1 << 20,
            "emulated": False,
        }
        for d in (1, 2)
        for n in (1, 8)
    ]
    written = write_bench_report(rows, tmp_path / "bench.md")
    assert [p.suffix for p in written] == [".md", ".png"]
    assert (
        "| t.py::test[1] | Stack | cuda | FULL-T1 | 1 | 300.0 µs | 100.0 µs | 100.0 µs | 3.00x | 1.0 MiB |"
        in (tmp_path / "bench.md").read_text()
    )
