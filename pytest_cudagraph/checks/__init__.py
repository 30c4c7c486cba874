"""Verification: capture every descriptor and prove each graph right, or name the bug."""

from __future__ import annotations

from .engine import CHECKS, select_descriptors, verify
from .report import Finding, Outcome, VerifyReport

__all__ = ["CHECKS", "Finding", "Outcome", "VerifyReport", "select_descriptors", "verify"]
