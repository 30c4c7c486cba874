"""Finding the operations that cannot live in a graph, and who called them.

A CUDA graph records kernel launches. Anything that needs the host to see a
value computed on the device (``.item()``, ``bool(tensor)``, an output whose
size depends on data) or that moves data between host and device cannot be
recorded. On a GPU such an op either fails deep inside the driver or, worse,
is recorded with a value frozen at capture. The guard sees every op before it
runs, so both backends can name the op, the submodule and the line that
called it instead.

On the emulator the graph's device is the CPU, so "host" and "device" cannot
be told apart by a tensor's device: there the guard goes by provenance
instead, and treats what the forward made from Python data (or with a
factory given no device) as host memory. While a guard is active the code it
watches is told that a stream is capturing, as a real capture would tell it.

This module holds the guard itself (``CaptureGuard``, ``GuardDispatchMode``,
``find_violations``); below it, importing none of it: ``rules.py`` (the rule
tables and their reasons, ``check_op``, how the learned capturability table
is consulted), ``tracker.py`` (``Violation``, the call site, the submodule
running), ``host.py`` (the host methods watched, the capturing query) and
``host_values.py`` (the emulator's rules of provenance). The guard lives here
rather than in a module of its own so that the names it reads are this
module's globals, as they were when the guard was one file: a test that
patches ``guard.capturability_table`` patches what ``check_dispatch`` calls.
The names other modules, tests and scripts import from here are re-exported
(the ``X as X`` form marks a re-export for mypy and ruff; ``__all__`` stays the
guard's face).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..capturability import REFUSED, Table, Verdict, pattern, value_rule
from ..observe import DispatchMode, ForwardObserver, internal_error
from . import host
from .host import _while_running
from .host import as_captured as as_captured
from .host import host_methods_watched as host_methods_watched
from .host_values import _HostValueMode
from .rules import _DATA_DEPENDENT as _DATA_DEPENDENT
from .rules import _DATA_TO_DEVICE_REASON as _DATA_TO_DEVICE_REASON
from .rules import _LIST_INDEX_REASON as _LIST_INDEX_REASON
from .rules import _MOVE_REASON as _MOVE_REASON
from .rules import _ONE_HOT_REASON as _ONE_HOT_REASON
from .rules import _OPERAND_REASON as _OPERAND_REASON
from .rules import _WHERE_REASON as _WHERE_REASON
from .rules import _WRITE_REASON as _WRITE_REASON
from .rules import (
    _WRITES,
    _any_on_cpu,
    _decisive,
    _held_on_device,
    _is_masked_fill,
    _is_view,
    _on_cpu,
    _refused,
    _storage_key,
    _written_value,
)
from .rules import SPARSE_REASON as SPARSE_REASON
from .rules import capturability_table as capturability_table
from .rules import check_op as check_op
from .rules import no_capturability_table as no_capturability_table
from .rules import not_strided as not_strided
from .rules import tensors_in as tensors_in
from .tracker import ModuleTracker, Violation
from .tracker import call_site as call_site

__all__ = ["CaptureGuard", "GuardDispatchMode", "ModuleTracker", "Violation", "find_violations"]

aten = torch.ops.aten


class CaptureGuard:
    """Checks every op while the module runs; raises or collects violations.

    With ``collect=False`` (used during capture) the first violation raises
    through ``on_violation`` before the op runs, so the device never sees it.
    With ``collect=True`` every violation is listed and the op still runs
    eagerly, so one pass finds them all.
    """

    def __init__(
        self,
        tracker: ModuleTracker,
        device: torch.device,
        *,
        on_violation: Callable[[Violation], None] | None = None,
        observer: ForwardObserver | None = None,
        rules: bool = True,
    ) -> None:
        self.tracker = tracker
        self.device = device
        self.on_violation = on_violation
        #: Every op is held to the rules and the learned table (``check_dispatch``). False (a CUDA
        #: capture of the checked sequence after its first, see ``Capture._capture_one``): the ops
        #: are still observed and what they read kept alive, and the host methods still watched,
        #: but what a graph cannot hold is left to the device to refuse, then named. The emulator's
        #: capture always applies them: its CPU refuses nothing.
        self.rules = rules
        #: Sees every op the guard sees (the module's writes, its precision).
        self.observer = observer
        self.violations: list[Violation] = []
        self._in_host_method = 0
        #: Above zero while a submodule that runs eagerly anyway (a PIECEWISE
        #: graph's eager piece) is running: its ops are not the graph's.
        self.suspended = 0
        #: On the emulator the graph's device is the CPU: host memory is told
        #: apart by provenance (see _HostValueMode), not by device.
        self.by_provenance = device.type == "cpu"
        #: Storage key -> a tensor made on the host during the forward, held
        #: weakly: a strong hold would keep the emulator from moving a
        #: capture's memory into its pool. An entry leaves with its tensor,
        #: so a storage freed and reused by a graph tensor is not mistaken.
        self.host_made: dict[int, weakref.ref[torch.Tensor]] = {}

    @contextlib.contextmanager
    def exempt(self, modules: list[torch.nn.Module]) -> Iterator[None]:
        """Report nothing while any of ``modules`` runs."""

        def count(step: int) -> None:
            self.suspended += step

        try:
            with _while_running(modules, count):
                yield
        finally:
            self.suspended = 0

    def report(self, op: str, reason: str) -> None:
        if self.suspended:
            return
        violation = Violation(
            op=op, reason=reason, module_path=self.tracker.path, location=call_site(sys._getframe(1))
        )
        if violation not in self.violations:
            self.violations.append(violation)
        if self.on_violation is not None:
            self.on_violation(violation)

    def check_dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.observer is not None and not self.suspended:
            try:
                self.observer.observe(func, args, kwargs)
            except Exception as exc:  # the harness's own bookkeeping, not the module's op
                internal_error(f"observing {func} under the capture guard", exc)
        if self._in_host_method:
            return  # already reported under its Python name
        if not self.rules:
            return
        if self.by_provenance:
            layout = not_strided(tensors_in(args, kwargs))
            if layout is not None:
                self.report(str(func), SPARSE_REASON.format(layout=layout))
                return
        if (
            self.by_provenance
            and self.host_made
            and _is_masked_fill(getattr(func, "overloadpacket", None), args, kwargs)
        ):
            value = _written_value(func.overloadpacket, 2, args, kwargs)
            if _storage_key(value) in self.host_made:
                return  # `t[mask] = 0.0` with a number made on the host: masked_fill_ on a GPU
        table = capturability_table()
        if table is not None and (self.by_provenance or _decisive(table, func)):
            if not self.by_provenance and _held_on_device(table, func) and not _any_on_cpu(args, kwargs):
                # The capture's hot path: no host tensor among the arguments, and the table refuses
                # no pattern of this op without one (nor has it a value rule), so its verdict can only
                # be held or unknown, and the rules below decide either way unless they find
                # something; only then is the pattern built, for the verdict that outranks them.
                found = check_op(func, args, kwargs, self.device)
                if found is None:
                    return
            learned = self._learned(table, func, args, kwargs, exact=True)
            if learned is not None:
                # What a GPU did with this op and these kinds of arguments outranks the rules below,
                # which are written for the general case (a boolean mask on the host is no sync).
                if learned.kind == REFUSED:
                    self.report(*_refused(table, func, learned))
                return
        found = check_op(func, args, kwargs, self.device)
        if found is None and self.by_provenance:
            if func is aten.lift_fresh.default:
                # Python data made a tensor (torch.tensor, as_tensor, the value
                # of `t[i] = 3.0`): on a GPU it would be host memory.
                self.mark_host(args[0])
                return
            if self.host_made:
                found = self._check_host_values(func, args, kwargs)
        if (
            found is None
            and self.by_provenance
            and not self.suspended
            and table is not None
            and not _is_view(func)
        ):
            # On the emulator, what its CPU cannot refuse: what a GPU refused when the table was
            # learned. An op the table does not cover is kept as not known (the report says so).
            verdict = self._learned(table, func, args, kwargs, exact=False)
            if verdict is None:
                self.tracker.not_known.setdefault(str(func), self.tracker.path)
            elif verdict.kind == REFUSED:
                found = _refused(table, func, verdict)
        if found is not None:
            self.report(*found)

    def _learned(self, table: Table, func: Any, args: Any, kwargs: Any, *, exact: bool) -> Verdict | None:
        if self.by_provenance:
            is_host = (lambda t: _storage_key(t) in self.host_made) if self.host_made else None
        else:
            is_host = _on_cpu
        letters = pattern(args, kwargs, is_host)
        if "h" not in letters:
            # Where shapes or values decide (an isin's sizes, an LU's shape), the op's value rule
            # outranks what the table learned for the pattern.
            ruled = value_rule(str(func), args, kwargs)
            if ruled is not None:
                return ruled
        return table.verdict(str(func), letters, exact=exact)

    # -- host-made values (the emulator) ------------------------------------
    def mark_host(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and not self.suspended:
            key = _storage_key(t)
            host = self.host_made

            def forget(ref: weakref.ref[torch.Tensor]) -> None:
                if host.get(key) is ref:
                    del host[key]

            host[key] = weakref.ref(t, forget)

    def unmark_host(self, t: torch.Tensor) -> None:
        self.host_made.pop(_storage_key(t), None)

    def is_host(self, t: torch.Tensor) -> bool:
        return bool(self.host_made) and _storage_key(t) in self.host_made

    def _check_host_values(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, str] | None:
        """The emulator's version of the CUDA rules in ``check_op``, with "made on
        the host in this forward" standing in for "on the CPU"."""
        tensors = tensors_in(args, kwargs)
        host = self.host_made
        on_host = [t for t in tensors if _storage_key(t) in host]
        if not on_host or len(on_host) == len(tensors):
            return None  # no host value, or an op of the host's own: nothing the graph records
        packet = getattr(func, "overloadpacket", None)
        position = _WRITES.get(packet)
        if position is not None:
            dest = args[0] if args else None
            value = _written_value(packet, position, args, kwargs)
            if (
                isinstance(dest, torch.Tensor)
                and _storage_key(dest) not in host
                and isinstance(value, torch.Tensor)
                and _storage_key(value) in host
            ):
                return str(func), _WRITE_REASON
        if packet is aten.where and any(t.dim() == 0 for t in on_host):
            return str(func), _WHERE_REASON
        if any(t.dim() > 0 for t in on_host):
            return str(func), _OPERAND_REASON
        # A 0-dim host tensor as a plain operand (x * torch.tensor(2.0)) is a
        # CPU scalar on a GPU, passed to the kernel by value.
        return None

    @contextlib.contextmanager
    def function_mode(self) -> Iterator[None]:
        """Report the Python-level tensor methods that hand device data to the host.

        The eight methods are replaced on ``torch.Tensor`` (see
        ``host_methods_watched``) rather than watched through a
        ``TorchFunctionMode``: a mode sees every torch call, which doubles the
        cost of a capture, while these wrappers cost nothing to the calls they
        do not name. They report to the innermost active guard.

        While it is active ``torch.cuda.is_current_stream_capturing()`` answers
        True (see ``host_methods_watched``), and on the emulator a cheap
        function mode (``_HostValueMode``) follows the values made on the host.
        """
        with host_methods_watched():
            host._ACTIVE.append(self)
            try:
                if self.by_provenance:
                    # Only the emulator pays for a function mode: there a
                    # tensor's device cannot say whether it is host memory.
                    with _HostValueMode(self):
                        yield
                else:
                    yield
            finally:
                host._ACTIVE.pop()


class GuardDispatchMode(DispatchMode):
    """A dispatch mode that checks every ATen op against the guard.

    With ``keep_alive`` it also collects every tensor an op reads that was not
    made during this capture, for the graph to hold (see
    ``CapturedGraph.hold``).
    """

    def __init__(self, guard: CaptureGuard, keep_alive: list[torch.Tensor] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.guard = guard
        self.keep_alive = keep_alive
        self._made: set[int] = set()
        self._kept: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.guard.check_dispatch(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if self.guard.device.type == "cuda" and _capturing(self.guard.device):
                # The op itself failed the capture (a sync or a pageable copy inside its kernel
                # code): a finding that names it, with CUDA's own words, not a raw exception.
                lines = str(exc).strip().splitlines()
                self.guard.report(
                    str(func), f"a CUDA graph capture refuses it: {lines[0] if lines else type(exc).__name__}"
                )
            raise
        if self.guard.observer is not None:
            try:
                self.guard.observer.after(func, out)
            except Exception as exc:  # the harness's own bookkeeping, not the module's op
                internal_error(f"observing {func}'s result under the capture guard", exc)
        if self.guard.by_provenance:
            layout = not_strided(tree_flatten(out)[0])
            if layout is not None:
                self.guard.report(str(func), SPARSE_REASON.format(layout=layout))
        if self.keep_alive is not None:
            made, kept = self._made, self._kept
            for t in tensors_in(args, kwargs):
                key = _address(t)
                if key not in made and key not in kept:
                    kept.add(key)
                    self.keep_alive.append(t)
            if isinstance(out, torch.Tensor):
                made.add(_address(out))
            elif isinstance(out, (list, tuple)):
                for t in tensors_in(out, None):
                    made.add(_address(t))
        return out


def _address(t: torch.Tensor) -> int:
    """Where a tensor's memory is (a sparse tensor, with no one storage, is itself)."""
    return id(t) if t.layout != torch.strided else int(t.untyped_storage().data_ptr())


def _capturing(device: torch.device) -> bool:
    """Whether the current stream is capturing, asked of CUDA itself (the Python query may be
    answered by as_captured)."""
    query = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    try:
        return bool(query()) if query is not None else False
    except RuntimeError:
        return False


class _FirstFound(Exception):
    """Stops a forward at its first violation, before the op runs."""


def _stop(_violation: Violation) -> None:
    raise _FirstFound


def find_violations(
    forward: Callable[[], object],
    tracker: ModuleTracker,
    device: torch.device,
    *,
    exempt: Sequence[torch.nn.Module] = (),
    first_only: bool = False,
    observer: ForwardObserver | None = None,
) -> list[Violation]:
    """Run ``forward`` eagerly under the full guard and return the ops a graph cannot hold, in the order met.

    The full guard sees every ATen op, the host methods (``.item()``,
    ``bool(tensor)``, ...) and, on the emulator, the values made on the host;
    ``tracker`` names the submodule of each op. ``exempt`` modules run eagerly
    anyway (a PIECEWISE graph's eager pieces): their ops are not the graph's.
    ``device`` is the graph's device (the CPU on the emulator).

    ``first_only``: stop the forward at the first violation, before that op
    runs (a diagnosis needs one name, and on a GPU the op is not run); a
    failure of the forward after a violation was met then returns that
    violation. Otherwise every violation is listed (each op still runs) and
    a failure of the forward propagates; either way ``tracker.failed_path``
    then names the submodule that was running.
    """
    guard = CaptureGuard(tracker, device, on_violation=_stop if first_only else None, observer=observer)
    try:
        with tracker.track(), guard.exempt(list(exempt)), guard.function_mode(), GuardDispatchMode(guard):
            forward()
    except _FirstFound:
        pass
    except Exception:
        # A module may catch the stop and fail another way: the op met first is still the answer.
        if not (first_only and guard.violations):
            raise
    return guard.violations[:1] if first_only else guard.violations
