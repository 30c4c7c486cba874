"""pytest-cudagraph: prove CUDA-graph replay correct for any ``nn.Module``.

The planning names import without torch; the torch-backed names
(``GraphManager``, ``CaptureError``'s users) load on first use so that the
pytest plugin keeps ``pytest --help`` fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import CaptureError
from .options import VerifyOptions
from .plan import Batch, BatchDescriptor, CaptureConfig, CapturePlan, GraphMode

if TYPE_CHECKING:
    from .checks import CHECKS, VerifyReport, verify
    from .checks.registry import Check
    from .context import current_descriptor
    from .distributed import verify_data_parallel, verify_distributed
    from .manager import GraphManager
    from .references import register_reference
    from .runner import RUNNER_CHECKS, verify_runner
    from .training import TRAINING_CHECKS, TrainingStep, verify_training

__all__ = [
    "CHECKS",
    "RUNNER_CHECKS",
    "TRAINING_CHECKS",
    "Batch",
    "BatchDescriptor",
    "CaptureConfig",
    "CaptureError",
    "CapturePlan",
    "Check",
    "GraphManager",
    "GraphMode",
    "TrainingStep",
    "VerifyOptions",
    "VerifyReport",
    "current_descriptor",
    "register_reference",
    "verify",
    "verify_data_parallel",
    "verify_distributed",
    "verify_runner",
    "verify_training",
]

__version__ = "0.1.0"

_LAZY = {
    "GraphManager": ("pytest_cudagraph.manager", "GraphManager"),
    "current_descriptor": ("pytest_cudagraph.context", "current_descriptor"),
    "register_reference": ("pytest_cudagraph.references", "register_reference"),
    "verify": ("pytest_cudagraph.checks", "verify"),
    "Check": ("pytest_cudagraph.checks.registry", "Check"),
    "VerifyReport": ("pytest_cudagraph.checks", "VerifyReport"),
    "CHECKS": ("pytest_cudagraph.checks", "CHECKS"),
    "verify_runner": ("pytest_cudagraph.runner", "verify_runner"),
    "verify_distributed": ("pytest_cudagraph.distributed", "verify_distributed"),
    "RUNNER_CHECKS": ("pytest_cudagraph.runner", "RUNNER_CHECKS"),
    "verify_training": ("pytest_cudagraph.training", "verify_training"),
    "verify_data_parallel": ("pytest_cudagraph.distributed", "verify_data_parallel"),
    "TRAINING_CHECKS": ("pytest_cudagraph.training", "TRAINING_CHECKS"),
    "TrainingStep": ("pytest_cudagraph.training", "TrainingStep"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pytest_cudagraph' has no attribute {name!r}")
