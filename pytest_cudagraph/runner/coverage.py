"""How many CUDA graphs a call replayed: ``torch.cuda.CUDAGraph.replay`` counted.

Every CUDA-graph runner PyTorch users write or get replays through
``torch.cuda.CUDAGraph`` (a hand-written runner, ``make_graphed_callables``,
torch.compile's CUDA graph trees), so counting that method's calls tells
whether a call ran as graphs or silently eagerly, whoever wrote the runner.
The method is replaced on the class for as long as a ``ReplayCounter`` is
entered (nested uses share one replacement) and put back afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ReplayCounter"]

_DEPTH = 0
_COUNT = 0
_ORIGINAL: Any = None


def _counting_replay(self: Any) -> None:
    global _COUNT
    _COUNT += 1
    _ORIGINAL(self)


class ReplayCounter:
    """``with ReplayCounter() as counter: ...``; ``counter.count`` replays since it was entered."""

    def __init__(self) -> None:
        self._start = 0

    def __enter__(self) -> ReplayCounter:
        global _DEPTH, _ORIGINAL
        if _DEPTH == 0:
            _ORIGINAL = torch.cuda.CUDAGraph.replay
            torch.cuda.CUDAGraph.replay = _counting_replay  # type: ignore[method-assign]
        _DEPTH += 1
        self._start = _COUNT
        return self

    @property
    def count(self) -> int:
        return _COUNT - self._start

    def __exit__(self, *exc: object) -> None:
        global _DEPTH, _ORIGINAL
        _DEPTH -= 1
        if _DEPTH == 0:
            torch.cuda.CUDAGraph.replay = _ORIGINAL  # type: ignore[method-assign]
            _ORIGINAL = None
