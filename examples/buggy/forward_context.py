"""State forward reads from outside the module: a forward context the runner fills each step, as
vLLM's attention layers read ``get_forward_context().attn_metadata``, and a step counter kept in a
module-level dict. A graph freezes what forward read there at capture.

Caught by ``real_batches`` and ``fresh_inputs`` (a Python int and a tensor put in the context) and
by ``replay_matches_eager`` (the counter), each named by where it lives, the line that read it and
its values. The plugin prints, for ``ReadsTokenCount``:

    FAIL real_batches           FULL-T8-R4
         Python value(s) forward reads from outside the module changed since FULL-T8-R4 was captured (FORWARD_CONTEXT['meta'].num_actual_tokens (a module-level dict of examples.buggy.forward_context, read at examples/buggy/forward_context.py:90 in ReadsTokenCount.forward): 8 at capture, 5 now); the graph holds the capture-time value; with it put back eager gives the graph's result. Fix: keep such a value in a tensor the runner copies into each step (a persistent buffer, as vLLM's attention metadata builders keep theirs for graphs), or pass it to forward as a tensor input

for ``ReadsReplacedTemperature``:

    FAIL fresh_inputs           FULL-T8-R4
         FORWARD_CONTEXT['temperature'] (a module-level dict of examples.buggy.forward_context, read at examples/buggy/forward_context.py:107 in ReadsReplacedTemperature.forward) holds another tensor than when FULL-T8-R4 was captured (a float32 tensor [1] at 0x... then, a float32 tensor [1] at 0x... now): the graph reads the tensor it captured, never one put in its place; with it put back eager gives the graph's result. Fix: copy into the captured tensor instead (FORWARD_CONTEXT['temperature'].copy_(new)), so that every replay reads the step's values

and for ``CountsStepsInDict``:

    FAIL replay_matches_eager   FULL-T8-R4
         Python state changes on every forward (STEPS['step'] (a module-level dict of examples.buggy.forward_context, read at examples/buggy/forward_context.py:121 in CountsStepsInDict.forward): 12 -> 13), but a graph runs Python only at capture, so replay keeps the capture-time value (the output: values differ); keep such state in a registered buffer updated in place

    (CPU emulator, `verify(..., capture_sizes=[1, 2, 4, 8], max_num_reqs=4)`, 2026-12-05; addresses elided)

The twins: the count passed to forward as a tensor argument (``TakesTokenCount``), the temperature
copied into one persistent tensor the context keeps (``ReadsCopiedTemperature``, as vLLM's metadata
builders copy into buffers made once for graphs), and the counter kept in a device tensor advanced
in place (``CountsStepsOnDevice``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .common import Base, D


@dataclass
class Metadata:
    """What an engine's runner builds each step for its attention layers (a piece of it)."""

    num_actual_tokens: int


#: The forward context: the runner (here, make_inputs) fills it before every forward.
FORWARD_CONTEXT: dict[str, Any] = {}
#: A step counter kept beside the module, as samplers and schedulers keep theirs.
STEPS: dict[str, int] = {"step": 0}


def _persistent(name: str, like: torch.Tensor) -> torch.Tensor:
    """One tensor per name and device, made once and written in place ever after."""
    key = f"{name}@{like.device}"
    if key not in FORWARD_CONTEXT:
        FORWARD_CONTEXT[key] = torch.zeros_like(like)
    return FORWARD_CONTEXT[key]


def context_inputs(device: str | torch.device = "cpu") -> Callable[[int, int], dict[str, torch.Tensor]]:
    """make_inputs as a runner's step: the context filled, the temperature put there anew (the bug)
    and copied into the persistent one (the fix), the token count also passed as a tensor."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        temperature = torch.rand(1, device=device) + 0.5
        FORWARD_CONTEXT["meta"] = Metadata(num_actual_tokens=num_tokens)
        FORWARD_CONTEXT["temperature"] = temperature
        _persistent("temperature_buffer", temperature).copy_(temperature)
        FORWARD_CONTEXT["temperature_buffer"] = _persistent("temperature_buffer", temperature)
        return {
            "x": torch.randn(num_tokens, D, device=device),
            "num_actual_tokens": torch.tensor(num_tokens, device=device),
        }

    return make_inputs


def _pooled(h: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Each row plus the mean of the real rows (``real``: a mask of them)."""
    weights = real.to(h.dtype)[:, None]
    return h + (h * weights).sum(0) / weights.sum()


class ReadsTokenCount(Base):
    """Reads the count of real tokens from the forward context as a Python int: frozen at capture."""

    def forward(self, x: torch.Tensor, num_actual_tokens: torch.Tensor) -> torch.Tensor:
        n = FORWARD_CONTEXT["meta"].num_actual_tokens
        h = self.lin(x)
        return _pooled(h, torch.arange(h.shape[0], device=h.device) < n)


class TakesTokenCount(Base):
    """The same count taken as a tensor argument: every replay reads the step's from its buffer."""

    def forward(self, x: torch.Tensor, num_actual_tokens: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return _pooled(h, torch.arange(h.shape[0], device=h.device) < num_actual_tokens)


class ReadsReplacedTemperature(Base):
    """Reads a tensor the runner makes anew each step: a graph reads the one it captured."""

    def forward(self, x: torch.Tensor, num_actual_tokens: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / FORWARD_CONTEXT["temperature"]


class ReadsCopiedTemperature(Base):
    """Reads the persistent tensor the runner copies each step's temperature into."""

    def forward(self, x: torch.Tensor, num_actual_tokens: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / FORWARD_CONTEXT["temperature_buffer"]


class CountsStepsInDict(Base):
    """Counts steps in a module-level dict and scales by the count: frozen at capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        STEPS["step"] += 1
        return self.lin(x) * (1.0 + 0.01 * STEPS["step"])


class CountsStepsOnDevice(Base):
    """The same count in a buffer advanced in place: every replay counts."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        return self.lin(x) * (1.0 + 0.01 * self.step)
