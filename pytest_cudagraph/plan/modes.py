"""Graph modes: which kind of graph serves a batch.

The three *runtime* modes (``NONE``, ``PIECEWISE``, ``FULL``) say how one batch
runs. The two composite modes configure an engine that keeps a separate routine
for decode batches: its decode batches get one mode and its mixed
(prefill + decode) batches another. This mirrors vLLM's ``CUDAGraphMode``.
"""

from __future__ import annotations

import enum

from .validate import UsageError, did_you_mean, short

__all__ = ["GraphMode"]


class GraphMode(enum.Enum):
    """How batches are graphed.

    ``NONE``: eager. ``PIECEWISE``: the module is captured in pieces around
    submodules that stay eager, and serves any number of requests.
    ``FULL``: the whole forward is one graph, captured for a fixed number of
    requests. ``FULL_DECODE_ONLY``: decode batches run as FULL graphs, mixed
    batches eager. ``FULL_AND_PIECEWISE``: decode batches FULL, mixed
    batches PIECEWISE.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    # Composite modes hold (decode mode, mixed mode).
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)

    def separate_routine(self) -> bool:
        """True when decode and mixed batches are graphed differently."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> GraphMode:
        """The runtime mode of uniform (decode) batches."""
        if isinstance(self.value, tuple):
            return GraphMode(self.value[0])
        return self

    def mixed_mode(self) -> GraphMode:
        """The runtime mode of mixed prefill/decode batches."""
        if isinstance(self.value, tuple):
            return GraphMode(self.value[1])
        return self

    def is_runtime_mode(self) -> bool:
        """True for the modes a single batch can run in."""
        return not self.separate_routine()

    def has_mode(self, mode: GraphMode) -> bool:
        """Whether this configuration captures graphs of runtime ``mode``."""
        return mode in (self.decode_mode(), self.mixed_mode())

    def __bool__(self) -> bool:
        # ``if mode:`` reads as "graphs are wanted", as in vLLM.
        return self is not GraphMode.NONE

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        """Accept a ``GraphMode`` or its name, case-insensitively."""
        if isinstance(value, GraphMode):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        names = [m.name for m in cls]
        hint = did_you_mean(value.strip().upper(), names) if isinstance(value, str) else ""
        raise UsageError(f"mode must be a GraphMode or one of {', '.join(names)}; got {short(value)}{hint}")
