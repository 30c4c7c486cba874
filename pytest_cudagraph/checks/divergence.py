"""Finding the first submodule whose output differs between the graph and eager.

Forward hooks record every submodule's output, in the order forwards finish
(children before their parent). On the graph side a separate capture of the
one descriptor keeps each recorded output alive, so its memory is not reused
inside the graph and holds that submodule's value after a replay.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from itertools import zip_longest
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import _disable_current_modes

from .. import faults, launches
from ..guard.tracker import call_site, user_site
from ..manager import tree
from ..manager.pieces import SegmentedGraph, piece_of
from ..plan import BatchDescriptor
from .compare import first_difference
from .floor import across_shapes, cut_leaf, given

__all__ = [
    "Located",
    "first_differing_call",
    "locate_divergence",
    "parting",
    "recording",
    "where_runs_part",
]

Record = tuple[str, list[torch.Tensor]]


class _Recorder:
    def __init__(self, module: torch.nn.Module, *, clone: bool) -> None:
        self.module = module
        self.clone = clone
        self.records: list[Record] = []

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        handles = []

        def start(_m: Any, _a: Any) -> None:
            self.records = []  # keep only the latest forward

        handles.append(self.module.register_forward_pre_hook(start))
        for name, sub in self.module.named_modules():

            def hook(_m: Any, _a: Any, out: Any, name: str = name) -> None:
                tensors = [t for t in tree.leaves(out) if isinstance(t, torch.Tensor)]
                if self.clone:
                    tensors = [t.detach().clone() for t in tensors]
                self.records.append((name, tensors))

            handles.append(sub.register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


@contextlib.contextmanager
def recording(module: torch.nn.Module) -> Iterator[list[Record]]:
    """Copies of every submodule's tensor outputs of the block's last forward of ``module``, in the
    order forwards finish; the list is filled when the block ends."""
    records: list[Record] = []
    recorder = _Recorder(module, clone=True)
    try:
        with recorder.attached():
            yield records
    finally:
        records.extend(recorder.records)


def first_divergent_submodule(
    module: torch.nn.Module,
    run_expected: Callable[[], Any],
    run_got: Callable[[], Any],
    differs: Callable[[torch.Tensor, torch.Tensor], bool],
) -> str | None:
    """The first submodule of ``module`` (in the order forwards finish) one of whose tensor outputs
    ``differs`` between ``run_got`` and ``run_expected``; the first whose name differs where the two
    runs' structure parts; None where none does. The expected run's outputs are kept on the host
    and the other run's compared as each submodule finishes, so the device holds one pair at a
    time: every submodule output of an 8B model's forward in float64 is about 10 GiB, twice that
    kept on the device made a failing verification's peak twice the hand loop's (issue #67)."""
    expected: list[Record] = []

    def keep(name: str, tensors: list[torch.Tensor]) -> None:
        expected.append((name, [t.detach().to("cpu", copy=True) for t in tensors]))

    with _each_output(module, keep, expected.clear):
        run_expected()
    found: list[str] = []
    index = [0]

    def compare(name: str, tensors: list[torch.Tensor]) -> None:
        if found or index[0] >= len(expected):
            return
        name_e, outs_e = expected[index[0]]
        index[0] += 1
        if name_e != name:
            found.append(name)  # control flow itself differs from here on
            return
        for got, e in zip(tensors, outs_e, strict=False):
            if differs(got.detach(), e.to(got.device)):
                found.append(name)
                return

    def reset() -> None:
        found.clear()
        index[0] = 0

    with _each_output(module, compare, reset):
        run_got()
    return found[0] if found else None


@contextlib.contextmanager
def _each_output(
    module: torch.nn.Module, seen: Callable[[str, list[torch.Tensor]], None], reset: Callable[[], None]
) -> Iterator[None]:
    """``seen(name, tensors)`` as each submodule's forward finishes, outside every dispatch mode (the
    float64 reference's is active around the forward); ``reset()`` when ``module``'s forward starts
    (only the block's last forward counts)."""
    handles = []

    def start(_m: Any, _a: Any) -> None:
        reset()

    def hook(_m: Any, _a: Any, out: Any, name: str) -> None:
        with _disable_current_modes():
            seen(name, [t for t in tree.leaves(out) if isinstance(t, torch.Tensor)])

    handles.append(module.register_forward_pre_hook(start))
    for name, sub in module.named_modules():
        handles.append(sub.register_forward_hook(partial(hook, name=name)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class Located(str):
    """A submodule's dotted path ("" = the top-level module), with ``branch``: where the graph's program
    and eager's part, when that was looked for ("" looked for and not found, None not looked for)."""

    branch: str | None = None


# (the function called, "path:line in function" of the call: the first frame outside torch and this
# package, a library's line where a library called it; the user's own frame that led there)
Site = tuple[str, str, str]


class _OpSites(TorchFunctionMode):
    """Every torch function a forward of ``module`` calls, with its call site (``call_site``) and the
    user's own frame that led there (``user_site``); with no module, every call in the block. Calls
    made inside a torch function are not seen (the mode is off there), nor those the harness makes
    around the forward (cutting its output to the real rows)."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.sites: list[Site] = []
        self.module = module
        self._inside = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if self._inside or self.module is None:
            name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
            self.sites.append((str(name), call_site(), user_site()))
        return func(*args, **(kwargs or {}))

    def _step(self, by: int) -> None:
        self._inside += by

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        if self.module is None:
            with self:
                yield
            return
        enter = self.module.register_forward_pre_hook(lambda _m, _a: self._step(1))
        leave = self.module.register_forward_hook(lambda _m, _a, _o: self._step(-1))
        try:
            with self:
                yield
        finally:
            enter.remove()
            leave.remove()


def parting(
    graph: Sequence[tuple[str, ...]],
    eager: Sequence[tuple[str, ...]],
    sides: tuple[str, str] = ("the graph", "eager on the real batch"),
) -> str:
    """Where two runs' sequences of calls first differ, in words ("" when they do not). The branch
    that parts them lies after their last common call and before the first that differs. A call
    site inside a library is given with the user's own frame that led there (``Site``'s third part,
    where given)."""
    for i, (g, e) in enumerate(zip_longest(graph, eager)):
        if g is not None and e is not None and g[:2] == e[:2]:
            continue
        last = graph[i - 1] if i > 0 else None
        after = (
            f"; the branch that decides lies after their last common call, {last[0]} at "
            f"{_reached(last[1], _user(last))}, and before"
            if last is not None
            else "; the branch that decides lies before"
        )
        if g is not None and e is not None:
            return (
                f"the two runs part at call {i + 1} of the forward: {sides[0]} calls {g[0]} at "
                f"{_reached(g[1], _user(g))}, {sides[1]} calls {e[0]} at {_reached(e[1], _user(e))}"
                f"{after} these lines"
            )
        extra, other = sides if g is not None else (sides[1], sides[0])
        site = g if g is not None else e
        assert site is not None
        return (
            f"the two runs part at call {i + 1} of the forward: {extra} calls {site[0]} at "
            f"{_reached(site[1], _user(site))} where {other} has finished{after} that line (a branch or a loop)"
        )
    return ""


def _user(site: tuple[str, ...]) -> str:
    return site[2] if len(site) > 2 else ""


def where_runs_part(
    first: Callable[[], Any],
    second: Callable[[], Any],
    sides: tuple[str, str] = ("the graph", "eager on the real batch"),
    module: torch.nn.Module | None = None,
) -> str:
    """Run ``first`` then ``second`` (the caller restores state between them if it must), recording
    every torch function each calls with its call site (in ``module``'s forward, where given), and
    say where the two first call something else or from another line ("" when nowhere: then no
    Python branch parts them)."""
    one, two = _OpSites(module), _OpSites(module)
    with one.attached():
        first()
    with two.attached():
        second()
    return parting(one.sites, two.sites, sides)


class _OwnCalls(TorchFunctionMode):
    """The torch functions (and Triton launches) that the modules of ``chain`` (a submodule and its
    ancestors) call in their own code, not inside a child, during one forward: each with its call
    site, the user's frame that led there, and copies of the tensors it returned (a Triton kernel:
    of the tensors it was handed, which it writes). What the harness calls around the forward
    (cutting an output to its rows) is not the forward's and is left out."""

    def __init__(self, module: torch.nn.Module, chain: frozenset[str]) -> None:
        super().__init__()
        self.module, self.chain = module, chain
        self.calls: list[tuple[str, str, str, list[torch.Tensor], str]] = []
        self._stack: list[str] = []
        self._launching = 0

    def _enter(self, name: str, _m: Any, _a: Any) -> None:
        self._stack.append(name)

    def _watching(self) -> bool:
        """Whether the call now made belongs to the watched code: inside the forward (not the harness's
        work around it), in the own code of a module of the chain."""
        return bool(self._stack) and self._stack[-1] in self.chain and not self._launching

    def _add(self, name: str, out: Any, *, launch: bool = False) -> None:
        tensors = [t.detach().clone() for t in tree.leaves(out) if isinstance(t, torch.Tensor)]
        self.calls.append((name, call_site(launch=launch), user_site(), tensors, self._stack[-1]))

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._watching():
            self._add(str(resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)), out)
        return out

    @contextlib.contextmanager
    def _launched(self, launch: launches.Launch) -> Iterator[None]:
        # What runs on the way (Triton's own argument handling, the reference running it on raised
        # tensors) is the launch's, not calls of the forward: the launch is one call, and its tensors
        # after it are what it wrote.
        watching = self._watching()
        self._launching += 1
        try:
            yield
            if watching:  # still launching: the copies it makes are no calls of the forward either
                self._add(f"Triton kernel {launch.name}", launch.tensors, launch=True)
        finally:
            self._launching -= 1

    @contextlib.contextmanager
    def attached(self) -> Iterator[list[tuple[str, str, str, list[torch.Tensor], str]]]:
        handles = []

        def leave(_m: Any, _a: Any, _o: Any) -> None:  # a hook that returned a value would replace the output
            self._stack.pop()

        for name, sub in self.module.named_modules():
            handles.append(sub.register_forward_pre_hook(functools.partial(self._enter, name)))
            handles.append(sub.register_forward_hook(leave))
        try:
            with launches.watching_launches(self._launched), self:
                yield self.calls
        finally:
            for h in handles:
                h.remove()


def _owner(path: str) -> str:
    return f"submodule '{path}'" if path else "the top-level module"


def _reached(site: str, user: str) -> str:
    """A call site, with the user's own frame that led there where the site is a library's."""
    if not site:
        return f"a line not known{f', reached from {user}' if user else ''}"
    return f"{site}, reached from {user}" if user and user != site else site


def first_differing_call(
    module: torch.nn.Module,
    submodule: str,
    first: Callable[[], Any],
    second: Callable[[], Any],
    differs: Callable[[torch.Tensor, torch.Tensor], bool],
) -> str | None:
    """Where the values of two runs first differ: the first call made in ``submodule``'s own code or
    its ancestors' (what runs before a child whose output differs, a kernel launch among it), matched
    between the runs by name and call site, whose results ``differs`` (the first run's cut to the
    second's shape, against the second's). Said as the call and its line, with the user's frame
    that led there where the line is inside a library; None where no call's results differ."""
    parts = submodule.split(".") if submodule else []
    chain = frozenset(["", *(".".join(parts[: i + 1]) for i in range(len(parts)))])
    records = []
    for run in (first, second):
        calls = _OwnCalls(module, chain)
        with calls.attached():
            run()
        records.append(calls.calls)
    one, two = records
    matcher = difflib.SequenceMatcher(None, [c[:2] for c in one], [c[:2] for c in two], autojunk=False)
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            name, site, user, outs, owner = one[block.a + i]
            theirs = two[block.b + i][3]
            for a, b in zip(outs, theirs, strict=False):
                cut = cut_leaf(a, b.shape)
                if cut is None or not (b.is_floating_point() or b.is_complex()) or not differs(cut, b):
                    continue
                return f"{name} at {_reached(site, user)}, in {_owner(owner)}"
    return None


def _branch(
    ctx: Any,
    padded: Mapping[str, Any],
    desc: BatchDescriptor,
    inputs: Mapping[str, Any],
    batch: Any,
    state0: Any,
) -> str:
    """Where the graph's program (eager at its padded shape, on the capture path) and eager on the real
    batch (as ``real_batches`` runs it) first call something else, or from another line."""

    def graph() -> None:
        ctx.restore(state0)
        ctx.eager(padded, desc)

    def eager() -> None:
        ctx.restore(state0)
        ctx.eager_real(inputs, batch, captured_path=False)

    return where_runs_part(
        graph, eager, ("the graph (eager at its padded shape)", "eager on the real batch"), ctx.module
    )


def _rows_ndim(graph: torch.Tensor, eager: torch.Tensor) -> int:
    """The leading dimensions that make rows: up to the last one padding changed."""
    cut = [d for d, (g, e) in enumerate(zip(graph.shape, eager.shape, strict=False)) if g != e]
    return cut[-1] + 1 if cut else 1


def _first_divergent(
    graph: list[Record],
    eager: list[Record],
    *,
    rtol: float | None,
    atol: float | None,
    padded: list[Record] | None = None,
    roundoff: float = 0.0,
) -> int | None:
    """Index in ``graph`` of the first record that differs from eager's: bit for bit
    or within tolerance, or, given ``padded`` (eager at the graph's shape), held to
    the floor across shapes as ``real_batches`` holds the outputs."""
    for i, ((g_name, g_out), (e_name, e_out)) in enumerate(zip(graph, eager, strict=False)):
        if g_name != e_name:
            return i  # control flow itself differs from here on
        p_out = padded[i][1] if padded is not None and i < len(padded) and padded[i][0] == g_name else None
        for k, (g, e) in enumerate(zip(g_out, e_out, strict=False)):
            cut = cut_leaf(g, e.shape)
            if cut is None:
                continue
            if padded is None:
                if first_difference(cut, e, rtol=rtol, atol=atol) is not None:
                    return i
                continue
            p = cut_leaf(p_out[k], e.shape) if p_out is not None and k < len(p_out) else None
            verdict = across_shapes(
                cut,
                e,
                given(p) if p is not None else None,
                rtol=rtol,
                atol=atol,
                roundoff=roundoff,
                rows_ndim=[_rows_ndim(g, e)],
            )
            if not verdict.passed:
                return i
    return None


def _segment_of(records: list[Record], index: int, pieces: list[str], segments: int) -> str:
    """Which part of a PIECEWISE graph record ``index`` ran in.

    Records come in the order forwards finish: a piece's submodules, then the
    piece, after which the next graph segment begins. A module that holds a
    piece (a layer around its attention) finishes in a later segment.
    """
    segment = 1
    for i, (name, _) in enumerate(records):
        piece = piece_of(name, pieces)
        if i == index:
            return f"eager piece '{piece}'" if piece is not None else f"graph segment {segment} of {segments}"
        if piece is not None and name == piece:
            segment += 1
    return f"graph segment {segment} of {segments}"


def locate_divergence(
    ctx: Any,
    desc: BatchDescriptor,
    inputs: Mapping[str, Any],
    batch: Any,
    *,
    against_real: bool,
) -> tuple[Located | None, str | None]:
    """The first submodule whose graph output differs from eager, or None, and
    for a graph captured in pieces, the segment or eager piece it ran in.

    ``against_real``: compare with eager on the unpadded batch (real rows,
    within tolerance); else with eager on the same padded inputs, bit for bit.
    Against the real batch, where the first divergent place is the top-level
    module (no submodule narrows it) or the two runs finish other submodules,
    the submodule's ``branch`` says where their calls first differ: the line
    of a branch on the batch's shape (or on whether it is captured).
    """
    manager = ctx.manager
    module = manager.module
    with ctx.preserved_state() as state0:
        diag = manager.sibling()
        graph_rec = _Recorder(module, clone=False)
        try:
            with graph_rec.attached():
                diag.capture([desc])
            held = graph_rec.records
            ctx.restore(state0)
            diag.load_inputs(desc, inputs, batch)
            padded = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in diag.forward_inputs(desc.num_tokens, diag.capture_reqs(desc)).items()
            }
            diag.replay(desc)
            diag.synchronize()
            graph = [(name, [t.detach().clone() for t in ts]) for name, ts in held]
            captured = diag.graph(desc)
            pieces = captured.pieces if isinstance(captured, SegmentedGraph) else []
            segments = captured.segments if isinstance(captured, SegmentedGraph) else 1
        finally:
            diag.release()
        ctx.restore(state0)
        eager_rec = _Recorder(module, clone=True)
        with eager_rec.attached():
            if against_real:
                ctx.eager_real(inputs, batch, captured_path=False)  # as real_batches compares
            else:
                ctx.eager(padded, desc)
        eager = eager_rec.records
        padded_records: list[Record] | None = None
        if against_real:
            # The floor of each submodule: eager on the graph's padded inputs, its program.
            ctx.restore(state0)
            padded_rec = _Recorder(module, clone=True)
            with padded_rec.attached():
                ctx.eager(padded, desc)
            padded_records = padded_rec.records
        if pieces:
            # Inside an eager piece only its result is bridged into the graph
            # on replay; its submodules' capture-time outputs are stale. Keep
            # records outside every piece, and each piece's own.
            graph = [r for r in graph if piece_of(r[0], pieces) in (None, r[0])]
            eager = [r for r in eager if piece_of(r[0], pieces) in (None, r[0])]
            if padded_records is not None:
                padded_records = [r for r in padded_records if piece_of(r[0], pieces) in (None, r[0])]
        if against_real:
            index = _first_divergent(
                graph, eager, rtol=ctx.rtol, atol=ctx.atol, padded=padded_records, roundoff=ctx.roundoff
            )
        else:
            index = _first_divergent(graph, eager, rtol=0.0, atol=0.0)
        if index is None:
            return None, None
        segment = _segment_of(graph, index, pieces, segments) if pieces else None
        located = Located(graph[index][0])
        if against_real and (located == "" or index >= len(eager) or eager[index][0] != located):
            try:
                located.branch = _branch(ctx, padded, desc, inputs, batch, state0)
            except Exception as exc:
                if faults.is_sticky(exc):
                    raise  # the process's CUDA context is gone: verify tells it
                located.branch = None  # not found out: the report claims no line, nor that there is none
            ctx.restore(state0)
        return located, segment
