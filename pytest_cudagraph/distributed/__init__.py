"""Sharded modules verified across ranks: ``verify_distributed`` (gloo on the CPU, NCCL on GPUs)."""

from __future__ import annotations

from .verify import AGREEMENT_CHECK, verify_distributed

__all__ = ["AGREEMENT_CHECK", "verify_distributed"]
