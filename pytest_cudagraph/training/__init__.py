"""Training graphs: a training step (forward, backward, the optimizer's step) captured and held to
eager (``verify_training``)."""

from __future__ import annotations

from .verify import TRAINING_CHECKS, TrainingStep, verify_training

__all__ = ["TRAINING_CHECKS", "TrainingStep", "verify_training"]
