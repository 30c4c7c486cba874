"""Each collective a rank issues, held to its peers' before any rank enters it.

A collective that one rank issues and another does not, issued in another order, or given another
shape or dtype on one rank is the commonest bug of sharded code, and the backend does not name it:
gloo ends the process on a size mismatch (SIGABRT) or waits, NCCL waits until its watchdog. Like
``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s ``ProcessGroupWrapper``, each rank here says what it is about to
issue before it issues it, and waits for its peers to say the same; unlike it, the ranks say it
through a store, never through the process group, so that a rank which never comes (it skipped the
collective, finished, raised) is found by looking, and no rank enters a collective its peers did
not agree to. The group is then left as it was: the next verification runs on it.

What is compared, per collective of a step of a verification (its n-th; a step is a check on a
descriptor, or a stage, as ``pytest_cudagraph.peers`` says): the operation, the shape and dtype of
each tensor it is given, and which forward of the step it belongs to (its k-th, a graph's replay
counted as one, and the collective's place in it), so that a rank that skipped one and went on to
the next forward is named at the one it skipped, not later when the counts run out. The line of the
user's code that issued it is told, not compared.

The harness's own forwards stay in step: a rank whose peer ended the step having run fewer
forwards than it is running now (a check that failed there stopped early) leaves the step
(``peers.StepLeft``) instead of waiting for a collective no peer will issue; a decision that runs
forwards is taken by every rank alike (``any_rank``); and a failure's diagnosis runs alone, its
collectives answered on its rank (``peers.alone``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..guard.tracker import raised_at, user_site
from ..peers import StepLeft
from .rank import RankStopped

__all__ = ["Agreement", "CollectivesDiffer", "described"]

#: The longest pause between two looks at the store while a peer has not said what it issues.
POLL = 0.002
#: How often a waiting rank looks whether a peer finished its work (a peer that will never say).
LOOK_FOR_GONE = 0.02

#: Whether the ranks hold their collectives, steps and decisions to each other
#: (``benchmarks/collective_check.py`` turns it off to measure what it costs; nothing else does).
ENABLED = True


class CollectivesDiffer(RankStopped):
    """The ranks would issue different collectives (or one would issue none): raised on every rank
    that sees it, before any enters the collective. A ``RankStopped``: the rank's verification ends
    there, since its forwards would no longer be in step with its peers'."""


def described(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A collective in words: its name, each tensor's shape and dtype, and a reduce op if given."""
    parts = []
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(t, "shape") and hasattr(t, "dtype"):
                parts.append(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
    op = kwargs.get("op")
    if op is None:
        op = next((a for a in args if type(a).__name__ in ("ReduceOp", "RedOpType")), None)
    said = f"{name} of {', '.join(parts)}" if parts else name
    return f"{said} ({str(op).rsplit('.', 1)[-1]})" if op is not None else said


@dataclass(frozen=True)
class _Said:
    """What a rank said it issues as its n-th collective."""

    what: str  # the collective in words (compared)
    forward: int  # which forward of the module (compared)
    place: int  # its place in that forward, from 1 (compared)
    line: str  # where the user's code issued it (told)

    def key(self) -> tuple[str, int, int]:
        return (self.what, self.forward, self.place)

    def encode(self) -> str:
        return "\x1f".join((self.what, str(self.forward), str(self.place), self.line))

    @staticmethod
    def decode(raw: bytes) -> _Said:
        what, forward, place, line = raw.decode().split("\x1f")
        return _Said(what, int(forward), int(place), line)

    def told(self) -> str:
        at = f" at {self.line}" if self.line else ""
        return f"{self.what}{at} (the {_nth(self.place)} collective of its forward {self.forward})"


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class Agreement:
    """One verification's collectives on this rank, held to its peers' (see the module's docstring).

    ``store``: keys the ranks share for this verification alone; ``finished(r)``: whether rank ``r``
    ended this verification's work (it will issue no more): True where it finished it, or why it
    ended otherwise, in words ("its process ended (exit code 3)", "it skipped this test"). A rank whose time ran out is stopped by
    the caller's watchdog, which raises into it as it polls."""

    def __init__(self, store: Any, rank: int, world_size: int, finished: Callable[[int], bool | str]) -> None:
        self.store, self.rank, self.world_size, self.finished = store, rank, world_size, finished
        #: The step (its number from 1, its name) and, in it: the collectives issued, the forwards
        #: (and replays) begun, the collectives of the current forward.
        self.steps = 0
        self.step_name = "the verification's start"
        self.issued = 0
        self.forwards = 0
        self.in_forward = 0
        #: Decisions taken with the peers in the step so far (``any_rank``).
        self.decided = 0
        self.closed = False
        #: Where the rank says what it is doing (``rank.Where``'s): what it waits for, in full.
        self.say: Callable[[str], None] = lambda text: None

    @property
    def peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def step(self, name: str) -> None:
        """A new step begins: the last one said done, with the forwards this rank ran in it."""
        if not ENABLED:
            return
        self._done()
        self.steps += 1
        self.step_name = name
        self.issued = self.forwards = self.in_forward = self.decided = 0

    def _done(self) -> None:
        self.store.set(f"done/{self.steps}/{self.rank}", str(self.forwards))

    def close(self) -> None:
        """This rank's work ended (finished or stopped): its last step is done."""
        if not self.closed:
            self.closed = True
            self._done()

    def forward_started(self) -> None:
        self.forwards += 1
        self.in_forward = 0

    def forward_raised(self, exc: BaseException) -> None:
        """This rank's forward raised (its collectives after that point will not come): said, for a
        peer that waits at one of them to name the cause."""
        first = (str(exc).strip().splitlines() or [""])[0]
        at = raised_at(exc)
        self.store.set(
            f"raised/{self.steps}/{self.forwards}/{self.rank}",
            f"{type(exc).__name__}: {first}" + (f" (at {at})" if at else ""),
        )

    def _raised(self, rank: int, forward: int) -> str:
        """What rank ``rank``'s ``forward``-th forward of this step raised ("" where it did not)."""
        key = f"raised/{self.steps}/{forward}/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag set where any rank set it: said through the store, the peers waited for (a peer
        that finished its work adds nothing)."""
        if not ENABLED:
            return list(flags)
        # Keyed by the step: a peer whose check stopped early in it (and took fewer decisions there)
        # is not waited for, and never pairs one of its later decisions with this one.
        self.decided += 1
        here = f"any/{self.steps}/{self.decided}"
        self.store.set(f"{here}/{self.rank}", "".join("1" if f else "0" for f in flags))
        keys = {r: f"{here}/{r}" for r in self.peers}
        waiting = dict(keys)
        while not self.store.check(list(waiting.values())):
            ended, finished = self._wait_a_while(waiting)
            for r in (*ended, *finished):
                waiting.pop(r)
        merged = list(flags)
        for key in keys.values():
            if self.store.check([key]):
                theirs = self.store.get(key).decode()
                merged = [m or (i < len(theirs) and theirs[i] == "1") for i, m in enumerate(merged)]
        return merged

    def before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Say what this rank issues next and wait for every peer to say the same; raise
        ``CollectivesDiffer`` (naming each rank's) where one says otherwise or never will, and
        ``peers.StepLeft`` where the peers ended the step before this forward."""
        if not ENABLED:
            return
        self.issued += 1
        self.in_forward += 1
        n = self.issued
        mine = _Said(described(name, args, kwargs), self.forwards, self.in_forward, user_site())
        self.store.set(f"op/{self.steps}/{n}/{self.rank}", mine.encode())
        self.say(f"waiting for its peers to issue {mine.told()} too, its {_nth(n)} of {self.step_name}")
        peers = self.peers
        keys = {r: f"op/{self.steps}/{n}/{r}" for r in peers}

        every = list(keys.values())
        while not self.store.check(every):
            ended, finished = self._wait_a_while(keys)
            # A peer that ended this step without saying this collective: it ran fewer forwards in it
            # than this rank is running (its check stopped early: this rank leaves the step too), or
            # it ran this forward without issuing it (the module's skip, named as such).
            if ended:
                ran = int(self.store.get(f"done/{self.steps}/{ended[0]}").decode())
                if ran < self.forwards:
                    raise StepLeft(
                        f"rank {ended[0]} ended {self.step_name} after {ran} forward(s) and replay(s), before this "
                        f"rank's {_nth(self.forwards)} (its check stopped early there, as a failed check does), so "
                        "no rank pairs with what this rank would run: not checked further on this rank"
                    )
                raise CollectivesDiffer(self._skipped_by(n, mine, ended[0]))
            if finished:
                raise CollectivesDiffer(self._none_from(n, mine, finished[0]))
        theirs = {r: _Said.decode(self.store.get(keys[r])) for r in peers}
        other = next((r for r in peers if theirs[r].key() != mine.key()), None)
        if other is not None:
            raise CollectivesDiffer(self._differ(n, mine, other, theirs[other]))

    def _wait_a_while(self, keys: dict[int, str]) -> tuple[list[int], list[int]]:
        """Wait up to ``LOOK_FOR_GONE`` for ``keys`` (the caller then looks again); the peers without
        their key that never will say it: (those that ended this step, those that finished their work).

        Polled, one round trip a look. A store's ``wait`` with a short timeout in a loop was tried:
        after one timed out, torchrun's TCPStore failed later requests (DistNetworkError) and the
        ranks could not rebuild their group. The pause grows from nothing (peers that are already
        there cost one look) to ``POLL``."""
        until = time.monotonic() + LOOK_FOR_GONE
        pause = 0.0
        every = list(keys.values())
        while not self.store.check(every) and time.monotonic() < until:
            time.sleep(pause)
            pause = min(POLL, pause * 2 or 0.0001)
        absent = [r for r in keys if not self.store.check([keys[r]])]
        ended = [r for r in absent if self.store.check([f"done/{self.steps}/{r}"])]
        finished = [r for r in absent if r not in ended and self.finished(r)]
        # Looked again: a peer may have said it just before it ended or finished.
        return (
            [r for r in ended if not self.store.check([keys[r]])],
            [r for r in finished if not self.store.check([keys[r]])],
        )

    def _skipped_by(self, n: int, mine: _Said, peer: int) -> str:
        """``peer`` ran this forward to its end (and ended the step) without issuing the collective."""
        raised = self._raised(peer, mine.forward)
        why = (
            f"rank {peer} raised in its forward {mine.forward} before issuing what rank {self.rank} issues there: {raised}"
            if raised
            else f"rank {peer} ended a forward without issuing what rank {self.rank} issues there: a collective one "
            "rank skips (a branch on the rank or on what only one rank holds)"
        )
        return (
            f"collectives differ between ranks at the {_nth(n)} of {self.step_name}: rank {self.rank} issues "
            f"{mine.told()}; rank {peer} ended that step having issued {n - 1}: {why}. No rank entered it"
        )

    def _none_from(self, n: int, mine: _Said, peer: int) -> str:
        raised = self._raised(peer, mine.forward)
        ended = self.finished(peer)
        if isinstance(ended, str) and ended:
            return (
                f"rank {peer} will never issue what rank {self.rank} issues, {mine.told()} (its {_nth(n)} of "
                f"{self.step_name}): rank {peer} {ended}, having issued {n - 1} there. No rank entered it"
            )
        why = (
            f"rank {peer} raised in its forward {mine.forward} before it: {raised}"
            if raised
            else f"a collective one rank issues and another does not (skipped on rank {peer})"
        )
        return (
            f"collectives differ between ranks: rank {self.rank} issues {mine.told()}, its {_nth(n)} of "
            f"{self.step_name}; rank {peer} finished having issued {n - 1} there: {why}. No rank entered it"
        )

    def _differ(self, n: int, mine: _Said, peer: int, theirs: _Said) -> str:
        if (mine.forward, mine.place) != (theirs.forward, theirs.place):
            ahead, behind = (peer, self.rank) if theirs.forward > mine.forward else (self.rank, peer)
            forward = min(mine.forward, theirs.forward)
            raised = self._raised(ahead, forward)
            why = (
                f"rank {ahead} raised in its forward {forward} before issuing what rank {behind} issues there: {raised}"
                if raised
                else f"rank {ahead} ended a forward without issuing what rank {behind} issues there: a collective one "
                "rank skips (a branch on the rank or on what only one rank holds)"
            )
        elif mine.what.split(" of ")[0] != theirs.what.split(" of ")[0]:
            why = "collectives issued in another order on one rank"
        else:
            why = "a collective given another shape or dtype on one rank (padding or sharding that depends on the rank)"
        return (
            f"collectives differ between ranks at the {_nth(n)} of {self.step_name}: rank {self.rank} issues "
            f"{mine.told()}; rank {peer} issues {theirs.told()}: {why}. No rank entered it"
        )
