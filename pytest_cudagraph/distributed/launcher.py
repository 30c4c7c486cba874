"""Ranks a launcher started: torchrun, srun, or a process group the suite made itself.

Each rank is a process the launcher started, running the whole suite; a verification runs its
rank's work where it stands (``build(rank, world_size)`` in this process) instead of spawning, and
the ranks hear from each other through a store of their own, never through the process group: a
collective that hangs holds the group, not the store.

- ``Ranks`` (one a process, ``current()``): the launcher's environment (``launch_env``), the
  process group (joined here through ``torch.distributed.rendezvous("env://")`` unless the suite
  made one), and the coordination store: a prefix of the rendezvous store (torchrun's agent's, or
  the one rank 0 hosts at ``MASTER_ADDR:MASTER_PORT``), or the default group's store for a group
  the suite made.
- ``Ranks.run(label, work, timeout)``: one verification on every rank. Each rank says where it is
  under ``label`` and publishes its ``RankResult``; the ranks agree on one verdict (the first to
  propose it wins: the store's compare-and-set), which lists the ranks that finished in time and
  names the others with where they were. A watchdog thread proposes the verdict when the time runs
  out, raises ``RankStopped`` into a rank the verdict names that still runs Python, and ends the
  process of one stuck in a call that never returns (so that no rank waits forever).
- After a verdict that names a rank, a group the harness made is rebuilt by every rank at its next
  verification (a collective one rank issued and another did not leaves the two counting
  collectives differently for good).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..launch_env import LaunchEnv, from_environment
from .merge import still_running
from .rank import RankResult, RankStopped, RankWork, Where, portable, run_rank, watching

__all__ = ["Ranks", "Verdict", "current", "labelled"]

#: Where the harness's keys live in the rendezvous store (the user's keys are elsewhere).
PREFIX = "pytest-cudagraph/"
#: How often a waiting rank looks at the store (seconds).
POLL = 0.05
#: The verification the launcher's SIGTERM stopped (empty: none): the session stops after its test.
STOPPING: list[str] = []


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on for one verification: who finished in time, and why the others did not."""

    present: tuple[int, ...]
    missing: dict[int, str] = field(default_factory=dict)


@dataclass
class Ranks:
    """This process among the launcher's ranks (see the module's docstring)."""

    env: LaunchEnv
    store: Any  # the harness's own keys: a PrefixStore
    backend: str  # "gloo", or "cpu:gloo,cuda:nccl" where CUDA is
    #: The store the harness made the group over (None: the suite made the group, it is theirs).
    base: Any = None
    group_timeout: float = 0.0
    generation: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    started_by: str = ""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def device(self, backend: str) -> Any:
        """The rank's device: its ``LOCAL_RANK``'s GPU on CUDA, the CPU on the emulator."""
        import torch

        if backend != "cuda":
            return "cpu"
        # Not run on a GPU in this repository yet (no machine of several GPUs was lent for #59).
        torch.cuda.set_device(self.env.local_rank)
        return torch.device("cuda", self.env.local_rank)

    # -- one verification on every rank ------------------------------------------------------
    def label(self, what: str) -> str:
        """A key for the next verification named ``what`` (the n-th of that name in this process)."""
        n = self.counts.get(what, 0)
        self.counts[what] = n + 1
        return f"{what}#{n}"

    def say(self, text: str) -> None:
        """What this rank is doing now, for a peer that waits for it in a verification."""
        with contextlib.suppress(Exception):
            self.store.set(f"now/{self.rank}", text)

    def run(
        self, label: str, work: RankWork, timeout: float, backend: str
    ) -> tuple[dict[int, RankResult], dict[int, str]]:
        """``work`` on this rank, and every rank's result: (results of the ranks that finished in
        time, {rank: why it has none}); the same on every rank."""
        self._regroup_if_asked()
        self._bound_collectives(timeout)
        started = time.monotonic()
        deadline = started + timeout
        if not self._has(f"{label}/verdict"):  # a rank that comes after the verdict does not run
            self.say(f"in {label}")
            where = Where(
                lambda text: self.store.set(f"{label}/where/{self.rank}", text),
                agreement=self._agreement(label),
            )
            dog = _Watchdog(self, label, deadline, timeout, backend)
            dog.start()
            try:
                try:
                    with watching(where):
                        result = run_rank(self.rank, self.world_size, self.device(backend), work)
                finally:
                    dog.working = False
            except RankStopped as exc:  # raised between run_rank's end and the flag
                result = RankResult(self.rank, error=str(exc))
            if result.error is not None and where.now and (STOPPING or "time ran out" in result.error):
                result.error = f"{result.error.rstrip()} (it was {where.now})"
            try:
                self.store.set(f"{label}/result/{self.rank}", portable(result))
                verdict = self._wait(label, deadline, timeout, backend)
            except RankStopped:  # the launcher stops the run (SIGTERM): a rank's process ended
                STOPPING.append(label)
                verdict = self.propose(label, timeout, backend)
            finally:
                dog.stop()
        else:
            verdict = self._read(label)
        self.say(f"after {label}")
        results = {r: pickle.loads(self.store.get(f"{label}/result/{r}")) for r in verdict.present}
        return results, dict(verdict.missing)

    def _agreement(self, label: str) -> Any:
        """This verification's collectives held to the peers' (``agree``), through the store."""
        from torch.distributed import PrefixStore  # type: ignore[attr-defined]

        from .agree import Agreement

        def finished(r: int) -> bool | str:
            if self._has(f"{label}/result/{r}"):
                return True
            skipped = self.skipped(_test_of(label), r)
            return f"skipped this test ({skipped})" if skipped else False

        return Agreement(PrefixStore(f"{label}/", self.store), self.rank, self.world_size, finished)

    # -- tests one rank skips --------------------------------------------------------------------
    def say_skipped(self, test: str, why: str) -> None:
        """This rank skipped ``test`` (``why``: pytest's reason and where): its peers' verifications
        of it name that instead of waiting for this rank."""
        with contextlib.suppress(Exception):
            self.store.set(f"skipped/{test}/{self.rank}", why)

    def skipped(self, test: str, rank: int) -> str:
        """Why rank ``rank`` skipped ``test``; "" where it did not (yet)."""
        key = f"skipped/{test}/{rank}"
        return self.store.get(key).decode() if self._has(key) else ""

    def say_done(self, test: str, ran: bool) -> None:
        """This rank is done with ``test``: it ran it (``ran``), or skipped it."""
        with contextlib.suppress(Exception):
            self.store.set(f"done/{test}/{self.rank}", "ran" if ran else "skipped")

    def ran_where_skipped(self, test: str, timeout: float) -> list[int]:
        """The peers that ran ``test``, which this rank skipped: waited for until each is done with it
        (a peer's verification of it ends at once, naming this rank's skip)."""
        keys = {r: f"done/{test}/{r}" for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + timeout
        while not self.store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(POLL)
        return [r for r, key in keys.items() if self._has(key) and self.store.get(key).decode() == "ran"]

    def _wait(self, label: str, deadline: float, timeout: float, backend: str) -> Verdict:
        test = _test_of(label)
        while True:
            if self._has(f"{label}/verdict"):
                return self._read(label)
            # Every rank's result, or why it will give none (it skipped this test).
            done = all(
                self._has(f"{label}/result/{r}") or self.skipped(test, r) for r in range(self.world_size)
            )
            if done or time.monotonic() >= deadline or STOPPING:
                return self.propose(label, timeout, backend)
            time.sleep(POLL)

    def propose(self, label: str, timeout: float, backend: str) -> Verdict:
        """The verdict as this rank sees the store now; the first rank's proposal is everyone's."""
        present, missing = [], {}
        for r in range(self.world_size):
            skipped = self.skipped(_test_of(label), r)
            if self._has(f"{label}/result/{r}"):
                present.append(r)
            elif skipped:
                missing[r] = (
                    f"rank {r} skipped this test ({skipped}) where its peers ran it: the ranks' verifications pair "
                    "up test by test, so a skip that depends on the rank skips the test on every rank or on none"
                )
            elif self._has(f"{label}/where/{r}"):
                where = self.store.get(f"{label}/where/{r}").decode()
                missing[r] = (
                    f"rank {r} stopped answering, {where or 'before its first collective'}: the launcher is "
                    "stopping the run (SIGTERM), as it does when a rank's process ends (its output says why)"
                    if STOPPING
                    else still_running(r, timeout, where, backend)
                )
            else:
                now = self.store.get(f"now/{r}").decode() if self._has(f"now/{r}") else ""
                doing = f"it is {_doing(now)}" if now else "it has not said what it is doing"
                missing[r] = f"rank {r} did not reach this verification within {timeout:g} s: {doing}"
        proposal = pickle.dumps(Verdict(tuple(present), missing))
        agreed = self.store.compare_set(f"{label}/verdict", "", proposal)
        verdict: Verdict = pickle.loads(agreed)
        # A rank that skipped the test entered no collective: the group is as it was.
        broken = [r for r in verdict.missing if not self.skipped(_test_of(label), r)]
        if broken and agreed == proposal and self.base is not None:
            self.store.add("generation", 1)  # every rank rebuilds the group at its next verification
        return verdict

    def _read(self, label: str) -> Verdict:
        verdict: Verdict = pickle.loads(self.store.get(f"{label}/verdict"))
        return verdict

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _bound_collectives(self, timeout: float) -> None:
        """A collective of a group the harness made gives up after the verification's seconds, so
        that a rank stuck in one returns to Python about when its peers agree it hangs (the
        suite's own group keeps the timeout the suite gave it)."""
        if self.base is None:
            return
        from torch.distributed.distributed_c10d import _set_pg_timeout

        with contextlib.suppress(Exception):  # a private function of torch's: without it, the group's timeout
            _set_pg_timeout(datetime.timedelta(seconds=timeout))

    def _regroup_if_asked(self) -> None:
        """Rebuild a group the harness made when a verdict named a rank since the last rebuild."""
        if self.base is None:
            return
        wanted = int(self.store.add("generation", 0))
        if wanted == self.generation:
            return
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self.generation = wanted
        _init_group(self)

    # -- the ranks' collections ----------------------------------------------------------------
    def collections(self, nodeids: list[str], timeout: float) -> dict[int, list[str]] | str:
        """Every rank's collected tests (this rank's are ``nodeids``), or why not all are known."""
        self.store.set(f"collected/{self.rank}", "\n".join(nodeids))
        keys = [f"collected/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                late = [r for r in range(self.world_size) if not self._has(keys[r])]
                return f"rank(s) {late} did not finish collecting within {timeout:g} s"
            time.sleep(POLL)
        return {
            r: [t for t in self.store.get(keys[r]).decode().split("\n") if t] for r in range(self.world_size)
        }

    def order_differs(self, found: dict[int, list[str]], nodeids: list[str]) -> str | None:
        """None where the tests every rank collected run in one order on every rank; else how not."""
        common = set.intersection(*(set(ids) for ids in found.values()))
        mine = [t for t in nodeids if t in common]
        for r, theirs in found.items():
            shared = [t for t in theirs if t in common]
            if shared != mine:
                return _collection_difference(self.rank, mine, r, shared)
        return None


def _test_of(label: str) -> str:
    """The test a verification's label belongs to (``NODEID#n``: its n-th verification)."""
    return label.rsplit("#", 1)[0]


def _doing(now: str) -> str:
    if now.startswith("in "):
        return f"in another verification ({now[3:]})"
    if now.startswith("after "):
        return f"past its last verification ({now[6:]})"
    return now


def _collection_difference(rank: int, mine: list[str], other: int, theirs: list[str]) -> str:
    only_mine = [n for n in mine if n not in set(theirs)]
    only_theirs = [n for n in theirs if n not in set(mine)]
    if only_mine or only_theirs:
        first = (
            f"rank {rank} has {only_mine[0]}, which rank {other} did not collect"
            if only_mine
            else f"rank {other} has {only_theirs[0]}, which rank {rank} did not collect"
        )
        return f"ranks {rank} and {other} collected different tests ({len(mine)} and {len(theirs)}): {first}"
    return f"ranks {rank} and {other} collected the same tests in another order"


class _Watchdog(threading.Thread):
    """When a verification's time runs out: proposes the verdict, stops this rank if it is named
    and still runs, and ends the process if it is stuck where nothing can stop it."""

    def __init__(self, ranks: Ranks, label: str, deadline: float, timeout: float, backend: str) -> None:
        super().__init__(daemon=True, name="cudagraph-rank-watchdog")
        self.ranks, self.label, self.deadline = ranks, label, deadline
        self.timeout, self.backend = timeout, backend
        self.working = True
        self.main = threading.main_thread().ident
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join(5)

    def run(self) -> None:
        if self._done.wait(max(0.0, self.deadline - time.monotonic())) or not self.working:
            return
        with contextlib.suppress(Exception):
            verdict = self.ranks.propose(self.label, self.timeout, self.backend)
            if self.ranks.rank not in verdict.present and self.working:
                _stop(self.main)
        # A rank stuck in a call that returns to Python only at the group's own timeout (or never).
        grace = max(10.0, self.ranks.group_timeout or self.timeout)
        if self._done.wait(grace) or not self.working:
            return
        sys.stderr.write(
            f"pytest-cudagraph: rank {self.ranks.rank} is still stuck in {self.label} {grace:g} s after its "
            f"{self.timeout:g} s ran out; ending its process so that no rank waits forever\n"
        )
        sys.stderr.flush()
        os._exit(1)


#: Set while the watchdog asks the main thread to stop (``_stop``); the signal's handler reads it.
_STOP_ASKED: list[bool] = []
#: The signal that interrupts the main thread where it waits in a call (``time.sleep``, a lock).
_INTERRUPT = "SIGUSR1"


def _stop(thread: int | None) -> None:
    """Stop the main thread (``thread``) with ``RankStopped``: by a signal where the harness holds
    one, which also ends a wait in a call (``time.sleep`` returns to Python only when its time is
    up; an exception raised into the thread waits for that), else when it next runs Python."""
    import signal

    number = getattr(signal, _INTERRUPT, None)
    if thread is not None and number is not None and signal.getsignal(number) is _interrupted:
        _STOP_ASKED.append(True)
        signal.pthread_kill(thread, number)
    else:
        _raise_in(thread, RankStopped)


def _interrupted(signum: int, frame: Any) -> None:
    if _STOP_ASKED:
        _STOP_ASKED.clear()
        raise RankStopped("this rank's time ran out while its own code ran or waited: stopped there")


def _raise_in(thread: int | None, exc: type[BaseException]) -> None:
    """Raise ``exc`` in the thread ``thread`` when it next runs Python (CPython's async exception)."""
    if thread is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc))


# -- joining ------------------------------------------------------------------------------------
_RANKS: list[Ranks] = []


def launched() -> bool:
    """Whether this process is a rank of a launcher (its environment) or of a group the suite made."""
    if from_environment() is not None:
        return True
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def current(timeout: float) -> Ranks | None:
    """This process's ``Ranks``, joined on first use (None: no launcher, no group: spawn ranks).
    ``timeout``: the seconds a collective of a group made here may wait (the rank timeout)."""
    if _RANKS:
        return _RANKS[0]
    if not launched():
        return None
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    cuda = torch.cuda.is_available()
    if dist.is_initialized():  # the suite made the group: its store is the one all ranks share
        from torch.distributed.distributed_c10d import _get_default_store

        given = from_environment() or LaunchEnv(
            dist.get_rank(), dist.get_world_size(), dist.get_rank(), "", None, None
        )
        ranks = Ranks(given, PrefixStore(PREFIX, _get_default_store()), str(dist.get_backend()))
        ranks.started_by = f"{given.launcher + ', ' if given.launcher else ''}the suite's process group"
    else:
        launched_env = from_environment()
        assert launched_env is not None
        ranks = Ranks(launched_env, None, "cpu:gloo,cuda:nccl" if cuda else "gloo", group_timeout=timeout)
        ranks.base = _rendezvous(launched_env, timeout)
        ranks.store = PrefixStore(PREFIX, ranks.base)
        ranks.started_by = launched_env.launcher
        _init_group(ranks)
    if (
        cuda
    ):  # each rank on its LOCAL_RANK's GPU, before any test picks "the current device" (not run on GPUs yet)
        torch.cuda.set_device(ranks.env.local_rank % torch.cuda.device_count())
    stop_on_sigterm()
    _RANKS.append(ranks)
    return ranks


def _rendezvous(env: LaunchEnv, timeout: float) -> Any:
    from torch.distributed import rendezvous  # type: ignore[attr-defined]

    from ..errors import UsageError

    if env.master_addr is None or env.master_port is None:
        raise UsageError(
            f"{env.launcher} started rank {env.rank} of {env.world_size}, but MASTER_ADDR and MASTER_PORT are not "
            "both set: the ranks meet there. Export them in the job script, such as MASTER_ADDR=$(scontrol show "
            "hostnames $SLURM_JOB_NODELIST | head -n 1) MASTER_PORT=29500"
        )
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    store, _, _ = next(
        rendezvous(
            "env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=max(timeout, 60)),
        )
    )
    return store


def _init_group(ranks: Ranks) -> None:
    import torch.distributed as dist
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    if "nccl" in ranks.backend:  # whole-network capture needs NCCL's async error handling off (torch's notes)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        os.environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group(
        ranks.backend,
        store=PrefixStore(f"pytest-cudagraph-group-{ranks.generation}/", ranks.base),
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=datetime.timedelta(seconds=ranks.group_timeout),
    )


# -- the label of the verification a test runs ---------------------------------------------------
_LABEL: list[str] = []


@contextlib.contextmanager
def labelled(what: str) -> Iterator[None]:
    """Verifications in the block are keyed by ``what`` (the plugin: the test's node id), so that
    ranks running different tests never take each other's results."""
    _LABEL.append(what)
    try:
        yield
    finally:
        _LABEL.pop()


def next_label(ranks: Ranks) -> str:
    return ranks.label(_LABEL[-1] if _LABEL else "verification")


def stop_on_sigterm() -> None:
    """The launcher stops the other ranks with SIGTERM when one ends: raise ``RankStopped`` here, so
    that the verification running says so and the session still writes its reports."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        STOPPING.append("SIGTERM")
        raise RankStopped("the launcher stopped this rank (SIGTERM): another rank ended; its output says why")

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, handler)
    number = getattr(signal, _INTERRUPT, None)
    if number is not None and signal.getsignal(number) in (signal.SIG_DFL, None):
        signal.signal(number, _interrupted)
