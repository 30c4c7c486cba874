"""verify_runner on small runners written here: a correct one passes, each bug is named by its check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pytest_cudagraph import RUNNER_CHECKS, verify_runner
from pytest_cudagraph.runner.coverage import ReplayCounter

D = 8
SIZES = [1, 2, 4]


class Cached(nn.Module):
    """Writes each token's row into a cache at its slot; slot -1 (the last row) is the padding scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("cache", torch.zeros(16 + 1, D))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        self.cache.index_copy_(0, slots, h)
        return h * 2


def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, D), "slots": torch.randperm(16)[:num_tokens]}


class Runner:
    """Static buffers for the largest size, padding to the smallest capture size that fits, eager past it."""

    pad_slot = 16

    def __init__(self, module: nn.Module, sizes: list[int] = SIZES) -> None:
        self.module = module
        self.sizes = sorted(sizes)
        top = self.sizes[-1]
        self.x = torch.zeros(top, D)
        self.slots = torch.full((top,), self.pad_slot, dtype=torch.long)
        self.out = torch.zeros(top, D)

    def pick(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def load(self, n: int, size: int, x: torch.Tensor, slots: torch.Tensor) -> None:
        self.x[:n].copy_(x)
        self.x[n:size].zero_()
        self.slots[:n].copy_(slots)
        self.slots[n:size].fill_(self.pad_slot)

    def result(self, n: int) -> torch.Tensor:
        return self.out[:n].clone()

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        size = self.pick(n)
        if size is None:
            return self.module(x, slots)
        self.load(n, size, x, slots)
        self.out[:size].copy_(self.module(self.x[:size], self.slots[:size]))
        return self.result(n)


class LiveSlotPadding(Runner):
    pad_slot = 0  # a live slot: padded rows overwrite a real token's cache row


class StaleTable(Runner):
    def load(self, n: int, size: int, x: torch.Tensor, slots: torch.Tensor) -> None:
        self.x[:n].copy_(x)
        self.slots[:n].copy_(slots)  # padded rows keep the previous step's slots


class TooSmall(Runner):
    def pick(self, n: int) -> int | None:
        fits = [s for s in self.sizes if s <= n]
        return fits[-1] if fits and n <= self.sizes[-1] else None

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        size = self.pick(x.shape[0])
        if size is None:
            return self.module(x, slots)
        n = min(x.shape[0], size)
        self.load(n, size, x[:n], slots[:n])
        self.out[:size].copy_(self.module(self.x[:size], self.slots[:size]))
        return self.result(n)


class Views(Runner):
    def result(self, n: int) -> torch.Tensor:
        return self.out[:n]


class FirstCallOnly(Runner):
    """Keeps the inputs of its first call of each size, as a graph that captured a tensor by reference."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.seen: dict[int, torch.Tensor] = {}

    def load(self, n: int, size: int, x: torch.Tensor, slots: torch.Tensor) -> None:
        x = self.seen.setdefault(n, x.clone())
        super().load(n, size, x, slots)


def _verify(runner_cls, **kw):
    torch.manual_seed(0)
    module = Cached().eval()
    return verify_runner(
        runner_cls(module), module, make_inputs, capture_sizes=SIZES, scratch_state={"cache": 16}, **kw
    )


def test_a_correct_runner_passes_every_check():
    report = _verify(Runner)
    assert report.ok, report.format()
    assert report.kind == "runner"
    ran = {o.check for o in report.outcomes if not o.skipped}
    assert ran == set(RUNNER_CHECKS.names()) - {"graph_coverage"}
    # On the CPU graph replays cannot be counted: said so, never a pass.
    cover = [o for o in report.outcomes if o.check == "graph_coverage"]
    assert cover and all(o.skipped and "CUDA" in o.message for o in cover)
    assert [d.label() for d in report.descriptors] == ["FULL-T1", "FULL-T2", "FULL-T4", "NONE-T5"]
    assert report.real_batches >= 5
    assert "3 capture sizes and the eager fallback verified" in report.summary()


@pytest.mark.parametrize(
    ("runner_cls", "check"),
    [
        (LiveSlotPadding, "state"),
        (StaleTable, "state"),
        (TooSmall, "real_batches"),
        (Views, "output_lifetime"),
        (FirstCallOnly, "fresh_inputs"),
    ],
)
def test_each_runner_bug_is_named_by_its_check(runner_cls, check):
    report = _verify(runner_cls)
    assert not report.ok
    assert check in {o.check for o in report.failures}, report.format()


def test_a_stale_context_passes_the_sweep_and_fails_fresh_inputs():
    # The sweep calls each size once, on the inputs the runner keeps: only a
    # second call of the same size on other inputs shows what was kept.
    report = _verify(FirstCallOnly)
    assert {(o.check, o.descriptor.num_tokens) for o in report.failures} == {
        ("fresh_inputs", 1),
        ("fresh_inputs", 2),
        ("fresh_inputs", 4),
    }, report.format()


def test_without_a_scratch_region_padding_writes_are_state_differences():
    torch.manual_seed(0)
    module = Cached().eval()
    report = verify_runner(Runner(module), module, make_inputs, capture_sizes=SIZES, checks=["state"])
    assert {o.check for o in report.failures} == {"state"}
    assert "scratch_state" in report.failures[0].message


def test_capture_is_called_once_first_and_its_failure_is_reported():
    class Captures(Runner):
        captured = 0

        def capture(self) -> None:
            type(self).captured += 1

    _verify(Captures)
    assert Captures.captured == 1

    class Fails(Runner):
        def capture(self) -> None:
            raise RuntimeError("no room")

    report = _verify(Fails)
    assert [o.check for o in report.failures] == ["runner_capture"]
    assert "no room" in report.failures[0].message


def test_a_runner_that_raises_fails_the_checks_of_that_size():
    class Raises(Runner):
        def __call__(self, x, slots):
            if x.shape[0] == 3:
                raise IndexError("slot table too short")
            return super().__call__(x, slots)

    report = _verify(Raises, checks=["real_batches", "state"])
    failed = {(o.check, o.descriptor.num_tokens) for o in report.failures}
    assert failed == {("real_batches", 4), ("state", 4)}
    assert "IndexError" in report.failures[0].message


def test_checks_are_selected_by_name_and_unknown_names_are_refused():
    report = _verify(Runner, checks=["determinism"])
    assert {o.check for o in report.outcomes} == {"determinism"}
    with pytest.raises(ValueError, match="determinism"):
        _verify(Runner, checks=["determinsm"])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"capture_sizes": []}, "capture_sizes"),
        ({"capture_sizes": [0, 2]}, "capture_sizes"),
        ({"capture_sizes": "1,2"}, "capture_sizes"),
        ({"capture_sizes": SIZES, "max_num_reqs": 0}, "max_num_reqs"),
        ({"capture_sizes": SIZES, "scratch_state": {"kv": 0}}, "scratch_state"),
    ],
)
def test_bad_arguments_say_what_was_expected(kw, match):
    module = Cached()
    with pytest.raises(ValueError, match=match):
        verify_runner(Runner(module), module, make_inputs, **kw)


def test_bad_runner_module_or_make_inputs_are_refused():
    from pytest_cudagraph.errors import UsageError

    module = Cached()
    with pytest.raises(UsageError, match="runner"):
        verify_runner(object(), module, make_inputs, capture_sizes=SIZES)
    with pytest.raises(UsageError, match="module"):
        verify_runner(Runner(module), object(), make_inputs, capture_sizes=SIZES)
    with pytest.raises(UsageError, match="make_inputs"):
        verify_runner(Runner(module), module, None, capture_sizes=SIZES)


def test_the_replay_counter_counts_and_puts_the_method_back():
    original = torch.cuda.CUDAGraph.replay
    calls = []
    fake = type("G", (), {})()
    with ReplayCounter() as outer:
        with ReplayCounter() as inner:
            torch.cuda.CUDAGraph.replay.__globals__["_ORIGINAL"] = lambda self: calls.append(self)
            torch.cuda.CUDAGraph.replay(fake)
            torch.cuda.CUDAGraph.replay(fake)
        assert inner.count == 2
        torch.cuda.CUDAGraph.replay(fake)
        assert outer.count == 3
        torch.cuda.CUDAGraph.replay.__globals__["_ORIGINAL"] = original
    assert torch.cuda.CUDAGraph.replay is original
    assert len(calls) == 3


# -- the fixture ---------------------------------------------------------------------------

_FIXTURE_TESTS = """
import pytest
import torch
from tests.test_runner import Cached, Runner, Views, make_inputs


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4], scratch_state={"cache": 16})
def test_marker_sizes(cudagraph_verify_runner):
    module = Cached().eval()
    report = cudagraph_verify_runner(Runner(module), module, make_inputs)
    assert report.ok and report.config["capture_sizes"] == [1, 2, 4]


def test_option_sizes_and_call_keywords(cudagraph_verify_runner):
    module = Cached().eval()
    report = cudagraph_verify_runner(Runner(module), module, make_inputs, scratch_state={"cache": 16},
                                     checks=["real_batches"])
    assert report.config["capture_sizes"] == [2, 8]
    assert {o.check for o in report.outcomes} == {"real_batches"}


@pytest.mark.cudagraph(capture_sizes=[1, 2, 4], scratch_state={"cache": 16})
def test_a_buggy_runner_fails(cudagraph_verify_runner):
    module = Cached().eval()
    cudagraph_verify_runner(Views(module), module, make_inputs)


def test_unknown_keyword(cudagraph_verify_runner):
    module = Cached().eval()
    cudagraph_verify_runner(Runner(module), module, make_inputs, pad_values={"x": 0})
"""


def test_the_fixture_takes_call_then_marker_then_option(pytester, monkeypatch, verify_imported):
    from tests.conftest import isolate_plugins

    isolate_plugins(monkeypatch)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    pytester.makepyfile(test_runners=_FIXTURE_TESTS)
    result = pytester.runpytest_inprocess("--cudagraph-sizes=2,8", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "FAIL output_lifetime" in out
    assert "pad_values" in out and "cudagraph_verify_runner" in out


# -- on CUDA: graphs counted ----------------------------------------------------------------


class GraphRunner:
    """A hand-written CUDA-graph runner for an MLP: one graph per size, except those in ``skip``."""

    def __init__(self, module: nn.Module, sizes: list[int], skip: tuple[int, ...] = ()) -> None:
        self.module, self.sizes, self.skip = module, sorted(sizes), skip
        self.device = next(module.parameters()).device
        self.x = torch.zeros(self.sizes[-1], D, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for s in self.sizes:
                    self.module(self.x[:s])
            torch.cuda.current_stream().wait_stream(side)
            for s in reversed(self.sizes):
                if s in self.skip:
                    continue
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.module(self.x[:s])
                self.graphs[s] = (graph, out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        size = next((s for s in self.sizes if s >= n), None)
        if size is None or size not in self.graphs:
            return self.module(x)
        self.x[:n].copy_(x)
        self.x[n:size].zero_()
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n].clone()


def _mlp_on_cuda():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D)).cuda().eval()
    return module, (lambda t, r: {"input": torch.randn(t, D, device="cuda")})


@pytest.mark.cuda
def test_on_cuda_every_size_replays_a_graph():
    module, make = _mlp_on_cuda()

    class Runner(GraphRunner):
        def __call__(self, input):  # the Sequential's keyword
            return super().__call__(input)

    report = verify_runner(Runner(module, [1, 2, 4, 8]), module, make, capture_sizes=[1, 2, 4, 8])
    assert report.ok, report.format()
    cover = {o.descriptor.label(): o.figures for o in report.outcomes if o.check == "graph_coverage"}
    assert cover["FULL-T8"]["graphed"] == cover["FULL-T8"]["calls"] == 4
    assert cover["NONE-T9"]["graphed"] == 0
    assert "8/9 real batches replayed a CUDA graph" in report.summary()


@pytest.mark.cuda
def test_on_cuda_sizes_run_eagerly_are_named():
    module, make = _mlp_on_cuda()

    class Runner(GraphRunner):
        def __call__(self, input):
            return super().__call__(input)

    report = verify_runner(Runner(module, [1, 2, 4, 8], skip=(4,)), module, make, capture_sizes=[1, 2, 4, 8])
    failures = [(o.check, o.descriptor.label(), o.figures.get("eager_sizes")) for o in report.failures]
    assert failures == [("graph_coverage", "FULL-T4", [3, 4])], report.format()


def test_a_capture_that_writes_live_state_fails_state_and_the_checks_start_from_the_callers_state():
    class WarmsUpIntoALiveSlot(Runner):
        def capture(self) -> None:
            # A warm-up batch whose tokens all go to slot 0 (a live slot), as a
            # runner whose static slot table starts at 0 writes at capture.
            with torch.no_grad():
                self.module(torch.randn(2, D), torch.zeros(2, dtype=torch.long))

    torch.manual_seed(0)
    module = Cached().eval()
    with torch.no_grad():
        module.cache.normal_()
    before = module.cache.clone()
    report = verify_runner(
        WarmsUpIntoALiveSlot(module), module, make_inputs, capture_sizes=SIZES, scratch_state={"cache": 16}
    )
    assert [(o.check, o.descriptor) for o in report.failures] == [("state", None)], report.format()
    assert "runner.capture()" in report.failures[0].message
    assert torch.equal(module.cache, before)
    # A capture that writes only the scratch slot passes.

    class WarmsUpIntoScratch(Runner):
        def capture(self) -> None:
            with torch.no_grad():
                self.module(torch.randn(2, D), torch.full((2,), 16, dtype=torch.long))

    report = verify_runner(
        WarmsUpIntoScratch(module), module, make_inputs, capture_sizes=SIZES, scratch_state={"cache": 16}
    )
    assert report.ok, report.format()


def test_a_config_gives_the_plan_as_verify_and_the_manager_take_it():
    from pytest_cudagraph import CaptureConfig

    torch.manual_seed(0)
    module = Cached().eval()
    by_sizes = _verify(Runner)
    torch.manual_seed(0)
    report = verify_runner(
        Runner(module),
        module,
        make_inputs,
        config=CaptureConfig(capture_sizes=SIZES, max_num_reqs=max(SIZES)),
        scratch_state={"cache": 16},
    )
    assert report.ok and [d.label() for d in report.descriptors] == [d.label() for d in by_sizes.descriptors]
    assert verify_runner(
        Runner(module), module, make_inputs, config={"capture_sizes": SIZES}, scratch_state={"cache": 16}
    ).ok
    with pytest.raises(ValueError, match="pass config or capture_sizes/max_num_reqs, not both"):
        verify_runner(
            Runner(module), module, make_inputs, config={"capture_sizes": SIZES}, capture_sizes=SIZES
        )
    with pytest.raises(ValueError, match="needs capture_sizes"):
        verify_runner(Runner(module), module, make_inputs)
