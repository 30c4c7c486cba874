"""The small interface every graph backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from .. import environment
from ..guard import CaptureGuard

__all__ = ["BACKEND_NAMES", "Backend", "CapturedGraph", "OpenCapture"]

BACKEND_NAMES = ("auto", "cuda", "emulate")


class CapturedGraph(ABC):
    """One captured graph: replaying it re-runs the recorded work in place."""

    #: The forward's return value from the capture run. Its tensors live in
    #: graph memory and are overwritten by every replay.
    output: Any
    #: Bytes of graph memory this capture added (pool growth).
    nbytes: int
    #: Device memory this capture took in all (pool growth plus what the
    #: driver keeps for the graph); equal to ``nbytes`` on the emulator.
    device_bytes: int

    @abstractmethod
    def replay(self) -> None: ...

    def hold(self, tensors: list[Any]) -> None:
        """Keep ``tensors`` alive as long as the graph: it may read them by address.

        A module that drops a tensor its graph still reads (a buffer rebound
        in ``forward``, a memoised tensor replaced at the next warm-up) would
        otherwise let the allocator hand that memory to someone else, or back
        to the driver, and a replay would read garbage or fault the device.
        Held, the graph reads stale values, which the checks report.
        Successive calls add to what is held.
        """
        held: list[Any] = self.__dict__.setdefault("_held", [])
        held.extend(tensors)


#: Overrides every capture's mode when set: "checked" or "fast".
CAPTURE_ENV = environment.CAPTURE.name


def resolve_checked(checked: bool | None, *, default: bool) -> bool:
    """Whether a CUDA capture is checked: the environment, then the argument, then the default.

    A ``GraphManager`` captures fast by default (as fast as a hand-written
    loop); ``verify()`` and the plugin's fixtures, whose job is to find bugs,
    capture checked. ``PYTEST_CUDAGRAPH_CAPTURE=fast|checked`` overrides both,
    to run a whole suite one way.
    """
    forced = environment.read(environment.CAPTURE)  # a UsageError for a value it cannot read
    if forced is not None:
        return bool(forced == "checked")
    return default if checked is None else bool(checked)


class OpenCapture(ABC):
    """A capture in progress: whatever the device runs until ``end`` is recorded.

    Opened and ended in different stack frames when a forward is captured in
    pieces (a forward hook ends it, the next one opens another), so it keeps
    its own contexts rather than living in a ``with`` block.
    """

    @abstractmethod
    def end(self, output: Any) -> CapturedGraph:
        """Stop recording; the graph of what ran, whose result is ``output``."""

    @abstractmethod
    def abort(self) -> None:
        """Stop recording after a failure and leave the device fit for another capture."""


class Backend(ABC):
    """Warm-up, capture into one shared pool, and release."""

    name: str
    device: torch.device
    measure_device_memory: bool = False
    checked: bool = False
    #: The capture run itself computes (the emulator runs the ops it records);
    #: on CUDA nothing runs until a replay.
    capture_executes: bool = False
    #: Autograd on during warm-up and capture: a training step captures its backward (forward
    #: graphs, the default, capture with autograd off).
    grad_enabled: bool = False

    def begin(self) -> None:  # noqa: B027 - optional hook
        """Called once before a sequence of captures."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Called once after a sequence of captures that succeeded."""

    def trim(self) -> bool:
        """Hand cached memory back to the device; whether there was a cache to hand back."""
        return False

    @abstractmethod
    def warmup(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` eagerly as the warm-up before a capture."""

    @abstractmethod
    def open_capture(self, guard: CaptureGuard) -> OpenCapture:
        """Start recording into the shared pool, checking every op with ``guard``."""

    def open_whole_capture(self, guard: CaptureGuard) -> OpenCapture:
        """``open_capture`` for a whole forward (not a segment between eager pieces)."""
        return self.open_capture(guard)

    def capture(self, fn: Callable[[], Any], guard: CaptureGuard) -> CapturedGraph:
        """Capture ``fn`` whole into the shared pool, checking every op with ``guard``."""
        capture = self.open_whole_capture(guard)
        try:
            output = fn()
        except BaseException:
            capture.abort()
            raise
        return capture.end(output)

    @abstractmethod
    def release(self) -> None:
        """Forget the pool; the caller has dropped every graph in it."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook, a no-op on the CPU
        """Wait for queued device work (a no-op on the CPU)."""

    def poison_free(self, which: int) -> bool:
        """Fill the shared pool's free memory with poison ``which`` (0 or 1): the memory a graph's
        intermediates live in between replays, so that a replay reading what nobody wrote reads
        one poison or the other. False where this backend cannot."""
        return False


#: The byte each poison fills graph memory with: large finite floats of opposite signs
#: (0x5A5A5A5A is 1.5e16 as a float32), and integers that differ.
POISON_BYTES = (0x5A, 0xA5)
