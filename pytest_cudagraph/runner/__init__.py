"""Verifying runners someone else wrote: an engine's own CUDA-graph runner,
torch.compile's CUDA graphs, ``torch.cuda.make_graphed_callables``."""

from __future__ import annotations

from .adapters import compiled, graphed_callables
from .checks import RUNNER_CHECKS
from .runner_context import RunnerContext
from .verify import verify_runner

__all__ = ["RUNNER_CHECKS", "RunnerContext", "compiled", "graphed_callables", "verify_runner"]
