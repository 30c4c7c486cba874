"""Verification: capture every descriptor and prove each graph right, or name the bug.

A downstream suite adds a check of its own as a ``Check`` (see
``registry``), given to ``verify(..., extra_checks=[...])`` or returned by
the ``pytest_cudagraph_checks`` hook of its ``conftest.py``. The check
function gets a ``VerifyContext`` (the manager, real batches, eager runs,
state snapshots) and compares with ``first_difference``.
"""

from __future__ import annotations

from .builtin import BUILTIN, DISPATCH_CHECK
from .compare import Difference, first_difference
from .engine import CHECKS, select_descriptors, verify
from .registry import Check, CheckRegistry, failed, passed, skipped
from .report import Finding, Outcome, VerifyReport
from .verify_context import VerifyContext

__all__ = [
    "BUILTIN",
    "CHECKS",
    "DISPATCH_CHECK",
    "Check",
    "CheckRegistry",
    "Difference",
    "Finding",
    "Outcome",
    "VerifyContext",
    "VerifyReport",
    "failed",
    "first_difference",
    "passed",
    "select_descriptors",
    "skipped",
    "verify",
]
