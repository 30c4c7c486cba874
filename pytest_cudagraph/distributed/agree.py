"""Each collective a rank issues, held to its peers' before any rank enters it.

A collective that one rank issues and another does not, issued in another order, or given another
shape or dtype on one rank is the commonest bug of sharded code, and the backend does not name it:
gloo ends the process on a size mismatch (SIGABRT) or waits, NCCL waits until its watchdog. Like
``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s ``ProcessGroupWrapper``, each rank here says what it is about to
issue before it issues it, and waits for its peers to say the same; unlike it, the ranks say it
through a store, never through the process group, so that a rank which never comes (it skipped the
collective, finished, raised) is found by looking, and no rank enters a collective its peers did
not agree to. The group is then left as it was: the next verification runs on it.

What is compared, per collective of a verification (its n-th): the operation, the shape and dtype
of each tensor it is given, and which forward of the module it belongs to (its k-th, and the
collective's place in it), so that a rank that skipped one and went on to the next forward is named
at the one it skipped, not later when the counts run out. The line of the user's code that issued
it is told, not compared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..guard.tracker import raised_at, user_site
from .rank import RankStopped

__all__ = ["Agreement", "CollectivesDiffer", "described"]

#: The longest pause between two looks at the store while a peer has not said what it issues.
POLL = 0.002
#: How often a waiting rank looks whether a peer finished its work (a peer that will never say).
LOOK_FOR_GONE = 0.02

#: Whether the ranks hold their collectives to each other (``benchmarks/collective_check.py`` turns it
#: off to measure what it costs; nothing else does).
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
    ended this verification's work (it will issue no more); ``stopped()``: whether this rank is to
    stop waiting (its time ran out: the caller's watchdog raises into it then, as it polls)."""

    def __init__(self, store: Any, rank: int, world_size: int, finished: Callable[[int], bool]) -> None:
        self.store, self.rank, self.world_size, self.finished = store, rank, world_size, finished
        self.issued = 0
        self.forwards = 0
        self.in_forward = 0

    def forward_started(self) -> None:
        self.forwards += 1
        self.in_forward = 0

    def forward_raised(self, exc: BaseException) -> None:
        """This rank's forward raised (its collectives after that point will not come): said, for a
        peer that waits at one of them to name the cause."""
        first = (str(exc).strip().splitlines() or [""])[0]
        at = raised_at(exc)
        self.store.set(
            f"raised/{self.forwards}/{self.rank}",
            f"{type(exc).__name__}: {first}" + (f" (at {at})" if at else ""),
        )

    def _raised(self, rank: int, forward: int) -> str:
        """What rank ``rank``'s ``forward``-th forward raised ("" where it did not)."""
        key = f"raised/{forward}/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Say what this rank issues next and wait for every peer to say the same; raise
        ``CollectivesDiffer`` (naming each rank's) where one says otherwise or never will."""
        if not ENABLED:
            return
        self.issued += 1
        self.in_forward += 1
        n = self.issued
        mine = _Said(described(name, args, kwargs), self.forwards, self.in_forward, user_site())
        self.store.set(f"op/{n}/{self.rank}", mine.encode())
        peers = [r for r in range(self.world_size) if r != self.rank]
        keys = {r: f"op/{n}/{r}" for r in peers}
        every = list(keys.values())
        pause, looked = 0.0, time.monotonic()
        # Polled, one round trip a look. A store's ``wait`` with a short timeout in a loop was tried:
        # after one timed out, torchrun's TCPStore failed later requests (DistNetworkError) and the
        # ranks could not rebuild their group. The pause grows from nothing (peers that are already
        # there cost one look) to ``POLL``.
        while not self.store.check(every):
            if time.monotonic() - looked > LOOK_FOR_GONE:
                looked = time.monotonic()
                gone = [r for r in peers if not self.store.check([keys[r]]) and self.finished(r)]
                # Looked again: a peer may have said it just before it finished.
                gone = [r for r in gone if not self.store.check([keys[r]])]
                if gone:
                    raise CollectivesDiffer(self._none_from(n, mine, gone[0]))
            time.sleep(pause)
            pause = min(POLL, pause * 2 or 0.0001)
        theirs = {r: _Said.decode(self.store.get(keys[r])) for r in peers}
        other = next((r for r in peers if theirs[r].key() != mine.key()), None)
        if other is not None:
            raise CollectivesDiffer(self._differ(n, mine, other, theirs[other]))

    def _none_from(self, n: int, mine: _Said, peer: int) -> str:
        raised = self._raised(peer, mine.forward)
        why = (
            f"rank {peer} raised in its forward {mine.forward} before it: {raised}"
            if raised
            else f"a collective one rank issues and another does not (skipped on rank {peer})"
        )
        return (
            f"collectives differ between ranks: rank {self.rank} issues {mine.told()}, its {_nth(n)} of this "
            f"verification; rank {peer} finished its work having issued {n - 1}: {why}. No rank entered it"
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
            f"collectives differ between ranks at the {_nth(n)} of this verification: rank {self.rank} issues "
            f"{mine.told()}; rank {peer} issues {theirs.told()}: {why}. No rank entered it"
        )
