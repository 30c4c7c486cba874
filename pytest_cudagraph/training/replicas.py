"""The copies of the module that train, and the steps they run.

A training verification never trains the caller's module: it trains deep copies of it
(``_Replica``), one captured and two eager (``_Sides``). Here is what such a copy is and how it
runs a step: the caller's ``TrainingStep`` or the default one (``_step``: gradients zeroed in
place, forward, the loss, backward, the optimizer's step), which inputs its ``forward`` takes, the
state a step changes (snapshotted and restored in place, since a graph keeps the addresses), and
the stand-in for a graph where the step replays graphs of its own (``_OwnGraphs``). It imports
nothing else of the training layer: ``adapters.py``, the checks and the entry point all build on
these types.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# -- the caller's callables --------------------------------------------------------------------
LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclass(frozen=True)
class TrainingStep:
    """A training step the caller writes, as a training loop runs it: ``run(inputs)`` returns the
    scalar loss and is what a graph captures (forward, backward, and whatever optimizer work the
    loop captures with them); ``between()`` is the loop's host code after each step, run eagerly
    after every replay and every eager step (an optimizer step kept outside the graph, a
    ``zero_grad``, an accumulation counter)."""

    run: Callable[[Mapping[str, Any]], torch.Tensor]
    between: Callable[[], Any] | None = None
    #: For a step that replays graphs of its own (``training/adapters.py``): why its last calls ran
    #: without them ("" when they ran), asked after its first call at a size and after its replays.
    not_graphed: Callable[[], str] | None = None


#: ``step(module, optimizer, loss_fn)``: a step for one copy of the module (its optimizer is None
#: without an optimizer factory); a plain callable is taken as ``TrainingStep(run=it)``.
StepFactory = Callable[
    [torch.nn.Module, "torch.optim.Optimizer | None", LossFn],
    "TrainingStep | Callable[[Mapping[str, Any]], torch.Tensor]",
]


# -- a copy of the module that trains -----------------------------------------------------------
@dataclass
class _Replica:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    #: The caller's step for this copy (None: the default one, ``_step``).
    custom: TrainingStep | None = None

    def run(self, loss_fn: LossFn, inputs: Mapping[str, Any], autocast: torch.dtype | None) -> torch.Tensor:
        """One whole step: the caller's, or the default one."""
        if self.custom is None:
            return _step(self, loss_fn, inputs, autocast)
        return _scalar(self.custom.run(inputs), "the step's run(inputs)")

    def between(self) -> None:
        if self.custom is not None and self.custom.between is not None:
            self.custom.between()

    def not_graphed(self) -> str:
        told = self.custom.not_graphed if self.custom is not None else None
        return told() if told is not None else ""

    @functools.cached_property
    def forward_parameters(self) -> tuple[frozenset[str], bool]:
        """See ``_forward_parameters``; read once, not at every step."""
        return _forward_parameters(self.module)

    def taken(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return _taken(inputs, self.forward_parameters)

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def state(self) -> dict[str, Any]:
        """Every tensor a step changes, by a name that says what it is."""
        out: dict[str, Any] = {}
        for name, p in self.params():
            out[name] = p.detach()
            out[f"grad of {name}"] = p.grad
        for name, b in self.module.named_buffers():
            out[f"buffer {name}"] = b
        if self.optimizer is not None:
            names = {id(param): n for n, param in self.module.named_parameters()}
            for owner, slots in self.optimizer.state.items():
                for key, value in slots.items():
                    out[f"optimizer state {key!r} of {names.get(id(owner), '?')}"] = value
        return out

    def over_the_same_tensors(self) -> _Replica | None:
        """A copy of this one's Python state (the module's counters and flags, the optimizer's
        settings) over its very tensors: another eager run from the same start needs the Python
        state where it was, and a copy of the tensors would cost a whole replica's memory. None for
        a step the caller wrote, whose closure cannot be copied."""
        if self.custom is not None:
            return None
        memo: dict[int, Any] = {id(t): t for t in self.module.parameters()}
        memo.update({id(t): t for t in self.module.buffers()})
        if self.optimizer is not None:
            for slots in self.optimizer.state.values():
                memo.update({id(v): v for v in slots.values() if isinstance(v, torch.Tensor)})
        module = copy.deepcopy(self.module, memo)
        optimizer = copy.deepcopy(self.optimizer, memo) if self.optimizer is not None else None
        return _Replica(module, optimizer)

    def snapshot(self, keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
        """A copy of the state (``keep``: of the names it keeps only, never copying the rest)."""
        return {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.copy(v)
            for k, v in self.state().items()
            if keep is None or keep(k)
        }

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Put a snapshot back into the very tensors it came from: a graph keeps their addresses."""
        with torch.no_grad():
            for key, value in self.state().items():
                old = saved.get(key)
                if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
                    value.copy_(old)


def _taken(inputs: Mapping[str, Any], params: tuple[frozenset[str], bool]) -> dict[str, Any]:
    """The inputs ``forward`` takes (``params``: what ``_forward_parameters`` read of it): the rest
    (a per-token loss weight, labels) are the loss's."""
    named, everything = params
    return dict(inputs) if everything else {k: v for k, v in inputs.items() if k in named}


def _forward_parameters(module: torch.nn.Module) -> tuple[frozenset[str], bool]:
    """The inputs ``forward`` names, and whether it takes ``**kwargs`` too (where its signature cannot
    be read: no names, and every input is passed)."""
    # DistributedDataParallel hands every input on to the module it wraps: read that one's forward.
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return frozenset(), True
    named = frozenset(n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())


def _step(
    replica: _Replica,
    loss_fn: LossFn,
    inputs: Mapping[str, Any],
    autocast: torch.dtype | None = None,
    *,
    optimize: bool = True,
) -> torch.Tensor:
    """One training step (``optimize=False``: up to the gradients). Gradients are zeroed in place,
    never set to None: a graph writes them where it captured them."""
    if replica.optimizer is not None:
        replica.optimizer.zero_grad(set_to_none=False)
    else:
        for _, p in replica.params():
            if p.grad is not None:
                p.grad.zero_()
    if autocast is None:
        loss = loss_fn(replica.module(**replica.taken(inputs)), inputs)
    else:
        device = next((p.device.type for _, p in replica.params()), "cpu")
        with torch.autocast(device, dtype=autocast):
            loss = loss_fn(replica.module(**replica.taken(inputs)), inputs)
    _scalar(loss, "loss_fn")
    loss.backward()  # type: ignore[no-untyped-call]
    if replica.optimizer is not None and optimize:
        replica.optimizer.step()
    return loss.detach()


def _scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            f"{what} must return the scalar loss as a 0-dim tensor; got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss.detach()


def _made_step(
    factory: StepFactory | None, module: torch.nn.Module, opt: torch.optim.Optimizer | None, loss_fn: LossFn
) -> TrainingStep | None:
    if factory is None:
        return None
    made = factory(module, opt, loss_fn)
    if isinstance(made, TrainingStep):
        return made
    if callable(made):
        return TrainingStep(run=made)
    raise ValueError(
        "step(module, optimizer, loss_fn) must return a TrainingStep or a callable run(inputs) -> loss; "
        f"got {type(made).__name__}"
    )


def _inputs(
    make_inputs: Callable[[int, int], Mapping[str, Any]], tokens: int, reqs: int, seed: int
) -> dict[str, Any]:
    """A batch drawn from ``seed``: the graph's side and eager's draw the very same one."""
    torch.manual_seed(seed)
    return dict(make_inputs(tokens, reqs))


class _OwnGraphs:
    """A step that replays graphs of its own, called where a captured step is replayed: on the
    static inputs ``load`` fills, its loss the output."""

    nbytes = 0  # its graphs' memory is its own, not counted here

    def __init__(self, replica: _Replica, loss_fn: LossFn, static: Mapping[str, Any]) -> None:
        self.replica, self.loss_fn, self.static = replica, loss_fn, static
        self.output: torch.Tensor | None = None

    def replay(self) -> None:
        self.output = self.replica.run(self.loss_fn, self.static, None)


@dataclass(frozen=True)
class _Sides:
    """The copies a size is verified with."""

    graphed: _Replica
    eager: _Replica
    twin: _Replica  # eager again from the same start: whether eager reproduces itself
    #: Each parameter's ``p.grad`` right after capture: the tensors the graph's backward writes.
    written: Mapping[str, torch.Tensor | None]
