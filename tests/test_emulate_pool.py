"""The emulator's shared graph pool: graphs of one backend reuse each other's memory as CUDA graphs do.

The tests that say what CUDA does run on both backends (on CUDA where there
is a GPU): the emulator must overwrite exactly where a real pool would.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph import CaptureConfig, CaptureError, GraphManager, GraphMode
from pytest_cudagraph.backends.base import Backend
from pytest_cudagraph.backends.emulate import BLOCK, EmulateBackend, EmulatedGraph
from pytest_cudagraph.backends.factory import make_backend
from pytest_cudagraph.guard import CaptureGuard, ModuleTracker
from pytest_cudagraph.manager.pieces import SegmentedGraph, capture_in_pieces
from tests import models
from tests.test_pieces import PieceNet, manager, piece_inputs

CPU = torch.device("cpu")
ROW = BLOCK // 4  # float32 features per row: one row is exactly one 512-byte block
SIZES_35 = (1, 2, 4, *range(16, 513, 16))


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def emulated(
    module: nn.Module, make_inputs: Callable[[int, int], dict[str, Any]], sizes: tuple[int, ...], **kw: Any
) -> GraphManager:
    return GraphManager(
        module.eval(),
        make_inputs,
        CaptureConfig(capture_sizes=sizes, max_num_reqs=8),
        backend="emulate",
        progress=False,
        **kw,
    )


def rows_inputs(device: torch.device | str = CPU) -> Callable[[int, int], dict[str, torch.Tensor]]:
    return lambda t, r: {"x": torch.randn(t, ROW, device=device)}


def pool_of(mgr: GraphManager) -> EmulateBackend:
    backend = mgr.state.backend
    assert isinstance(backend, EmulateBackend)
    return backend


def graphs(mgr: GraphManager) -> list[EmulatedGraph]:
    found: list[EmulatedGraph] = []
    for desc in mgr.captured_descriptors:
        graph = mgr.graph(desc)
        parts = graph.steps if isinstance(graph, SegmentedGraph) else [graph]
        found.extend(g for g in parts if isinstance(g, EmulatedGraph))
    return found


class Doubled(nn.Module):
    """One intermediate (``h``), then the output: each a row per token."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return h + 1


class Scaled(nn.Module):
    """The output and nothing else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Stash(nn.Module):
    """Stores a tensor on itself: held after capture until the next forward rebinds it."""

    def __init__(self, keep_all: bool = False) -> None:
        super().__init__()
        self.keep_all = keep_all
        self.kept: list[torch.Tensor] = []
        self.stash: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stash = x * 3
        if self.keep_all:
            self.kept.append(self.stash)
        return x + 1


# -- (a) one pool: the sum of the graphs' figures, and reuse ---------------------------------
def test_later_graphs_fit_in_the_memory_the_largest_one_freed():
    # Sizes 8, 4, 2, 1 (captured largest first), a row per block. Graph 8
    # needs h [0, 8) and its output [8, 16): 16 blocks, the whole pool. Its
    # h dies with the capture: graph 4 puts h at [0, 4) and its output at
    # [4, 8), graph 2 then uses [0, 2) and [2, 4), graph 1 [0, 1) and [1, 2).
    mgr = emulated(Doubled(), rows_inputs(), (1, 2, 4, 8))
    mgr.capture()
    assert [d.num_tokens for d in mgr.captured_descriptors] == [8, 4, 2, 1]
    assert list(mgr.graph_memory.values()) == [16 * BLOCK, 0, 0, 0]
    assert pool_of(mgr).pool_bytes == 16 * BLOCK
    # Every storage on its own, as before the pool: 2 * (8 + 4 + 2 + 1) blocks.
    assert sum(g.created_bytes for g in graphs(mgr)) == 30 * BLOCK
    for n in (8, 4, 2, 1, 3):
        x = torch.randn(n, ROW)
        assert torch.equal(mgr.run(x=x), x * 2 + 1)


def test_many_capture_sizes_cost_the_largest_graph_and_the_outputs_they_keep():
    mgr = emulated(models.MLP(d=64, hidden=512), models.mlp_inputs(d=64), SIZES_35)
    mgr.capture()
    assert len(mgr.captured_descriptors) == 35
    backend = pool_of(mgr)
    pool = backend.pool_bytes
    assert sum(mgr.graph_memory.values()) == pool
    largest, *others = mgr.captured_descriptors
    outputs = {d: rounded(mgr.graph(d).output.untyped_storage().nbytes()) for d in mgr.captured_descriptors}
    # The largest graph alone, in a pool of its own: what it needs at its peak.
    alone = emulated(models.MLP(d=64, hidden=512), models.mlp_inputs(d=64), (largest.num_tokens,))
    alone.capture()
    own_need = pool_of(alone).pool_bytes
    # Every output stays (the manager holds them), so the pool holds at least
    # all of them; every other intermediate fits in memory freed before.
    assert sum(outputs.values()) <= pool <= own_need + sum(outputs[d] for d in others)
    old = sum(g.created_bytes for g in graphs(mgr))
    assert pool * 8 < old, (pool, old)
    x = torch.randn(100, 64)
    torch.testing.assert_close(mgr.run(x=x), mgr.eager(x=x))


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_after_capture_what_is_held_has_the_values_the_capture_computed(mode):
    # The emulator's capture runs the forward: before any replay, each output
    # (moved into the pool) still holds what its capture computed, and in
    # PIECEWISE graphs each eager piece read real values between segments.
    # (The checked capture keeps each descriptor's sample.)
    if mode == "FULL":
        mgr = emulated(models.MLP(), models.mlp_inputs(), (1, 2, 4, 8), checked_capture=True)
    else:
        mgr = manager(PieceNet(), "emulate", CPU, checked_capture=True)
    mgr.capture()
    for desc in mgr.captured_descriptors:
        sample = mgr.capture_sample(desc)
        reqs = mgr.capture_reqs(desc)
        kwargs = mgr.eager_kwargs(sample, desc.num_tokens)
        with torch.no_grad():
            want = mgr.module(**kwargs)
        assert torch.equal(mgr.graph(desc).output, want), (desc, reqs)


def test_replay_writes_pool_memory_not_what_the_capture_allocated():
    mgr = emulated(models.MLP(), models.mlp_inputs(), (1, 4, 8))
    mgr.capture()
    segments = pool_of(mgr)._pool.segments  # type: ignore[union-attr]
    spans = [(s.storage.data_ptr(), s.storage.data_ptr() + s.size) for s in segments]

    def in_pool(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in spans)

    for graph in graphs(mgr):
        targets = [t for step in graph._steps for _, t in step.targets]
        assert targets and all(in_pool(t) for t in targets)
        assert in_pool(graph.output)


def test_release_drops_the_pool_and_a_new_capture_starts_another():
    mgr = emulated(Doubled(), rows_inputs(), (2, 4))
    mgr.capture()
    first = pool_of(mgr)._pool
    assert first is not None and pool_of(mgr).pool_bytes == 8 * BLOCK
    mgr.release()
    assert pool_of(mgr).pool_bytes == 0
    mgr.capture()
    assert pool_of(mgr)._pool is not first
    assert sum(mgr.graph_memory.values()) == pool_of(mgr).pool_bytes == 8 * BLOCK


# -- (b) what a later replay overwrites, as on CUDA ------------------------------------------
def test_run_views_of_an_earlier_graph_survive_later_graphs_but_not_the_reverse(backend, device):
    # Captured largest first: graph 8 keeps its output, so graph 4 cannot
    # take that memory, but graph 4's output lands in graph 8's dead
    # intermediate h, rows 4..8 of it. A real shared pool does the same.
    mgr = GraphManager(
        Doubled(),
        rows_inputs(device),
        CaptureConfig(capture_sizes=(4, 8), max_num_reqs=8),
        backend=backend,
        device=device,
        output_views=True,
        progress=False,
    )
    mgr.capture()
    x8, x4 = torch.randn(8, ROW, device=device), torch.randn(4, ROW, device=device)
    view8 = mgr.run(x=x8)
    view4 = mgr.run(x=x4)
    mgr.synchronize()
    assert torch.equal(view8, x8 * 2 + 1)  # graph 4's replay left it alone
    assert torch.equal(view4, x4 * 2 + 1)
    x8 = torch.randn(8, ROW, device=device)
    mgr.run(x=x8)
    mgr.synchronize()
    assert torch.equal(view4, x8[4:] * 2)  # graph 8 wrote its h over graph 4's output


@pytest.mark.parametrize("hold", [True, False], ids=["output-held", "output-dropped"])
def test_a_dropped_output_is_memory_the_next_graph_takes(backend, device, hold):
    engine = make_backend(backend, device)
    module = Scaled()
    x = torch.randn(8, ROW, device=device)
    guard = CaptureGuard(ModuleTracker(module), engine.device)

    def capture(n: int) -> Any:
        engine.warmup(lambda: module(x[:n]))
        return engine.capture(lambda: module(x[:n]), guard)

    engine.begin()
    graph8 = capture(8)
    where = graph8.output.data_ptr()
    if not hold:
        graph8.output = None  # nothing holds graph 8's output any more
    graph4 = capture(4)
    assert (graph4.output.data_ptr() == where) is not hold
    graph4.replay()
    before = graph4.output.clone()
    x.copy_(torch.randn(8, ROW, device=device))
    graph8.replay()  # writes x * 2 where its output was
    engine.synchronize()
    if hold:
        assert torch.equal(graph4.output, before)
    else:
        assert torch.equal(graph4.output, x[:4] * 2)
    del graph8, graph4
    engine.release()


@pytest.mark.parametrize("keep_all", [False, True], ids=["stash-rebound", "stash-kept"])
def test_a_tensor_the_module_stored_then_dropped_is_reused_by_the_next_graph(backend, device, keep_all):
    # Graph 8 stores 3 * x on the module; the warm-up of graph 4 rebinds the
    # attribute, and graph 4 captures into the memory it freed: its output
    # is rows 4..8 of graph 8's stash, which graph 8 rewrites on every replay.
    # (The checked capture warms each graph up just before its capture, the
    # order this sequence needs; the fast one warms them all up first.)
    module = Stash(keep_all)
    mgr = GraphManager(
        module,
        rows_inputs(device),
        CaptureConfig(capture_sizes=(4, 8), max_num_reqs=8),
        backend=backend,
        device=device,
        output_views=True,
        progress=False,
        checked_capture=True,
    )
    mgr.capture()
    x4 = torch.randn(4, ROW, device=device)
    view4 = mgr.run(x=x4)
    x8 = torch.randn(8, ROW, device=device)
    mgr.run(x=x8)
    mgr.synchronize()
    if keep_all:
        assert torch.equal(view4, x4 + 1)
    else:
        assert torch.equal(view4, x8[4:] * 3)


# -- (c) replay still equals eager -------------------------------------------------------------
class RingCache(nn.Module):
    """Writes each token's key into a ring buffer and keeps running sums: all in place."""

    def __init__(self, d: int = 16, slots: int = 40) -> None:
        super().__init__()
        self.slots = slots
        self.proj = nn.Linear(d, d)
        self.register_buffer("cache", torch.zeros(slots, d))
        self.register_buffer("pos", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = torch.tanh(self.proj(x))
        idx = (self.pos + torch.arange(x.shape[0], device=x.device)) % self.slots
        self.cache.index_copy_(0, idx, k)
        self.pos.add_(x.shape[0])
        self.total.add_(k.sum(0))
        return k * 2 + self.cache[(idx + 1) % self.slots] + self.total


def test_in_place_buffer_updates_match_eager_through_the_shared_pool():
    module = RingCache()
    mgr = emulated(module, lambda t, r: {"x": torch.randn(t, 16)}, (1, 2, 4, 8, 16))
    mgr.capture()
    assert pool_of(mgr).pool_bytes < sum(g.created_bytes for g in graphs(mgr))
    reference = copy.deepcopy(module)  # the state capture left, for eager to start from
    for n in (4, 16, 1, 8, 4, 2, 16, 1, 8):
        x = torch.randn(n, 16)
        got = mgr.run(x=x)
        with torch.no_grad():
            want = reference(x)
        assert torch.equal(got, want), n
        for name, buf in reference.named_buffers():
            assert torch.equal(module.get_buffer(name), buf), (n, name)


def test_piecewise_segments_share_the_pool_and_match_eager():
    mgr = manager(PieceNet(), "emulate", CPU)
    mgr.capture()
    backend = pool_of(mgr)
    assert sum(mgr.graph_memory.values()) == backend.pool_bytes
    assert backend.pool_bytes < sum(g.created_bytes for g in graphs(mgr))
    for desc in mgr.captured_descriptors:
        graph = mgr.graph(desc)
        assert isinstance(graph, SegmentedGraph) and graph.segments == 3
        reqs = mgr.capture_reqs(desc)
        inputs = piece_inputs(CPU, seed=5)(desc.num_tokens, reqs)
        mgr.load_inputs(desc, inputs, mgr.batch_of(inputs, num_reqs=reqs))
        padded = {k: v.clone() for k, v in mgr.forward_inputs(desc.num_tokens, reqs).items()}
        got = mgr.replay(desc).clone()
        with torch.no_grad():
            assert torch.equal(got, mgr.module(**padded)), desc
    make_inputs = piece_inputs(CPU, seed=9)
    for tokens, reqs in [(8, 4), (1, 1), (5, 3), (8, 4), (3, 2), (2, 2)]:
        inputs = make_inputs(tokens, reqs)
        assert mgr.dispatch(num_reqs=reqs, num_tokens=tokens).mode is GraphMode.PIECEWISE
        torch.testing.assert_close(mgr.run(**inputs), mgr.eager(**inputs), rtol=1e-5, atol=1e-5)


# -- (d) a failed capture leaves the pool fit for the next ------------------------------------
def _capture(engine: Backend, module: nn.Module, fn: Callable[[], Any]) -> Any:
    return engine.capture(fn, CaptureGuard(ModuleTracker(module), engine.device))


def test_a_capture_that_fails_or_is_aborted_leaves_the_pool_as_it_was():
    engine = EmulateBackend(CPU)
    module = Doubled()
    x = torch.randn(8, ROW)
    graph8 = _capture(engine, module, lambda: module(x))
    before = engine.pool_bytes
    assert before == 16 * BLOCK

    def fails() -> torch.Tensor:
        module(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _capture(engine, module, fails)
    opened = engine.open_capture(CaptureGuard(ModuleTracker(module), CPU))
    module(x[:4])
    opened.abort()
    assert engine.pool_bytes == before
    graph4 = _capture(engine, module, lambda: module(x[:4]))
    assert graph4.nbytes == 0  # still fits in graph 8's dead intermediate
    x.copy_(torch.randn(8, ROW))
    graph4.replay()
    assert torch.equal(graph4.output, x[:4] * 2 + 1)
    graph8.replay()
    assert torch.equal(graph8.output, x * 2 + 1)


def test_a_piecewise_capture_that_fails_after_a_segment_ended_leaves_the_pool_consistent():
    engine = EmulateBackend(CPU)
    module = PieceNet().eval()
    make_inputs = piece_inputs(CPU)
    inputs = make_inputs(8, 4)
    pieces = [("blocks.0.mix", module.blocks[0].mix), ("blocks.1.mix", module.blocks[1].mix)]
    guard = CaptureGuard(ModuleTracker(module), CPU)
    desc = manager(PieceNet(), "emulate", CPU).plan.capture_order[0]

    def fails() -> torch.Tensor:
        h = module.inp(inputs["x"])
        h = module.blocks[0](h, inputs["query_start_loc"])  # ends the first segment
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        capture_in_pieces(engine, fails, guard, pieces, desc)
    gc.collect()
    failed = engine.pool_bytes
    assert failed > 0  # the first segment had ended into the pool
    graph = capture_in_pieces(engine, lambda: module(**inputs), guard, pieces, desc)
    fresh = EmulateBackend(CPU)
    capture_in_pieces(fresh, lambda: module(**inputs), guard, pieces, desc)
    # What the failed capture held is free again, and reused.
    assert engine.pool_bytes - failed <= fresh.pool_bytes
    with torch.no_grad():
        want = module(**inputs)
    graph.replay()
    assert torch.equal(graph.output, want)


def test_a_manager_captures_again_after_a_capture_failed():
    class FailsOnce(nn.Module):
        """Fails the first capture of its 2-token graph, after the 4-token graph went into the pool."""

        def __init__(self) -> None:
            super().__init__()
            self.two_token_calls = 0
            self.lin = nn.Linear(ROW, ROW)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if x.shape[0] == 2:
                self.two_token_calls += 1
                if self.two_token_calls == 2:  # its warm-up, then its capture
                    raise RuntimeError("boom")
            return h.relu()

    module = FailsOnce()
    mgr = emulated(module, rows_inputs(), (2, 4))
    with pytest.raises(CaptureError, match="boom"):
        mgr.capture()
    assert not mgr.captured and pool_of(mgr).pool_bytes == 0
    mgr.capture()
    assert sum(mgr.graph_memory.values()) == pool_of(mgr).pool_bytes > 0
    x = torch.randn(3, ROW)
    models.assert_matches_unpadded(mgr.run(x=x), mgr.eager(x=x))


# -- (e) memory: what the pool costs against every capture's own storages ---------------------
_RSS = """
import ctypes, gc, json, os, sys, torch
sys.path.insert(0, {root!r})
from pytest_cudagraph import CaptureConfig, GraphManager
from tests import models

def resident():
    # What is live: glibc keeps freed memory mapped until asked to hand it back.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.manual_seed(0)
sizes = {sizes!r}
mgr = GraphManager(models.MLP(d=64, hidden=2048).eval(), models.mlp_inputs(d=64),
                   CaptureConfig(capture_sizes=sizes, max_num_reqs=8), backend="emulate", progress=False)
mgr.eager(x=torch.randn(sizes[-1], 64))  # eager, at the largest size: the allocator has seen it
import torch._dynamo  # what the first capture imports (tens of MiB of modules) is no graph's memory
gc.collect()
before = resident()
mgr.capture()
grown = resident() - before
graphs = [mgr.graph(d) for d in mgr.captured_descriptors]
print(json.dumps({{"rss_growth": grown, "pool": getattr(mgr.state.backend, "pool_bytes", None),
                   "created": sum(getattr(g, "created_bytes", 0) for g in graphs)}}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_process_memory_grows_with_the_pool_not_with_every_graph(capsys):
    root = str(Path(__file__).resolve().parents[1])
    code = textwrap.dedent(_RSS.format(root=root, sizes=list(SIZES_35)))
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    with capsys.disabled():
        print(
            f"\n35 MLP graphs (d=64, hidden=2048): pool {figures['pool'] / 2**20:.1f} MiB, every capture's "
            f"storages {figures['created'] / 2**20:.1f} MiB, resident set grew {figures['rss_growth'] / 2**20:.1f} MiB"
        )
    assert figures["pool"] * 8 < figures["created"]
    # Capture-time storages are freed once each capture ends: what stays
    # resident is the pool (and allocator slack), not every graph's storages.
    assert figures["rss_growth"] < figures["created"] / 4
