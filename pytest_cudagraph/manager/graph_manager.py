"""The graph manager's one face: wrap a module, capture every descriptor, run real batches.

``GraphManager`` sets up what its two parts read (the module, the plan, the
static buffers, the backend), checks the module and config it is given, and
answers questions about the graphs; ``manager/capture.py`` makes and drops
the graphs and ``manager/runtime.py`` serves real batches with them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..backends.base import CapturedGraph, resolve_checked
from ..backends.factory import make_backend
from ..guard import ModuleTracker
from ..observe import ForwardObserver
from ..plan import Batch, BatchDescriptor, CaptureConfig, CapturePlan
from .capture import CapturePart
from .layout import InputSpec, PadValue, infer_layout, not_a_module
from .pieces import EagerSpec, resolve_eager_submodules

__all__ = ["Batch", "GraphManager"]


class GraphManager(CapturePart):
    """Captures a module as one graph per descriptor and replays real batches.

    One face over two parts: ``CapturePart`` (manager/capture.py) makes and
    drops the graphs, ``RuntimePart`` (manager/runtime.py) serves real batches
    with them; this class sets up what both read (the module, the plan, the
    static buffers, the backend) and answers questions about the graphs.

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
                    f"{' and '.join(CaptureConfig.required_names())}, and may set "
                    f"{', '.join(CaptureConfig.defaults())}"
                ) from None
        if not isinstance(config, CaptureConfig):
            raise ValueError(
                f"config must be a CaptureConfig or a dict of its keywords; got {type(config).__name__}"
            )
        self.module = module
        self.observer = ForwardObserver(module)
        self.replays = 0
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
        self._backend = make_backend(backend, device if device is not None else self._module_device())
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
        self._plans = {}
        self._hot = {}
        self._probed_rows = None
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._is_padding = None
        if "is_padding" not in self._inputs and self._forward_takes("is_padding"):
            self._is_padding = torch.zeros(self.max_tokens, dtype=torch.bool, device=self.device)
        self._entries = {}
        self.capture_failures = {}
        self._tracker = ModuleTracker(module)
        self._eager_spec = eager_submodules
        self.eager_pieces = resolve_eager_submodules(module, eager_submodules)
        # The module tree and its attribute names, read at each capture().
        self._holders: list[tuple[torch.nn.Module, list[str]]] = []
        self._walked: list[Any] | None = None
        self.capture_seconds = 0.0

    @property
    def declared_pads(self) -> dict[str, PadValue]:
        """The pad values the caller declared (``pad_values``): a padded entry's meaning, which checks keep."""
        return dict(self._pad_values)

    def sibling(self) -> GraphManager:
        """A new, uncaptured manager over the same module, inputs and settings."""
        sibling = GraphManager(
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
        sibling.observer = self.observer  # what its captures see written is the module's, as here
        return sibling

    # -- set-up helpers -------------------------------------------------
    def _module_device(self) -> torch.device | None:
        for param in self.module.parameters():
            return param.device
        for buffer in self.module.buffers():
            return buffer.device
        return None

    def _check_not_meta(self) -> None:
        tensors: list[tuple[str, torch.Tensor]] = [
            *self.module.named_parameters(),
            *self.module.named_buffers(),
        ]
        for name, tensor in tensors:
            if tensor.device.type == "meta":
                raise ValueError(
                    f"module tensor '{name}' is on meta, the device that holds no data, so nothing can be "
                    "run or compared; materialise the module first (module.to_empty(device=...) and load "
                    "its weights, or build it on a real device)"
                )

    def _check_module_device(self) -> None:
        tensors: list[tuple[str, torch.Tensor]] = [
            *self.module.named_parameters(),
            *self.module.named_buffers(),
        ]
        for name, tensor in tensors:
            if tensor.device != self.device and not (tensor.device.type == self.device.type == "cpu"):
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
        """The inputs ``desc`` was captured on (``make_inputs`` at its own shape).

        Kept by the checked capture (``checked_capture=True``, what ``verify``
        uses) only: the fast capture keeps no samples, which would hold device
        memory for every size until ``release()``. KeyError if ``desc`` has
        no graph; LookupError if its capture kept no sample."""
        entry = self._entries[desc]
        if entry.sample is None:
            why = (
                "its sample was dropped (drop_sample: verification drops each once its checks are done)"
                if entry.dropped
                else "it was captured by the fast capture, which keeps no samples (each would hold memory of its "
                "size until release()); build the manager with checked_capture=True to keep them"
            )
            raise LookupError(
                f"{desc} has no capture sample: {why}; call make_inputs({desc.num_tokens}, "
                f"{self.capture_reqs(desc)}) for inputs of that shape"
            )
        return entry.sample

    def drop_sample(self, desc: BatchDescriptor) -> None:
        """Let go of ``desc``'s capture sample (verification, once the descriptor's checks are done):
        a checked capture keeps one per graph, memory of each graph's input size."""
        entry = self._entries.get(desc)
        if entry is not None and entry.sample is not None:
            entry.sample = None
            entry.dropped = True

    @property
    def graph_memory(self) -> dict[BatchDescriptor, int]:
        """Bytes of graph memory (pool growth) each capture added."""
        return {d: e.graph.nbytes for d, e in self._entries.items()}

    @property
    def device_memory(self) -> dict[BatchDescriptor, int]:
        """Device memory each capture took, the driver's share for the graph included."""
        return {d: e.graph.device_bytes for d, e in self._entries.items()}

    def __enter__(self) -> GraphManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"GraphManager({type(self.module).__name__}, backend={self.backend!r}, "
            f"device={str(self.device)!r}, {len(self.plan.descriptors)} descriptors, "
            f"{len(self._entries)} captured)"
        )
