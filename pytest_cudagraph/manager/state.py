"""What the graph manager's parts share: one state object, set up by ``GraphManager``.

The manager is a face over parts that own their jobs: ``Runtime``
(manager/runtime.py) serves real batches, ``Capture`` (manager/capture.py)
makes and drops the graphs, ``layout`` and ``estimate`` are functions they
call. What more than one of them reads lives here, once, with who writes it;
a part never sets an attribute another part declares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.base import Backend
from ..errors import CaptureError
from ..guard import ModuleTracker
from ..observe import ForwardObserver
from ..plan import BatchDescriptor, CaptureConfig, CapturePlan
from .layout import InputSpec, PadValue
from .pieces import EagerSpec
from .types import Entry, HotPath, LoadPlan, OutCut

__all__ = ["ManagerState"]


@dataclass(eq=False)
class ManagerState:
    """The module, its plan and buffers, and the graphs (see the module's docstring)."""

    # -- set once by GraphManager ---------------------------------------------
    module: torch.nn.Module
    config: CaptureConfig
    plan: CapturePlan
    backend: Backend
    #: What the caller gave; the capture part checks each call's keys against ``inputs``.
    user_make_inputs: Callable[[int, int], Mapping[str, Any]]
    #: Every input's layout and static buffer, const ones included.
    inputs: dict[str, InputSpec]
    #: The mask passed as ``is_padding`` when forward takes one and make_inputs does not give it.
    is_padding: torch.Tensor | None
    output_views: bool
    progress: bool | None
    pad_values: dict[str, PadValue]
    batch_dims: dict[str, int]
    eager_spec: EagerSpec
    #: Names the submodule running, for diagnosis; its ``not_known`` collects what the table lacks.
    tracker: ModuleTracker
    #: What forwards under the guard write in the module (a sibling manager shares its module's).
    observer: ForwardObserver
    # -- derived from the above -------------------------------------------------
    #: The tensor inputs, in input order, and their names.
    tensor_specs: list[tuple[str, InputSpec]] = field(init=False)
    tensor_names: set[str] = field(init=False)
    run_names: set[str] = field(init=False)
    value_names: list[str] = field(init=False)
    #: -1 on the CPU: the replay path compares device indices, not devices.
    device_index: int = field(init=False)
    # -- written by the capture part ---------------------------------------------
    #: Each captured descriptor's graph as the runtime replays it. Cleared in place, never rebound.
    entries: dict[BatchDescriptor, Entry] = field(default_factory=dict)
    #: Set by the first capture(): run() before any capture is a mistake, told.
    capture_called: bool = False
    #: Descriptors whose capture failed under ``capture(keep_going=True)``, with why.
    capture_failures: dict[BatchDescriptor, CaptureError] = field(default_factory=dict)
    #: (dotted name, submodule) run eagerly between PIECEWISE segments; found again each capture.
    eager_pieces: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    #: Per output leaf, the dimensions the probes saw follow the batch; None until probed.
    probed_rows: list[OutCut] | None = None
    #: The module tree and its attribute names, read at each capture().
    holders: list[tuple[torch.nn.Module, list[str]]] = field(default_factory=list)
    #: The tensors they held after the fast capture's warm-ups; None until walked.
    walked: list[Any] | None = None
    capture_seconds: float = 0.0
    #: Descriptors of the last capture() whose every op was held to the guard's rules (every one on
    #: the emulator; on CUDA the checked sequence's first): see ``Capture._capture_one``.
    guarded_every_op: set[BatchDescriptor] = field(default_factory=set)
    #: Where set (by verification), each checked capture's warm-up runs through it:
    #: ``watch(desc, kwargs, warm_up)`` runs ``warm_up()`` and returns what it returned, free to
    #: look at the inputs ``kwargs`` before and after and at the output (``replay_matches_eager``
    #: keeps prints of them: the warm-up is an eager run on the capture's own inputs).
    warmup_watch: Callable[[BatchDescriptor, Mapping[str, Any], Callable[[], Any]], Any] | None = None
    #: (tokens, request rows) of each shape staged for capture -> the "value" inputs its sample gave:
    #: what a graph of that shape holds (``Runtime.forward_inputs`` reads them back).
    values_at: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    # -- written by the runtime part ----------------------------------------------
    #: (descriptor tokens, its request rows, real tokens, real requests) -> views to load.
    plans: dict[tuple[int, int, int, int], LoadPlan] = field(default_factory=dict)
    #: run()'s hot path: the input shapes of a batch seen before -> what was decided for it.
    #: Cleared in place (by the capture part when the graphs change), never rebound.
    hot: dict[tuple[Any, ...], HotPath] = field(default_factory=dict)
    #: Graph replays so far (what a verification's cost report counts).
    replays: int = 0

    def __post_init__(self) -> None:
        self.tensor_specs = [(n, spec) for n, spec in self.inputs.items() if not spec.is_python]
        #: The Python inputs that change with the batch ("value"): each graph holds its capture's.
        self.value_names = [n for n, spec in self.inputs.items() if spec.kind == "value"]
        self.tensor_names = {n for n, _ in self.tensor_specs}
        #: The keys a batch gives run() on its fast path: every tensor input, and the Python values
        #: that change with the batch (the eager fallback passes them on; a graph holds its own).
        self.run_names = self.tensor_names | set(self.value_names)
        self.device_index = self.device.index if self.device.type == "cuda" else -1

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def max_tokens(self) -> int:
        return self.config.largest_capture_size

    @property
    def max_reqs(self) -> int:
        return min(self.max_tokens, self.config.max_num_reqs)
