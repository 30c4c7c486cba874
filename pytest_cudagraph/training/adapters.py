"""Training steps graphed by PyTorch's own machinery, for ``verify_training(step=...)``.

``graphed_training()`` graphs the module's forward and backward with
``torch.cuda.make_graphed_callables`` (one graphed callable per input shape,
made on the first step at that shape), as Megatron-LM and TransformerEngine do
per layer; ``compiled_training()`` runs the module through
``torch.compile(mode="reduce-overhead")``, whose CUDA graph trees record the
forward and the backward. In both the optimizer steps between the graphed
steps, outside the graphs. ``verify_training`` calls such a step as it is
(it captures nothing itself) and holds it to the default step run eagerly, with
the same checks as a step it captures::

    report = verify_training(model, make_inputs, loss_fn, optimizer=opt, step=compiled_training())

Both need a CUDA device: CUDA graphs exist nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..plan.validate import check_int
from ..runner.adapters import _require_cuda, skips_recorded
from .replicas import LossFn, TrainingStep, _forward_parameters, _taken

__all__ = ["compiled_training", "graphed_training"]


class _Positional(torch.nn.Module):
    """``module`` called positionally (make_graphed_callables passes its sample args so), with the
    module's parameters as its own: the graphed backward gives them their gradients."""

    def __init__(self, module: torch.nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.inner = module
        self.names = tuple(names)

    def forward(self, *args: torch.Tensor) -> Any:
        return self.inner(**dict(zip(self.names, args, strict=True)))


def _zero_grads(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """In place, never to None: a graph writes the gradients where it found them."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=False)
        return
    for p in module.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _own_gradients(module: torch.nn.Module) -> None:
    """Every gradient its own tensor before the first graphed backward. Where ``p.grad`` is None,
    autograd takes the gradient the graph hands it as ``p.grad`` itself, and that is the graph's
    output: under ``make_graphed_callables`` its static buffer, which the next replay writes before
    autograd adds it to itself (every gradient exactly twice eager's); under torch.compile's graph
    trees an output the next run overwrites (read after it: "accessing tensor output of CUDAGraphs
    that has been overwritten"). Both seen on an NVIDIA H200 with torch 2.11, 2026-12-03."""
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def _forward_inputs(
    inputs: Mapping[str, Any], params: tuple[frozenset[str], bool]
) -> dict[str, torch.Tensor]:
    """The tensor inputs ``forward`` takes (the rest, a loss weight or labels, are the loss's)."""
    return {k: v for k, v in _taken(inputs, params).items() if isinstance(v, torch.Tensor)}


class _RunnerStep:
    """A step factory whose steps replay graphs of their own: ``verify_training`` calls them
    rather than capturing them, and holds them to its default step run eagerly."""

    graphs_itself = True

    def __init__(self, name: str, make: Callable[..., TrainingStep]) -> None:
        self.__name__ = name
        self._make = make

    def __call__(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn
    ) -> TrainingStep:
        _require_cuda(f"{self.__name__}()")
        return self._make(module, optimizer, loss_fn)


def graphed_training(*, num_warmup_iters: int = 3) -> _RunnerStep:
    """Forward and backward through ``torch.cuda.make_graphed_callables``, one graphed callable per
    input shape (made, with ``num_warmup_iters`` warm-up iterations, at the first step of that
    shape); the loss eager between them; the optimizer's step after each step, outside the graphs."""
    warmups = check_int("num_warmup_iters", num_warmup_iters, minimum=0)

    def make(
        module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn
    ) -> TrainingStep:
        graphed: dict[tuple[Any, ...], Callable[..., Any]] = {}
        params = _forward_parameters(module)  # read once, not at every step
        _own_gradients(module)

        def run(inputs: Mapping[str, Any]) -> torch.Tensor:
            taken = _forward_inputs(inputs, params)
            key = tuple((name, tuple(t.shape), t.dtype) for name, t in taken.items())
            if key not in graphed:
                sample = tuple(t.detach().clone() for t in taken.values())
                graphed[key] = torch.cuda.make_graphed_callables(  # type: ignore[assignment]
                    _Positional(module, list(taken)),
                    sample,
                    num_warmup_iters=warmups,
                    allow_unused_input=True,
                )
            _zero_grads(module, optimizer)
            loss = loss_fn(graphed[key](*taken.values()), inputs)
            loss.backward()  # type: ignore[no-untyped-call]
            return loss.detach()

        return TrainingStep(run, optimizer.step if optimizer is not None else None)

    return _RunnerStep("graphed_training", make)


def compiled_training(*, recompile_limit: int = 64) -> _RunnerStep:
    """The module through ``torch.compile(mode="reduce-overhead", dynamic=False)``: CUDA graph trees
    record its forward and backward per input shape (warm-up on a shape's first call, recorded on
    its second); the optimizer's step after each step, outside the graphs. A step torch ran
    without its CUDA graphs (a skip it logs, a frame dynamo gave up) is told, not passed:
    ``TrainingStep.not_graphed`` says why."""
    limit = check_int("recompile_limit", recompile_limit)

    def make(
        module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn
    ) -> TrainingStep:
        from torch._dynamo import config as dynamo_config

        compiled = torch.compile(module, mode="reduce-overhead", dynamic=False)
        params = _forward_parameters(module)  # read once, not at every step
        _own_gradients(module)
        reasons: list[str] = []

        def record(messages: Iterable[str]) -> None:
            reasons.extend(m for m in messages if m and m not in reasons)

        def run(inputs: Mapping[str, Any]) -> torch.Tensor:
            _zero_grads(module, optimizer)
            # Each step a new generation of CUDA graph trees: the last step's outputs are dead.
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
            with skips_recorded(record), dynamo_config.patch(recompile_limit=limit):
                loss = loss_fn(compiled(**_forward_inputs(inputs, params)), inputs)
                loss.backward()  # type: ignore[no-untyped-call]
            # A copy: what the graph trees hand out is overwritten by their next run, and the loss
            # is read after it (held to eager's).
            return loss.detach().clone()

        return TrainingStep(
            run,
            optimizer.step if optimizer is not None else None,
            not_graphed=lambda: reasons[0] if reasons else "",
        )

    return _RunnerStep("compiled_training", make)
