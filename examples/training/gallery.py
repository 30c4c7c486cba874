"""Training graphs' bugs, each beside its fix: what ``verify_training`` must catch and pass.

Each case is a module, its inputs, its loss and its optimizer: ``Case.verify(...)`` runs
``verify_training`` on them. ``test_training_gallery.py`` holds every bug to the check that must
name it and every fix to passing all of them, on the emulator here and on a GPU where there is one.

- ``optimizer_capturable``: ``AdamW`` with its step count on the host (``capturable=False``, the
  default, and with ``fused=True``, which torch's capture refuses as well) against
  ``AdamW(capturable=True)``.
- ``training_capture``: a loss that checks on the host that it is finite (``bool(tensor)``, what a
  dynamic loss scaler's ``found_inf.item()`` does) against the check kept on the device.
- ``training_padding``: a loss averaged over every row, padded ones too, against one weighted by a
  per-token mask, with the mask given to forward as well or not (a mask's padded rows are not
  stale data: they keep their pad value); and a ``BatchNorm1d`` in train mode, whose statistics
  take the padded rows, against a ``LayerNorm``.
- ``training_real_batches``: a masked loss divided by the padded row count rather than the real one,
  which no pad value shows, only eager on the unpadded batch.
- ``training_replay_matches_eager``: a learning-rate warm-up counted in a Python attribute, frozen at
  capture, against the same count kept in a buffer the step updates in place; gradients set to None
  between replays (``zero_grad(set_to_none=True)``) under an optimizer kept outside the graph,
  against gradients zeroed in place; gradient accumulation whose every-other-step optimizer branch
  is captured, against the branch kept in the loop's code between replays; a dropout whose seed
  Python's ``random`` draws on the host, against one drawn by torch's generator.
- ``training_capture`` again: ``GradScaler`` over an optimizer that cannot take the scale itself
  (its ``step`` reads ``found_inf`` on the host), against a fused ``SGD``, which takes the scale
  and the overflow flag on the device (a fused ``AdamW`` does too, but torch refuses its capture
  while ``capturable=False``: measured on an H200 by ``scripts/optimizer_capture.py``).

The cases that need a loop of their own give ``verify_training`` a ``step``: a ``TrainingStep`` per
copy of the module, whose ``run`` is captured and whose ``between`` runs after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pytest_cudagraph import TrainingStep

D = 16


def token_inputs(device: Any = "cpu") -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Hidden states and a per-token loss weight (1 on real rows; padded rows hold its pad value, 0)."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {
            "x": torch.randn(num_tokens, D, device=device),
            "weight": torch.ones(num_tokens, device=device),
        }

    return make_inputs


def masked_loss(out: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared output over the real rows: padded rows weigh 0."""
    w = inputs["weight"]
    return ((out.float() ** 2).mean(-1) * w).sum() / w.sum().clamp(min=1)


def over_padded_count(out: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Padded rows weigh 0, but the sum is divided by every row's count: the loss (and every
    gradient) shrinks by the padding's share, whatever the padded rows hold."""
    w = inputs["weight"]
    return ((out.float() ** 2).mean(-1) * w).sum() / w.numel()


def mean_loss(out: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared output over every row, padded ones too."""
    return (out.float() ** 2).mean()


def checked_on_host(out: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A loss scaler's overflow check, made on the host: ``bool(tensor)`` syncs."""
    loss = masked_loss(out, inputs)
    if not torch.isfinite(loss):
        return torch.zeros_like(loss)
    return loss


def checked_on_device(out: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The same check kept on the device: nothing read back."""
    loss = masked_loss(out, inputs)
    return torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss))


def adamw(capturable: bool) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, lr=1e-2, capturable=capturable)


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def fused_capturable_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True, capturable=True)


def fused_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)


def _loss(module: nn.Module, loss_fn: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return loss_fn(module(x=inputs["x"]), inputs)


def optimizer_outside(set_to_none: bool) -> Callable[..., TrainingStep]:
    """Forward and backward captured, the optimizer's step and ``zero_grad`` run between replays,
    as a loop around ``make_graphed_callables`` does."""

    def step(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> TrainingStep:
        def run(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
            loss = _loss(module, loss_fn, inputs)
            loss.backward()
            return loss.detach()

        def between() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)

        return TrainingStep(run, between)

    return step


ACCUMULATE = 2  # micro-steps per optimizer step


def accumulating(branch_in_graph: bool) -> Callable[..., TrainingStep]:
    """Gradient accumulation: the optimizer steps every ``ACCUMULATE`` micro-steps, counted in
    Python. Inside the captured step the branch is taken (or not) once, at capture, for every
    replay; between replays it runs each time."""

    def step(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> TrainingStep:
        module.micro_steps = 0

        def branch() -> None:
            module.micro_steps += 1
            if module.micro_steps % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)

        def run(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
            loss = _loss(module, loss_fn, inputs) / ACCUMULATE
            loss.backward()
            if branch_in_graph:
                branch()
            return loss.detach()

        return TrainingStep(run, None if branch_in_graph else branch)

    return step


def scaled(module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> TrainingStep:
    """Mixed precision's loss scaling: ``GradScaler`` scales the loss, unscales the gradients and
    skips the step on an overflow."""
    device = next(module.parameters()).device.type
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)

    def run(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=False)
        loss = _loss(module, loss_fn, inputs)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    return TrainingStep(run)


class Mlp(nn.Module):
    """Two linear layers with a GELU between them (no dropout: a module that draws random numbers
    cannot be held to eager on the unpadded batch, whose draws are others)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class WeightReceived(Mlp):
    """The same MLP whose forward also receives the per-token weight (as a model takes its
    attention mask): the weight's padded rows hold 0 because they mark padding, not because they
    are stale data, and the test of padded rows must keep them so."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class HostSeededDropout(Mlp):
    """A hash dropout (as a hand-written kernel takes its seed) whose seed Python's ``random``
    draws: a graph holds the capture's seed, so every replay drops the same units."""

    def keep(self, h: torch.Tensor) -> torch.Tensor:
        return _hash_keep(h, random.randrange(1 << 20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(x))
        return self.down(h * self.keep(h) / 0.9)


class DeviceSeededDropout(HostSeededDropout):
    """The same dropout with its seed drawn by torch's generator on the device: replays advance it."""

    def keep(self, h: torch.Tensor) -> torch.Tensor:
        return _hash_keep(h, torch.randint(1 << 20, (), device=h.device))


def _hash_keep(h: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """Keeps 90 % of the units, picked by a hash of their index and ``seed``."""
    index = torch.arange(h.numel(), device=h.device).view_as(h)
    return ((index * 2654435761 + seed) % 1000) >= 100


class BatchNormed(Mlp):
    """Normalised over the batch: in train mode its mean and variance take every row."""

    def __init__(self) -> None:
        super().__init__()
        self.norm: nn.Module = nn.BatchNorm1d(2 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


class LayerNormed(BatchNormed):
    """Normalised per row: padded rows touch nothing of the real ones."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2 * D)


class PythonWarmup(Mlp):
    """Scales its output by a warm-up factor counted in a Python attribute: the capture reads it
    once, so every replay trains at the factor of the captured step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * min(1.0, self.calls / 8)


class BufferWarmup(Mlp):
    """The same warm-up counted in a buffer the step updates in place: a replay counts too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x) * (self.calls / 8).clamp(max=1.0)


@dataclass(frozen=True)
class Case:
    """A module and how it trains."""

    name: str
    module: Callable[[], nn.Module]
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = field(default_factory=lambda: adamw(True))
    step: Callable[..., Any] | None = None  # verify_training's step: a loop of the case's own

    def verify(self, verify_training: Callable[..., Any], device: Any, **keywords: Any) -> Any:
        torch.manual_seed(0)
        return verify_training(
            self.module().to(device),
            token_inputs(device),
            self.loss_fn,
            optimizer=self.optimizer,
            step=self.step,
            **keywords,
        )


@dataclass(frozen=True)
class Pair:
    check: str
    buggy: Case
    fixed: Case
    message: str  # a regex the failure message must match


PAIRS = [
    Pair(
        "optimizer_capturable",
        Case("AdamW(capturable=False)", Mlp, masked_loss, adamw(False)),
        Case("AdamW(capturable=True)", Mlp, masked_loss, adamw(True)),
        r"AdamW keeps its step count on the host \(capturable=False\)",
    ),
    Pair(
        "optimizer_capturable",
        Case("AdamW(fused=True)", Mlp, masked_loss, fused_adamw),
        Case("AdamW(fused=True, capturable=True)", Mlp, masked_loss, fused_capturable_adamw),
        r"AdamW keeps its step count on the host \(capturable=False, fused=True does not change that\)",
    ),
    Pair(
        "training_capture",
        Case("overflow checked on the host", Mlp, checked_on_host),
        Case("overflow checked on the device", Mlp, checked_on_device),
        r"cannot be captured in a graph; the first is (bool\(tensor\)|aten\._local_scalar_dense|aten\.is_nonzero)",
    ),
    Pair(
        "training_padding",
        Case("loss over padded rows", Mlp, mean_loss),
        Case("loss masked by a per-token weight", Mlp, masked_loss),
        r"padded rows reach the training step: .* padded rows of 'x' at 10000.0",
    ),
    Pair(
        "training_padding",
        Case("forward receives the weight, loss over padded rows", WeightReceived, mean_loss),
        Case("forward receives the weight, loss masked by it", WeightReceived, masked_loss),
        r"padded rows of 'x' at 10000.0 instead of its pad value change .*mask them out of the loss",
    ),
    Pair(
        "training_real_batches",
        Case("loss divided by the padded row count", Mlp, over_padded_count),
        Case("loss divided by the real row count", Mlp, masked_loss),
        r"a step on \d+ real tokens? padded to \d+ differs from eager's step on the \d+ tokens? alone in loss",
    ),
    Pair(
        "training_padding",
        Case("BatchNorm over padded rows", BatchNormed, masked_loss),
        Case("LayerNorm", LayerNormed, masked_loss),
        r"BatchNorm in train mode: 'norm'",
    ),
    Pair(
        "training_replay_matches_eager",
        Case("warm-up counted in Python", PythonWarmup, masked_loss),
        Case("warm-up counted in a buffer", BufferWarmup, masked_loss),
        r"step \d of 3 replayed on fresh inputs differs from eager .*Python state differs too: 'calls'",
    ),
    Pair(
        "training_replay_matches_eager",
        Case("grads set to None between replays", Mlp, masked_loss, step=optimizer_outside(True)),
        Case("grads zeroed in place between replays", Mlp, masked_loss, step=optimizer_outside(False)),
        r"after replay 1, the gradient of '[\w.]+' is None, not the tensor the graph writes",
    ),
    Pair(
        "training_replay_matches_eager",
        Case("accumulation branch captured", Mlp, masked_loss, step=accumulating(True)),
        Case("accumulation branch between replays", Mlp, masked_loss, step=accumulating(False)),
        r"step \d of 3 replayed .*Python state differs too: 'micro_steps' .*gradient accumulation",
    ),
    Pair(
        "training_replay_matches_eager",
        Case("dropout seeded by Python's random", HostSeededDropout, masked_loss),
        Case("dropout seeded by torch's generator", DeviceSeededDropout, masked_loss),
        r"eager differs from itself from the same start and seed: step 1's loss .*Python's random",
    ),
    Pair(
        "training_capture",
        Case("GradScaler over AdamW(capturable=True)", Mlp, masked_loss, step=scaled),
        Case("GradScaler over SGD(fused=True)", Mlp, masked_loss, fused_sgd, step=scaled),
        r"cannot be captured in a graph; the first is .*inside GradScaler\.step: .*only SGD\(fused=True\)",
    ),
]
