"""Faults that take the process's CUDA context down, told as what they are.

A kernel that trips a device-side assert or reads an illegal address leaves
the CUDA context unusable: every later CUDA call in the process fails with
the same error, whatever it does. PyTorch raises ``torch.AcceleratorError``
with the driver's numeric ``error_code``; this module tells such a "sticky"
error by that code (never by its wording), names where it showed, and
keeps the first one of the process, which the plugin uses to end an xdist
worker or to stop running GPU tests in this process.

``phase`` marks what the harness is doing (warm-up, capture, replay, eager,
for a module and a descriptor). CUDA reports a kernel's error
asynchronously, at a later call; with ``synchronizing(True)`` (verification
sets it) every phase ends with a synchronize, so the error shows in the
phase whose kernel raised it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "STICKY_CODES",
    "ContextLost",
    "Where",
    "context_lost_error",
    "cuda_error_code",
    "described",
    "first_loss",
    "is_sticky",
    "oom_detail",
    "phase",
    "synchronizing",
    "watch_out_of_memory",
]

#: cudaError_t codes after which the context cannot be used again (CUDA's
#: runtime API documents each as leaving the process in an inconsistent
#: state that must be terminated and relaunched).
STICKY_CODES: dict[int, str] = {
    700: "an illegal memory access (cudaErrorIllegalAddress)",
    702: "a kernel that ran too long (cudaErrorLaunchTimeout)",
    710: "a device-side assert (cudaErrorAssert)",
    714: "a hardware stack error (cudaErrorHardwareStackError)",
    715: "an illegal instruction (cudaErrorIllegalInstruction)",
    716: "a misaligned address (cudaErrorMisalignedAddress)",
    717: "an invalid address space (cudaErrorInvalidAddressSpace)",
    718: "an invalid program counter (cudaErrorInvalidPc)",
    719: "a kernel launch failure (cudaErrorLaunchFailure)",
}


@dataclass(frozen=True)
class Where:
    """What the harness was doing: the module, the descriptor (None: no one descriptor's) and the phase."""

    module: str
    descriptor: str | None
    phase: str

    def __str__(self) -> str:
        return f"{self.phase} of {self.descriptor}" if self.descriptor else self.phase


_sync = False
_first: ContextLost | None = None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def cuda_error_code(exc: BaseException) -> int | None:
    """The CUDA error code a ``torch.AcceleratorError`` in ``exc``'s chain carries, or None."""
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None:
        return None
    for e in _chain(exc):
        code = getattr(e, "error_code", None)
        if isinstance(e, accelerator_error) and isinstance(code, int) and not isinstance(code, bool):
            return code
    return None


def is_sticky(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) is a CUDA error that loses the process's context."""
    return cuda_error_code(exc) in STICKY_CODES


class ContextLost(RuntimeError):
    """The process's CUDA context is gone: a sticky CUDA error, with where it showed."""

    def __init__(self, code: int, error: str, where: Where | None) -> None:
        self.code = code
        self.error = error
        self.where = where
        what = STICKY_CODES.get(code, f"CUDA error {code}")
        place = f" in {where.module}, {where}" if where is not None else ""
        super().__init__(
            f"CUDA context lost: {what}{place}. CUDA said: {error}. The kernel's own message (an assert's "
            "file, line and condition) is in the captured stderr. No CUDA call can succeed in this process "
            "any more; under pytest-xdist the plugin ends this worker so a fresh one runs the tests after it, "
            "and without it the remaining GPU tests of this process are not run (--cudagraph-isolate runs "
            "each test in a process of its own)"
        )


def context_lost_error(exc: BaseException) -> ContextLost | None:
    """``exc`` told as a lost context when it is a sticky CUDA error (or one came with it), else None."""
    for e in _chain(exc):
        if isinstance(e, ContextLost):
            return e
    code = cuda_error_code(exc)
    if code not in STICKY_CODES:
        return None
    where = next(
        (w for e in _chain(exc) if isinstance(w := getattr(e, "cudagraph_where", None), Where)), None
    )
    source = next(e for e in _chain(exc) if getattr(e, "error_code", None) == code)
    first_line = (str(source).strip().splitlines() or [type(source).__name__])[0]
    return ContextLost(code, first_line, where)


def first_loss() -> ContextLost | None:
    """The first lost context this process saw (None while it has seen none)."""
    return _first


def note_loss(lost: ContextLost) -> ContextLost:
    """Keep ``lost`` as the process's first, unless there was one already; return the first."""
    global _first
    if _first is None:
        _first = lost
    return _first


@contextlib.contextmanager
def synchronizing(on: bool) -> Iterator[None]:
    """While on, every CUDA ``phase`` ends with a synchronize (verification: errors show where raised)."""
    global _sync
    before, _sync = _sync, on
    try:
        yield
    finally:
        _sync = before


@contextlib.contextmanager
def phase(name: str, module: str, descriptor: Any, device: Any) -> Iterator[None]:
    """Mark a phase of the harness; a sticky CUDA error raised in it is tagged with where it showed."""
    global _last_oom
    where = Where(module, descriptor.label() if hasattr(descriptor, "label") else descriptor, name)
    _last_oom = None  # an out-of-memory reading is this phase's or none
    try:
        yield
        if _sync and getattr(device, "type", None) == "cuda":
            import torch

            # The stream's own status: the capture guard tells the module's code
            # that it is capturing (torch.cuda.is_current_stream_capturing) when it is not.
            if not torch._C._cuda_isCurrentStreamCapturing():
                torch.cuda.synchronize(device)
    except BaseException as exc:
        if is_sticky(exc) and not any(hasattr(e, "cudagraph_where") for e in _chain(exc)):
            with contextlib.suppress(AttributeError, TypeError):
                exc.cudagraph_where = where  # type: ignore[attr-defined]
            lost = context_lost_error(exc)
            if lost is not None:
                note_loss(lost)
        raise


# -- out of memory ---------------------------------------------------------------

#: The last allocation the CUDA allocator refused: (device, bytes asked, device total, device free).
_last_oom: tuple[int, int, int, int] | None = None
_watching = False


def _observe(device: int, asked: int, total: int, free: int) -> None:
    global _last_oom
    _last_oom = (int(device), int(asked), int(total), int(free))


def watch_out_of_memory() -> None:
    """Have the CUDA allocator tell this module what it refused (once a process; a no-op without CUDA
    or where PyTorch has no such observer), so an out-of-memory finding says what was asked and free."""
    global _watching
    if _watching:
        return
    _watching = True
    import torch

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            attach(_observe)


def oom_detail(exc: BaseException, device: Any = None) -> str | None:
    """What an out-of-memory error asked for and what was free, in words; None if ``exc`` is no OOM."""
    import torch

    from .units import format_bytes

    if not any(isinstance(e, torch.OutOfMemoryError) for e in _chain(exc)):
        return None
    if _last_oom is not None:
        index, asked, total, free = _last_oom
        return (
            f"out of device memory: an allocation of {format_bytes(asked)} was asked for with "
            f"{format_bytes(free)} free of {format_bytes(total)} on cuda:{index}"
        )
    if getattr(device, "type", None) == "cuda":
        with contextlib.suppress(Exception):
            free, total = torch.cuda.mem_get_info(device)
            return (
                f"out of device memory: an allocation larger than what was free was asked for; "
                f"{format_bytes(free)} free of {format_bytes(total)} on {device} now"
            )
    return "out of memory: an allocation larger than what was free was asked for"


def described(exc: BaseException, device: Any = None) -> str:
    """``exc`` in a failure message: what an out-of-memory error asked for and found free, else its type and words."""
    oom = oom_detail(exc, device)
    return f"{oom} ({type(exc).__name__})" if oom else f"{type(exc).__name__}: {exc}"
