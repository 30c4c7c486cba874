"""Errors the harness raises on purpose, with what went wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import BatchDescriptor

from .plan.validate import UsageError

__all__ = ["CaptureError", "EagerFailure", "InternalError", "UsageError"]


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


class InternalError(RuntimeError):
    """The harness's own bookkeeping failed (reading a module tensor's storage, observing an op,
    putting the module back): a bug in pytest-cudagraph, never the user's ``make_inputs``,
    ``forward`` or ``loss_fn``, though it may have been raised while their code ran.

    ``step`` says what the harness was doing, ``tensor`` the module tensor it was reading (None
    when not known) and ``cause`` the original exception as ``"Type: its first line"`` (the
    exception itself is ``__cause__``). Code that wraps the user's exceptions lets this one pass
    unchanged, also when the user's code raised another with this one as its cause or context
    (``found_in``).
    """

    def __init__(
        self,
        step: str,
        error: BaseException | None = None,
        tensor: str | None = None,
        cause: str | None = None,
    ) -> None:
        self.step = step
        self.tensor = tensor
        if cause is None and error is not None:
            lines = str(error).strip().splitlines()
            cause = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        self.cause = cause
        reading = f" (reading {tensor!r})" if tensor else ""
        said = f": {cause}" if cause else ""
        super().__init__(
            f"pytest-cudagraph internal error while {step}{reading}{said}; this is a bug in "
            "pytest-cudagraph, not in your make_inputs, forward or loss_fn: please report it with this line"
        )

    def __reduce__(self) -> tuple[type[InternalError], tuple[str, None, str | None, str | None]]:
        # Rebuilt from its words (the original exception need not pickle): xdist and spawned ranks send it.
        return (type(self), (self.step, None, self.tensor, self.cause))

    @staticmethod
    def raise_if_in(exc: BaseException) -> None:
        """Raise the ``InternalError`` ``exc`` is or came from (``found_in``), chained to its own
        cause; return when there is none. Where the user's exceptions are wrapped (make_inputs,
        forward, loss_fn, a capture), this goes first: the harness's failure is never theirs."""
        internal = InternalError.found_in(exc)
        if internal is not None:
            raise internal from internal.__cause__

    @staticmethod
    def found_in(exc: BaseException) -> InternalError | None:
        """``exc`` if it is an ``InternalError``, else the first one it came from (its ``__cause__``
        or ``__context__``, at any depth); None if there is none."""
        seen: set[int] = set()
        todo: list[BaseException] = [exc]
        while todo:
            e = todo.pop(0)
            if id(e) in seen:
                continue
            seen.add(id(e))
            if isinstance(e, InternalError):
                return e
            todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        return None
