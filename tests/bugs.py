"""One module per bug class the checks find, each beside a correct twin.

Every check of the harness is proven by a pair: the buggy module must fail
that check with the expected message, the twin must pass every check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

D = 8


def token_inputs(device: str | torch.device = "cpu") -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, D, device=device)}

    return make_inputs


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)


# capture_safety ------------------------------------------------------------
class HostSync(_Base):
    """Scales by a Python float read from the device: a host sync."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.lin.weight.abs().max().item()


class HostSyncFixed(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.lin.weight.abs().max()


# replay_matches_eager ------------------------------------------------------------
class PythonCounter(_Base):
    """Counts calls in a Python int: frozen at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class BufferCounter(_Base):
    """The same counter in a buffer updated in place: graph-safe."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x) * self.calls


# fresh_inputs -------------------------------------------------------------------
class IdentityMemo(_Base):
    """Memoises a feature by the identity of its input tensor.

    The manager passes the same static views to warm-up and capture, so the
    feature is computed at warm-up, outside the graph, and frozen.
    """

    def __init__(self) -> None:
        super().__init__()
        self._last: torch.Tensor | None = None
        self._feature: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self._last:
            self._feature = torch.tanh(x)
            self._last = x
        assert self._feature is not None
        return self.lin(self._feature)


class NoMemo(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(x))


# real_batches -------------------------------------------------------------------------
class BatchStatistics(_Base):
    """Centres by the mean over all tokens, padded rows included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(0, keepdim=True))


class TokenStatistics(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(-1, keepdim=True))


# padding_isolation ---------------------------------------------------------------------------
class MaskByMultiply(_Base):
    """Masks padded rows by multiplying by 0: exact for zero padding, NaN for NaN."""

    def forward(self, x: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:
        keep = (~is_padding).to(x.dtype)[:, None]
        pooled = (x * keep).sum(0, keepdim=True)
        return self.lin(x + pooled)


class MaskBySelect(_Base):
    def forward(self, x: torch.Tensor, is_padding: torch.Tensor) -> torch.Tensor:
        pooled = torch.where(is_padding[:, None], 0.0, x).sum(0, keepdim=True)
        return self.lin(x + pooled)


# state ---------------------------------------------------------------------------------------------
class MutatesInput(_Base):
    """Scales its input in place: eager changes the caller's tensor, the graph its own copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


class CopiesInput(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * 2)


# determinism -----------------------------------------------------------------------------------------
class UnregisteredState(_Base):
    """Accumulates into a tensor attribute that is not a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.acc: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.acc is None:
            self.acc = torch.zeros(D, device=x.device)
        self.acc.add_(1.0)
        return self.lin(x) + self.acc


class RegisteredState(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(1.0)
        return self.lin(x) + self.acc


# output_lifetime ----------------------------------------------------------------------------------------
class ReturnsStatsBuffer(_Base):
    """Returns its statistics buffer itself: later calls overwrite what the caller holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        self.stats.copy_(y[0])  # row 0 is always a real row
        return y, self.stats


class ReturnsStatsCopy(ReturnsStatsBuffer):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, stats = super().forward(x)
        return y, stats.clone()


# address_stability ---------------------------------------------------------------------------------------
class RebindsBuffer(_Base):
    """Updates a running average by rebinding the buffer: graphs keep the old memory."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running = self.running * 0.5 + x[0]
        return self.lin(x) + self.running


class UpdatesBufferInPlace(RebindsBuffer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running.mul_(0.5).add_(x[0])
        return self.lin(x) + self.running


# rng --------------------------------------------------------------------------------------------------------
class ReseedsInForward(_Base):
    """Seeds the generator inside forward: eager repeats its noise, replays do not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1234)
        return self.lin(x) + torch.randn_like(x)


class DrawsNoise(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.randn_like(x)


@dataclass(frozen=True)
class Pair:
    check: str
    buggy: type[nn.Module]
    correct: type[nn.Module]
    message: str  # a regex the failure message must match
    kwargs: dict[str, Any] = field(default_factory=dict)


PAIRS = [
    Pair("capture_safety", HostSync, HostSyncFixed, r"Tensor\.item\(\) \(host sync\) in the top-level module"),
    Pair("replay_matches_eager", PythonCounter, BufferCounter, r"Python state changes on every forward \(calls:"),
    Pair("fresh_inputs", IdentityMemo, NoMemo, r"with fresh inputs after capture, replay differs from eager"),
    Pair("real_batches", BatchStatistics, TokenStatistics,
         r"real rows differ from eager on the unpadded batch within tolerance"),
    Pair("padding_isolation", MaskByMultiply, MaskBySelect,
         r"real rows change when padded rows hold NaN instead of zeros: padding leaks into real rows"),
    Pair("state", MutatesInput, CopiesInput, r"input \['x'\] is mutated in place by eager but not by run\(\)"),
    Pair("determinism", UnregisteredState, RegisteredState,
         r"two replays of the same inputs, from the same module state and seed, differ"),
    Pair("output_lifetime", ReturnsStatsBuffer, ReturnsStatsCopy,
         r"an output returned by run\(\) on the eager \(NONE\) path changed when later batches ran"),
    Pair("address_stability", RebindsBuffer, UpdatesBufferInPlace, r"module tensor 'running' moved: it was rebound to another tensor"),
    Pair("rng", ReseedsInForward, DrawsNoise, r"under the same seed, replay draws differ from eager draws"),
]
