"""Modules verified across ranks: sharded ones (``verify_distributed``) and training steps under
DistributedDataParallel (``verify_data_parallel``); gloo on the CPU, NCCL on GPUs."""

from __future__ import annotations

from .data_parallel import SYNC_CHECK, verify_data_parallel
from .verify import AGREEMENT_CHECK, verify_distributed

__all__ = ["AGREEMENT_CHECK", "SYNC_CHECK", "verify_data_parallel", "verify_distributed"]
