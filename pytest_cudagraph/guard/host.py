"""The host methods the guard watches, and the capturing query it answers.

The eight ``torch.Tensor`` methods that hand device data to the host
(``.item()``, ``bool(tensor)``, ...) are replaced by wrappers that report to
the innermost active guard, and ``torch.cuda.is_current_stream_capturing``
answers True while a guard (or an ``as_captured`` block) is active. Both are
process-wide replacements, so their state (the guards active, the depth of
the replacement, the functions replaced) has its one home here; the guard
reaches it through this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.cuda.graphs
from torch.overrides import TorchFunctionMode

# Python-level tensor methods that hand device data to the host.
_HOST_METHODS: dict[Any, tuple[str, str]] = {
    torch.Tensor.item: ("host sync", "Tensor.item()"),
    torch.Tensor.tolist: ("device-to-host copy", "Tensor.tolist()"),
    torch.Tensor.numpy: ("device-to-host copy", "Tensor.numpy()"),
    torch.Tensor.cpu: ("device-to-host copy", "Tensor.cpu()"),
    torch.Tensor.__bool__: ("host sync", "bool(tensor)"),
    torch.Tensor.__int__: ("host sync", "int(tensor)"),
    torch.Tensor.__float__: ("host sync", "float(tensor)"),
    torch.Tensor.__index__: ("host sync", "tensor used as an index"),
}


@dataclass(frozen=True)
class DevicePath:
    """A library function whose CUDA path a capture cannot hold while its CPU path can, as seen on
    a GPU: the emulator runs the CPU path, so it reports the function when a forward calls it."""

    #: How the finding names it.
    op: str
    #: Why a capture cannot hold it (starts with "a library's CUDA path").
    reason: str
    #: What to do instead, each way one that captured on the GPU it was seen on.
    fix: str
    #: A fragment of the function's source that shows the path is still there: a release that
    #: drops it is not reported.
    fragment: str


#: (module, function) -> the path; callers that reach it on CUDA alone are listed with it.
DEVICE_PATHS: dict[tuple[str, str], DevicePath] = {}
_TORCHAO_INT_MM = DevicePath(
    op="torchao's safe_int_mm on CUDA",
    reason=(
        "a library's CUDA path, a host sync: outside torch.compile it formats its input ('FakeTensor' in "
        "input.__repr__()), which reads the tensor to the host (seen on an NVIDIA H200 with torchao 0.18, "
        "2026-12-03; on the CPU int_scaled_matmul takes another path)"
    ),
    fix=(
        "torchao's dynamic int8 activations reach safe_int_mm on CUDA: quantize the weights only "
        "(Int8WeightOnlyConfig, which captured on the H200), or use a torchao release whose safe_int_mm does "
        "not format its input"
    ),
    fragment="input.__repr__()",
)
DEVICE_PATHS[("torchao.kernel.intmm", "safe_int_mm")] = _TORCHAO_INT_MM
DEVICE_PATHS[("torchao.kernel.intmm", "int_scaled_matmul")] = _TORCHAO_INT_MM
#: Where each path's fragment is looked for (the function that holds it).
_DEVICE_PATH_SOURCE = {_TORCHAO_INT_MM: ("torchao.kernel.intmm", "safe_int_mm")}


def device_path_fix(op: str) -> str:
    """The fix of the device path a finding names as ``op``; "" for any other op."""
    return next((p.fix for p in DEVICE_PATHS.values() if p.op == op), "")


class ActiveGuard(Protocol):
    """What the wrappers and the capturing query ask of an active guard (``CaptureGuard`` has it).
    A protocol here, so that this module, below the guard, never names the guard's own module."""

    #: Above zero while an exempt submodule (an eager piece) runs.
    suspended: int
    #: Above zero while a host method runs: the ops beneath it are the same event.
    _in_host_method: int
    #: Whether the guard emulates a capture on the CPU (where a CUDA-only path does not run).
    by_provenance: bool

    def report(self, op: str, reason: str) -> None: ...


@contextlib.contextmanager
def host_methods_watched() -> Iterator[None]:
    """Keep the eight host methods replaced by reporting wrappers for the duration.

    Nested uses share one replacement. A capture sequence holds it from its
    first graph to its last: replacing an attribute of ``torch.Tensor``
    invalidates the interpreter's attribute caches for every tensor, which
    costs more than the replacement itself, so it is done once a sequence,
    not once a graph. With no guard active the wrappers call straight through.

    ``torch.cuda.is_current_stream_capturing`` is replaced alongside (under
    both names code reaches it by), to answer True while a guard is active:
    code that asks (transformers skips a ``bool(tensor)`` check that way)
    must take the path it takes under a real capture, also on the emulator
    and in the guarded eager runs, where no stream is capturing.
    """
    global _PATCH_DEPTH
    wrappers = _host_wrappers()
    _PATCH_DEPTH += 1
    try:
        if _PATCH_DEPTH == 1:
            for name, (_original, wrapper) in wrappers.items():
                setattr(torch.Tensor, name, wrapper)
            _patch_device_paths()
            for home in _CAPTURE_QUERY_HOMES:
                original = getattr(home, _CAPTURE_QUERY)
                _SAVED_QUERIES.append((home, original))
                setattr(home, _CAPTURE_QUERY, _answering_capturing(original))
        yield
    finally:
        _PATCH_DEPTH -= 1
        if _PATCH_DEPTH == 0:
            for name, (original, _wrapper) in wrappers.items():
                setattr(torch.Tensor, name, original)
            while _SAVED_QUERIES:
                home, original = _SAVED_QUERIES.pop()
                setattr(home, _CAPTURE_QUERY, original)
            while _SAVED_PATHS:
                home, name, original = _SAVED_PATHS.pop()
                setattr(home, name, original)


_PATCH_DEPTH = 0
#: Guards whose function_mode is active, innermost last.
_ACTIVE: list[ActiveGuard] = []
_WRAPPERS: dict[str, tuple[Any, Any]] = {}
_CAPTURE_QUERY = "is_current_stream_capturing"
# torch.cuda re-exports it from torch.cuda.graphs, whose own functions read the
# module global: both names are replaced.
_CAPTURE_QUERY_HOMES = (torch.cuda, torch.cuda.graphs)
#: (module, the function replaced there) while the replacement holds.
_SAVED_QUERIES: list[tuple[Any, Any]] = []


#: (module, name, the function replaced there) while the device-path replacements hold.
_SAVED_PATHS: list[tuple[Any, str, Any]] = []


def _patch_device_paths() -> None:
    """Replace each function of ``DEVICE_PATHS`` wherever a module of its library holds it (``from
    torchao.kernel import int_scaled_matmul`` binds it in the importer) by a wrapper that reports
    the path to an emulating guard. Only libraries already imported are touched; none is imported
    here."""
    import sys

    for (module_name, func_name), path in DEVICE_PATHS.items():
        home = sys.modules.get(module_name)
        original = getattr(home, func_name, None) if home is not None else None
        if original is None or getattr(original, "__device_path__", None) is not None:
            continue
        if not _path_still_there(path):
            continue
        wrapper = _reporting_device_path(original, path)
        for module, attr in _holders(original, module_name.split(".")[0]):
            _SAVED_PATHS.append((module, attr, original))
            setattr(module, attr, wrapper)


def _holders(func: Any, library: str) -> list[tuple[Any, str]]:
    """(module, name) of every module of ``library`` that holds ``func``; the walk over the modules
    is kept until another module is imported (each guard's entry would otherwise repeat it)."""
    import sys

    imported = len(sys.modules)
    known = _HOLDERS.get(func)
    if known is not None and known[0] == imported:
        return known[1]
    found = [
        (module, attr)
        for name, module in list(sys.modules.items())
        if module is not None and (name == library or name.startswith(library + "."))
        for attr, value in list(getattr(module, "__dict__", {}).items())
        if value is func
    ]
    _HOLDERS[func] = (imported, found)
    return found


#: Per function, its last walk: how many modules were imported then, and the holders found.
_HOLDERS: dict[Any, tuple[int, list[tuple[Any, str]]]] = {}


def _path_still_there(path: DevicePath) -> bool:
    """Whether the function that holds ``path`` still holds its fragment, read from its source once
    per function object (a fresh import of another release is a new object, read again): each
    capture sequence and each ``as_captured`` block enters here, and a source read costs
    milliseconds."""
    import inspect
    import sys

    source_module, source_name = _DEVICE_PATH_SOURCE[path]
    func = getattr(sys.modules.get(source_module), source_name, None)
    if func is None:
        return False
    func = inspect.unwrap(func)
    known = _SOURCE_READ.get(path)
    if known is not None and known[0] is func:
        return known[1]
    try:
        held = path.fragment in inspect.getsource(func)
    except (OSError, TypeError):
        held = False
    _SOURCE_READ[path] = (func, held)
    return held


#: Per path, the function whose source was read and whether the fragment was in it.
_SOURCE_READ: dict[DevicePath, tuple[Any, bool]] = {}


def _reporting_device_path(func: Any, path: DevicePath) -> Any:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE and _ACTIVE[-1].by_provenance:
            _ACTIVE[-1].report(path.op, path.reason)
        return func(*args, **kwargs)

    wrapper.__device_path__ = path  # type: ignore[attr-defined]
    return wrapper


#: One entry per active ``as_captured`` block: how many of its exempt modules are running.
_AS_CAPTURED: list[list[int]] = []


class _InertFunctionMode(TorchFunctionMode):
    """A function mode that changes nothing but being there.

    torch takes other paths while any function mode is active
    (``has_torch_function`` is then true: ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` leave their fused fast paths). The
    emulated capture runs under ``_HostValueMode``; a reference run meant to
    be the same program runs under this one.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def as_captured(exempt: list[torch.nn.Module] | tuple[()] = (), *, emulated: bool = False) -> Iterator[None]:
    """Run a forward eagerly on the path a capture takes: ``is_current_stream_capturing()`` answers True.

    The checks compare a graph with eager runs of the same program. Code that
    asks whether it is captured (transformers builds its attention mask
    another way then, and on a GPU another kernel runs) would otherwise run
    one program in the graph and another in the reference, and a bit-for-bit
    comparison would fail a correct graph. ``exempt`` modules (a PIECEWISE
    graph's eager pieces) get the plain answer, as they do on replay.
    ``emulated``: the graph was recorded under the emulator's function mode,
    so the run is made under an inert one (see ``_InertFunctionMode``).
    """
    running = [0]

    def count(step: int) -> None:
        running[0] += step

    with (
        _while_running(exempt, count),
        host_methods_watched(),
        _InertFunctionMode() if emulated else contextlib.nullcontext(),
    ):
        _AS_CAPTURED.append(running)
        try:
            yield
        finally:
            _AS_CAPTURED.pop()


@contextlib.contextmanager
def _while_running(modules: Iterable[torch.nn.Module], count: Callable[[int], None]) -> Iterator[None]:
    """``count(+1)`` when any of ``modules`` starts its forward, ``count(-1)`` when it ends
    (also on an exception), for the duration of the block."""
    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(lambda *_: count(1)))
        handles.append(m.register_forward_hook(lambda *_: count(-1), always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _answering_capturing(original: Any) -> Any:
    @functools.wraps(original)
    def is_current_stream_capturing() -> Any:
        if _ACTIVE:
            if not _ACTIVE[-1].suspended:
                # A guard's forward is a capture, emulated, real or rehearsed
                # (the guarded eager runs); an exempt eager piece runs outside it.
                return True
        elif _AS_CAPTURED and not _AS_CAPTURED[-1][0]:
            return True  # a reference run of the captured program (as_captured)
        # Outside, exactly what it did before (on a CPU-only build it raises).
        return original()

    return is_current_stream_capturing


def _host_wrappers() -> dict[str, tuple[Any, Any]]:
    """Method name -> (the original, a wrapper that reports it to the active guard)."""
    if not _WRAPPERS:
        for func, (reason, label) in _HOST_METHODS.items():
            original = getattr(torch.Tensor, func.__name__)
            _WRAPPERS[func.__name__] = (original, _reporting(original, reason, label))
    return _WRAPPERS


def _reporting(method: Any, reason: str, name: str) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return method(*args, **kwargs)
        guard = _ACTIVE[-1]
        guard.report(name, reason)
        # The aten op beneath (``_local_scalar_dense``) is the same event.
        guard._in_host_method += 1
        try:
            return method(*args, **kwargs)
        finally:
            guard._in_host_method -= 1

    return wrapper
