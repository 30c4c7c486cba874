"""The graph manager's one face: wrap a module, capture every descriptor, run real batches.

``GraphManager`` checks the module and config it is given, builds the state
its parts share (``manager/state.py``: the module, the plan, the static
buffers, the backend, the graphs) and the parts themselves, and answers
questions about the graphs. ``Capture`` (``manager/capture.py``) makes and
drops the graphs; ``Runtime`` (``manager/runtime.py``) serves real batches
with them. Every public method is one of the face's or one line handing the
call to the part that owns it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..backends.base import CapturedGraph, resolve_checked
from ..backends.factory import make_backend
from ..errors import CaptureError
from ..guard import ModuleTracker
from ..observe import ForwardObserver, named_tensors, restoring
from ..options import check_named
from ..plan import Batch, BatchDescriptor, CaptureConfig, CapturePlan
from ..plan.validate import UsageError, short, unknown_keyword
from .capture import Capture
from .devices import move_to
from .inputs import call_make_inputs
from .layout import InputSpec, PadValue, check_module, infer_layout
from .pieces import EagerSpec, resolve_eager_submodules
from .runtime import Runtime
from .state import ManagerState
from .types import OutCut

__all__ = ["Batch", "GraphManager"]


class GraphManager:
    """Captures a module as one graph per descriptor and replays real batches.

    One face over two parts that share one state (``state``, a
    ``ManagerState``): ``Capture`` (manager/capture.py) makes and drops the
    graphs, ``Runtime`` (manager/runtime.py) serves real batches with them;
    this class builds the three and answers questions about the graphs.

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
    guard. True warms each descriptor up just before its capture (vLLM's
    order) and routes every op of every capture through the guard's dispatch
    mode, which observes it (what it writes, draws, reads unwritten) and keeps
    every tensor the graph reads alive with it; the sequence's first capture
    also holds each op to the guard's rules, which name an op a graph cannot
    hold before the device sees it, while a later one leaves that to the
    device, whose refusal fails the capture and is named by the op that failed
    and an eager run under the full guard (``guarded_every_op`` lists the
    captures held to the rules). ``verify()`` and the plugin's fixtures
    capture this way.
    ``PYTEST_CUDAGRAPH_CAPTURE=fast|checked`` overrides both.

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
        config = _checked_arguments(
            module,
            make_inputs,
            config,
            pad_values,
            batch_dims,
            (
                ("output_views", output_views, False),
                ("measure_device_memory", measure_device_memory, False),
                ("progress", progress, True),
                ("checked_capture", checked_capture, True),
            ),
        )
        plan = CapturePlan(config)
        _check_not_meta(module)
        eager_pieces = resolve_eager_submodules(
            module, eager_submodules
        )  # what it refuses, before any forward
        _materialise_lazy(module, make_inputs)
        chosen = make_backend(backend, device if device is not None else _module_device(module))
        chosen.measure_device_memory = bool(measure_device_memory)
        chosen.checked = resolve_checked(checked_capture, default=False)
        _check_module_device(module, chosen.name, chosen.device)
        largest = config.largest_capture_size
        inputs = infer_layout(
            make_inputs,
            max_tokens=largest,
            max_reqs=min(largest, config.max_num_reqs),
            device=chosen.device,
            pad_values=pad_values or {},
            batch_dims=dict(batch_dims or {}),
        )
        is_padding = None
        if "is_padding" not in inputs and _forward_takes(module, "is_padding"):
            is_padding = torch.zeros(largest, dtype=torch.bool, device=chosen.device)
        #: What the parts share (see manager/state.py).
        self.state = ManagerState(
            module=module,
            config=config,
            plan=plan,
            backend=chosen,
            user_make_inputs=make_inputs,
            inputs=inputs,
            is_padding=is_padding,
            output_views=bool(output_views),
            progress=progress,
            pad_values=dict(pad_values or {}),
            batch_dims=dict(batch_dims or {}),
            eager_spec=eager_submodules,
            tracker=ModuleTracker(module),
            observer=ForwardObserver(module),
            eager_pieces=eager_pieces,
        )
        self._runtime = Runtime(self.state)
        self._capture = Capture(self.state, self._runtime)
        # run() is the call a serving loop makes: the runtime's own method, bound here, so that
        # the face adds no call to it (the method below documents it and serves the class).
        self.run = self._runtime.run  # type: ignore[method-assign]

    # -- what the manager is over ---------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.state.module

    @property
    def config(self) -> CaptureConfig:
        return self.state.config

    @property
    def plan(self) -> CapturePlan:
        return self.state.plan

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def backend(self) -> str:
        """The backend's name: 'cuda' or 'emulate'."""
        return self.state.backend.name

    @property
    def output_views(self) -> bool:
        return self.state.output_views

    @property
    def max_tokens(self) -> int:
        """The largest graph's token count: the static buffers' token rows."""
        return self.state.max_tokens

    @property
    def max_reqs(self) -> int:
        """The static buffers' request rows."""
        return self.state.max_reqs

    @property
    def observer(self) -> ForwardObserver:
        """What forwards under the guard write in the module, and their precision (see ``observe``)."""
        return self.state.observer

    @property
    def declared_pads(self) -> dict[str, PadValue]:
        """The pad values the caller declared (``pad_values``): a padded entry's meaning, which checks keep."""
        return dict(self.state.pad_values)

    def sibling(self) -> GraphManager:
        """A new, uncaptured manager over the same module, inputs and settings."""
        state = self.state
        sibling = GraphManager(
            state.module,
            state.user_make_inputs,
            state.config,
            backend=self.backend,
            device=self.device,
            pad_values=state.pad_values,
            output_views=state.output_views,
            progress=False,
            measure_device_memory=state.backend.measure_device_memory,
            checked_capture=state.backend.checked,
            eager_submodules=state.eager_spec,
            batch_dims=state.batch_dims,
        )
        sibling.state.observer = state.observer  # what its captures see written is the module's, as here
        return sibling

    # -- inspection -----------------------------------------------------
    @property
    def input_specs(self) -> Mapping[str, InputSpec]:
        """Each input's layout and static buffer."""
        return dict(self.state.inputs)

    @property
    def static_inputs(self) -> dict[str, torch.Tensor]:
        """The static input buffers, by name (their addresses never change)."""
        buffers = {n: s.buffer for n, s in self.state.inputs.items() if s.buffer is not None}
        if self.state.is_padding is not None:
            buffers["is_padding"] = self.state.is_padding
        return buffers

    @property
    def uses_padding_mask(self) -> bool:
        """Whether the manager passes an ``is_padding`` mask to ``forward``."""
        return self.state.is_padding is not None

    @property
    def captured(self) -> bool:
        return bool(self.state.entries)

    @property
    def captured_descriptors(self) -> tuple[BatchDescriptor, ...]:
        """Descriptors with a live graph, in capture order."""
        return tuple(self.state.entries)

    @property
    def capture_failures(self) -> dict[BatchDescriptor, CaptureError]:
        """Descriptors whose capture failed under ``capture(keep_going=True)``, with why; reset by each
        capture()."""
        return self.state.capture_failures

    @property
    def guarded_every_op(self) -> frozenset[BatchDescriptor]:
        """Descriptors of the last capture() whose every op was held to the guard's rules: every one on
        the emulator; with ``checked_capture`` on CUDA, the sequence's first (see ``checked_capture``)."""
        return frozenset(self.state.guarded_every_op)

    @property
    def capture_seconds(self) -> float:
        """How long the last capture() took."""
        return self.state.capture_seconds

    @property
    def replays(self) -> int:
        """Graph replays so far (what a verification's cost report counts)."""
        return self.state.replays

    @property
    def eager_pieces(self) -> list[tuple[str, torch.nn.Module]]:
        """(dotted name, submodule) run eagerly between the segments of PIECEWISE graphs."""
        return self.state.eager_pieces

    def graph(self, desc: BatchDescriptor) -> CapturedGraph:
        """The captured graph of ``desc`` (KeyError if it has none)."""
        return self.state.entries[desc].graph

    def capture_sample(self, desc: BatchDescriptor) -> dict[str, Any]:
        """The inputs ``desc`` was captured on (``make_inputs`` at its own shape).

        Kept by the checked capture (``checked_capture=True``, what ``verify``
        uses) only: the fast capture keeps no samples, which would hold device
        memory for every size until ``release()``. KeyError if ``desc`` has
        no graph; LookupError if its capture kept no sample."""
        entry = self.state.entries[desc]
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
        entry = self.state.entries.get(desc)
        if entry is not None and entry.sample is not None:
            entry.sample = None
            entry.dropped = True

    @property
    def graph_memory(self) -> dict[BatchDescriptor, int]:
        """Bytes of graph memory (pool growth) each capture added."""
        return {d: e.graph.nbytes for d, e in self.state.entries.items()}

    @property
    def device_memory(self) -> dict[BatchDescriptor, int]:
        """Device memory each capture took, the driver's share for the graph included."""
        return {d: e.graph.device_bytes for d, e in self.state.entries.items()}

    # -- the capture part's jobs ------------------------------------------------
    def capture(
        self, descriptors: Iterable[BatchDescriptor] | None = None, *, keep_going: bool = False
    ) -> None:
        """Capture every descriptor of the plan (or those given), largest first; a failed capture
        raises ``CaptureError`` and leaves the manager usable. ``Capture.capture`` says how, and
        what ``keep_going=True`` changes."""
        self._capture.capture(descriptors, keep_going=keep_going)

    def release(self) -> None:
        """Drop every graph and the pool. Static buffers stay; capture() again works."""
        self._capture.release()

    @property
    def make_inputs(self) -> Callable[[int, int], Mapping[str, Any]]:
        """``make_inputs``, checked: a call whose keys differ from the layout's raises ``ValueError``."""
        return self._capture.staging.make_inputs

    def stage_sample(self, desc: BatchDescriptor) -> tuple[dict[str, Any], dict[str, Any]]:
        """See ``Staging.stage_sample``."""
        return self._capture.staging.stage_sample(desc)

    def eager_modules(self, desc: BatchDescriptor) -> list[torch.nn.Module]:
        """See ``Capture.eager_modules``."""
        return self._capture.eager_modules(desc)

    @property
    def not_known_ops(self) -> dict[str, str]:
        """Ops the emulator's guard met that the capturability table does not cover (op -> the
        submodule that ran it first): whether a CUDA capture holds them is not known."""
        return self._capture.not_known_ops

    # -- the runtime part's jobs -------------------------------------------------
    def run(self, **inputs: Any) -> Any:
        """Run one real batch given as keyword inputs; see ``run_batch``."""
        return self._runtime.run(**inputs)

    def run_batch(
        self,
        inputs: Mapping[str, Any],
        batch: Batch | None = None,
        *,
        num_reqs: int | None = None,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> Any:
        """See ``Runtime.run_batch``."""
        return self._runtime.run_batch(
            inputs,
            batch,
            num_reqs=num_reqs,
            uniform_token_count=uniform_token_count,
            num_active_loras=num_active_loras,
            max_query_len=max_query_len,
            num_ubatches=num_ubatches,
        )

    def dispatch(self, batch: Batch | None = None, /, **fields: Any) -> BatchDescriptor:
        """The descriptor whose live graph serves a batch, given as a ``Batch`` or as its fields
        (``dispatch(num_tokens=8, num_reqs=4)``), or a ``NONE`` one (the plan has none, or its
        capture failed or was released)."""
        if batch is None:
            batch = _batch_of_fields(fields)
        elif fields:
            raise TypeError("dispatch takes a Batch or its fields as keywords, not both")
        return self._runtime.dispatch_batch(batch)

    def dispatch_batch(self, batch: Batch) -> BatchDescriptor:
        """``dispatch(batch)``."""
        return self._runtime.dispatch_batch(batch)

    def batch_of(self, inputs: Mapping[str, Any], **fields: Any) -> Batch:
        """Validate ``inputs`` against the static buffers and read the batch shape; ``fields`` are
        the ``Batch`` fields the inputs do not say (``num_reqs``, ``uniform_token_count``, ...)."""
        return self._runtime.batch_of(inputs, **fields)

    def capture_reqs(self, desc: BatchDescriptor) -> int:
        """Request rows a descriptor is captured with (PIECEWISE: as many as fit)."""
        return self._runtime.capture_reqs(desc)

    def forward_inputs(self, num_tokens: int, num_reqs: int) -> dict[str, Any]:
        """The keyword inputs a graph of that shape reads: views of the static buffers."""
        return self._runtime.forward_inputs(num_tokens, num_reqs)

    def eager_kwargs(self, inputs: Mapping[str, Any], num_tokens: int) -> dict[str, Any]:
        """See ``Runtime.eager_kwargs``."""
        return self._runtime.eager_kwargs(inputs, num_tokens)

    def eager(self, **inputs: Any) -> Any:
        """Run the module eagerly on a real batch, as ``run`` would without graphs."""
        return self._runtime.eager(**inputs)

    def load_inputs(self, desc: BatchDescriptor, inputs: Mapping[str, Any], batch: Batch) -> None:
        """Copy a real batch into the static buffers and pad the rest of ``desc``'s rows."""
        self._runtime.load_inputs(desc, inputs, batch)

    def padding_views(self, desc: BatchDescriptor, batch: Batch) -> list[tuple[str, torch.Tensor]]:
        """See ``Runtime.padding_views``."""
        return self._runtime.padding_views(desc, batch)

    def replay(self, desc: BatchDescriptor) -> Any:
        """Replay ``desc``'s graph on whatever the static buffers hold; return its full output
        (graph memory: the next replay overwrites it)."""
        return self._runtime.replay(desc)

    def real_rows(self, desc: BatchDescriptor, batch: Batch) -> Any:
        """The last replay's outputs of ``desc``, cut to the batch's real rows."""
        return self._runtime.real_rows(desc, batch)

    def output_dims(self, desc: BatchDescriptor) -> list[OutCut]:
        """How each leaf of ``desc``'s output is cut to a batch's real rows."""
        return self._runtime.output_dims(desc)

    def cut_output(self, desc: BatchDescriptor, output: Any, batch: Batch) -> Any:
        """An output of ``desc``'s shape cut to ``batch``'s real rows exactly as the graph's is."""
        return self._runtime.cut_output(desc, output, batch)

    def synchronize(self) -> None:
        """Wait for the device work queued so far (a no-op on the emulator)."""
        self._runtime.synchronize()

    def poison_free(self, which: int) -> bool:
        """Fill the graphs' free pool memory with poison ``which`` (0 or 1); False where the
        backend cannot."""
        return self._runtime.poison_free(which)

    def __enter__(self) -> GraphManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"GraphManager({type(self.module).__name__}, backend={self.backend!r}, "
            f"device={str(self.device)!r}, {len(self.plan.descriptors)} descriptors, "
            f"{len(self.state.entries)} captured)"
        )


def _batch_of_fields(fields: dict[str, Any]) -> Batch:
    try:
        return Batch(**fields)
    except TypeError:
        known = ", ".join(f.name for f in dataclasses.fields(Batch))
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Batch)})
        missing = [n for n in ("num_tokens", "num_reqs") if n not in fields]
        raise TypeError(
            f"dispatch takes a Batch or its fields ({known}); "
            + (f"unknown: {', '.join(unknown)}" if unknown else f"missing: {', '.join(missing)}")
        ) from None


# -- set-up checks ---------------------------------------------------------------
def _module_device(module: torch.nn.Module) -> torch.device | None:
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return None


def _check_not_meta(module: torch.nn.Module) -> None:
    tensors: list[tuple[str, torch.Tensor]] = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in tensors:
        if tensor.device.type == "meta":
            raise UsageError(
                f"module tensor '{name}' is on meta, the device that holds no data, so nothing can be "
                "run or compared; materialise the module first (module.to_empty(device=...) and load "
                "its weights, or build it on a real device)"
            )


def _checked_arguments(
    module: object,
    make_inputs: object,
    config: CaptureConfig | Mapping[str, Any],
    pad_values: object,
    batch_dims: object,
    flags: tuple[tuple[str, object, bool], ...],
) -> CaptureConfig:
    """``GraphManager``'s arguments checked before anything runs (a ``UsageError`` for the first
    wrong: the module, make_inputs, the plan's keywords, the named mappings, each flag, which is
    True or False, or also None where the flag's third part says so); the plan's configuration."""
    check_module(module)
    if not callable(make_inputs):
        raise UsageError(
            f"make_inputs must be a callable (num_tokens, num_reqs) -> dict of inputs; got {type(make_inputs).__name__}"
        )
    if isinstance(config, Mapping):
        keywords = dict(config)
        unknown = [k for k in keywords if k not in CaptureConfig.field_names()]
        missing = [k for k in CaptureConfig.required_names() if k not in keywords]
        if unknown or missing:
            raise UsageError(
                f"config {short(keywords)} is not a CaptureConfig's keywords "
                f"({unknown_keyword(unknown[0], CaptureConfig.field_names(), 'CaptureConfig') if unknown else 'missing ' + ', '.join(missing)}); "
                f"it needs {' and '.join(CaptureConfig.required_names())}"
            )
        config = CaptureConfig(**keywords)
    if not isinstance(config, CaptureConfig):
        raise UsageError(
            f"config must be a CaptureConfig or a dict of its keywords; got {type(config).__name__}"
        )
    check_named("pad_values", pad_values)
    check_named("batch_dims", batch_dims)
    for name, value, none in flags:
        if not isinstance(value, bool) and not (none and value is None):
            raise UsageError(f"{name} must be True or False{' or None' if none else ''}; got {short(value)}")
    return config


def _lazy_names(module: torch.nn.Module) -> list[str]:
    """The module's lazy parameters and buffers (``nn.LazyLinear``'s before its first forward), by
    dotted name, tied ones under each of their names."""
    return [name for name, t in named_tensors(module) if torch.nn.parameter.is_lazy(t)]


def _materialise_lazy(module: torch.nn.Module, make_inputs: Callable[[int, int], Mapping[str, Any]]) -> None:
    """Where ``module`` holds lazy tensors, one eager forward on ``make_inputs(1, 1)`` (under
    ``no_grad``, on the module's device) makes them, before anything reads the module.

    The forward is for its effect on the lazy tensors only: what it writes in the tensors that
    were there before is put back, and each lazy tensor is left as its module's initialisation made
    it, before that module's forward used it (a lazy batch norm's running statistics as reset, not
    updated by the batch). A forward that raises, or leaves a tensor lazy, is a ``UsageError`` of one
    line that says how to materialise the module by hand."""
    lazy = _lazy_names(module)
    if not lazy:
        return
    inputs = call_make_inputs(make_inputs, 1, 1)  # a broken make_inputs is told as such
    device = _module_device(module)
    if device is not None:
        inputs = move_to(inputs, device)  # .to: no copy where a tensor is on it already
    if "is_padding" not in inputs and _forward_takes(module, "is_padding"):
        inputs["is_padding"] = torch.zeros(1, dtype=torch.bool, device=device)
    lazy_set = set(lazy)
    # Each lazy tensor as its module's lazy hook (run before the forward, registered when the
    # module was built, so before ours) initialised it: what the forward's writes are undone to.
    initialised: dict[str, torch.Tensor] = {}

    def snapshot(prefix: str) -> Callable[[torch.nn.Module, Any], None]:
        def hook(sub: torch.nn.Module, args: Any) -> None:
            own = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
            for name, t in own:
                full = f"{prefix}.{name}" if prefix else name
                if full in lazy_set and full not in initialised and not torch.nn.parameter.is_lazy(t):
                    initialised[full] = t.detach().clone()

        return hook

    holders = {
        prefix: sub
        for prefix, sub in module.named_modules(remove_duplicate=False)
        if any(torch.nn.parameter.is_lazy(t) for t in [*sub.parameters(False), *sub.buffers(False)])
    }
    failed: Exception | None = None
    hooks = [sub.register_forward_pre_hook(snapshot(prefix)) for prefix, sub in holders.items()]
    try:
        with torch.no_grad(), restoring(ForwardObserver(module)) as copies:
            try:
                module(**inputs)
            except Exception as exc:  # the user's forward: told below, in one line
                failed = exc
            finally:
                # A copy taken of a lazy tensor holds what its first write found: memory
                # torch.empty left. Put back what initialisation made instead, or leave it be.
                for name in [n for n in copies if _under(n, lazy_set)]:
                    del copies[name]
                copies.update(initialised)
    finally:
        for handle in hooks:
            handle.remove()
    still = _lazy_names(module)
    if failed is None and not still:
        return
    named = _some_names(still or lazy)
    fix = "run one forward on a real batch (module(**make_inputs(n, r))) before handing the module over"
    if failed is None:
        raise UsageError(
            f"module tensor(s) {named} are still lazy (empty until a first forward) after a first eager "
            f"forward on make_inputs(1, 1): that forward does not use them; {fix}, or drop them"
        )
    lines = str(failed).strip().splitlines()
    first = lines[0] if lines else ""
    first = first if len(first) <= 200 else f"{first[:197]}..."
    raise UsageError(
        f"module tensor(s) {named} {'are' if still else 'were'} lazy (empty until a first forward); "
        f"a first eager forward on make_inputs(1, 1) to materialise them raised "
        f"{type(failed).__name__}{': ' if first else ''}{first}; {fix}"
    ) from failed


def _some_names(names: list[str]) -> str:
    """The first three of ``names``, quoted, and how many more."""
    shown = ", ".join(repr(n) for n in names[:3])
    return f"{shown} and {len(names) - 3} more" if len(names) > 3 else shown


def _under(name: str, names: set[str]) -> bool:
    """Whether ``name`` is one of ``names`` or a part of one (``weight.qdata`` of ``weight``)."""
    return name in names or any(name.startswith(f"{n}.") for n in names)


def _check_module_device(module: torch.nn.Module, backend: str, device: torch.device) -> None:
    tensors: list[tuple[str, torch.Tensor]] = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in tensors:
        if tensor.device != device and not (tensor.device.type == device.type == "cpu"):
            raise UsageError(
                f"module tensor '{name}' is on {tensor.device}, but the {backend} "
                f"backend runs on {device}; move the module with module.to('{device}')"
            )


def _forward_takes(module: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params
