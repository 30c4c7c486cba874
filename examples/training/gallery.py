"""Training graphs' bugs, each beside its fix: what ``verify_training`` must catch and pass.

Each case is a module, its inputs, its loss and its optimizer: ``Case.verify(...)`` runs
``verify_training`` on them. ``test_training_gallery.py`` holds every bug to the check that must
name it and every fix to passing all of them, on the emulator here and on a GPU where there is one.

- ``optimizer_capturable``: ``AdamW`` with its step count on the host (``capturable=False``, the
  default) against ``AdamW(capturable=True)``.
- ``training_capture``: a loss that checks on the host that it is finite (``bool(tensor)``, what a
  dynamic loss scaler's ``found_inf.item()`` does) against the check kept on the device.
- ``training_padding``: a loss averaged over every row, padded ones too, against one weighted by a
  per-token mask; and a ``BatchNorm1d`` in train mode, whose statistics take the padded rows,
  against a ``LayerNorm``.
- ``training_replay_matches_eager``: a learning-rate warm-up counted in a Python attribute, frozen at
  capture, against the same count kept in a buffer the step updates in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

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


class Mlp(nn.Module):
    """Two linear layers with a GELU and dropout between them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(nn.functional.gelu(self.up(x))))


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

    def verify(self, verify_training: Callable[..., Any], device: Any, **keywords: Any) -> Any:
        torch.manual_seed(0)
        return verify_training(
            self.module().to(device), token_inputs(device), self.loss_fn, optimizer=self.optimizer, **keywords
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
]
