"""Progress of a long verification: its stage and the descriptor it is at (k of n).

The verification and the capture walk their descriptors through ``over``, and
name a stage without a count through ``stage``. Where a sink is installed for
the running code (``shown_by``: the pytest plugin installs one for each test
that uses it, which writes to the terminal past pytest's output capture and
from xdist workers), every step goes to it. Elsewhere (``verify()`` in a
script), a tqdm bar on stderr shows the walks when asked (``progress=True``)
or, by default, when stderr is a terminal and the walk runs past
``PROGRESS_DELAY`` seconds. ``progress=False`` shows nothing. No torch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["PROGRESS_DELAY", "Sink", "Step", "over", "progress_label", "shown_by", "stage"]

#: Seconds a walk runs before an automatic progress bar appears (quick runs stay quiet).
PROGRESS_DELAY = 2.0

_T = TypeVar("_T")


@dataclass(frozen=True)
class Step:
    """Where a verification is: ``label`` (the module and backend), ``stage`` (capture, checks,
    a check that runs alone), and the ``index``-th of ``total`` ``unit``\\s (0 of 0: no count)."""

    label: str
    stage: str
    index: int = 0
    total: int = 0
    unit: str = "descriptor"

    def text(self) -> str:
        """'MLP (emulate): checks, descriptor 3 of 12'."""
        count = f", {self.unit} {self.index} of {self.total}" if self.total else ""
        return f"{self.label}: {self.stage}{count}"


def progress_label(module: str, backend: str) -> str:
    """What the steps of one module's verification or capture are labelled: 'MLP (emulate)'."""
    return f"{module} ({backend})"


#: What a step is handed to.
Sink = Callable[[Step], None]
_SINK: ContextVar[Sink | None] = ContextVar("pytest_cudagraph_progress_sink", default=None)


@contextlib.contextmanager
def shown_by(sink: Sink) -> Iterator[None]:
    """Hand every step of the code run in the block (in this thread) to ``sink``."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def stage(label: str, name: str, show: bool | None) -> None:
    """Tell the installed sink that stage ``name`` began (a stage with no descriptors to count)."""
    sink = _SINK.get()
    if sink is not None and show is not False:
        sink(Step(label, name))


def over(items: Sequence[_T], show: bool | None, *, label: str, stage: str, unit: str) -> Iterator[_T]:
    """``items``, each told as a step (``unit`` k of n of ``stage``) before it is yielded: to the
    installed sink, else to a tqdm bar on stderr when ``show`` is True, or None and stderr is a
    terminal (then after ``PROGRESS_DELAY`` seconds). Nothing when ``show`` is False."""
    sink = _SINK.get()
    if show is False:
        yield from items
    elif sink is not None:
        for index, item in enumerate(items, start=1):
            sink(Step(label, stage, index, len(items), unit))
            yield item
    else:
        yield from _bar(items, show, f"{label}: {stage}", unit)


def _bar(items: Sequence[_T], show: bool | None, desc: str, unit: str) -> Sequence[_T] | Iterator[_T]:
    auto = show is None
    if auto:
        try:
            show = sys.stderr.isatty()
        except (AttributeError, ValueError):  # a replaced or closed stderr
            show = False
    if not show:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but progress is optional
        return items
    bar: Iterator[_T] = iter(
        tqdm(items, desc=desc, unit=unit, file=sys.stderr, delay=PROGRESS_DELAY if auto else 0.0, leave=False)
    )
    return bar
