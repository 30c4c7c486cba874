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
from itertools import islice
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..backends.base import Backend, CapturedGraph, OpenCapture
from ..context import running
from ..guard import CaptureGuard
from ..observe import plain_parts
from ..plan import BatchDescriptor
from ..plan.validate import MAX_ITEMS, UsageError, short

__all__ = [
    "EagerCall",
    "EagerPieceError",
    "EagerSpec",
    "SegmentedGraph",
    "capture_in_pieces",
    "piece_of",
    "resolve_eager_submodules",
]

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
    if isinstance(spec, torch.nn.Module):
        path = next((n for n, m in named if m is spec), None)
        hint = f"its name ({path!r})" if path else "its dotted name"
        raise UsageError(
            f"eager_submodules got a module instance ({type(spec).__name__}); pass {hint}, its type "
            f"({type(spec).__name__}), or a predicate (name, module) -> bool"
        )
    if isinstance(spec, (type, str)):
        spec = [spec]
    if callable(spec) and not isinstance(spec, type):
        predicate = spec
        chosen = []
        for name, sub in named:
            verdict = predicate(name, sub)
            if not isinstance(verdict, bool):
                raise UsageError(
                    f"eager_submodules predicate must return a bool for (name, module); "
                    f"got {verdict!r} for {name!r}"
                )
            if verdict:
                chosen.append((name, sub))
    else:
        try:
            items = list(islice(spec, MAX_ITEMS + 1))  # type: ignore[arg-type]  # never an endless one whole
        except TypeError:
            raise UsageError(
                "eager_submodules must be a module type, a dotted submodule name, a list of those, "
                f"or a predicate (name, module) -> bool; got {type(spec).__name__}"
            ) from None
        if len(items) > MAX_ITEMS or isinstance(spec, (bytes, bytearray)):
            raise UsageError(
                f"eager_submodules must be a list of module types or dotted names; got {short(spec)}"
            )
        names = {n for n, _ in named}
        types: list[type] = []
        wanted: set[str] = set()
        for item in items:
            if isinstance(item, torch.nn.Module):
                raise UsageError(
                    f"eager_submodules got a module instance ({type(item).__name__}); pass its dotted "
                    f"name or its type"
                )
            if isinstance(item, type):
                if not issubclass(item, torch.nn.Module):
                    raise UsageError(f"eager_submodules type {item.__name__} is not an nn.Module subclass")
                types.append(item)
            elif isinstance(item, str):
                if item not in names:
                    shown = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
                    raise UsageError(
                        f"eager_submodules names {item!r}, which is not a submodule; "
                        f"the submodules are: {shown}"
                    )
                wanted.add(item)
            else:
                raise UsageError(
                    f"eager_submodules entries must be module types or dotted names; got {item!r}"
                )
        chosen = [(n, m) for n, m in named if n in wanted or isinstance(m, tuple(types))]
        if types and not any(isinstance(m, tuple(types)) for _, m in named):
            raise UsageError(
                f"eager_submodules names type(s) {', '.join(t.__name__ for t in types)}, "
                f"but no submodule of {type(module).__name__} is one"
            )
    outer: list[tuple[str, torch.nn.Module]] = []
    for name, sub in chosen:
        if not any(name.startswith(o + ".") for o, _ in outer):
            outer.append((name, sub))
    return outer


def piece_of(path: str, pieces: Iterable[str]) -> str | None:
    """The piece that submodule ``path`` is, or runs inside; None if it is in no piece."""
    return next((p for p in pieces if path == p or path.startswith(p + ".")), None)


class EagerPieceError(RuntimeError):
    """An eager piece failed, at capture or on replay; ``path`` names it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def _storages(values: Any) -> set[int]:
    """The storage addresses of the tensors in ``values``, a wrapper subclass (a quantized weight)
    by those of its inner tensors."""
    return {
        part.untyped_storage().data_ptr()
        for t in tree_flatten(values)[0]
        if isinstance(t, torch.Tensor)
        for _, part in plain_parts("", t)
    }


def own_result(output: Any, reads: set[int]) -> Any:
    """``output`` with every tensor the piece does not own replaced by a copy.

    A result that aliases the piece's inputs or its module's state (an input
    returned as is, a view of it, a buffer) or overlaps itself (an expand)
    cannot take the next replay's result: copying into it would overwrite
    what it aliases. The copy is the piece's own bridge.
    """
    leaves, spec = tree_flatten(output)
    changed = False
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        overlapping = any(st == 0 for st, size in zip(leaf.stride(), leaf.shape, strict=True) if size > 1)
        if leaf.untyped_storage().data_ptr() in reads or overlapping:
            leaves[i] = leaf.clone()
            changed = True
    return tree_unflatten(leaves, spec) if changed else output


class EagerCall:
    """One eager piece as captured: its call, and the tensors its result goes into."""

    def __init__(
        self, path: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        self.path = path
        self.module = module
        self.args = args
        self.kwargs = kwargs
        leaves, self.spec = tree_flatten(output)
        self.bridges = [t for t in leaves if isinstance(t, torch.Tensor)]
        # What the next segment saw of the non-tensor results: frozen there.
        self.frozen = [(i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)]

    def __call__(self) -> None:
        try:
            result = self.module(*self.args, **self.kwargs)
        except Exception as exc:
            raise EagerPieceError(
                self.path, f"eager piece '{self.path}' failed on replay: {type(exc).__name__}: {exc}"
            ) from exc
        leaves, spec = tree_flatten(result)
        if spec != self.spec:
            raise EagerPieceError(
                self.path,
                f"eager piece '{self.path}' returned {spec} on replay but {self.spec} at capture: the next graph "
                "segment reads its results at fixed places, so an eager piece must return the same structure",
            )
        for i, value in self.frozen:
            if leaves[i] is not value and leaves[i] != value:
                raise EagerPieceError(
                    self.path,
                    f"eager piece '{self.path}' returned {leaves[i]!r} on replay where it returned {value!r} at "
                    "capture: the graph segment after it froze the capture-time value. Return it as a tensor",
                )
        fresh = [t for t in leaves if isinstance(t, torch.Tensor)]
        for bridge, new in zip(self.bridges, fresh, strict=True):
            if new.shape != bridge.shape or new.dtype != bridge.dtype or new.device != bridge.device:
                raise EagerPieceError(
                    self.path,
                    f"eager piece '{self.path}' returned a {new.dtype} tensor of shape {tuple(new.shape)} on "
                    f"{new.device} on replay but {bridge.dtype} {tuple(bridge.shape)} on {bridge.device} at "
                    "capture: an eager piece must return the same shapes for the same descriptor",
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
    """Capture ``forward`` as graph segments, inside ``pieces`` eagerly between them."""
    steps: list[CapturedGraph | EagerCall] = []
    current: list[OpenCapture] = []
    # The piece running now, with its call; a piece it calls runs inside it.
    inside: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def cut(path: str) -> Callable[..., None]:
        def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # The first pre-hook: the piece's own pre-hooks run eagerly, as
            # they will on replay, where the recorded call goes through them.
            if inside:
                inside.append((path, args, kwargs))  # called by a piece: part of that one
                return
            if not current:
                raise EagerPieceError(path, f"eager piece '{path}' was entered with no graph segment open")
            inside.append((path, args, kwargs))
            segment = current.pop().end(None)
            steps.append(segment)
            if not backend.capture_executes:
                segment.replay()

        return before

    def resume(path: str) -> Callable[..., Any]:
        def after(module: torch.nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
            _, args, kwargs = inside.pop()
            if inside:
                return None  # still inside the outer piece
            output = own_result(
                output, _storages((args, kwargs)) | _storages([*module.parameters(), *module.buffers()])
            )
            steps.append(EagerCall(path, module, args, kwargs, output))
            current.append(backend.open_capture(guard))
            return output

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
            except BaseException as exc:
                if current:
                    current.pop().abort()
                steps.clear()  # the segments ended so far die now, not with the traceback
                if inside and not isinstance(exc, EagerPieceError):
                    path = inside[0][0]
                    raise EagerPieceError(
                        path,
                        f"eager piece '{path}' failed while {desc} was captured: {type(exc).__name__}: {exc}",
                    ) from exc
                raise
            steps.append(current.pop().end(output))
    finally:
        for h in handles:
            h.remove()
    return SegmentedGraph(steps, output, desc)
