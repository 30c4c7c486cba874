"""``--cudagraph-progress``: a long verification's stage and descriptor (k of n) on the terminal.

pytest captures a test's output (its file descriptors 1 and 2), so the bar a
verification draws on stderr never reached the terminal unless run with
``-s``. Here each test that uses the plugin gets a sink (``progress.shown_by``)
that writes with the capture suspended, as pytest's own live logging does:

- **inline** (the output is a terminal, no xdist): the step is written after
  what pytest wrote on the current line (``test_model.py ..``) and erased
  before the next one and at the test's end, so the line reads as pytest left it;
- **lines** (``on`` where the output is not a terminal, such as a CI log, and
  any xdist worker): a line a stage, its last step, and at most one every
  ``LINE_EVERY`` seconds between. An xdist worker's stdout is not the
  terminal, but its stderr is the controller's: its lines go there, each
  prefixed with the worker (``[gw0]``).

``auto`` shows the progress of a test that runs past ``PROGRESS_DELAY`` seconds
where the output is a terminal, not CI and not ``-q``; the controller decides
and tells its workers (``pytest_configure_node``). Pure Python: no torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

import pytest

from ..progress import PROGRESS_DELAY, Step, shown_by
from .report import run_state

__all__ = ["LINE_EVERY", "WORKER_KEY", "TerminalProgress", "decided", "on_ci", "showing", "shown"]

#: Lines mode: at most one line a stage every this many seconds, besides its first and last.
LINE_EVERY = 10.0
#: ``workerinput`` key under which the controller tells its xdist workers whether to show progress.
WORKER_KEY = "cudagraph_progress"
#: An inline step needs at least this many columns left on pytest's line, or it starts a new one.
_MIN_ROOM = 24
_DECIDED = pytest.StashKey[bool]()


def on_ci(environ: Mapping[str, str]) -> bool:
    """A CI job, as pytest itself tells one: the CI or BUILD_NUMBER environment variable is set."""
    return "CI" in environ or "BUILD_NUMBER" in environ


def shown(setting: str, *, terminal: bool, environ: Mapping[str, str], quiet: bool) -> bool:
    """Whether a run shows progress: ``on`` always, ``off`` never, ``auto`` where its output is a
    terminal, not a CI job's and not made quiet (``-q``)."""
    if setting == "auto":
        return terminal and not on_ci(environ) and not quiet
    return setting == "on"


def _capture(config: pytest.Config) -> Any:
    """pytest's capture manager (None under ``-p no:capture``)."""
    return config.pluginmanager.getplugin("capturemanager")


@contextlib.contextmanager
def _uncaptured(config: pytest.Config) -> Iterator[None]:
    """The block writes to the process's real stdout and stderr, past pytest's capture."""
    capman = _capture(config)
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        yield


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def decided(config: pytest.Config) -> bool:
    """Whether this process shows progress, decided once: by the controller, from the setting, its
    output and its environment; an xdist worker takes its controller's word."""
    if _DECIDED not in config.stash:
        workerinput = getattr(config, "workerinput", None)
        if workerinput is not None:
            config.stash[_DECIDED] = bool(workerinput.get(WORKER_KEY, False))
        else:
            with _uncaptured(config):
                terminal = _is_terminal(sys.stdout)
            config.stash[_DECIDED] = shown(
                run_state(config).settings.progress,
                terminal=terminal,
                environ=os.environ,
                quiet=config.get_verbosity() < 0,
            )
    return config.stash[_DECIDED]


class TerminalProgress:
    """One test's steps on the terminal (see the module's docstring for the two ways)."""

    def __init__(self, config: pytest.Config, *, delay: float) -> None:
        self.config = config
        self.delay = delay
        self.started = time.monotonic()
        workerinput = getattr(config, "workerinput", None)
        self.worker: str | None = workerinput["workerid"] if workerinput is not None else None
        #: pytest's own terminal output (none under ``-p no:terminal``: then lines on stderr)
        self.reporter = config.pluginmanager.get_plugin("terminalreporter") is not None
        with _uncaptured(config):
            self.inline = self.worker is None and self.reporter and _is_terminal(sys.stdout)
        #: inline: the characters written after pytest's text, erased before the next step
        self.shown = 0
        #: lines: the stage of the last line and when it was written
        self.last: tuple[str, float] | None = None

    def __call__(self, step: Step) -> None:
        now = time.monotonic()
        if now - self.started < self.delay:
            return
        with _uncaptured(self.config):
            if self.inline:
                self._inline(f"cudagraph: {step.text()}")
            else:
                self._line(step, now)

    def _inline(self, text: str) -> None:
        writer = self.config.get_terminal_writer()
        room = writer.fullwidth - writer.width_of_current_line - 1  # pytest's, without ours
        if room < _MIN_ROOM and not self.shown:  # a long line (-v): a line of its own below it
            writer.line()
            room = writer.fullwidth - 1
        text = text[: max(room, 0)]
        out = sys.stdout
        out.write(self._erasing() + text)
        out.flush()
        self.shown = len(text)

    def _erasing(self) -> str:
        """Back over what the last step wrote, blank it, and back again."""
        return "\b" * self.shown + " " * self.shown + "\b" * self.shown

    def _line(self, step: Step, now: float) -> None:
        last_stage, last_time = self.last or ("", -LINE_EVERY)
        if step.stage == last_stage and step.index != step.total and now - last_time < LINE_EVERY:
            return
        self.last = (step.stage, now)
        # A worker's stderr is its controller's terminal; without pytest's reporter, stderr too.
        if self.worker is not None or not self.reporter:
            prefix = f"[{self.worker}] " if self.worker is not None else ""
            sys.stderr.write(f"{prefix}cudagraph: {step.text()}\n")
            sys.stderr.flush()
            return
        writer = self.config.get_terminal_writer()
        if writer.width_of_current_line:
            writer.line()
        writer.line(f"cudagraph: {step.text()}", flush=True)

    def close(self) -> None:
        """Erase an inline step: the line reads as pytest left it."""
        if self.shown:
            with _uncaptured(self.config):
                sys.stdout.write(self._erasing())
                sys.stdout.flush()
            self.shown = 0


@contextlib.contextmanager
def showing(config: pytest.Config) -> Iterator[None]:
    """The steps of the code run in the block on the terminal, where this run shows progress; else
    nowhere (not even the library's own bar: the run said off, or auto decided so)."""
    if not decided(config):
        with shown_by(lambda step: None):
            yield
        return
    delay = PROGRESS_DELAY if run_state(config).settings.progress == "auto" else 0.0
    sink = TerminalProgress(config, delay=delay)
    try:
        with shown_by(sink):
            yield
    finally:
        sink.close()
