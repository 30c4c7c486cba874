"""Errors the harness raises on purpose, with what went wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import BatchDescriptor

from .plan.validate import UsageError

__all__ = ["CaptureError", "EagerFailure", "UsageError"]


class CaptureError(RuntimeError):
    """A graph could not be captured.

    ``op`` is the operation that cannot live in a graph (``None`` when the
    capture failed for another reason), ``module_path`` the submodule that
    called it (``""``: the wrapped module itself), ``descriptor`` the batch
    shape being captured and ``backend`` the backend's name. The manager that
    raised it stays usable: its graphs are released and batches run eagerly
    until ``capture()`` succeeds.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        reason: str | None = None,
        module_path: str | None = None,
        descriptor: BatchDescriptor | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.reason = reason
        self.module_path = module_path
        self.descriptor = descriptor
        self.backend = backend


class EagerFailure(UsageError):
    """The module's eager forward fails at every shape verification tried, before anything is
    captured: nothing can be captured or compared, so it is one error with eager's own exception
    (``__cause__``), not a failed capture per descriptor."""
