"""PIECEWISE graphs captured in pieces around eager submodules, on both backends."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from pytest_cudagraph import CaptureConfig, CaptureError, GraphManager, GraphMode, verify
from pytest_cudagraph.manager.pieces import SegmentedGraph, resolve_eager_submodules

D = 16
SIZES = (1, 2, 4, 8)


class HostPlannedMix(nn.Module):
    """Averages each token with the earlier tokens of its request, planned on the host.

    ``query_start_loc.tolist()`` is what a graph cannot hold: the plan changes
    with every batch. Padded tokens (past the last request) pass through.
    """

    def forward(self, h: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        out = h.clone()
        bounds = query_start_loc.tolist()
        for start, end in itertools.pairwise(bounds):
            if end > start:
                steps = torch.arange(1, end - start + 1, device=h.device, dtype=h.dtype)[:, None]
                out[start:end] = h[start:end].cumsum(0) / steps
        return out


class DeviceMix(nn.Module):
    """The same mixing as one capturable expression (a graph can hold it)."""

    def forward(self, h: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        idx = torch.arange(t, device=h.device)
        req = torch.searchsorted(query_start_loc[1:], idx, right=True)
        start = query_start_loc[req.clamp(max=query_start_loc.shape[0] - 2)]
        real = idx < query_start_loc[-1]
        same = (start[:, None] == start[None, :]) & (idx[None, :] <= idx[:, None]) & real[:, None]
        weights = same.to(h.dtype) / same.sum(1, keepdim=True).clamp(min=1).to(h.dtype)
        mixed = weights @ h
        return torch.where(real[:, None], mixed, h)


class Block(nn.Module):
    def __init__(self, mix: type[nn.Module]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mix = mix()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, h: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        h = h + self.mix(self.norm(h), query_start_loc)
        return h + self.mlp(h)


class PieceNet(nn.Module):
    def __init__(self, mix: type[nn.Module] = HostPlannedMix, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(mix) for _ in range(layers))
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, query_start_loc)
        return self.out(h)


def piece_inputs(device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        sizes = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(torch.tensor(sizes), 0)
        return {"x": torch.randn(num_tokens, D, generator=gen).to(device), "query_start_loc": qsl.to(device)}

    return make_inputs


def manager(module, backend, device, mode="PIECEWISE", eager=(HostPlannedMix,), **kw):
    torch.manual_seed(0)
    return GraphManager(
        module.to(device).eval(),
        piece_inputs(device),
        CaptureConfig(capture_sizes=SIZES, max_num_reqs=4, mode=mode),
        backend=backend,
        device=device,
        pad_values={"query_start_loc": "edge"},
        eager_submodules=eager,
        **kw,
    )


def test_piecewise_replay_is_bit_identical_to_eager_in_pieces(backend, device):
    mgr = manager(PieceNet(), backend, device)
    mgr.capture()
    assert set(mgr.captured_descriptors) == set(mgr.plan.descriptors)
    for desc in mgr.captured_descriptors:
        graph = mgr.graph(desc)
        assert isinstance(graph, SegmentedGraph)
        assert graph.segments == 3 and graph.pieces == ["blocks.0.mix", "blocks.1.mix"]
        # On the inputs the graph holds: graph and eager agree bit for bit.
        for seed in range(2):
            reqs = mgr.capture_reqs(desc)
            inputs = piece_inputs(device, seed=seed + 1)(desc.num_tokens, reqs)
            mgr.load_inputs(desc, inputs, mgr.batch_of(inputs, num_reqs=reqs))
            padded = {k: v.clone() for k, v in mgr.forward_inputs(desc.num_tokens, reqs).items()}
            got = mgr.replay(desc).clone()
            with torch.no_grad():
                assert torch.equal(got, mgr.module(**padded)), desc
    # Real batches, padded up to the graph: the eager pieces plan on the real
    # requests, and the real rows match eager on the unpadded batch.
    make_inputs = piece_inputs(device, seed=7)
    for tokens, reqs in [(1, 1), (3, 2), (5, 3), (7, 4), (8, 4)]:
        inputs = make_inputs(tokens, reqs)
        assert mgr.dispatch(num_reqs=reqs, num_tokens=tokens).mode is GraphMode.PIECEWISE
        torch.testing.assert_close(mgr.run(**inputs), mgr.eager(**inputs), rtol=1e-5, atol=1e-5)


def test_an_eager_piece_at_the_start_or_twice_in_a_row_leaves_empty_segments(backend, device):
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = HostPlannedMix()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
            x = self.mix(x, query_start_loc)  # first thing: an empty first segment
            x = self.mix(x, query_start_loc)  # again at once: an empty second one
            return self.lin(x)

    mgr = manager(Twice(), backend, device, eager="mix")
    mgr.capture()
    graph = mgr.graph(mgr.plan.capture_order[0])
    assert isinstance(graph, SegmentedGraph) and graph.segments == 3 and graph.pieces == ["mix", "mix"]
    inputs = piece_inputs(device, seed=3)(6, 3)
    torch.testing.assert_close(mgr.run(**inputs), mgr.eager(**inputs), rtol=1e-5, atol=1e-5)


def test_a_piece_returning_a_new_tensor_feeds_the_next_segment(backend, device):
    # The piece allocates its result on every call; the next segment reads the
    # tensor it returned at capture, which each replay refills.
    mgr = manager(PieceNet(layers=1), backend, device)
    mgr.capture()
    make_inputs = piece_inputs(device, seed=11)
    first = make_inputs(8, 4)
    second = make_inputs(8, 4)
    a = mgr.run(**first)
    b = mgr.run(**second)
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, mgr.eager(**first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, mgr.eager(**second), rtol=1e-5, atol=1e-5)


def test_an_uncapturable_op_outside_the_pieces_is_reported(backend, device):
    class Leaky(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h * float(h.abs().max())  # a host sync in what should be graph

    module = PieceNet(layers=1)
    module.blocks[0].mlp.append(Leaky())
    mgr = manager(module, backend, device)
    with pytest.raises(CaptureError) as info:
        mgr.capture()
    err = info.value
    assert err.module_path == "blocks.0.mlp.3" and "float(tensor)" in str(err)
    assert err.descriptor.mode is GraphMode.PIECEWISE
    assert not mgr.captured
    # Usable afterwards: eager until a capture succeeds.
    inputs = piece_inputs(device)(3, 2)
    assert torch.equal(mgr.run(**inputs), mgr.eager(**inputs))


def test_full_graphs_capture_whole_and_name_a_piece_they_cannot_hold(backend, device):
    # A capturable piece: FULL graphs hold it, PIECEWISE graphs run it eagerly.
    mgr = manager(PieceNet(mix=DeviceMix), backend, device, mode="FULL_AND_PIECEWISE", eager=[DeviceMix])
    mgr.capture()
    kinds = {d.mode: type(mgr.graph(d)) for d in mgr.captured_descriptors}
    assert kinds[GraphMode.PIECEWISE] is SegmentedGraph and kinds[GraphMode.FULL] is not SegmentedGraph
    for tokens, reqs in [(4, 4), (6, 2)]:  # a uniform decode batch (FULL) and a mixed one (PIECEWISE)
        inputs = piece_inputs(device, seed=5)(tokens, reqs)
        torch.testing.assert_close(mgr.run(**inputs), mgr.eager(**inputs), rtol=1e-5, atol=1e-5)
    # A piece only an eager run can do: a FULL graph must say so.
    mgr = manager(PieceNet(), backend, device, mode="FULL_AND_PIECEWISE")
    with pytest.raises(
        CaptureError,
        match=r"'blocks.0.mix' is an eager piece, but only PIECEWISE graphs run it "
        r"eagerly",
    ) as info:
        mgr.capture()
    assert info.value.descriptor.mode is GraphMode.FULL and "Tensor.tolist()" in str(info.value)


def test_verify_checks_piecewise_graphs_and_names_the_segment(backend, device):
    report = verify(
        PieceNet().to(device),
        piece_inputs(device),
        capture_sizes=SIZES,
        max_num_reqs=4,
        mode="PIECEWISE",
        backend=backend,
        device=device,
        pad_values={"query_start_loc": "edge"},
        eager_submodules=[HostPlannedMix],
    )
    assert report.ok, report.format()

    class Memo(nn.Module):
        """Memoises its feature by the identity of its input: warm-up and
        capture see the same static view, so the feature is frozen."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self._last: torch.Tensor | None = None
            self._feature: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x is not self._last:
                self._feature, self._last = torch.tanh(x), x
            assert self._feature is not None
            return self.lin(self._feature)

    module = PieceNet()
    module.inp = Memo()
    module.to(device)
    report = verify(
        module,
        piece_inputs(device),
        capture_sizes=(4,),
        max_num_reqs=4,
        mode="PIECEWISE",
        backend=backend,
        device=device,
        pad_values={"query_start_loc": "edge"},
        eager_submodules=[HostPlannedMix],
        checks=["fresh_inputs"],
    )
    assert not report.ok
    finding = report.failures[0].finding
    assert finding.submodule == "inp.lin"
    assert finding.segment == "graph segment 1 of 3"
    assert "first divergent submodule: 'inp.lin'; in graph segment 1 of 3" in report.format()


def test_eager_submodules_are_named_by_type_name_or_predicate():
    module = PieceNet()
    by_type = resolve_eager_submodules(module, HostPlannedMix)
    assert [n for n, _ in by_type] == ["blocks.0.mix", "blocks.1.mix"]
    assert [n for n, _ in resolve_eager_submodules(module, ["blocks.1.mix"])] == ["blocks.1.mix"]
    assert [n for n, _ in resolve_eager_submodules(module, lambda name, m: name.endswith("mix"))] == [
        "blocks.0.mix",
        "blocks.1.mix",
    ]
    # A piece inside a piece runs eagerly with it: only the outer one cuts.
    assert [n for n, _ in resolve_eager_submodules(module, ["blocks.0", "blocks.0.mix"])] == ["blocks.0"]
    assert resolve_eager_submodules(module, None) == []
    with pytest.raises(
        ValueError, match=r"names 'blocks.2.mix', which is not a submodule; the submodules are"
    ):
        resolve_eager_submodules(module, ["blocks.2.mix"])
    with pytest.raises(ValueError, match="names type\\(s\\) DeviceMix, but no submodule of PieceNet is one"):
        resolve_eager_submodules(module, DeviceMix)
    with pytest.raises(ValueError, match=r"type int is not an nn\.Module subclass"):
        resolve_eager_submodules(module, [int])
    with pytest.raises(ValueError, match="predicate must return a bool"):
        resolve_eager_submodules(module, lambda name, m: name)
    with pytest.raises(ValueError, match="entries must be module types or dotted names; got 3"):
        resolve_eager_submodules(module, [3])
    with pytest.raises(ValueError, match="must be a module type, a dotted submodule name"):
        resolve_eager_submodules(module, 3)  # type: ignore[arg-type]


class Gate(nn.Module):
    """Returns its input (a view of it when ``view``): the result aliases graph memory."""

    def __init__(self, view: bool = False) -> None:
        super().__init__()
        self.view = view

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, :] if self.view else h


class Gated(nn.Module):
    def __init__(self, view: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gate = Gate(view)

    def forward(self, x: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + self.gate(h)


@pytest.mark.parametrize("view", [False, True])
def test_a_piece_returning_its_own_input_gets_a_bridge_of_its_own(backend, device, view):
    # Copying the next result into the piece's input would overwrite h, which
    # the next segment also reads: the piece's result is copied out instead.
    mgr = manager(Gated(view), backend, device, eager=[Gate])
    mgr.capture()
    for seed in range(3):
        inputs = piece_inputs(device, seed=seed)(5, 2)
        torch.testing.assert_close(mgr.run(**inputs), mgr.eager(**inputs), rtol=1e-5, atol=1e-5)


def test_a_piece_calling_another_piece_runs_it_inside(backend, device):
    class Outer(nn.Module):
        def forward(self, h: torch.Tensor, mix: nn.Module, qsl: torch.Tensor) -> torch.Tensor:
            return mix(h, qsl) * 2

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.outer = Outer()
            self.mix = HostPlannedMix()

        def forward(self, x: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
            return self.lin(self.outer(self.lin(x), self.mix, query_start_loc))

    mgr = manager(Net(), backend, device, eager=["outer", "mix"])
    mgr.capture()
    graph = mgr.graph(mgr.plan.capture_order[0])
    assert isinstance(graph, SegmentedGraph) and graph.pieces == ["outer"]
    inputs = piece_inputs(device, seed=4)(7, 3)
    torch.testing.assert_close(mgr.run(**inputs), mgr.eager(**inputs), rtol=1e-5, atol=1e-5)


def test_a_failing_piece_is_named_at_capture_and_on_replay(backend, device):
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fail = False

        def forward(self, h: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise RuntimeError("planner out of memory")
            return h * 2

    module = PieceNet(mix=Flaky, layers=1)
    mgr = manager(module, backend, device, eager=[Flaky])
    module.blocks[0].mix.fail = True
    with pytest.raises(CaptureError, match="planner out of memory") as info:
        mgr.capture()
    assert info.value.module_path == "blocks.0.mix"
    module.blocks[0].mix.fail = False
    mgr.capture()
    module.blocks[0].mix.fail = True
    from pytest_cudagraph.manager.pieces import EagerPieceError

    with pytest.raises(EagerPieceError, match=r"eager piece 'blocks\.0\.mix' failed on replay: RuntimeError"):
        mgr.run(**piece_inputs(device)(3, 2))


def test_a_non_tensor_result_that_changes_is_an_error(backend, device):
    class Counts(nn.Module):
        def forward(self, h: torch.Tensor, query_start_loc: torch.Tensor):
            return h + 1, int(query_start_loc[-1])  # a host value, frozen in the next segment

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.counts = Counts()

        def forward(self, x: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
            h, n = self.counts(self.lin(x), query_start_loc)
            return h * n

    mgr = manager(Net(), backend, device, eager=[Counts])
    mgr.capture()
    from pytest_cudagraph.manager.pieces import EagerPieceError

    with pytest.raises(EagerPieceError, match="returned 3 on replay where it returned 4 at capture"):
        mgr.run(**piece_inputs(device)(3, 2))


def test_a_replaced_submodule_is_found_at_the_next_capture(backend, device):
    module = PieceNet(layers=1)
    mgr = manager(module, backend, device, eager=[HostPlannedMix])
    module.blocks[0].mix = HostPlannedMix()  # after the manager was made
    mgr.capture()
    graph = mgr.graph(mgr.plan.capture_order[0])
    assert isinstance(graph, SegmentedGraph) and graph.pieces == ["blocks.0.mix"]
    inputs = piece_inputs(device)(5, 2)
    torch.testing.assert_close(mgr.run(**inputs), mgr.eager(**inputs), rtol=1e-5, atol=1e-5)


def test_a_module_instance_is_not_a_predicate():
    module = PieceNet()
    with pytest.raises(
        ValueError, match=r"got a module instance \(HostPlannedMix\); pass its name \('blocks.0.mix'\)"
    ):
        resolve_eager_submodules(module, module.blocks[0].mix)
    with pytest.raises(ValueError, match="got a module instance"):
        resolve_eager_submodules(module, [module.blocks[0].mix])


def test_verify_named_descriptors_are_verified_whatever_the_quick_selection(backend, device):
    kw = {
        "capture_sizes": SIZES,
        "max_num_reqs": 4,
        "backend": backend,
        "device": device,
        "exhaustive": False,
        "pad_values": {"query_start_loc": "edge"},
    }
    report = verify(PieceNet(mix=DeviceMix).to(device), piece_inputs(device), descriptors="FULL-T2-R2", **kw)
    assert [d.label() for d in report.descriptors] == ["FULL-T2-R2"] and report.ok and report.outcomes
    with pytest.raises(ValueError, match=r"descriptors \['FULL-T3-R3'\] are not in the plan"):
        verify(PieceNet(mix=DeviceMix).to(device), piece_inputs(device), descriptors=["FULL-T3-R3"], **kw)
    # The plan's first descriptor carries the plan-wide dispatch check.
    kw["exhaustive"] = True
    first = verify(PieceNet(mix=DeviceMix).to(device), piece_inputs(device), descriptors=["FULL-T8-R4"], **kw)
    (dispatch,) = [o for o in first.outcomes if o.check == "dispatch"]
    assert dispatch.passed and not dispatch.skipped
    other = verify(PieceNet(mix=DeviceMix).to(device), piece_inputs(device), descriptors=["FULL-T1-R1"], **kw)
    (dispatch,) = [o for o in other.outcomes if o.check == "dispatch"]
    assert dispatch.skipped and "in the item of the plan's first descriptor" in dispatch.message
