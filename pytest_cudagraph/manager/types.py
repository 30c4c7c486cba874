"""The manager's shared types: a captured entry, how outputs are cut, where a batch is loaded.

They sit below ``state.py`` (which holds them), ``runtime.py`` (which uses them on
the replay path) and ``capture.py`` (which makes entries), so that no two of
those name each other's types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import CapturedGraph
from ..plan import Batch
from . import tree
from .layout import CountKind, PadValue

__all__ = ["BlockLoadPlan", "Entry", "HotPath", "LoadPlan", "OutCut", "cut_leaf", "cut_to_real"]

# How one output leaf is cut to a real batch: each dimension that follows a
# count, cut to the batch's real count; () returns the leaf whole.
OutCut = tuple[tuple[int, CountKind], ...]


@dataclass
class Entry:
    """A captured descriptor as the runtime replays it: its graph, inputs and
    how to cut its outputs. Made by the capture part."""

    graph: CapturedGraph
    num_reqs: int  # request rows the graph was captured with
    out_dims: list[OutCut]  # per output leaf (tree.flatten's order)
    sample: (
        dict[str, Any] | None
    )  # the make_inputs batch the graph was captured on; kept by the checked capture only
    dropped: bool = False  # the sample was let go (drop_sample)

    def __post_init__(self) -> None:
        # The output tensors never change (replay rewrites them in place), so
        # their structure is taken apart once, not on every run().
        self.leaves, self.structure = tree.flatten(self.graph.output)
        self.single = isinstance(self.graph.output, torch.Tensor)
        # (real tokens, real requests) -> the output leaves cut to them (views)
        self.cuts: dict[tuple[int, int], list[Any]] = {}


def cut_leaf(leaf: Any, dims: OutCut, batch: Batch) -> Any:
    """One output leaf cut to ``batch``'s real rows along each dimension that follows a count."""
    for d, kind in dims:
        if isinstance(leaf, torch.Tensor) and d < leaf.dim():
            count = batch.num_tokens if kind == "tokens" else batch.num_reqs
            # Never past the captured size (a slice's clamp, as before).
            leaf = leaf.narrow(d, 0, min(count, leaf.shape[d]))
    return leaf


def cut_to_real(output: Any, out_dims: list[OutCut], batch: Batch) -> Any:
    """``output`` (of a graph's shape) cut to ``batch``'s real rows, each leaf along the dimensions
    ``out_dims`` gives it: the cut the graph's output gets, usable after the graph is gone."""
    leaves, structure = tree.flatten(output)
    cut = [
        cut_leaf(leaf, dims, batch) if isinstance(leaf, torch.Tensor) else leaf
        for leaf, dims in zip(leaves, out_dims, strict=False)
    ]
    cut.extend(leaves[len(cut) :])
    return structure.unflatten(cut)


@dataclass
class LoadPlan:
    """Where a batch of one shape goes for one descriptor: views of the static
    buffers, made once (on the replay path a slice costs as much as a copy's
    launch)."""

    # (input name, its real rows in the static buffer, the padded rows or None, pad value)
    loads: list[tuple[str, torch.Tensor, torch.Tensor | None, PadValue]]
    masks: list[tuple[torch.Tensor, bool]]  # is_padding views and the value they get

    def apply(self, inputs: Mapping[str, Any]) -> None:
        """Copy the real rows in and pad the rest."""
        for name, head, tail, pad in self.loads:
            value = inputs[name]
            head.copy_(value)
            if tail is not None:
                if pad == "edge":
                    tail.copy_(value[-1:].expand_as(tail))
                else:
                    tail.fill_(pad)
        for mask, flag in self.masks:
            mask.fill_(flag)


@dataclass
class BlockLoadPlan(LoadPlan):
    """A load plan with inputs the row plan cannot take: its own class, so
    that batches of the usual inputs pay nothing for them on the replay path."""

    # (input name, its real block, its descriptor's whole window or None, pad
    # value): several dimensions follow the batch (a square mask), so the
    # window is filled and the real block written over it.
    blocks: list[tuple[str, torch.Tensor, torch.Tensor | None, int | float | bool]]
    # (input name, real part, padded part, dimension): "edge" padding along a
    # dimension other than the first.
    edges: list[tuple[str, torch.Tensor, torch.Tensor, int]]

    def apply(self, inputs: Mapping[str, Any]) -> None:
        for name, real, window, pad in self.blocks:
            if window is not None:
                window.fill_(pad)
            real.copy_(inputs[name])
        for name, head, tail, dim in self.edges:
            value = inputs[name]
            head.copy_(value)
            tail.copy_(value.narrow(dim, value.shape[dim] - 1, 1).expand_as(tail))
        super().apply(inputs)


@dataclass
class HotPath:
    """What run() decided for a batch shape: the graph, and the views it copies into and cuts."""

    entry: Entry
    load: LoadPlan
    cut: list[Any]
