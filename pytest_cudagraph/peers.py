"""What a verification running on one rank of several asks of its peers; nothing elsewhere.

The ranks of a distributed verification run the same checks in the same order, and their forwards
(and replays) must pair up collective by collective. A check's own decisions can part them: a batch
one rank's fast route leaves open goes to float64 there alone, a failure is diagnosed with forwards
only the failing rank runs, a check that fails stops early on that rank. So the checks say:

- ``step(name)``: a new step of the verification begins (a check on a descriptor, a stage). A rank
  whose peer ended the step with fewer forwards than it is now running stops the step
  (``StepLeft``): what it would run has no peer to pair with.
- ``any_rank(flags)``: the same decision on every rank, each flag set where any rank's is, before
  forwards that follow from it (the float64 route's batches, a floor measured).
- ``alone()``: the block is this rank's alone (a failure's diagnosis): its collectives are answered
  by this rank as if it were the only one (an all-reduce returns its own shard), never issued to
  the group, and its forwards are not counted. What the diagnosis compares, it computes alone too.

The distributed harness (``distributed.rank``) joins a verification's peers here while the rank
works (``joined``); the checks reach them through these functions and never import ``distributed``,
which imports the checks. Outside a distributed verification each is what one process alone does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

__all__ = ["Peers", "StepLeft", "alone", "alone_now", "any_rank", "joined", "step"]


class StepLeft(Exception):
    """This rank's peers ended the current step before it (a check that failed on one of them ends
    early there): the rest of the step would run forwards no peer pairs with. The check's outcome on
    this rank says so, skipped; the next step runs on every rank again."""


class Peers(Protocol):
    """What ``distributed.agree.Agreement`` does for the functions below."""

    def step(self, name: str) -> None: ...

    def any_rank(self, flags: list[bool]) -> list[bool]: ...


_PEERS: list[Peers] = []
#: Above zero while a block runs alone (``alone``).
_ALONE = [0]


def step(name: str) -> None:
    """A new step of the verification begins on this rank (see the module's docstring)."""
    if _PEERS and not _ALONE[0]:
        _PEERS[-1].step(name)


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """Each flag set where any rank set it (one process: the flags as they are)."""
    if _PEERS and not _ALONE[0]:
        return _PEERS[-1].any_rank([bool(f) for f in flags])
    return [bool(f) for f in flags]


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """The block runs on this rank alone: its collectives answered here, never issued to the group."""
    _ALONE[0] += 1
    try:
        yield
    finally:
        _ALONE[0] -= 1


def alone_now() -> bool:
    """Whether a block that runs on this rank alone is running."""
    return _ALONE[0] > 0


@contextlib.contextmanager
def joined(peers: Peers) -> Iterator[None]:
    """The checks run in the block ask ``peers``."""
    _PEERS.append(peers)
    try:
        yield
    finally:
        _PEERS.remove(peers)
