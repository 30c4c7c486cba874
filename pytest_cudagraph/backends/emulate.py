"""A CPU emulation of CUDA-graph semantics.

Capture runs the forward once under a ``TorchDispatchMode`` that records every
ATen op with the very tensors it read and wrote. Replay re-runs the recorded
ops, writing each result into the tensor the capture produced. That gives the
emulated graph the properties that make real graphs bite:

- Python runs only at capture: control flow, Python scalars and attributes
  read by the forward are frozen into the recording.
- Tensors created during capture are the graph's memory (its pool): the
  forward's outputs are those tensors, so a later replay overwrites them.
- Inputs are read from the storages captured, so data must be copied into the
  static buffers; rebinding a Python attribute to a new tensor is not seen.
- In-place updates of buffers (a KV cache, a counter) happen on every replay.
- Random ops draw fresh values on every replay, as with graph-safe RNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .base import Backend, CapturedGraph, OpenCapture
from .guard import CaptureGuard

__all__ = ["EmulateBackend", "EmulatedGraph"]

aten = torch.ops.aten

# Allocation without a kernel: a real graph does not re-run it on replay, and
# re-running it here would only produce garbage to copy.
_ALLOCATIONS = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _mutates(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True  # unknown: re-run it rather than risk skipping a write
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


class _Step:
    """One recorded op and how to redo it."""

    __slots__ = ("args", "func", "kwargs", "targets")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], targets: list[tuple[int, torch.Tensor]]):
        self.func = func
        self.args = args
        self.kwargs = kwargs
        # (position in the flattened result, captured tensor to write it into)
        self.targets = targets

    def __call__(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if not self.targets:
            return
        if isinstance(result, torch.Tensor):
            self.targets[0][1].copy_(result)
            return
        flat, _ = tree_flatten(result)
        for index, target in self.targets:
            target.copy_(flat[index])


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, guard: CaptureGuard) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.guard = guard
        self.steps: list[_Step] = []
        self.created: dict[int, int] = {}  # storage pointer -> bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.guard.check_dispatch(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self._note_created(out)
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {_storage_key(t) for t in flat_in if isinstance(t, torch.Tensor)}
        flat_out, _ = tree_flatten(out)
        fresh = [
            (i, t)
            for i, t in enumerate(flat_out)
            if isinstance(t, torch.Tensor) and t.numel() and _storage_key(t) not in inputs
        ]
        if not fresh and not _mutates(func):
            # A pure view: the captured view already aliases the storage it
            # reads, so there is nothing to redo.
            return out
        for _, t in fresh:
            self._note_created(t)
        self.steps.append(_Step(func, tuple(args), dict(kwargs), fresh))
        return out

    def _note_created(self, out: Any) -> None:
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.created.setdefault(storage.data_ptr(), storage.nbytes())


class EmulatedGraph(CapturedGraph):
    def __init__(self, steps: list[_Step], output: Any, nbytes: int) -> None:
        self._steps = steps
        self.output = output
        self.nbytes = nbytes
        self.device_bytes = nbytes

    @property
    def num_ops(self) -> int:
        return len(self._steps)

    def replay(self) -> None:
        with torch.no_grad():
            for step in self._steps:
                step()


class _EmulatedCapture(OpenCapture):
    def __init__(self, guard: CaptureGuard) -> None:
        self.recorder = _Recorder(guard)
        self.stack = contextlib.ExitStack()
        try:
            self.stack.enter_context(torch.no_grad())
            self.stack.enter_context(guard.function_mode())
            self.stack.enter_context(self.recorder)
        except BaseException:
            self.stack.close()
            raise

    def end(self, output: Any) -> CapturedGraph:
        self.stack.close()
        return EmulatedGraph(self.recorder.steps, output, sum(self.recorder.created.values()))

    def abort(self) -> None:
        self.stack.close()


class EmulateBackend(Backend):
    name = "emulate"
    capture_executes = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def warmup(self, fn: Callable[[], Any]) -> Any:
        with torch.no_grad():
            return fn()

    def open_capture(self, guard: CaptureGuard) -> OpenCapture:
        return _EmulatedCapture(guard)

    def release(self) -> None:
        # Emulated graphs own their memory; dropping them frees it.
        return None
