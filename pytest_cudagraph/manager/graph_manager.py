"""The graph manager: wrap a module, capture every descriptor, run real batches."""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..backends.base import Backend, CapturedGraph, make_backend, resolve_checked
from ..backends.guard import CaptureGuard, GuardDispatchMode, ModuleTracker, Violation, host_methods_watched
from ..context import running
from ..errors import CaptureError
from ..plan import Batch, BatchDescriptor, CaptureConfig, CapturePlan, GraphMode
from . import tree
from .layout import PROBES, InputSpec, MakeInputsError, PadValue, call_make_inputs, infer_layout, not_a_module
from .pieces import EagerPieceError, EagerSpec, capture_in_pieces, piece_of, resolve_eager_submodules

__all__ = ["Batch", "GraphManager"]

CountKind = Literal["tokens", "reqs"]
# How one output leaf is cut to a real batch: each dimension that follows a
# count, cut to the batch's real count; () returns the leaf whole.
OutCut = tuple[tuple[int, CountKind], ...]

# run_batch's keyword defaults; its hot path keys other values apart.
_DEFAULT_BATCH_ARGS = (None, None, 0, None, 1)


# What every nn.Module keeps in its __dict__ (hook tables, the parameter and
# buffer dicts, ...): never user state, so never walked.
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)  # also the checks' (side_outputs)


def _tensor_holders(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, list[str]]]:
    """Each module with the names of its own attributes (not nn.Module's
    bookkeeping): read once a capture sequence, so that each graph's walk
    over them is short."""
    return [(sub, [k for k in sub.__dict__ if k not in MODULE_INTERNALS]) for sub in modules]


def _tensors_of(holders: list[tuple[torch.nn.Module, list[str]]]) -> list[Any]:
    """Every tensor the modules hold now: parameters, buffers and tensor attributes."""
    found: list[Any] = []
    for sub, names in holders:
        found.extend(sub._parameters.values())
        found.extend(sub._buffers.values())
        attrs = sub.__dict__
        for name in names:
            value = attrs.get(name)
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
            elif isinstance(value, dict):
                found.extend(v for v in value.values() if isinstance(v, torch.Tensor))
    return found


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Put the module's buffers back as they were when the block ends: for
    forwards run only to learn something (shapes, memory), not for their effect."""
    snapshot = {name: t.detach().clone() for name, t in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, t in module.named_buffers():
                if name in snapshot:
                    t.copy_(snapshot[name])


class _Uncapturable(Exception):
    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation


def _raise_violation(violation: Violation) -> None:
    raise _Uncapturable(violation)


@dataclass
class _Entry:
    """A captured descriptor: its graph, inputs and how to cut its outputs."""

    graph: CapturedGraph
    num_reqs: int  # request rows the graph was captured with
    out_dims: list[OutCut]  # per output leaf (tree.flatten's order)
    sample: dict[str, Any]  # the make_inputs batch the graph was captured on

    def __post_init__(self) -> None:
        # The output tensors never change (replay rewrites them in place), so
        # their structure is taken apart once, not on every run().
        self.leaves, self.structure = tree.flatten(self.graph.output)
        self.single = isinstance(self.graph.output, torch.Tensor)
        # (real tokens, real requests) -> the output leaves cut to them (views)
        self.cuts: dict[tuple[int, int], list[Any]] = {}


@dataclass
class _LoadPlan:
    """Where a batch of one shape goes for one descriptor: views of the static
    buffers, made once (on the replay path a slice costs as much as a copy's
    launch)."""

    # (input name, its real rows in the static buffer, the padded rows or None, pad value)
    loads: list[tuple[str, torch.Tensor, torch.Tensor | None, PadValue]]
    masks: list[tuple[torch.Tensor, bool]]  # is_padding views and the value they get

    def apply(self, inputs: Mapping[str, Any]) -> None:
        """Copy the real rows in and pad the rest."""
        for name, head, tail, pad in self.loads:
            value = inputs[name]
            head.copy_(value)
            if tail is not None:
                if pad == "edge":
                    tail.copy_(value[-1:].expand_as(tail))
                else:
                    tail.fill_(pad)
        for mask, flag in self.masks:
            mask.fill_(flag)


@dataclass
class _BlockLoadPlan(_LoadPlan):
    """A load plan with inputs the row plan cannot take: its own class, so
    that batches of the usual inputs pay nothing for them on the replay path."""

    # (input name, its real block, its descriptor's whole window or None, pad
    # value): several dimensions follow the batch (a square mask), so the
    # window is filled and the real block written over it.
    blocks: list[tuple[str, torch.Tensor, torch.Tensor | None, int | float | bool]]
    # (input name, real part, padded part, dimension): "edge" padding along a
    # dimension other than the first.
    edges: list[tuple[str, torch.Tensor, torch.Tensor, int]]

    def apply(self, inputs: Mapping[str, Any]) -> None:
        for name, real, window, pad in self.blocks:
            if window is not None:
                window.fill_(pad)
            real.copy_(inputs[name])
        for name, head, tail, dim in self.edges:
            value = inputs[name]
            head.copy_(value)
            tail.copy_(value.narrow(dim, value.shape[dim] - 1, 1).expand_as(tail))
        super().apply(inputs)


@dataclass
class _Hot:
    """What run() decided for a batch shape: the graph, and the views it copies into and cuts."""

    entry: _Entry
    load: _LoadPlan
    cut: list[Any]


class GraphManager:
    """Captures a module as one graph per descriptor and replays real batches.

    ``make_inputs(num_tokens, num_reqs) -> dict`` builds keyword inputs for
    ``module.forward`` at any shape; the manager learns which inputs follow
    tokens, requests or neither, and allocates static buffers at the largest
    shape once. ``config`` is a ``CaptureConfig`` (or a mapping of its
    keywords). ``backend`` is ``"cuda"``, ``"emulate"`` (CPU) or ``"auto"``.

    Outputs of ``run`` are owned by the caller (copies of the real rows)
    unless ``output_views=True``: then they are views of graph memory, valid
    until the next ``run`` of any descriptor.

    ``checked_capture`` (CUDA): False (the default) captures as fast as a
    hand-written loop; an op that cannot be captured fails the capture, and
    the manager then names it, with its submodule, by an eager run under the
    guard. True routes every op of the capture through the guard, which names
    such an op before the device sees it and keeps every tensor the graph
    reads alive with it (``verify()`` and the plugin's fixtures capture this
    way). ``PYTEST_CUDAGRAPH_CAPTURE=fast|checked`` overrides both.

    ``measure_device_memory=True`` also records, per graph, the device memory
    the driver took (``device_memory``), at about a millisecond a capture.

    ``eager_submodules`` (module types, dotted names, or a predicate
    ``(name, module) -> bool``): in PIECEWISE descriptors the forward is
    captured as graph segments with these submodules run eagerly between them
    on every replay, on what the previous segment computed from the real
    batch; FULL descriptors still capture them inside the one graph.

    ``pad_values`` maps input names to the value padded rows get (default 0;
    ``"edge"`` repeats the last real row). If ``module.forward`` takes an
    ``is_padding`` argument that ``make_inputs`` does not give, the manager
    passes a bool mask with True on padded token rows.

    The dimensions of each input that follow ``num_tokens`` or ``num_reqs``
    are learned at two probe shapes, in any position (``input_ids`` of shape
    ``(1, T)``); ``batch_dims`` names the one such dimension of an input
    outright, and the probes are checked against it. An input with several
    (a square ``(T, T)`` mask) is padded as a block and needs its pad value
    given in ``pad_values``: what a padded mask entry holds is semantics.
    Outputs are cut along every dimension the probes show to be the token or
    request count, in tuples, lists, dicts, namedtuples, transformers'
    ``ModelOutput`` and dataclasses, and come back in the same structure.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        config: CaptureConfig | Mapping[str, Any],
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        pad_values: Mapping[str, PadValue] | None = None,
        output_views: bool = False,
        progress: bool | None = None,
        measure_device_memory: bool = False,
        checked_capture: bool | None = None,
        eager_submodules: EagerSpec = None,
        batch_dims: Mapping[str, int] | None = None,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise ValueError(not_a_module(module))
        if not callable(make_inputs):
            raise ValueError("make_inputs must be a callable (num_tokens, num_reqs) -> dict of inputs")
        if isinstance(config, Mapping):
            keywords = dict(config)
            try:
                config = CaptureConfig(**keywords)
            except TypeError as exc:
                raise ValueError(
                    f"config {keywords!r} is not a CaptureConfig's keywords ({exc}); it needs "
                    "capture_sizes and max_num_reqs, and may set mode, decode_query_len, lora_cases, ..."
                ) from None
        if not isinstance(config, CaptureConfig):
            raise ValueError(f"config must be a CaptureConfig or a dict of its keywords; got {type(config).__name__}")
        self.module = module
        self.config = config
        self.plan = CapturePlan(config)
        self.output_views = bool(output_views)
        self.progress = progress
        self._pad_values = dict(pad_values or {})
        if batch_dims is not None and not isinstance(batch_dims, Mapping):
            raise ValueError(
                f"batch_dims must map input names to the one dimension that follows the batch, "
                f"e.g. {{'input_ids': 1}}; got {type(batch_dims).__name__}"
            )
        self._batch_dims = dict(batch_dims or {})
        self._check_not_meta()
        self._backend: Backend = make_backend(backend, device if device is not None else self._module_device())
        self._backend.measure_device_memory = bool(measure_device_memory)
        self._backend.checked = resolve_checked(checked_capture, default=False)
        self.device = self._backend.device
        self._check_module_device()

        self._make_inputs = make_inputs
        #: Set by the first capture(): run() before any capture is a mistake, told.
        self._capture_called = False
        self.max_tokens = config.largest_capture_size
        self.max_reqs = min(self.max_tokens, config.max_num_reqs)
        self._inputs = infer_layout(
            make_inputs,
            max_tokens=self.max_tokens,
            max_reqs=self.max_reqs,
            device=self.device,
            pad_values=pad_values or {},
            batch_dims=self._batch_dims,
        )
        self._tensor_specs = [(n, spec) for n, spec in self._inputs.items() if spec.kind != "const"]
        self._tensor_names = {n for n, _ in self._tensor_specs}
        # (descriptor tokens, its request rows, real tokens, real requests) -> views to load
        self._plans: dict[tuple[int, int, int, int], _LoadPlan] = {}
        # run()'s hot path: the input shapes of a batch seen before -> what
        # dispatch, validation and padding decided for it (see run_batch).
        self._hot: dict[tuple[Any, ...], _Hot] = {}
        self._probed_rows: list[OutCut] | None = None
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._is_padding: torch.Tensor | None = None
        if "is_padding" not in self._inputs and self._forward_takes("is_padding"):
            self._is_padding = torch.zeros(self.max_tokens, dtype=torch.bool, device=self.device)
        self._entries: dict[BatchDescriptor, _Entry] = {}
        self._tracker = ModuleTracker(module)
        self._eager_spec = eager_submodules
        self.eager_pieces = resolve_eager_submodules(module, eager_submodules)
        # The module tree and its attribute names, read at each capture().
        self._holders: list[tuple[torch.nn.Module, list[str]]] = []
        self.capture_seconds = 0.0

    def sibling(self) -> GraphManager:
        """A new, uncaptured manager over the same module, inputs and settings."""
        return GraphManager(
            self.module,
            self._make_inputs,
            self.config,
            backend=self.backend,
            device=self.device,
            pad_values=self._pad_values,
            output_views=self.output_views,
            progress=False,
            measure_device_memory=self._backend.measure_device_memory,
            checked_capture=self._backend.checked,
            eager_submodules=self._eager_spec,
            batch_dims=self._batch_dims,
        )

    # -- set-up helpers -------------------------------------------------
    def _module_device(self) -> torch.device | None:
        for param in self.module.parameters():
            return param.device
        for buffer in self.module.buffers():
            return buffer.device
        return None

    def _check_not_meta(self) -> None:
        tensors: list[tuple[str, torch.Tensor]] = [*self.module.named_parameters(), *self.module.named_buffers()]
        for name, tensor in tensors:
            if tensor.device.type == "meta":
                raise ValueError(
                    f"module tensor '{name}' is on meta, the device that holds no data, so nothing can be "
                    "run or compared; materialise the module first (module.to_empty(device=...) and load "
                    "its weights, or build it on a real device)"
                )

    def _check_module_device(self) -> None:
        tensors: list[tuple[str, torch.Tensor]] = [*self.module.named_parameters(), *self.module.named_buffers()]
        for name, tensor in tensors:
            if tensor.device != self.device and not (
                tensor.device.type == self.device.type == "cpu"
            ):
                raise ValueError(
                    f"module tensor '{name}' is on {tensor.device}, but the {self.backend} "
                    f"backend runs on {self.device}; move the module with module.to('{self.device}')"
                )

    def _forward_takes(self, name: str) -> bool:
        try:
            params = inspect.signature(self.module.forward).parameters
        except (TypeError, ValueError):
            return False
        return name in params

    # -- inspection -----------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend's name: 'cuda' or 'emulate'."""
        return self._backend.name

    @property
    def input_specs(self) -> Mapping[str, InputSpec]:
        """Each input's layout and static buffer."""
        return dict(self._inputs)

    @property
    def static_inputs(self) -> dict[str, torch.Tensor]:
        """The static input buffers, by name (their addresses never change)."""
        buffers = {n: s.buffer for n, s in self._inputs.items() if s.buffer is not None}
        if self._is_padding is not None:
            buffers["is_padding"] = self._is_padding
        return buffers

    @property
    def uses_padding_mask(self) -> bool:
        """Whether the manager passes an ``is_padding`` mask to ``forward``."""
        return self._is_padding is not None

    @property
    def make_inputs(self) -> Callable[[int, int], Mapping[str, Any]]:
        """``make_inputs``, checked: a call whose keys differ from the layout's raises ``ValueError``."""
        return self._checked_make_inputs

    def _checked_make_inputs(self, num_tokens: int, num_reqs: int) -> dict[str, Any]:
        inputs = call_make_inputs(self._make_inputs, num_tokens, num_reqs)
        if inputs.keys() != self._inputs.keys():
            missing = sorted(n for n in self._inputs if n not in inputs)
            extra = sorted(n for n in inputs if n not in self._inputs)
            raise MakeInputsError(
                f"make_inputs(num_tokens={num_tokens}, num_reqs={num_reqs}) returned inputs {sorted(inputs)}, "
                f"but at the probe and largest shapes it returned {sorted(self._inputs)} "
                f"(missing {missing}, new {extra}); make_inputs must return the same keys at every shape"
            )
        return inputs

    @property
    def captured(self) -> bool:
        return bool(self._entries)

    @property
    def captured_descriptors(self) -> tuple[BatchDescriptor, ...]:
        """Descriptors with a live graph, in capture order."""
        return tuple(self._entries)

    def graph(self, desc: BatchDescriptor) -> CapturedGraph:
        """The captured graph of ``desc`` (KeyError if it has none)."""
        return self._entries[desc].graph

    def capture_sample(self, desc: BatchDescriptor) -> dict[str, Any]:
        """The inputs ``desc`` was captured on (``make_inputs`` at its own shape)."""
        return self._entries[desc].sample

    @property
    def graph_memory(self) -> dict[BatchDescriptor, int]:
        """Bytes of graph memory (pool growth) each capture added."""
        return {d: e.graph.nbytes for d, e in self._entries.items()}

    @property
    def device_memory(self) -> dict[BatchDescriptor, int]:
        """Device memory each capture took, the driver's share for the graph included."""
        return {d: e.graph.device_bytes for d, e in self._entries.items()}

    # -- capture --------------------------------------------------------
    def capture_reqs(self, desc: BatchDescriptor) -> int:
        """Request rows a descriptor is captured with (PIECEWISE: as many as fit)."""
        if desc.num_reqs is not None:
            return desc.num_reqs
        return min(desc.num_tokens, self.config.max_num_reqs)

    def forward_inputs(self, num_tokens: int, num_reqs: int) -> dict[str, Any]:
        """The keyword inputs a graph of that shape reads: views of the static buffers."""
        kwargs: dict[str, Any] = {}
        for name, spec in self._inputs.items():
            if spec.kind == "const":
                kwargs[name] = spec.value
            else:  # the whole buffer when fixed, else its window for this shape
                kwargs[name] = spec.window(num_tokens, num_reqs)
        if self._is_padding is not None:
            kwargs["is_padding"] = self._is_padding[:num_tokens]
        return kwargs

    def capture(self, descriptors: Iterable[BatchDescriptor] | None = None) -> None:
        """Capture every descriptor of the plan (or those given), largest first.

        Each descriptor is warmed up eagerly, then captured on the static
        buffers into one pool shared by all graphs. On failure every graph is
        released, ``CaptureError`` is raised, and the manager runs batches
        eagerly until a later ``capture()`` succeeds.
        """
        order = list(self.plan.capture_order if descriptors is None else descriptors)
        unknown = [d for d in order if d not in set(self.plan.descriptors)]
        if unknown:
            raise ValueError(f"descriptor {unknown[0]} is not in this manager's plan")
        if self._entries:
            self.release()
        self._hot.clear()
        # From here on run() may run eagerly (a failed or refused capture);
        # before any capture() it is a mistake (see run_batch).
        self._capture_called = True
        from .estimate import check_capture_memory  # refuses, with its estimate, what will not fit

        check_capture_memory(self, order)
        started = time.perf_counter()
        self._tracker.refresh()
        self._holders = _tensor_holders(list(self.module.modules()))
        # Submodules replaced since the last capture are found again.
        self.eager_pieces = resolve_eager_submodules(self.module, self._eager_spec)
        # No cyclic garbage collection while the sequence runs: a collected
        # graph of another manager, captured on a stream PyTorch's stream pool
        # also handed to this one, would drop that stream's cuBLAS workspace
        # in the middle of it (pytorch#193402).
        collecting = gc.isenabled()
        gc.disable()
        try:
            if self._probed_rows is None:
                self._probed_rows = self._probe_output_rows()
            self._backend.begin()
            with host_methods_watched():  # once for the sequence: see its docstring
                for desc in self._progress(order):
                    self._capture_one(desc)
            self._backend.finish()
        except BaseException:
            self.release()
            raise
        finally:
            if collecting:
                gc.enable()
        if self._probed_rows is None:
            self._settle_row_kinds()
        self.capture_seconds = time.perf_counter() - started

    def _progress(self, order: list[BatchDescriptor]) -> Iterable[BatchDescriptor]:
        show = self.progress
        if show is None:
            show = len(order) >= 16 and sys.stderr.isatty()
        if not show:
            return order
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is a dependency, but progress is optional
            return order
        bar: Iterable[BatchDescriptor] = tqdm(order, desc=f"Capturing graphs ({self.backend})", unit="graph")
        return bar

    def stage_sample(self, desc: BatchDescriptor) -> tuple[dict[str, Any], dict[str, Any]]:
        """``make_inputs`` at ``desc``'s own shape, loaded into the static buffers:
        (the sample, the keyword inputs a forward of that shape reads).

        Captures run on valid data of their very shape (indices in range, say):
        a prefix of the largest shape's inputs need not be valid.
        """
        reqs = self.capture_reqs(desc)
        sample = self._checked_make_inputs(desc.num_tokens, reqs)
        self.load_inputs(desc, sample, self.batch_of(sample, num_reqs=reqs))
        return sample, self.forward_inputs(desc.num_tokens, reqs)

    def _capture_one(self, desc: BatchDescriptor) -> None:
        reqs = self.capture_reqs(desc)
        sample, kwargs = self.stage_sample(desc)

        def forward() -> Any:
            with running(desc):
                return self.module(**kwargs)

        def diagnose() -> None:
            # Run the forward eagerly under the full guard: it names an op that
            # cannot be captured (raising _Uncapturable) before torch fails on it.
            full = CaptureGuard(self._tracker, self.device, on_violation=_raise_violation)

            exempt = self.eager_modules(desc)

            def guarded() -> Any:
                with full.exempt(exempt), full.function_mode(), GuardDispatchMode(full):
                    return forward()

            try:
                self._backend.warmup(guarded)
            except _Uncapturable:
                raise
            except Exception:
                # No op to name: the original error stands, and now we know
                # which submodule was running when it came.
                self._tracker.failed_path = self._tracker.path

        self._tracker.failed_path = ""
        holders = self._holders
        guard = CaptureGuard(self._tracker, self.device, on_violation=_raise_violation)
        try:
            try:
                # Warm-up and capture run as fast as the module allows: no
                # hooks on submodules. Only a failure pays for naming where
                # it came from, by an eager rerun under the tracker.
                self._backend.warmup(forward)
                held = _tensors_of(holders)
                graph = self._record(desc, forward, guard)
            except Exception as exc:
                with self._tracker.track():
                    diagnose()  # raises _Uncapturable naming op and submodule, if it can
                if isinstance(exc, _Uncapturable):
                    # The rerun did not meet the op again (it came from a
                    # capture-only branch): name what the capture saw.
                    raise _Uncapturable(Violation(exc.violation.op, exc.violation.reason,
                                                  self._tracker.failed_path, exc.violation.location)) from None
                raise
            # Tensors bound before capture are what the graph reads; those bound
            # during capture live in its own pool.
            graph.hold(held)
        except _Uncapturable as exc:
            v = exc.violation
            raise CaptureError(
                f"cannot capture {v.describe()} while capturing {desc} on the {self.backend} "
                f"backend. A graph cannot read device values on the host or size outputs "
                f"from data: keep shapes static and values on the device{self._piece_hint(desc, v.module_path)}",
                op=v.op, reason=v.reason, module_path=v.module_path, descriptor=desc, backend=self.backend,
            ) from None
        except CaptureError:
            raise
        except Exception as exc:
            where = self._tracker.failed_path or (exc.path if isinstance(exc, EagerPieceError) else "")
            raise CaptureError(
                f"capture of {desc} failed on the {self.backend} backend"
                f"{f' in submodule {where!r}' if where else ''}: {type(exc).__name__}: {exc}"
                f"{self._piece_hint(desc, where)}",
                module_path=where, descriptor=desc, backend=self.backend,
            ) from exc
        leaves = tree.leaves(graph.output)
        out_dims = self._row_kinds(leaves, desc.num_tokens, reqs)
        probed = self._probed_rows
        if probed is not None and len(probed) == len(out_dims):
            # What the probes learned, where this graph's leaf has those dimensions.
            out_dims = [
                p if isinstance(leaf, torch.Tensor) and all(d < leaf.dim() for d, _ in p) else own
                for p, own, leaf in zip(probed, out_dims, leaves, strict=True)
            ]
        self._entries[desc] = _Entry(graph, reqs, out_dims, sample)

    def _record(self, desc: BatchDescriptor, forward: Callable[[], Any], guard: CaptureGuard) -> CapturedGraph:
        """Capture ``desc``'s forward, whole or in pieces.

        The backend keeps the allocator's cache through a sequence (see
        CudaBackend.begin), and an allocation inside a capture cannot hand
        cached blocks back to the driver. So a capture that runs out of
        memory is tried once more after the cache is handed back, which is
        where torch.cuda.graph would have started it.
        """
        for last in (False, True):
            try:
                if self.eager_pieces and desc.mode is GraphMode.PIECEWISE:
                    return capture_in_pieces(self._backend, forward, guard, self.eager_pieces, desc)
                return self._backend.capture(forward, guard)
            except torch.OutOfMemoryError:
                # Retried outside this handler, once the traceback (and the
                # graph memory its frames hold) is gone.
                if last or not self._backend.trim():
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def eager_modules(self, desc: BatchDescriptor) -> list[torch.nn.Module]:
        """The submodules ``desc``'s graph runs eagerly: the eager pieces in a
        PIECEWISE graph, none in a FULL one. Their ops are not the graph's."""
        return [m for _, m in self.eager_pieces] if desc.mode is GraphMode.PIECEWISE else []

    def _piece_hint(self, desc: BatchDescriptor, path: str) -> str:
        # An eager piece runs eagerly only in PIECEWISE graphs; a FULL graph
        # holds the whole forward, pieces included.
        if desc.mode is GraphMode.PIECEWISE:
            return ""
        piece = piece_of(path, [p for p, _ in self.eager_pieces])
        if piece is not None:
            return (f". '{piece}' is an eager piece, but only PIECEWISE graphs run it eagerly: a FULL "
                    f"graph captures the whole forward. Make it capturable, or use mode='PIECEWISE' "
                    f"(no FULL graphs)")
        return ""

    @staticmethod
    def _row_kinds(leaves: list[Any], num_tokens: int, num_reqs: int) -> list[OutCut]:
        # From one descriptor alone, per output leaf: cut its leading dimension
        # to the real tokens, the real requests, or return it whole. When tokens
        # and requests are the same count, rows follow tokens, as hidden states
        # do in inference engines. A later dimension of the same size may be a
        # coincidence (a hidden size of 8 at 8 tokens): only several
        # descriptors tell (_settle_row_kinds).
        kinds: list[OutCut] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                kinds.append(())
            elif leaf.shape[0] == num_tokens:
                kinds.append(((0, "tokens"),))
            elif leaf.shape[0] == num_reqs:
                kinds.append(((0, "reqs"),))
            else:
                kinds.append(())
        return kinds

    def _probe_output_rows(self) -> list[OutCut] | None:
        """Which dimensions of each output leaf follow the token or request
        count, learned as the inputs' are: by running the module eagerly at the
        two probe shapes (state restored after).

        A descriptor alone cannot tell a per-request output from a per-token
        one when it holds as many tokens as requests. None if the module cannot
        run at the probe shapes; then each descriptor's own shapes decide. A
        leaf that changes with the batch in a way that follows neither count
        (a flattened ``2 * T``) cannot be cut to the real batch: ValueError.
        """
        outputs = []
        try:
            with buffers_restored(self.module):
                for num_tokens, num_reqs in PROBES:
                    kwargs = self.eager_kwargs(call_make_inputs(self._make_inputs, num_tokens, num_reqs), num_tokens)
                    marker = BatchDescriptor(mode=GraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs)
                    with torch.no_grad(), running(marker):
                        outputs.append(tree.flatten_with_paths(self.module(**kwargs)))
        except Exception:
            return None
        first, second = outputs
        if [p for p, _ in first] != [p for p, _ in second]:
            return None
        (t1, r1), (t2, r2) = PROBES
        kinds: list[OutCut] = []
        for (path, a), (_, b) in zip(first, second, strict=True):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or (a.dim() == 0 and b.dim() == 0):
                kinds.append(())
                continue
            dims: list[tuple[int, CountKind]] = []
            unrelated = a.dim() != b.dim()
            for d, (n1, n2) in enumerate(zip(a.shape, b.shape, strict=False)):
                if n1 == n2:
                    continue
                if (n1, n2) == (t1, t2):
                    dims.append((d, "tokens"))
                elif (n1, n2) == (r1, r2):
                    dims.append((d, "reqs"))
                else:
                    unrelated = True
            if unrelated:
                where = f"output {path}" if path else "the output"
                raise ValueError(
                    f"{where} has shape {tuple(a.shape)} at (num_tokens={t1}, num_reqs={r1}) and "
                    f"{tuple(b.shape)} at (num_tokens={t2}, num_reqs={r2}): it changes with the batch, but "
                    "not as num_tokens or num_reqs. The manager can only cut dimensions that follow "
                    "num_tokens or num_reqs (exactly that many) to a real batch's rows, and return the "
                    "others whole; return it unflattened (say (num_tokens, 2, ...) rather than "
                    "(2 * num_tokens, ...)), or compute it outside the captured module"
                )
            kinds.append(tuple(dims))
        return kinds

    def _settle_row_kinds(self) -> None:
        # One descriptor alone cannot tell an output of fixed size from one
        # that follows the batch when the sizes coincide. Across descriptors
        # it can: a leading dimension whose size never changes is returned
        # whole, and one that tracks the request count is cut by requests; a
        # later dimension is cut only when its size changes across
        # descriptors, each time as the token (or request) count.
        shapes: dict[int, list[tuple[tuple[int, ...], int, int]]] = {}
        for desc, entry in self._entries.items():
            for i, leaf in enumerate(entry.leaves):
                if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                    shapes.setdefault(i, []).append((tuple(leaf.shape), desc.num_tokens, entry.num_reqs))
        for i, seen in shapes.items():
            ndim = len(seen[0][0])
            if any(len(shape) != ndim for shape, _, _ in seen):
                continue  # no one layout across descriptors: each keeps its own
            lead: CountKind | Literal["whole"] | None = None  # None: each descriptor's own
            later: list[tuple[int, CountKind]] = []
            for d in range(ndim):
                sizes = [(shape[d], t, r) for shape, t, r in seen]
                follows_tokens = all(n == t for n, t, _ in sizes)
                follows_reqs = all(n == r for n, _, r in sizes)
                constant = len({n for n, _, _ in sizes}) == 1
                if d == 0:
                    if constant and not follows_tokens and not follows_reqs:
                        lead = "whole"
                    elif follows_reqs and not follows_tokens:
                        lead = "reqs"
                elif not constant and (follows_tokens or follows_reqs):
                    later.append((d, "tokens" if follows_tokens else "reqs"))
            for entry in self._entries.values():
                if i >= len(entry.leaves) or not isinstance(entry.leaves[i], torch.Tensor) \
                        or entry.leaves[i].dim() != ndim:
                    continue
                own = [(d, k) for d, k in entry.out_dims[i] if d == 0]
                if lead == "whole":
                    own = []
                elif lead == "reqs":
                    own = [(0, "reqs")]
                entry.out_dims[i] = (*own, *later)
                entry.cuts.clear()

    def release(self) -> None:
        """Drop every graph and the pool. Static buffers stay; capture() again works."""
        self._entries.clear()
        self._hot.clear()
        self._backend.release()

    def __enter__(self) -> GraphManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- running --------------------------------------------------------
    def dispatch(
        self,
        *,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> BatchDescriptor:
        """The plan's answer, or ``NONE`` when that descriptor has no live graph."""
        desc = self.plan.dispatch(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            uniform_token_count=uniform_token_count,
            num_active_loras=num_active_loras,
            max_query_len=max_query_len,
            num_ubatches=num_ubatches,
        )
        if desc.mode is GraphMode.NONE or desc in self._entries:
            return desc
        return BatchDescriptor(
            mode=GraphMode.NONE,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_active_loras=self.plan.effective_loras(num_active_loras),
            num_ubatches=num_ubatches,
        )

    def run(self, **inputs: Any) -> Any:
        """Run one real batch given as keyword inputs; see ``run_batch``."""
        # run_batch's hot path, inlined: this is the call a serving loop makes.
        try:
            hot = self._hot.get(tuple([inputs[name].shape for name, _ in self._tensor_specs]))
        except (KeyError, AttributeError):
            hot = None
        if hot is not None and inputs.keys() == self._tensor_names and self._same_kind(inputs):
            return self._replay_hot(hot, inputs)
        if not self._capture_called:
            raise self._not_captured("run()")
        return self.run_batch(inputs)

    def _not_captured(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"GraphManager.{what} was called before capture(): no graph exists yet, so the batch would run "
            "eagerly and nothing graph-related would be exercised; call manager.capture() first "
            "(manager.eager(**inputs) runs the module eagerly on purpose)"
        )

    def _same_kind(self, inputs: Mapping[str, Any]) -> bool:
        # What the shape key leaves out and a copy into the static buffers
        # would silently convert: dtype and device. Checked on every call.
        index = self._device_index
        for name, spec in self._tensor_specs:
            value = inputs[name]
            if value.dtype != spec.dtype:
                return False
            if (not value.is_cpu) if index < 0 else value.get_device() != index:
                return False
        return True

    def _make_hot(self, desc: BatchDescriptor, batch: Batch) -> _Hot:
        entry = self._entries[desc]
        return _Hot(entry, self._load_plan(desc, batch), self._cut_views(entry, batch))

    def _replay_hot(self, hot: _Hot, inputs: Mapping[str, Any]) -> Any:
        # Static buffers and graph outputs never require grad, so autograd has
        # nothing to record unless an input does; entering no_grad costs as
        # much as a kernel launch on this path, so only then.
        if torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values()
        ):
            with torch.no_grad():
                return self._replay_hot(hot, inputs)
        hot.load.apply(inputs)
        hot.entry.graph.replay()
        return self._owned(hot.entry, hot.cut)

    def run_batch(
        self,
        inputs: Mapping[str, Any],
        *,
        num_reqs: int | None = None,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> Any:
        """Dispatch a real batch, replay its graph (or run eagerly), return real rows.

        ``num_reqs`` defaults to what request-shaped inputs say, or to the
        token count (capped at ``max_num_reqs``) when there are none. Before
        the first ``capture()`` it raises ``RuntimeError`` (no graph could
        serve the batch; ``eager()`` runs eagerly on purpose); after a failed
        or released capture, batches run eagerly until the next capture.
        """
        if not self._capture_called:
            raise self._not_captured("run_batch()")
        key: tuple[Any, ...] | None = None
        if inputs.keys() == self._tensor_names:
            # The hot path: a batch of input shapes and arguments seen before
            # replays what validation and dispatch decided then. Shapes are the
            # key; dtype and device, which a copy into the static buffers would
            # silently convert, are checked on every call.
            try:
                key = tuple([inputs[name].shape for name, _ in self._tensor_specs])
                args = (num_reqs, uniform_token_count, num_active_loras, max_query_len, num_ubatches)
                if args != _DEFAULT_BATCH_ARGS:
                    key = (args, key)
                hot = self._hot.get(key)
            except (AttributeError, TypeError):  # not tensors, or unhashable: the slow path says why
                key = hot = None
            if hot is not None and self._same_kind(inputs):
                return self._replay_hot(hot, inputs)
        batch = self.batch_of(
            inputs,
            num_reqs=num_reqs,
            uniform_token_count=uniform_token_count,
            num_active_loras=num_active_loras,
            max_query_len=max_query_len,
            num_ubatches=num_ubatches,
        )
        desc = self.dispatch(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            uniform_token_count=batch.uniform_token_count,
            num_active_loras=batch.num_active_loras,
            max_query_len=batch.max_query_len,
            num_ubatches=batch.num_ubatches,
        )
        if desc.mode is GraphMode.NONE:
            return self._run_eager(inputs, batch, desc)  # not remembered: capture() may add its graph
        hot = self._make_hot(desc, batch)
        if key is not None:
            self._hot[key] = hot
        return self._replay_hot(hot, inputs)

    def batch_of(
        self,
        inputs: Mapping[str, Any],
        *,
        num_reqs: int | None = None,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> Batch:
        """Validate ``inputs`` against the static buffers and read the batch shape."""
        if inputs.keys() != self._tensor_names:  # fast path: exactly the tensor inputs
            missing = [n for n, _ in self._tensor_specs if n not in inputs]
            unknown = [n for n in inputs if n not in self._inputs]
            if missing or unknown:
                parts = []
                if missing:
                    parts.append(f"missing input(s) {missing}")
                if unknown:
                    parts.append(f"unknown input(s) {unknown}")
                raise ValueError(f"{' and '.join(parts)}; the module's inputs are {list(self._inputs)}")
            for name, value in inputs.items():
                spec = self._inputs[name]
                if spec.kind == "const" and value is not spec.value and value != spec.value:
                    raise ValueError(
                        f"input '{name}' is {value!r}, but the graphs froze it at {spec.value!r} "
                        "during capture (a Python value is not read on replay); pass it as a tensor"
                    )
        num_tokens = -1
        token_input = ""
        from_inputs: int | None = None
        reqs_input = ""
        for name, spec in self._tensor_specs:
            value = inputs[name]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"input '{name}' must be {spec.expected()}; got {type(value).__name__}")
            if value.dtype != spec.dtype:
                raise ValueError(f"input '{name}' has dtype {value.dtype}; expected {spec.expected()}")
            # Cheaper than comparing torch.device objects, on the replay path.
            on_device = value.is_cpu if self._device_index < 0 else value.get_device() == self._device_index
            if not on_device:
                raise ValueError(
                    f"input '{name}' is on {value.device}; the graphs read it from {self.device}: "
                    f"move it with .to('{self.device}')"
                )
            shape = value.shape
            assert spec.buffer is not None  # every tensor input has its buffer
            full = spec.buffer.shape
            if spec.kind == "fixed":
                if shape != full:
                    raise ValueError(f"input '{name}' has shape {tuple(shape)}; expected {spec.expected()}")
                continue
            following = spec.following
            if len(shape) != len(full) or any(
                n != m for d, (n, m) in enumerate(zip(shape, full, strict=True)) if d not in following
            ):
                raise ValueError(f"input '{name}' has shape {tuple(shape)}; expected {spec.expected()}")
            for d, kind, offset in spec.dims:
                count = shape[d] - offset
                # Which input (and, past the first, which dimension) said so.
                said = f"'{name}'" if d == 0 else f"'{name}' (dimension {d})"
                if kind == "tokens":
                    if num_tokens >= 0 and count != num_tokens:
                        raise ValueError(f"inputs disagree on num_tokens: {token_input} says {num_tokens}, "
                                         f"{said} says {count}")
                    num_tokens, token_input = count, said
                else:
                    if from_inputs is not None and count != from_inputs:
                        raise ValueError(f"inputs disagree on num_reqs: {reqs_input} says {from_inputs}, "
                                         f"{said} says {count}")
                    from_inputs, reqs_input = count, said
        if num_tokens < 0:
            raise ValueError("no input follows num_tokens, so the batch's token count is unknown")
        if from_inputs is not None:
            if num_reqs is not None and num_reqs != from_inputs:
                raise ValueError(f"num_reqs={num_reqs} but request-shaped inputs hold {from_inputs} rows")
            num_reqs = from_inputs
        elif num_reqs is None:
            num_reqs = min(num_tokens, self.config.max_num_reqs)
        if num_tokens < 1:
            raise ValueError(f"the batch has {num_tokens} tokens; a batch needs at least one")
        if num_reqs > self.config.max_num_reqs:
            raise ValueError(
                f"the batch has {num_reqs} requests, above max_num_reqs={self.config.max_num_reqs}"
            )
        batch = Batch(num_tokens=num_tokens, num_reqs=num_reqs, uniform_token_count=uniform_token_count,
                      num_active_loras=num_active_loras, max_query_len=max_query_len, num_ubatches=num_ubatches)
        # Validates counts (num_reqs <= num_tokens, non-negative, ...).
        self.plan.dispatch(
            num_reqs=num_reqs, num_tokens=num_tokens, uniform_token_count=uniform_token_count,
            num_active_loras=num_active_loras, max_query_len=max_query_len, num_ubatches=num_ubatches,
        )
        return batch

    def eager_kwargs(self, inputs: Mapping[str, Any], num_tokens: int) -> dict[str, Any]:
        """Keyword arguments for an eager forward on an unpadded batch: the
        inputs, the Python values frozen into the graphs, and an all-False
        ``is_padding`` mask when the manager passes one."""
        kwargs = dict(inputs)
        for name, spec in self._inputs.items():
            if spec.kind == "const" and name not in kwargs:
                kwargs[name] = spec.value
        if self._is_padding is not None:
            kwargs["is_padding"] = torch.zeros(num_tokens, dtype=torch.bool, device=self.device)
        return kwargs

    def synchronize(self) -> None:
        """Wait for the device work queued so far (a no-op on the emulator)."""
        self._backend.synchronize()

    def _run_eager(self, inputs: Mapping[str, Any], batch: Batch, desc: BatchDescriptor) -> Any:
        kwargs = self.eager_kwargs(inputs, batch.num_tokens)
        with torch.no_grad(), running(desc):
            return self.module(**kwargs)

    def eager(self, **inputs: Any) -> Any:
        """Run the module eagerly on a real batch, as ``run`` would without graphs."""
        batch = self.batch_of(inputs)
        desc = BatchDescriptor(mode=GraphMode.NONE, num_tokens=batch.num_tokens, num_reqs=batch.num_reqs)
        return self._run_eager(inputs, batch, desc)

    def load_inputs(self, desc: BatchDescriptor, inputs: Mapping[str, Any], batch: Batch) -> None:
        """Copy a real batch into the static buffers and pad the rest of ``desc``'s rows."""
        missing = [n for n, _ in self._tensor_specs if n not in inputs]
        if missing:
            raise ValueError(f"missing input(s) {missing}; the module's inputs are {list(self._inputs)}")
        with torch.no_grad():
            self._load(desc, inputs, batch)

    def _load(self, desc: BatchDescriptor, inputs: Mapping[str, Any], batch: Batch) -> None:
        self._load_plan(desc, batch).apply(inputs)

    def _load_plan(self, desc: BatchDescriptor, batch: Batch) -> _LoadPlan:
        reqs = self.capture_reqs(desc)
        key = (desc.num_tokens, reqs, batch.num_tokens, batch.num_reqs)
        plan = self._plans.get(key)
        if plan is None:
            loads: list[tuple[str, torch.Tensor, torch.Tensor | None, PadValue]] = []
            blocks: list[tuple[str, torch.Tensor, torch.Tensor | None, int | float | bool]] = []
            edges: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
            for name, spec in self._tensor_specs:
                buf = spec.buffer
                assert buf is not None
                if spec.kind == "fixed":
                    loads.append((name, buf, None, 0))
                    continue
                # The graph of this descriptor reads this window of the buffer.
                window = spec.window(desc.num_tokens, reqs)
                if spec.kind == "multi":
                    real_block = window
                    for d, kind, offset in spec.dims:
                        real_block = real_block.narrow(d, 0, (batch.num_tokens if kind == "tokens"
                                                              else batch.num_reqs) + offset)
                    padded = real_block.shape != window.shape
                    assert spec.pad != "edge"  # refused by infer_layout: a block has no last row
                    blocks.append((name, real_block, window if padded else None, spec.pad))
                    continue
                real = spec.rows(batch.num_tokens, batch.num_reqs)
                rows = spec.rows(desc.num_tokens, reqs)
                head = window.narrow(spec.dim, 0, real)
                tail = window.narrow(spec.dim, real, rows - real) if rows > real else None
                if tail is not None and spec.pad == "edge" and spec.dim != 0:
                    edges.append((name, head, tail, spec.dim))
                else:
                    loads.append((name, head, tail, spec.pad))
            masks: list[tuple[torch.Tensor, bool]] = []
            if self._is_padding is not None:
                masks.append((self._is_padding[: batch.num_tokens], False))
                if desc.num_tokens > batch.num_tokens:
                    masks.append((self._is_padding[batch.num_tokens : desc.num_tokens], True))
            plan = _BlockLoadPlan(loads, masks, blocks, edges) if blocks or edges else _LoadPlan(loads, masks)
            self._plans[key] = plan
        return plan

    def padding_views(self, desc: BatchDescriptor, batch: Batch) -> list[tuple[str, torch.Tensor]]:
        """(input name, the view of its static buffer that holds padding) when
        ``batch`` runs under ``desc``, for every input with one dimension that
        follows the batch and padding to hold; in input order.

        These are the entries a graph reads but no real token or request put
        there: what they hold must not reach the real rows' outputs, so a check
        may fill them with anything. Inputs with several dimensions that follow
        the batch (a square mask) are left out: their padded entries hold the
        value ``pad_values`` declares, which the module reads as meaning (a
        mask's 'masked out'), so another fill is another program, not padding.
        """
        reqs = self.capture_reqs(desc)
        views: list[tuple[str, torch.Tensor]] = []
        for name, spec in self._tensor_specs:
            if spec.kind not in ("tokens", "reqs"):
                continue
            real = spec.rows(batch.num_tokens, batch.num_reqs)
            rows = spec.rows(desc.num_tokens, reqs)
            if rows > real:
                views.append((name, spec.window(desc.num_tokens, reqs).narrow(spec.dim, real, rows - real)))
        return views

    def real_rows(self, desc: BatchDescriptor, batch: Batch) -> Any:
        """The last replay's outputs of ``desc``, cut to the batch's real rows."""
        with torch.no_grad():
            entry = self._entries[desc]
            return self._owned(entry, self._cut_views(entry, batch))

    @staticmethod
    def _cut_views(entry: _Entry, batch: Batch) -> list[Any]:
        """The output leaves cut to the batch's real rows: views, made once per batch shape."""
        key = (batch.num_tokens, batch.num_reqs)
        cut = entry.cuts.get(key)
        if cut is None:
            cut = []
            for leaf, dims in zip(entry.leaves, entry.out_dims, strict=False):
                for d, kind in dims:
                    count = batch.num_tokens if kind == "tokens" else batch.num_reqs
                    # Never past the captured size (a slice's clamp, as before).
                    leaf = leaf.narrow(d, 0, min(count, leaf.shape[d]))
                cut.append(leaf)
            entry.cuts[key] = cut
        return cut

    def _owned(self, entry: _Entry, cut: list[Any]) -> Any:
        """The cut outputs in the forward's structure: copies the caller owns, or views with output_views."""
        if not self.output_views:
            cut = [t.clone() if isinstance(t, torch.Tensor) else t for t in cut]
        if entry.single:
            return cut[0]
        return entry.structure.unflatten(list(cut))

    def replay(self, desc: BatchDescriptor) -> Any:
        """Replay ``desc``'s graph on whatever the static buffers hold; return its full output.

        The output tensors are graph memory: the next replay overwrites them.
        """
        self._entries[desc].graph.replay()
        return self._entries[desc].graph.output

    def __repr__(self) -> str:
        return (
            f"GraphManager({type(self.module).__name__}, backend={self.backend!r}, "
            f"device={str(self.device)!r}, {len(self.plan.descriptors)} descriptors, "
            f"{len(self._entries)} captured)"
        )
