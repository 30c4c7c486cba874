"""The runners made of PyTorch's own CUDA-graph machinery: compiled() and graphed_callables()."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from examples.mlp import MLPBlock
from examples.mlp import make_inputs as mlp_inputs
from pytest_cudagraph.runner.adapters import (
    CompiledRunner,
    GraphedRunner,
    _cudagraph_skip_logger,
    _SizeGraph,
    compiled,
    graphed_callables,
)

SIZES = [1, 2, 4, 8]


def _close(got: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert set(got) == set(expected)
        for k in expected:
            _close(got[k], expected[k])
        return
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CUDAGraph.replay wrapped with a counter: one entry a replay."""
    calls: list[int] = []
    original = torch.cuda.CUDAGraph.replay

    def counting(self: torch.cuda.CUDAGraph) -> None:
        calls.append(1)
        original(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    return calls


def _mlp() -> tuple[nn.Module, Callable[[int, int], dict[str, torch.Tensor]]]:
    module = MLPBlock().cuda().eval()
    return module, functools.partial(mlp_inputs, device="cuda")


def _eager(module: nn.Module, inputs: dict[str, Any]) -> Any:
    with torch.no_grad():
        return module(**inputs)


# -- without a GPU: clear errors, the skip bookkeeping, the padding ----------------------------------------


def test_no_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"compiled\(\) needs a CUDA device.*pytest.mark.cuda"):
        compiled(MLPBlock())
    with pytest.raises(RuntimeError, match=r"graphed_callables\(\) needs a CUDA device"):
        graphed_callables(MLPBlock(), mlp_inputs, SIZES)
    runner = GraphedRunner(
        MLPBlock(), mlp_inputs, SIZES, max_num_reqs=None, pad_values={}, num_warmup_iters=3
    )
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        runner.capture()


def test_a_module_off_the_gpu_and_bad_arguments_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        torch.cuda, "is_available", lambda: True
    )  # past the CUDA check; nothing touches a GPU
    with pytest.raises(ValueError, match=r"on cpu.*module\.cuda\(\)"):
        compiled(MLPBlock())
    with pytest.raises(ValueError, match=r"on cpu.*module\.cuda\(\)"):
        graphed_callables(MLPBlock(), mlp_inputs, SIZES)
    bare = nn.GELU()  # no parameters or buffers: nothing to move
    with pytest.raises(ValueError, match="together"):
        compiled(bare, make_inputs=mlp_inputs)
    with pytest.raises(ValueError, match="warmup_calls"):
        compiled(bare, make_inputs=mlp_inputs, warmup_sizes=[1], warmup_calls=1)
    with pytest.raises(ValueError, match="reduce-overhead"):
        compiled(bare, mode="max-autotune")
    with pytest.raises(ValueError, match="capture_sizes"):
        graphed_callables(bare, mlp_inputs, [0, 2])
    with pytest.raises(ValueError, match="empty"):
        graphed_callables(bare, mlp_inputs, [])
    with pytest.raises(TypeError, match=r"nn\.Module"):
        compiled(lambda x: x)  # type: ignore[arg-type]


def _cpu_runner() -> CompiledRunner:
    # The class without compiled()'s CUDA check: torch.compile compiles lazily, on the first call.
    return CompiledRunner(
        nn.Linear(2, 2),
        dynamic=False,
        clone_outputs=False,
        make_inputs=None,
        warmup_sizes=[],
        max_num_reqs=None,
        warmup_calls=2,
        recompile_limit=None,
        compile_kwargs={},
    )


def _bump() -> None:
    from torch._dynamo.utils import counters

    counters["inductor"]["cudagraph_skips"] += 1


def test_skip_messages_are_recorded_once_in_order() -> None:
    runner = _cpu_runner()
    log = _cudagraph_skip_logger()
    for msg in ("skip A", "skip B", "skip A"):
        with runner._watch():
            log.warning(msg)
            _bump()
    assert runner.skip_reasons == ["skip A", "skip B"]


def test_a_skip_counted_but_not_logged_is_recorded() -> None:
    # A logging configuration that silences torch's warning: the counter still tells.
    runner = _cpu_runner()
    log = _cudagraph_skip_logger()
    level = log.level
    log.setLevel(logging.ERROR)  # setLevel, not the attribute: it clears the logger's level cache
    try:
        with runner._watch():
            log.warning("not seen")
            _bump()
    finally:
        log.setLevel(level)
    assert len(runner.skip_reasons) == 1 and runner.skip_reasons[0]
    assert "not seen" not in runner.skip_reasons[0]


def test_nothing_is_recorded_without_a_skip() -> None:
    runner = _cpu_runner()
    with runner._watch():
        logging.getLogger("torch._inductor").debug("unrelated")
    assert runner.skip_reasons == []


def test_a_real_compile_without_cuda_tensors_records_the_counted_skip() -> None:
    # torch counts a CPU-only graph as a skip without logging it: end to end through torch.compile.
    runner = _cpu_runner()
    module = runner.module
    x = torch.randn(3, 2)
    torch.testing.assert_close(runner(input=x), _eager(module, {"input": x}))
    assert runner.skip_reasons and all(isinstance(r, str) and r for r in runner.skip_reasons)


class _TwoOut(nn.Module):
    """Per-token and per-request outputs; a cache written at slots (pad slot: the last row)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(9, 4))

    def forward(self, x: torch.Tensor, slots: torch.Tensor, req_rows: torch.Tensor) -> dict[str, Any]:
        h = self.lin(x)
        self.cache.index_copy_(0, slots, h)
        return {"h": h, "per_req": (req_rows * 2, [h.sum(0)])}


def _two_out_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(num_tokens, 4),
        "slots": torch.randperm(8)[:num_tokens],
        "req_rows": torch.randn(num_reqs, 3),
    }


def test_padding_and_cutting_on_the_cpu() -> None:
    # The runner's own work around the graph (pick a size, pad, cut), with the module standing in for graphs.
    module = _TwoOut()
    runner = GraphedRunner(
        module, _two_out_inputs, [2, 4], max_num_reqs=2, pad_values={"slots": 8}, num_warmup_iters=3
    )
    for size in (2, 4):
        static = _two_out_inputs(size, runner.reqs(size))
        names = list(static)
        runner.graphs[size] = _SizeGraph(
            size, runner.reqs(size), lambda *a, n=names: module(**dict(zip(n, a, strict=True))), static
        )
    runner.token_input = runner._find_token_input({s: g.static for s, g in runner.graphs.items()})
    assert runner.token_input == "x"
    inputs = _two_out_inputs(3, 2)
    got = runner(**inputs)
    graph = runner.graphs[4]
    assert graph.static["slots"][3].item() == 8 and torch.equal(graph.static["x"][3], torch.zeros(4))
    expected = _eager(module, inputs)
    assert got["h"].shape == (3, 4) and got["per_req"][0].shape == (2, 3)
    torch.testing.assert_close(got["h"], expected["h"])
    torch.testing.assert_close(got["per_req"][0], expected["per_req"][0])
    assert runner.graph_calls == 1 and runner.eager_calls == 0
    runner(**_two_out_inputs(5, 2))
    assert runner.eager_calls == 1
    with pytest.raises(ValueError, match="does not fit"):
        runner(**{**_two_out_inputs(2, 2), "req_rows": torch.randn(2, 5)})
    with pytest.raises(ValueError, match="missing"):
        runner(x=torch.randn(2, 4), slots=torch.arange(2))


def test_graphed_runner_needs_capture_first() -> None:
    runner = GraphedRunner(
        MLPBlock(), mlp_inputs, SIZES, max_num_reqs=None, pad_values={}, num_warmup_iters=3
    )
    with pytest.raises(RuntimeError, match=r"capture\(\)"):
        runner(x=torch.randn(2, 64))


# -- torch.compile(mode="reduce-overhead") on the GPU ------------------------------------------------------


@pytest.mark.cuda
def test_compiled_matches_eager_and_replays_graphs(replays: list[int]) -> None:
    module, make = _mlp()
    runner = compiled(module, clone_outputs=True, make_inputs=make, warmup_sizes=[1, 3, 8])
    runner.capture()
    replays.clear()
    for n in (8, 3, 1, 3):
        inputs = make(n, n)
        _close(runner(**inputs), _eager(module, inputs))
    assert len(replays) >= 4, "warmed-up sizes replay a CUDA graph on every call"
    assert runner.skip_reasons == []


class _MutatesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # a mutated graph input: CUDA graph trees cannot replay it
        return self.lin(x)


# Graph partitioning (on by default) would split some incompatible work out of the graph instead of
# skipping it. A CPU-tensor op with graph_partition=False records "cpu device" too, but compiles a C++
# kernel (64 s on a fresh H200 machine), so it is not among the cases.
_NO_PARTITION = {"graph_partition": False}


@pytest.mark.cuda
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(("mutated-input", _MutatesInput, {}, False), id="mutated-input"),
        pytest.param(
            (
                "dynamic-graph",
                lambda: nn.Linear(8, 8),
                {"options": {**_NO_PARTITION, "triton.cudagraph_skip_dynamic_graphs": True}},
                True,
            ),
            id="skip-dynamic-graphs",
        ),
    ],
)
def test_a_forced_skip_records_a_reason(
    case: tuple[str, Callable[[], nn.Module], dict[str, Any], bool],
) -> None:
    name, build, kwargs, dynamic = case
    module = build().cuda()
    runner = compiled(module, dynamic=dynamic, **kwargs)
    for n in (4, 4, 4, 6, 6, 6):
        inputs: dict[str, torch.Tensor] = {"x": torch.randn(n, 8, device="cuda")}
        if name == "dynamic-graph":
            inputs = {"input": inputs["x"]}
        runner(**inputs)
    print(f"{name}: {runner.skip_reasons}")
    assert runner.skip_reasons, "torch skipped CUDA graphs; the runner must say so"
    assert all(isinstance(r, str) and r.strip() for r in runner.skip_reasons)


@pytest.mark.cuda
def test_compiled_outputs_are_overwritten_by_the_next_call_unless_cloned() -> None:
    module, make = _mlp()
    a, b = make(4, 4), make(4, 4)
    runner = compiled(module, make_inputs=make, warmup_sizes=[4])
    runner.capture()
    first = runner(**a)
    runner(**b)
    try:  # a replay overwrites it in silence; torch refuses to read one it freed
        overwritten = not torch.allclose(first, _eager(module, a))
    except RuntimeError:
        overwritten = True
    assert overwritten

    cloning = compiled(module, clone_outputs=True, make_inputs=make, warmup_sizes=[4])
    cloning.capture()
    first = cloning(**a)
    cloning(**b)
    _close(first, _eager(module, a))


# -- torch.cuda.make_graphed_callables on the GPU -------------------------------------------------------------


@pytest.mark.cuda
def test_graphed_callables_equal_eager_at_every_size(replays: list[int]) -> None:
    module, make = _mlp()
    runner = graphed_callables(module, make, SIZES)
    runner.capture()
    assert sorted(runner.graphs) == SIZES
    replays.clear()
    for n in range(1, SIZES[-1] + 2):
        inputs = make(n, n)
        got = runner(**inputs)
        assert got.shape == (n, 64)
        _close(got, _eager(module, inputs))
    assert len(replays) == SIZES[-1], "one replay a batch within the capture sizes, none past them"
    assert runner.graph_calls == SIZES[-1] and runner.eager_calls == 1


@pytest.mark.cuda
def test_graphed_callables_outputs_are_copies() -> None:
    module, make = _mlp()
    runner = graphed_callables(module, make, [4])
    runner.capture()
    a, b = make(3, 3), make(3, 3)
    first = runner(**a)
    runner(**b)
    _close(first, _eager(module, a))


# -- verify_runner on them ------------------------------------------------------------------------------------


@pytest.fixture
def verify_runner() -> Any:
    from pytest_cudagraph.runner import verify_runner

    return verify_runner


def _decoder_inputs() -> Callable[[int, int], dict[str, torch.Tensor]]:
    """The decoder's real batches on CUDA, with the all-False is_padding mask its forward takes."""
    from examples.engine_runner.runner import make_engine_inputs

    return functools.partial(make_engine_inputs, device="cuda")


def _failed(report: Any) -> list[str]:
    return [f"{o.check} {o.descriptor}: {o.message}" for o in report.failures]


@pytest.mark.cuda
def test_verify_runner_passes_compiled_mlp(verify_runner: Any) -> None:
    module, make = _mlp()
    # Warmed at every token count it serves: under dynamic=False each count is its own CUDA graph.
    runner = compiled(module, clone_outputs=True, make_inputs=make, warmup_sizes=range(1, SIZES[-1] + 1))
    report = verify_runner(runner, module, make, capture_sizes=SIZES)
    print(report.format(verbose=True))
    assert report.ok, _failed(report)


@pytest.mark.cuda
def test_verify_runner_reports_the_output_hazard_without_clones(verify_runner: Any) -> None:
    module, make = _mlp()
    runner = compiled(module, make_inputs=make, warmup_sizes=range(1, SIZES[-1] + 1))
    report = verify_runner(runner, module, make, capture_sizes=SIZES)
    failed = {o.check for o in report.failures}
    print(_failed(report))
    assert "output_lifetime" in failed


@pytest.mark.cuda
def test_verify_runner_without_warm_up_sees_first_calls_run_eagerly(verify_runner: Any) -> None:
    # CUDA graph trees run a new shape's first call eagerly: a compiled runner not warmed up replays
    # nothing on the sweep's one call a size, which graph_coverage reports.
    module, make = _mlp()
    report = verify_runner(compiled(module, clone_outputs=True), module, make, capture_sizes=SIZES)
    print(_failed(report))
    assert {o.check for o in report.failures} == {"graph_coverage"}


@pytest.mark.cuda
def test_verify_runner_passes_compiled_decoder(verify_runner: Any) -> None:
    from examples.decoder import MAX_REQS, SCRATCH_STATE, TinyDecoder

    torch.manual_seed(0)
    module = TinyDecoder().cuda().eval()
    make = _decoder_inputs()

    runner = compiled(
        module,
        clone_outputs=True,
        make_inputs=make,
        warmup_sizes=range(1, SIZES[-1] + 1),
        max_num_reqs=MAX_REQS,
    )
    # Every check, state included: inductor's fused kernels write K/V cache values that differ from
    # eager's in the last bits (up to 3.6e-7 on an H200), within the real rows' tolerance.
    report = verify_runner(
        runner, module, make, capture_sizes=SIZES, max_num_reqs=MAX_REQS, scratch_state=SCRATCH_STATE
    )
    print(report.format(verbose=True))
    assert report.ok, _failed(report)


@pytest.mark.cuda
def test_verify_runner_passes_graphed_callables_mlp(verify_runner: Any) -> None:
    module, make = _mlp()
    report = verify_runner(graphed_callables(module, make, SIZES), module, make, capture_sizes=SIZES)
    print(report.format(verbose=True))
    assert report.ok, _failed(report)


@pytest.mark.cuda
def test_verify_runner_passes_graphed_callables_decoder(verify_runner: Any) -> None:
    # Padded tokens write the padding slot and are masked; padded requests repeat the batch's end.
    from examples.decoder import MAX_REQS, PAD_SLOT, SCRATCH_STATE, TinyDecoder

    torch.manual_seed(0)
    module = TinyDecoder().cuda().eval()
    make = _decoder_inputs()

    runner = graphed_callables(
        module,
        make,
        SIZES,
        max_num_reqs=MAX_REQS,
        pad_values={"slot_mapping": PAD_SLOT, "query_start_loc": "edge", "is_padding": True},
    )
    report = verify_runner(
        runner, module, make, capture_sizes=SIZES, max_num_reqs=MAX_REQS, scratch_state=SCRATCH_STATE
    )
    print(report.format(verbose=True))
    assert report.ok, _failed(report)


@pytest.mark.cuda
def test_verify_runner_reports_a_silent_compile_skip_with_torchs_reason(verify_runner: Any) -> None:
    # The twin of the buggy case: the same compiled runner on a module torch can graph passes.
    def make(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, 8, device="cuda")}

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * 2)

    sizes = [1, 2, 4]
    for module_cls, graphed in ((_MutatesInput, False), (Plain, True)):
        torch.manual_seed(0)
        module = module_cls().cuda().eval()
        runner = compiled(module, clone_outputs=True, make_inputs=make, warmup_sizes=range(1, 5))
        report = verify_runner(runner, module, make, capture_sizes=sizes)
        failed = {o.check for o in report.failures}
        if graphed:
            assert report.ok, _failed(report)
            continue
        assert failed == {"graph_coverage"}, _failed(report)
        cover = [o for o in report.failures if o.check == "graph_coverage"]
        assert all(o.figures.get("skip_reasons") for o in cover)
        assert all("the runner says:" in o.message for o in cover)
