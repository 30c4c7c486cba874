"""PIECEWISE graphs: a forward captured as graph segments around eager submodules.

Engines capture attention (per-batch metadata, host-side planners) and other
pieces that a graph cannot hold outside the graph, and the rest of the model
as graphs between them. Here the pieces are submodules: while a PIECEWISE
descriptor is captured, a forward pre-hook on each eager submodule ends the
graph segment being recorded, the submodule runs eagerly, and a forward hook
records the call and opens the next segment. Replay runs the segments and the
recorded eager calls in turn.

An eager piece reads its inputs where the previous segment wrote them (graph
memory, fixed addresses) and its result must land where the next segment
reads it: the tensors it returned at capture (the "bridges") are kept alive,
and each replay copies the piece's new result into them.

On CUDA a capture runs nothing, so each segment is replayed as soon as it is
recorded: the eager piece that follows then reads real values (indices in
range, say) rather than uninitialised memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..backends.base import Backend, CapturedGraph, OpenCapture
from ..backends.guard import CaptureGuard
from ..context import running
from ..plan import BatchDescriptor

__all__ = ["EagerCall", "EagerSpec", "SegmentedGraph", "capture_in_pieces", "resolve_eager_submodules"]

#: What ``eager_submodules`` accepts: module types, dotted names, or a
#: predicate ``(name, module) -> bool``.
EagerSpec = type | str | Iterable[type | str] | Callable[[str, torch.nn.Module], bool] | None


def resolve_eager_submodules(module: torch.nn.Module, spec: EagerSpec) -> list[tuple[str, torch.nn.Module]]:
    """The submodules ``spec`` names, outermost only, in module order.

    A piece inside another piece already runs eagerly with it, so only the
    outer one cuts the graph. The root module cannot be a piece: there would
    be no graph left.
    """
    if spec is None:
        return []
    named = [(n, m) for n, m in module.named_modules() if n]
    if isinstance(spec, (type, str)):
        spec = [spec]
    if callable(spec) and not isinstance(spec, type):
        predicate = spec
        chosen = []
        for name, sub in named:
            verdict = predicate(name, sub)
            if not isinstance(verdict, bool):
                raise ValueError(
                    f"eager_submodules predicate must return a bool for (name, module); "
                    f"got {verdict!r} for {name!r}"
                )
            if verdict:
                chosen.append((name, sub))
    else:
        try:
            items = list(spec)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                "eager_submodules must be a module type, a dotted submodule name, a list of those, "
                f"or a predicate (name, module) -> bool; got {type(spec).__name__}"
            ) from None
        names = {n for n, _ in named}
        types: list[type] = []
        wanted: set[str] = set()
        for item in items:
            if isinstance(item, type):
                if not issubclass(item, torch.nn.Module):
                    raise ValueError(f"eager_submodules type {item.__name__} is not an nn.Module subclass")
                types.append(item)
            elif isinstance(item, str):
                if item not in names:
                    shown = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
                    raise ValueError(f"eager_submodules names {item!r}, which is not a submodule; "
                                     f"the submodules are: {shown}")
                wanted.add(item)
            else:
                raise ValueError(
                    f"eager_submodules entries must be module types or dotted names; got {item!r}"
                )
        chosen = [(n, m) for n, m in named if n in wanted or isinstance(m, tuple(types))]
        if types and not any(isinstance(m, tuple(types)) for _, m in named):
            raise ValueError(
                f"eager_submodules names type(s) {', '.join(t.__name__ for t in types)}, "
                f"but no submodule of {type(module).__name__} is one"
            )
    outer: list[tuple[str, torch.nn.Module]] = []
    for name, sub in chosen:
        if not any(name.startswith(o + ".") for o, _ in outer):
            outer.append((name, sub))
    return outer


class EagerCall:
    """One eager piece as captured: its call, and the tensors its result goes into."""

    def __init__(self, path: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
        self.path = path
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.output = output
        self.bridges = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]

    def __call__(self) -> None:
        result = self.module(*self.args, **self.kwargs)
        fresh = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if len(fresh) != len(self.bridges):
            raise RuntimeError(
                f"eager piece '{self.path}' returned {len(fresh)} tensor(s) on replay but {len(self.bridges)} "
                "at capture: the next graph segment reads them at fixed addresses, so an eager piece must "
                "return the same structure every time"
            )
        for bridge, new in zip(self.bridges, fresh, strict=True):
            if new.shape != bridge.shape or new.dtype != bridge.dtype:
                raise RuntimeError(
                    f"eager piece '{self.path}' returned a {new.dtype} tensor of shape {tuple(new.shape)} on "
                    f"replay but {bridge.dtype} {tuple(bridge.shape)} at capture: an eager piece must return "
                    "the same shapes for the same descriptor"
                )
            if new.data_ptr() != bridge.data_ptr():
                bridge.copy_(new)


class SegmentedGraph(CapturedGraph):
    """Graph segments with eager calls between them; replay runs them in order."""

    def __init__(self, steps: list[CapturedGraph | EagerCall], output: Any, desc: BatchDescriptor) -> None:
        self.steps = steps
        self.output = output
        self.desc = desc
        graphs = [s for s in steps if isinstance(s, CapturedGraph)]
        self.nbytes = sum(g.nbytes for g in graphs)
        self.device_bytes = sum(g.device_bytes for g in graphs)

    @property
    def segments(self) -> int:
        """How many graph segments the forward was captured as."""
        return sum(isinstance(s, CapturedGraph) for s in self.steps)

    @property
    def pieces(self) -> list[str]:
        """The eager pieces between them, by submodule path, in call order."""
        return [s.path for s in self.steps if isinstance(s, EagerCall)]

    def replay(self) -> None:
        with torch.no_grad(), running(self.desc):
            for step in self.steps:
                if isinstance(step, EagerCall):
                    step()
                else:
                    step.replay()


def capture_in_pieces(
    backend: Backend,
    forward: Callable[[], Any],
    guard: CaptureGuard,
    pieces: list[tuple[str, torch.nn.Module]],
    desc: BatchDescriptor,
) -> SegmentedGraph:
    """Capture ``forward`` as graph segments, running ``pieces`` eagerly between them."""
    steps: list[CapturedGraph | EagerCall] = []
    current: list[OpenCapture] = []
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def cut(path: str) -> Callable[..., None]:
        def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # The first pre-hook: the piece's own pre-hooks run eagerly, as
            # they will on replay, where the recorded call goes through them.
            calls[id(module)] = (args, kwargs)
            segment = current.pop().end(None)
            steps.append(segment)
            if not backend.capture_executes:
                segment.replay()
        return before

    def resume(path: str) -> Callable[..., None]:
        def after(module: torch.nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
            args, kwargs = calls.pop(id(module))
            steps.append(EagerCall(path, module, args, kwargs, output))
            current.append(backend.open_capture(guard))
        return after

    handles = []
    for path, sub in pieces:
        handles.append(sub.register_forward_pre_hook(cut(path), with_kwargs=True, prepend=True))
        handles.append(sub.register_forward_hook(resume(path), with_kwargs=True))
    try:
        with torch.no_grad():
            # A segment with no work (a piece called first, or two in a row)
            # is an empty graph, which the backend replays as nothing.
            current.append(backend.open_capture(guard))
            try:
                output = forward()
            except BaseException:
                if current:
                    current.pop().abort()
                raise
            steps.append(current.pop().end(output))
    finally:
        for h in handles:
            h.remove()
    return SegmentedGraph(steps, output, desc)
