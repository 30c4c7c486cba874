"""What a capture sequence will cost, told before it costs it.

Before ``GraphManager.capture`` warms up and records anything, the forward is
run eagerly once (or, for graphs above ``DIRECT_TOKENS`` tokens, at three
smaller shapes whose footprint is extrapolated to the largest graph) under a
dispatch mode that counts the bytes of every storage an op creates: how many
are created in all, the most alive at once, and what the outputs hold.

Graphs of a manager share one pool, so its graph memory is about the largest
graph's peak plus the outputs of the others (each graph's output stays in the
pool). The emulator also holds every storage of a capture until it ends,
before copying what lives on into the pool: it needs the largest graph's
created bytes on top. When that is more than the device has free (CUDA:
``torch.cuda.mem_get_info`` plus the allocator's cached blocks) or than the
machine has available (the emulator: ``MemAvailable``), the capture is
refused with a ``CaptureError`` that gives the estimate, before any graph.

The fast CUDA capture (the manager's default) runs no forward of its own for
this: its warm-up of the largest graph, which runs anyway, is measured from
the caching allocator's statistics (``WarmupMeter``), and the sequence is
refused after the warm-up, before any capture (``check_measured_memory``);
only when that reading is a bound that would refuse is the forward run again
under the storage counter.
There the device is asked what it has free (``cudaMemGetInfo``, about a
millisecond) only when the estimate is more than ``SMALL_NEED_FRACTION`` of
what the device holds beyond this process's reserved memory.

``check_input_memory`` does the same for the static input buffers, which are
allocated at the largest shape when the manager is built.
"""

from __future__ import annotations

import gc
import math
import os
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from .. import environment
from ..backends.base import Backend
from ..context import running
from ..errors import CaptureError
from ..observe import DispatchMode, buffers_restored, plain_parts
from ..plan import BatchDescriptor, CaptureConfig, GraphMode
from ..units import format_bytes
from .inputs import call_make_inputs


class SizedState(Protocol):
    """What an estimate reads of the manager's shared state (``ManagerState`` has it): the module,
    its configuration, the backend and its device. A protocol here, so that the estimate, which
    the layout below the state calls, never names the state's own module."""

    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def config(self) -> CaptureConfig: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def device(self) -> torch.device: ...


class Sizing(Protocol):
    """What an estimate reads of a manager: ``GraphManager``, or its capture part mid-sequence:
    the state they share and three calls."""

    @property
    def state(self) -> SizedState: ...
    @property
    def make_inputs(self) -> Callable[[int, int], Mapping[str, Any]]: ...
    def capture_reqs(self, desc: BatchDescriptor) -> int: ...
    def eager_kwargs(self, inputs: Mapping[str, Any], num_tokens: int) -> dict[str, Any]: ...


__all__ = [
    "DIRECT_TOKENS",
    "CaptureEstimate",
    "Footprint",
    "SizedState",
    "WarmupMeter",
    "available_memory",
    "check_capture_memory",
    "check_input_memory",
    "check_measured_memory",
    "estimate_capture",
    "measure_forward",
    "memory_check_enabled",
]

#: Graphs up to this many tokens are measured at their own shape; larger ones
#: are extrapolated from three shapes up to it.
DIRECT_TOKENS = 1024

#: ``PYTEST_CUDAGRAPH_MEMORY_CHECK=0`` skips the estimate (and its forwards).
CHECK_ENV = environment.MEMORY_CHECK.name


@dataclass(frozen=True)
class Footprint:
    """Bytes of the storages one eager forward created: in all, at most alive
    at once, and held by its outputs when it returned."""

    created: int
    peak: int
    output: int


class _StorageCounter(DispatchMode):
    """Counts the storages ops create (not views, not in-place results), and
    how many bytes of them are alive, by a finalizer on each tensor."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.holders: dict[int, list[int]] = {}  # storage address -> [bytes, tensors holding it]
        self.now = 0
        self.peak = 0
        self.created = 0

    def _release(self, ptr: int) -> None:
        entry = self.holders.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.holders[ptr]
            self.now -= entry[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: set[int] | None = None
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
                continue
            try:
                storage = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
                continue
            ptr, size = storage.data_ptr(), storage.nbytes()
            if size == 0:
                continue
            entry = self.holders.get(ptr)
            if entry is None:
                if inputs is None:
                    inputs = {
                        part.untyped_storage().data_ptr()
                        for t in tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)
                        and t.device.type != "meta"
                        and t.layout == torch.strided
                        for _, part in plain_parts("", t)
                    }
                if ptr in inputs:  # a view or an in-place result of something not ours
                    continue
                entry = self.holders[ptr] = [size, 0]
                self.created += size
                self.now += size
                self.peak = max(self.peak, self.now)
            entry[1] += 1
            weakref.finalize(leaf, self._release, ptr)
        return out


def measure_forward(
    module: torch.nn.Module, kwargs: Mapping[str, Any], *, marker: BatchDescriptor | None = None
) -> Footprint:
    """The footprint of one eager forward, without autograd (as captures run).

    The module's buffers are put back afterwards."""
    with buffers_restored(module), torch.no_grad():
        if marker is not None:
            with running(marker):
                out, footprint = _counted(module, kwargs)
        else:
            out, footprint = _counted(module, kwargs)
    del out
    return footprint


def _counted(module: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[Any, Footprint]:
    """``module(**kwargs)`` under the storage counter: its output and footprint."""
    counter = _StorageCounter()
    with counter:
        out = module(**kwargs)
    held = {
        leaf.untyped_storage().data_ptr()
        for leaf in tree_leaves(out)
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.device.type != "meta"
    }
    output = sum(counter.holders[p][0] for p in held if p in counter.holders)
    return out, Footprint(created=counter.created, peak=counter.peak, output=output)


def _extrapolate(points: Sequence[tuple[int, int]], at: int) -> int:
    """A value measured at t0, 2 t0, 4 t0, carried to ``at`` as a quadratic
    (linear when the points bend down), never below the last point."""
    (t0, f0), (_, f1), (t2, f2) = points
    d1, d2 = f1 - f0, f2 - f1
    c = max(0.0, (d2 - 2 * d1) / (6 * t0 * t0))
    b = (d1 - 3 * c * t0 * t0) / t0
    if c == 0.0:
        b = d2 / (2 * t0)
    value = f2 + b * (at - t2) + c * (at * at - t2 * t2)
    return max(f2, math.ceil(value))


@dataclass(frozen=True)
class CaptureEstimate:
    """What capturing ``count`` graphs, the largest ``largest``, will take.

    ``graph_bytes``: the pool (the largest graph's peak plus the others'
    outputs); ``transient_bytes``: what the capture holds on top while it runs
    (the emulator's recording); ``available_bytes``: what the device or the
    machine has; ``extrapolated``: measured at smaller shapes."""

    largest: BatchDescriptor
    count: int
    graph_bytes: int
    transient_bytes: int
    available_bytes: int | None
    backend: str
    extrapolated: bool

    @property
    def total_bytes(self) -> int:
        return self.graph_bytes + self.transient_bytes

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.total_bytes <= self.available_bytes

    def describe(self) -> str:
        where = "free on the device" if self.backend == "cuda" else "available in RAM"
        have = format_bytes(self.available_bytes) if self.available_bytes is not None else "unknown"
        how = "extrapolated from smaller shapes" if self.extrapolated else "measured by an eager forward"
        extra = (
            f" (graph memory {format_bytes(self.graph_bytes)} plus {format_bytes(self.transient_bytes)} "
            f"held while a capture records)"
            if self.transient_bytes
            else ""
        )
        return (
            f"capturing {self.count} graph{'s' if self.count != 1 else ''} (the largest {self.largest}) "
            f"needs about {format_bytes(self.total_bytes)}{extra}, {how}; {have} {where}"
        )


def available_memory(device: torch.device) -> int | None:
    """Bytes a capture may still take: on CUDA what the driver has free plus the
    allocator's cached blocks; on the CPU the machine's ``MemAvailable``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, cached))
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


_AVAILABLE_MEMORY = available_memory


def _footprint_at(manager: Sizing, num_tokens: int, num_reqs: int) -> Footprint:
    sample = call_make_inputs(manager.make_inputs, num_tokens, num_reqs)
    kwargs = manager.eager_kwargs(sample, num_tokens)
    marker = BatchDescriptor(mode=GraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs)
    return measure_forward(manager.state.module, kwargs, marker=marker)


def estimate_capture(manager: Sizing, descriptors: Iterable[BatchDescriptor]) -> CaptureEstimate | None:
    """The memory capturing ``descriptors`` will take; None when there is
    nothing to capture or the module cannot run eagerly at the shapes
    measured (the capture then reports what is wrong)."""
    order = list(descriptors)
    if not order:
        return None
    largest = max(order, key=lambda d: d.num_tokens)
    # The random draws of make_inputs and the module here are not the
    # captures': the generators are put back as they were.
    devices = [manager.state.device.index or 0] if manager.state.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            return _estimate(manager, order, largest)
    except Exception:  # the capture itself will say what fails, and where
        return None


def _estimate(manager: Sizing, order: list[BatchDescriptor], largest: BatchDescriptor) -> CaptureEstimate:
    top = largest.num_tokens
    if top <= DIRECT_TOKENS:
        foot = _footprint_at(manager, top, manager.capture_reqs(largest))
        created, peak, out_per_token = foot.created, foot.peak, foot.output / top
        extrapolated = False
    else:
        shapes = [DIRECT_TOKENS // 4, DIRECT_TOKENS // 2, DIRECT_TOKENS]
        max_reqs = manager.state.config.max_num_reqs
        feet = [_footprint_at(manager, t, min(t, max_reqs)) for t in shapes]
        created = _extrapolate([(t, f.created) for t, f in zip(shapes, feet, strict=True)], top)
        peak = _extrapolate([(t, f.peak) for t, f in zip(shapes, feet, strict=True)], top)
        out = _extrapolate([(t, f.output) for t, f in zip(shapes, feet, strict=True)], top)
        out_per_token = out / top
        extrapolated = True
    transient = created if manager.state.backend.name == "emulate" else 0
    return _capture_estimate(
        manager,
        order,
        largest,
        peak=peak,
        out_per_token=out_per_token,
        transient=transient,
        extrapolated=extrapolated,
        available=lambda need: available_memory(manager.state.device),
    )


def _capture_estimate(
    manager: Sizing,
    order: Sequence[BatchDescriptor],
    largest: BatchDescriptor,
    *,
    peak: int,
    out_per_token: float,
    transient: int,
    extrapolated: bool,
    available: Callable[[int], int | None],
) -> CaptureEstimate:
    """The estimate from the largest graph's footprint: ``available(need)``
    says what the device or machine has for ``need`` bytes of graphs."""
    # Every graph's outputs stay in the pool; the largest graph's peak covers its own.
    others = sum(d.num_tokens for d in order if d is not largest)
    graph_bytes = peak + math.ceil(out_per_token * others)
    return CaptureEstimate(
        largest=largest,
        count=len(order),
        graph_bytes=graph_bytes,
        transient_bytes=transient,
        available_bytes=available(graph_bytes),
        backend=manager.state.backend.name,
        extrapolated=extrapolated,
    )


def memory_check_enabled() -> bool:
    """False when ``PYTEST_CUDAGRAPH_MEMORY_CHECK`` switches the estimate off (``0``, ``false``,
    ``no``, ``off``: read as an ini boolean)."""
    return bool(environment.read(environment.MEMORY_CHECK))


def check_capture_memory(manager: Sizing, descriptors: Iterable[BatchDescriptor]) -> CaptureEstimate | None:
    """Refuse, with a ``CaptureError`` that gives the estimate, a capture that
    will not fit; else return the estimate (None when none could be made).

    Nothing is captured or released here: a refused manager runs batches
    eagerly, and a ``capture()`` of fewer or smaller descriptors may follow.
    ``PYTEST_CUDAGRAPH_MEMORY_CHECK=0`` skips it."""
    if not memory_check_enabled():
        return None
    # As in the capture sequence that follows: no cyclic garbage collection
    # while forwards run (see GraphManager.capture).
    collecting = gc.isenabled()
    gc.disable()
    try:
        estimate = estimate_capture(manager, descriptors)
    finally:
        if collecting:
            gc.enable()
    return _refuse_unless_fits(estimate)


def _refuse_unless_fits(estimate: CaptureEstimate | None) -> CaptureEstimate | None:
    if estimate is None or estimate.fits:
        return estimate
    # A refused capture is a failed one: the manager runs batches eagerly
    # (capture() has marked itself called before asking).
    raise CaptureError(
        f"capture refused before it started: {estimate.describe()}. Capture fewer or smaller sizes "
        f"(capture_sizes, lora_cases), or free memory; {CHECK_ENV}=0 skips this estimate",
        reason="memory",
        descriptor=estimate.largest,
        backend=estimate.backend,
    )


class WarmupMeter:
    """The footprint of the largest graph's warm-up forward, read from the
    caching allocator's statistics around it: what the fast capture measures
    instead of an estimate forward of its own (``measure_forward``).

    The warm-up is a real one, at full speed: the module's buffers are left as
    it leaves them, no dispatch mode watches it, and the allocator's
    statistics are only read, never reset (a user may be reading the peaks).
    So the peak it gives, the allocator's peak after the forward less what
    was allocated before it, is the forward's own peak when the forward set a
    new one (``exact``), else an upper bound: an earlier peak of the process
    may stand above it. ``check_measured_memory`` accepts a capture on the
    bound, and measures again with the storage counter only when the bound
    alone would refuse it."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index or 0
        self.footprint: Footprint | None = None
        #: The footprint is the forward's own peak, not a bound above it.
        self.exact = False

    def _allocated(self) -> tuple[int, int] | None:
        try:
            stat = torch._C._cuda_memoryStats(self.index)["allocated_bytes"]["all"]
            return int(stat["current"]), int(stat["peak"])
        except (AttributeError, KeyError, TypeError, RuntimeError):
            return None

    def run(self, module: Callable[..., Any], inputs: Mapping[str, Any]) -> Any:
        """``module(**inputs)``, measured."""
        before = self._allocated()
        if before is None:  # no statistics to read: count storages instead
            out, self.footprint = _counted(module, inputs)
            self.exact = True
            return out
        out = module(**inputs)
        after = self._allocated()
        if after is None:
            return out
        (now, peak_before), (_, peak_after) = before, after
        storages = {
            leaf.untyped_storage().data_ptr(): leaf.untyped_storage().nbytes()
            for leaf in tree_leaves(out)
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.device.type != "meta"
        }
        peak = max(0, peak_after - now)
        # What the forward created in all is not read here: the fast
        # capture's estimate needs the peak and the outputs only (the
        # emulator's recording, which holds every creation, is not involved).
        self.footprint = Footprint(created=peak, peak=peak, output=sum(storages.values()))
        self.exact = peak_after > peak_before
        return out


#: The device's memory is not asked for (``cudaMemGetInfo``, about a
#: millisecond) when a capture needs at most this fraction of what the
#: device holds beyond this process's reserved memory.
SMALL_NEED_FRACTION = 1 / 64


def _cuda_room(device: torch.device, need: int) -> int | None:
    """What a CUDA capture may take (``available_memory``), or None, taken
    as room enough, when ``need`` is at most ``SMALL_NEED_FRACTION`` of the
    device's memory beyond what this process has reserved."""
    if available_memory is _AVAILABLE_MEMORY:  # not replaced (a test's stand-in is always asked)
        index = device.index or 0
        try:
            total = torch.cuda.get_device_properties(index).total_memory
            reserved = int(torch._C._cuda_memoryStats(index)["reserved_bytes"]["all"]["current"])
        except (AttributeError, KeyError, TypeError, RuntimeError):
            total = reserved = 0
        if need <= (total - reserved) * SMALL_NEED_FRACTION:
            return None
    return available_memory(device)


def check_measured_memory(
    manager: Sizing,
    order: Sequence[BatchDescriptor],
    largest: BatchDescriptor,
    meter: WarmupMeter,
    remeasure: Callable[[], Footprint],
) -> CaptureEstimate:
    """``check_capture_memory`` for the fast CUDA capture: the estimate from
    the largest graph's warm-up footprint (``WarmupMeter``), refused with
    the same ``CaptureError`` before any capture starts.

    A footprint that is only a bound (``WarmupMeter.exact`` False) and would
    refuse the sequence is measured again by ``remeasure`` (a forward under
    the storage counter), which decides: a bound never refuses alone."""
    foot = meter.footprint
    if foot is None:
        foot = remeasure()
    estimate = _measured_estimate(manager, order, largest, foot)
    if not estimate.fits and not meter.exact and meter.footprint is not None:
        estimate = _measured_estimate(manager, order, largest, remeasure())
    _refuse_unless_fits(estimate)
    return estimate


def _measured_estimate(
    manager: Sizing, order: Sequence[BatchDescriptor], largest: BatchDescriptor, foot: Footprint
) -> CaptureEstimate:
    return _capture_estimate(
        manager,
        order,
        largest,
        peak=foot.peak,
        out_per_token=foot.output / largest.num_tokens,
        transient=0,
        extrapolated=False,
        available=lambda need: _cuda_room(manager.state.device, need),
    )


def _tensor_bytes(inputs: Mapping[str, Any]) -> int:
    return sum(v.nbytes for v in inputs.values() if isinstance(v, torch.Tensor))


def input_bytes_estimate(
    probes: Sequence[Mapping[str, Any]],
    shapes: Sequence[tuple[int, int]],
    *,
    max_tokens: int,
    max_reqs: int,
) -> int:
    """Bytes of ``make_inputs`` at the largest shape, carried from two probe
    shapes: the growth between them taken as following tokens or requests,
    whichever gives more."""
    (t1, r1), (t2, r2) = shapes[0], shapes[1]
    b1, b2 = _tensor_bytes(probes[0]), _tensor_bytes(probes[1])
    grow = max(0, b2 - b1)
    by_tokens = grow / max(1, t2 - t1) * max(0, max_tokens - t2)
    by_reqs = grow / max(1, r2 - r1) * max(0, max_reqs - r2)
    return b2 + math.ceil(max(by_tokens, by_reqs))


def check_input_memory(
    probes: Sequence[Mapping[str, Any]],
    shapes: Sequence[tuple[int, int]],
    *,
    max_tokens: int,
    max_reqs: int,
    device: torch.device,
    available: Callable[[torch.device], int | None] = available_memory,
) -> None:
    """Refuse (``ValueError``) static input buffers that will not fit: building
    them takes ``make_inputs`` at the largest shape and the buffers, twice the
    inputs' bytes, before any graph. ``probes`` are ``make_inputs`` at the
    ``shapes`` ``(num_tokens, num_reqs)``."""
    if not memory_check_enabled():
        return
    need = 2 * input_bytes_estimate(probes, shapes, max_tokens=max_tokens, max_reqs=max_reqs)
    have = available(device)
    if have is not None and need > have:
        where = "free on the device" if device.type == "cuda" else "available in RAM"
        raise ValueError(
            f"the static input buffers at the largest shape ({max_tokens} tokens, {max_reqs} requests) "
            f"and make_inputs' sample there need about {format_bytes(need)}; {format_bytes(have)} {where}. "
            f"Capture smaller sizes (capture_sizes, max_num_reqs); {CHECK_ENV}=0 skips this estimate"
        )
