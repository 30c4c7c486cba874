"""A test process's torch and GPU, and what happens after a test takes its CUDA context down.

Each xdist worker takes its own GPU (``gw<N>`` -> the N-th of
``--cudagraph-devices``, or of every visible device) and its torch threads,
once, when torch is first wanted; a worker whose CUDA context a test lost
ends after that test's reports, and the controller counts no crash for it.
Pure Python until torch is wanted.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator

import pytest

from . import report as pytest_report
from . import settings

__all__ = ["LostContext", "is_torch_ready", "torch_ready"]

_TORCH_READY_KEY = pytest.StashKey[bool]()


_state = pytest_report.run_state


def is_torch_ready(config: pytest.Config) -> bool:
    return config.stash.get(_TORCH_READY_KEY, False)


def torch_ready(config: pytest.Config) -> None:
    """Once a process: torch's threads, and each xdist worker's own GPU (gw<N> -> the N-th of
    --cudagraph-devices, or of every visible device), so that "cuda" means that GPU for the
    fixtures and the tests alike."""
    if config.stash.get(_TORCH_READY_KEY, False):
        return
    config.stash[_TORCH_READY_KEY] = True
    from .threads import apply_threads

    apply_threads(config)
    run = _state(config).settings
    worker = config.workerinput["workerid"] if hasattr(config, "workerinput") else None
    if (worker is None and run.devices is None) or run.backend == "emulate":
        return
    import torch

    if not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    missing = [d for d in run.devices or () if d >= count]
    if missing:  # checked once, where it can stop the run (a worker's error would crash it)
        if worker is not None:
            return
        raise pytest.UsageError(
            f"--cudagraph-devices names device(s) {missing}, but only {count} CUDA device(s) are visible"
        )
    if worker is None and getattr(config.option, "numprocesses", None):
        return  # the xdist controller runs no test: its workers take the devices
    index = settings.worker_device_index(worker, run.devices, count)
    if index is not None:
        torch.cuda.set_device(index)


class LostContext:
    """What happens after a test takes its process's CUDA context down, under pytest-xdist."""

    #: The exit status of a worker ended because its CUDA context was lost.
    EXIT = 75

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> Generator[None, None, None]:
        yield
        # A worker whose CUDA context a test took down ends once that test's
        # reports are sent: the controller starts a fresh worker for the tests
        # after it, and pytest_handlecrashitem keeps the test from counting twice.
        if hasattr(self.config, "workerinput") and _state(self.config).lost_here == nodeid:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.EXIT)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport) -> None:
        # The controller: the worker ended after its test lost the CUDA
        # context. That is no crash of the test (its failure is reported
        # already) nor of any other: xdist's report of it is logged as a passed teardown.
        if crashitem in _state(self.config).lost:
            report.outcome = "passed"
            report.when = "teardown"
            report.longrepr = None
