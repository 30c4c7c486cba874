"""Torch's intra-op threads per test process: the cores, shared among workers.

Torch starts as many intra-op threads as the machine has cores in every
process. Under pytest-xdist that is ``workers x cores`` spinning threads on
``cores`` cores, and the emulator's many small ops pay for every barrier: on
a shared 2-core machine the examples ran 10-30 times slower than with one
thread. Unless the user chose a thread count, the plugin gives each process
``cores // workers`` threads (at least one).

The user chose when ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` is set (torch
reads them at start-up); ``PYTEST_CUDAGRAPH_THREADS=N`` asks the plugin for
``N`` threads, and ``PYTEST_CUDAGRAPH_THREADS=0`` leaves torch alone. A
``torch.set_num_threads`` call in a conftest's ``pytest_sessionstart`` (or a
test) runs after the plugin's and wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import environment

__all__ = [
    "THREADS_ENV",
    "USER_THREAD_ENVS",
    "apply_threads",
    "available_cores",
    "describe_threads",
    "plan_threads",
    "worker_count",
]

#: Environment variables that mean the user chose torch's thread count.
USER_THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: The plugin's own override: a thread count, or 0 to leave torch alone.
THREADS_ENV = environment.THREADS.name


def plan_threads(*, cores: int, workers: int, env: Mapping[str, str]) -> int | None:
    """Torch intra-op threads for one of ``workers`` processes on ``cores``
    cores; None when the user chose (see the module's docstring).

    ``PYTEST_CUDAGRAPH_THREADS`` that is not a whole number from 0 to ``environment.MAX_THREADS``
    is a ``UsageError`` (the plugin refuses it when pytest starts).
    """
    own = environment.read(environment.THREADS, env)
    if own is not None:
        return int(own) or None
    if any(env.get(name, "").strip() for name in USER_THREAD_ENVS):
        return None
    return max(1, max(1, cores) // max(1, workers))


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        try:
            return max(1, len(affinity(0)))
        except OSError:  # pragma: no cover - an OS without the call's support
            pass
    return max(1, os.cpu_count() or 1)


def worker_count(config: Any = None, env: Mapping[str, str] | None = None) -> int:
    """Test processes sharing the machine: xdist's worker count on a worker
    (``PYTEST_XDIST_WORKER_COUNT``), ``-n N`` on xdist's controller, else 1."""
    env = os.environ if env is None else env
    value = env.get("PYTEST_XDIST_WORKER_COUNT", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    option = getattr(config, "option", None)
    processes = getattr(option, "numprocesses", None)
    if isinstance(processes, int) and not isinstance(processes, bool) and processes > 0:
        return processes
    return 1


def _chosen(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(the variable, its value) of the thread count the user chose, or None: the plugin's own
    variable first (torch is left alone only at 0), then the ones torch reads at start-up."""
    own = env.get(THREADS_ENV, "").strip()
    if own:
        return THREADS_ENV, own
    for name in USER_THREAD_ENVS:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def describe_threads(*, cores: int, workers: int, env: Mapping[str, str]) -> str:
    """The header's words for the threads a test process runs with and where the number came from
    (``"threads=1 (2 cores, 2 workers)"``, ``"threads=4 (OMP_NUM_THREADS)"``), with a warning
    when a count the user chose exceeds the cores: threads then wait on each other at every
    barrier, and the emulator's many small ops run several times slower."""
    threads = plan_threads(cores=cores, workers=workers, env=env)
    chosen = _chosen(env)
    plural = f"{cores} core{'s' if cores != 1 else ''}"
    if chosen is None or (chosen[0] == THREADS_ENV and threads is not None):
        source = (
            f"{THREADS_ENV}"
            if chosen is not None
            else f"{plural}, {workers} worker{'s' if workers != 1 else ''}"
        )
        line = f"threads={threads} ({source})"
        count: int | None = threads
    elif chosen[0] == THREADS_ENV:  # 0: torch's own choice, which is every core in each process
        line = f"threads=torch's default, {cores} a process ({THREADS_ENV}=0)"
        count = cores * max(1, workers)
    else:
        name, value = chosen
        count = int(value) if value.isdigit() else None
        line = f"threads={value} ({name})"
        if count is not None:
            count *= max(1, workers)
    if count is not None and count > cores:
        line += (
            f" WARNING: {count} threads in all on {plural}: they wait on each other, and the emulator "
            f"runs several times slower; unset {chosen[0] if chosen else THREADS_ENV} or set it to "
            f"{max(1, cores // max(1, workers))}"
        )
    return line


def thread_plan(config: Any = None) -> tuple[int | None, str]:
    """The threads ``plan_threads`` gives this process (None: the user chose, torch is left alone)
    and the header's words for them (``describe_threads``). No torch."""
    cores, workers = available_cores(), worker_count(config)
    threads = plan_threads(cores=cores, workers=workers, env=os.environ)
    return threads, describe_threads(cores=cores, workers=workers, env=os.environ)


def apply_threads(config: Any = None) -> str | None:
    """Set torch's intra-op threads as ``plan_threads`` says; the header line, or None when the
    user chose. Imports torch: the plugin calls it once torch is there anyway (a suite that never
    imports torch never pays for it)."""
    threads, line = thread_plan(config)
    if threads is None:  # the user chose: torch keeps it
        return None
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return line
