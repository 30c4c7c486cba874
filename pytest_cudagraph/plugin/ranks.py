"""The plugin under a launcher (torchrun, srun): one run of the suite a rank, one verdict, one report.

Every rank runs the whole suite. Rank 0 prints (with every rank's findings: a verification's
report merges the ranks') and writes ``--junitxml`` and ``--cudagraph-report``; the other ranks'
terminals stay quiet unless ``--cudagraph-all-ranks`` is given, and they write neither file (the
paths are the same on every rank). Once collected, the ranks hold each other to the same tests
(in the same order); a verification is keyed by its test's node id, so that ranks running
different tests never take each other's results; and a test running when the launcher stops the
run (a rank's process ended) fails saying so, and the session stops after it.

Reading the environment imports no torch; joining the ranks (after collection) does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

from ..launch_env import LaunchEnv, LaunchEnvError, from_environment

__all__ = ["RankPlugin", "configure", "launched_world_size", "writes_reports"]

ENV_KEY = pytest.StashKey["LaunchEnv | None"]()
#: A distributed verification's seconds when neither the call nor --cudagraph-rank-timeout sets them.
DEFAULT_TIMEOUT = 120.0


def configure(config: pytest.Config) -> LaunchEnv | None:
    """Read the launcher's environment (a malformed one is a usage error) and, on a rank other than
    0, leave ``--junitxml`` to rank 0 (called before junitxml's own configure)."""
    try:
        env = from_environment()
    except LaunchEnvError as exc:
        raise pytest.UsageError(f"the launcher's environment: {exc}") from None
    config.stash[ENV_KEY] = env
    if env is not None and env.rank != 0:
        config.option.xmlpath = None  # rank 0 writes it, with every rank's findings in each report
    return env


def writes_reports(config: pytest.Config) -> bool:
    """Whether this process writes the run's reports: not a rank other than 0 of a launcher."""
    env = config.stash.get(ENV_KEY, None)
    return env is None or env.rank == 0


def launched_world_size(config: pytest.Config) -> int | None:
    """The launcher's ranks (or a process group the suite made): None where the harness spawns."""
    env = config.stash.get(ENV_KEY, None)
    if env is not None:
        return env.world_size
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    return None


def timeout(config: pytest.Config, given: Any = None) -> float:
    """A distributed verification's seconds: the call's, else --cudagraph-rank-timeout, else 120."""
    if given is not None:
        return float(given)
    from .report import run_state

    chosen = run_state(config).settings.rank_timeout
    return DEFAULT_TIMEOUT if chosen is None else chosen


class RankPlugin:
    """The hooks of a rank: registered with the plugin, idle unless a launcher started the process."""

    @staticmethod
    def _env(config: pytest.Config) -> LaunchEnv | None:
        return config.stash.get(ENV_KEY, None)

    @pytest.hookimpl(trylast=True)  # after the terminal plugin made its reporter
    def pytest_configure(self, config: pytest.Config) -> None:
        from .report import STATE_KEY

        env = self._env(config)
        state = config.stash.get(STATE_KEY, None)
        if env is None or env.rank == 0 or state is None or state.settings.all_ranks:
            return
        # Quiet: the terminal reporter writes to nothing (rank 0 prints every rank's findings).
        old = config.pluginmanager.get_plugin("terminalreporter")
        if old is None:
            return
        sink = open(os.devnull, "w")  # closed with the config
        config.add_cleanup(sink.close)
        config.pluginmanager.unregister(old, "terminalreporter")
        config.pluginmanager.register(pytest.TerminalReporter(config, sink), "terminalreporter")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self._env(session.config) is None or hasattr(session.config, "workerinput"):
            return
        from ..distributed import launcher

        ranks = launcher.current(timeout(session.config))
        if ranks is None:
            return
        differs = ranks.same_tests([item.nodeid for item in session.items], timeout(session.config))
        if differs is not None:
            pytest.exit(
                f"cudagraph: the ranks must run the same tests in the same order (their collectives pair up "
                f"test by test), and {differs}; collect the same tests on every rank (a skip or a selection "
                "that depends on the rank belongs inside the test)",
                returncode=pytest.ExitCode.USAGE_ERROR,
            )

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        if self._env(item.config) is None:
            return (yield)
        from ..distributed import launcher

        ranks = launcher.current(timeout(item.config))
        if ranks is None:
            return (yield)
        ranks.say(f"running {item.nodeid}")
        try:
            with launcher.labelled(item.nodeid):
                return (yield)
        finally:
            ranks.say(f"past {item.nodeid}")

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        if self._env(item.config) is None:
            return
        from ..distributed import launcher

        if launcher.STOPPING:
            item.session.shouldstop = (
                "cudagraph: the launcher is stopping the run (SIGTERM): a rank's process ended"
            )
