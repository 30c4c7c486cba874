"""Every mutant, in the order the table runs them: each area's module holds its sections."""

from __future__ import annotations

from ..common import Mutant
from . import (
    capturability,
    causes,
    checks,
    invariant,
    manager,
    plan,
    plugin,
    precision,
    references,
    runner,
    training,
    usage,
)
from .cuda import CUDA_MUTANTS

__all__ = ["CUDA_MUTANTS", "MUTANTS"]

MUTANTS: list[Mutant] = [
    *checks.COMPARE,
    *checks.BUILTIN,
    *causes.CAUSES,
    *checks.VERIFY_CONTEXT,
    *manager.MANAGER,
    *plan.PLAN,
    *checks.ENGINE,
    *runner.RUNNER,
    *runner.DISTRIBUTED,
    *plan.TRACE,
    *plugin.FAULTS,
    *plugin.REPORTS,
    *plugin.PROGRESS,
    *checks.FLOOR,
    *precision.PADDED_SIZE,
    *invariant.INVARIANT,
    *references.REFERENCES,
    *precision.LAUNCHES,
    *precision.OBSERVE,
    *precision.QUANTIZED_MODELS,
    *manager.INTEGER_PADDING,
    *capturability.TABLE,
    *capturability.VALUE_RULES,
    *training.TRAINING,
    *training.TRAINING_PADDING,
    *plan.UNIFORM_DECODE,
    *usage.USAGE,
]
