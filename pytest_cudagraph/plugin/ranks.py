"""The plugin under a launcher (torchrun, srun): one run of the suite a rank, one verdict, one report.

Every rank runs the whole suite. Rank 0 prints (with every rank's findings: a verification's
report merges the ranks') and writes ``--junitxml`` and ``--cudagraph-report``; the other ranks'
terminals stay quiet unless ``--cudagraph-all-ranks`` is given, and they write neither file (the
paths are the same on every rank). Once collected, the ranks hold each other to the same tests: a
test some rank did not collect fails on the ranks that did, and a test one rank skips fails on
every rank (the skipping rank's report turned into a failure where a peer ran it), both named at
once; the tests they share run in one order, or the session ends as a usage error. A verification
is keyed by its test's node id, so that ranks running different tests never take each other's
results; and a test running when the launcher stops the run (a rank's process ended) fails saying
so, and the session stops after it.

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
#: Per test this rank collected, the ranks that did not collect it (tests every rank has: absent).
LACKING_KEY = pytest.StashKey[dict[str, list[int]]]()
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


def _skip_reason(longrepr: Any) -> str:
    """pytest's reason for a skip, with where it was taken."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, line, reason = longrepr
        return f"{str(reason).removeprefix('Skipped: ')} at {path}:{line}"
    return str(longrepr)


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
        nodeids = [item.nodeid for item in session.items]
        found = ranks.collections(nodeids, timeout(session.config))
        differs = found if isinstance(found, str) else ranks.order_differs(found, nodeids)
        if differs is not None:
            pytest.exit(
                f"cudagraph: the ranks must run the same tests in the same order (their collectives pair up "
                f"test by test), and {differs}; collect the same tests on every rank (a skip or a selection "
                "that depends on the rank belongs inside the test)",
                returncode=pytest.ExitCode.USAGE_ERROR,
            )
        assert not isinstance(found, str)
        # A test some rank did not collect fails on the ranks that did, named, and the others go on.
        lacking = {t: [r for r, ids in found.items() if t not in set(ids)] for t in nodeids}
        session.config.stash[LACKING_KEY] = {t: r for t, r in lacking.items() if r}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        if self._env(item.config) is None:
            return (yield)
        from ..distributed import launcher

        ranks = launcher.current(timeout(item.config))
        if ranks is None:
            return (yield)
        lacking = item.config.stash.get(LACKING_KEY, {}).get(item.nodeid)
        if lacking:
            ranks.say_done(item.nodeid, ran=True)
            pytest.fail(
                f"cudagraph: rank(s) {lacking} did not collect this test, which rank {ranks.rank} collected: the "
                "ranks' verifications pair up test by test, so every rank collects the same tests (a selection "
                "that depends on the rank belongs inside the test, on every rank alike)",
                pytrace=False,
            )
        ranks.say(f"running {item.nodeid}")
        try:
            with launcher.labelled(item.nodeid):
                return (yield)
        finally:
            ranks.say(f"past {item.nodeid}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, Any]:
        report = yield
        if self._env(item.config) is None or report.when == "teardown" or hasattr(report, "wasxfail"):
            return report
        from ..distributed import launcher

        ranks = launcher.current(timeout(item.config))
        if ranks is None:
            return report
        if report.skipped:
            reason = _skip_reason(report.longrepr)
            ranks.say_skipped(item.nodeid, reason)
            ranks.say_done(item.nodeid, ran=False)
            ran = ranks.ran_where_skipped(item.nodeid, timeout(item.config))
            if ran:
                report.outcome = "failed"
                report.longrepr = (
                    f"cudagraph: rank {ranks.rank} skipped this test ({reason}) where rank(s) {ran} ran it: the ranks' "
                    "verifications pair up test by test, so a skip that depends on the rank skips the test on every "
                    "rank or on none"
                )
        elif report.when == "call" or report.failed:
            ranks.say_done(item.nodeid, ran=True)
        return report

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        if self._env(item.config) is None:
            return
        from ..distributed import launcher

        if launcher.STOPPING:
            item.session.shouldstop = (
                "cudagraph: the launcher is stopping the run (SIGTERM): a rank's process ended"
            )
