"""How each output leaf of a graph is cut to a real batch's rows: learned from the module's
eager outputs at the two probe shapes (``probe``), from one descriptor's own shapes where the
probes cannot run (``row_kinds``), and settled across every descriptor captured (``settle``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from ..context import running
from ..errors import InternalError
from ..observe import restoring
from ..plan import BatchDescriptor, GraphMode
from . import tree
from .inputs import call_make_inputs
from .layout import CountKind, forward_probes
from .state import ManagerState
from .types import Entry, OutCut

__all__ = ["out_dims", "out_dims_like_captured", "probe", "row_kinds", "settle"]


def out_dims(output: Any, num_tokens: int, num_reqs: int, probed: list[OutCut] | None) -> list[OutCut]:
    """How each leaf of one graph's output is cut: what the probes learned,
    where the leaf has those dimensions, else what this descriptor alone shows."""
    leaves = tree.leaves(output)
    own = row_kinds(leaves, num_tokens, num_reqs)
    if probed is None or len(probed) != len(own):
        return own
    return [
        p if isinstance(leaf, torch.Tensor) and all(d < leaf.dim() for d, _ in p) else mine
        for p, mine, leaf in zip(probed, own, leaves, strict=True)
    ]


def row_kinds(leaves: list[Any], num_tokens: int, num_reqs: int) -> list[OutCut]:
    # From one descriptor alone, per output leaf: cut its leading dimension
    # to the real tokens, the real requests, or return it whole. When tokens
    # and requests are the same count, rows follow tokens, as hidden states
    # do in inference engines. A later dimension of the same size may be a
    # coincidence (a hidden size of 8 at 8 tokens): only several
    # descriptors tell (settle).
    kinds: list[OutCut] = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            kinds.append(())
        elif leaf.shape[0] == num_tokens:
            kinds.append(((0, "tokens"),))
        elif leaf.shape[0] == num_reqs:
            kinds.append(((0, "reqs"),))
        else:
            kinds.append(())
    return kinds


def probe(
    state: ManagerState, eager_kwargs: Callable[[Mapping[str, Any], int], dict[str, Any]]
) -> list[OutCut] | None:
    """Which dimensions of each output leaf follow the token or request
    count, learned as the inputs' are: by running the module eagerly at the
    two probe shapes (state restored after).

    A descriptor alone cannot tell a per-request output from a per-token
    one when it holds as many tokens as requests. None if the module cannot
    run at the probe shapes; then each descriptor's own shapes decide. A
    leaf that changes with the batch in a way that follows neither count
    (a flattened ``2 * T``) cannot be cut to the real batch: ValueError.
    """
    outputs = []
    probes = forward_probes(state.plan.config.largest_capture_size, state.plan.config.max_num_reqs)
    if probes is None:
        return None
    try:
        # make_inputs outside the observed forwards: what it draws is not the module's randomness.
        made = [eager_kwargs(call_make_inputs(state.user_make_inputs, t, r), t) for t, r in probes]
        with restoring(state.observer):
            for (num_tokens, num_reqs), kwargs in zip(probes, made, strict=True):
                marker = BatchDescriptor(mode=GraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs)
                with torch.no_grad(), running(marker):
                    outputs.append(tree.flatten_with_paths(state.module(**kwargs)))
    except InternalError:
        raise  # the harness's own failure, never a probe the module cannot take
    except Exception:
        return None
    first, second = outputs
    if [p for p, _ in first] != [p for p, _ in second]:
        return None
    (t1, r1), (t2, r2) = probes
    kinds: list[OutCut] = []
    for (path, a), (_, b) in zip(first, second, strict=True):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or (
            a.dim() == 0 and b.dim() == 0
        ):
            kinds.append(())
            continue
        dims: list[tuple[int, CountKind]] = []
        unrelated = a.dim() != b.dim()
        for d, (n1, n2) in enumerate(zip(a.shape, b.shape, strict=False)):
            if n1 == n2:
                continue
            if (n1, n2) == (t1, t2):
                dims.append((d, "tokens"))
            elif (n1, n2) == (r1, r2):
                dims.append((d, "reqs"))
            else:
                unrelated = True
        if unrelated:
            where = f"output {path}" if path else "the output"
            raise ValueError(
                f"{where} has shape {tuple(a.shape)} at (num_tokens={t1}, num_reqs={r1}) and "
                f"{tuple(b.shape)} at (num_tokens={t2}, num_reqs={r2}): it changes with the batch, but "
                "not as num_tokens or num_reqs. The manager can only cut dimensions that follow "
                "num_tokens or num_reqs (exactly that many) to a real batch's rows, and return the "
                "others whole; return it unflattened (say (num_tokens, 2, ...) rather than "
                "(2 * num_tokens, ...)), or compute it outside the captured module"
            )
        kinds.append(tuple(dims))
    return kinds


Lead = Literal["whole", "reqs"] | None  # None: each descriptor's own leading dimension


def _settled(
    entries: Mapping[BatchDescriptor, Entry],
) -> dict[int, tuple[int, Lead, list[tuple[int, CountKind]]]]:
    """Per output leaf, what the captured descriptors together show of its layout: its number of
    dimensions, how its leading dimension is cut, and the later dimensions that follow a count."""
    # One descriptor alone cannot tell an output of fixed size from one
    # that follows the batch when the sizes coincide. Across descriptors
    # it can: a leading dimension whose size never changes is returned
    # whole, and one that tracks the request count is cut by requests; a
    # later dimension is cut only when its size changes across
    # descriptors, each time as the token (or request) count.
    shapes: dict[int, list[tuple[tuple[int, ...], int, int]]] = {}
    for desc, entry in entries.items():
        for i, leaf in enumerate(entry.leaves):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                shapes.setdefault(i, []).append((tuple(leaf.shape), desc.num_tokens, entry.num_reqs))
    found: dict[int, tuple[int, Lead, list[tuple[int, CountKind]]]] = {}
    for i, seen in shapes.items():
        ndim = len(seen[0][0])
        if any(len(shape) != ndim for shape, _, _ in seen):
            continue  # no one layout across descriptors: each keeps its own
        lead: Lead = None
        later: list[tuple[int, CountKind]] = []
        for d in range(ndim):
            sizes = [(shape[d], t, r) for shape, t, r in seen]
            follows_tokens = all(n == t for n, t, _ in sizes)
            follows_reqs = all(n == r for n, _, r in sizes)
            constant = len({n for n, _, _ in sizes}) == 1
            if d == 0:
                if constant and not follows_tokens and not follows_reqs:
                    lead = "whole"
                elif follows_reqs and not follows_tokens:
                    lead = "reqs"
            elif not constant and (follows_tokens or follows_reqs):
                later.append((d, "tokens" if follows_tokens else "reqs"))
        found[i] = (ndim, lead, later)
    return found


def _apply(own: OutCut, lead: Lead, later: list[tuple[int, CountKind]]) -> OutCut:
    kept: list[tuple[int, CountKind]] = [(d, k) for d, k in own if d == 0]
    if lead == "whole":
        kept = []
    elif lead == "reqs":
        kept = [(0, "reqs")]
    return (*kept, *later)


def settle(entries: Mapping[BatchDescriptor, Entry]) -> None:
    """Every captured descriptor's cuts held to what the descriptors together show (``_settled``)."""
    for i, (ndim, lead, later) in _settled(entries).items():
        for entry in entries.values():
            if (
                i >= len(entry.leaves)
                or not isinstance(entry.leaves[i], torch.Tensor)
                or entry.leaves[i].dim() != ndim
            ):
                continue
            entry.out_dims[i] = _apply(entry.out_dims[i], lead, later)
            entry.cuts.clear()


def out_dims_like_captured(
    entries: Mapping[BatchDescriptor, Entry],
    output: Any,
    num_tokens: int,
    num_reqs: int,
    probed: list[OutCut] | None,
) -> list[OutCut]:
    """``out_dims`` of an output at a shape that was not captured (quick mode's other sizes), held to
    what the captured descriptors together show, as theirs are: one output alone takes a (1, T, V)
    leaf for a per-request row of one request where the graphs show its tokens follow in dimension 1."""
    own = out_dims(output, num_tokens, num_reqs, probed)
    leaves = tree.leaves(output)
    for i, (ndim, lead, later) in _settled(entries).items():
        if i < len(own) and isinstance(leaves[i], torch.Tensor) and leaves[i].dim() == ndim:
            own[i] = _apply(own[i], lead, later)
    return own
