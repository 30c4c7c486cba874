"""Training graphs: a training step (forward, backward, the optimizer's step) captured and held to
eager (``verify_training``); steps graphed by PyTorch's own machinery (``adapters.py``)."""

from __future__ import annotations

from .adapters import compiled_training, graphed_training
from .verify import TRAINING_CHECKS, TrainingStep, verify_training

__all__ = [
    "TRAINING_CHECKS",
    "TrainingStep",
    "compiled_training",
    "graphed_training",
    "verify_training",
]
