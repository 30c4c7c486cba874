"""Finding the first submodule whose output differs between the graph and eager.

Forward hooks record every submodule's output, in the order forwards finish
(children before their parent). On the graph side a separate capture of the
one descriptor keeps each recorded output alive, so its memory is not reused
inside the graph and holds that submodule's value after a replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..plan import BatchDescriptor
from .compare import first_difference

__all__ = ["locate_divergence"]

Record = tuple[str, list[torch.Tensor]]


class _Recorder:
    def __init__(self, module: torch.nn.Module, *, clone: bool) -> None:
        self.module = module
        self.clone = clone
        self.records: list[Record] = []

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        handles = []

        def start(_m: Any, _a: Any) -> None:
            self.records = []  # keep only the latest forward

        handles.append(self.module.register_forward_pre_hook(start))
        for name, sub in self.module.named_modules():

            def hook(_m: Any, _a: Any, out: Any, name: str = name) -> None:
                tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                if self.clone:
                    tensors = [t.detach().clone() for t in tensors]
                self.records.append((name, tensors))

            handles.append(sub.register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _cut(graph: torch.Tensor, eager: torch.Tensor) -> torch.Tensor | None:
    if graph.shape == eager.shape:
        return graph
    if graph.dim() == eager.dim() and graph.dim() > 0 and graph.shape[1:] == eager.shape[1:] \
            and graph.shape[0] >= eager.shape[0]:
        return graph[: eager.shape[0]]
    return None


def _first_divergent(graph: list[Record], eager: list[Record], *, rtol: float | None,
                     atol: float | None) -> str | None:
    for (g_name, g_out), (e_name, e_out) in zip(graph, eager, strict=False):
        if g_name != e_name:
            return g_name  # control flow itself differs from here on
        for g, e in zip(g_out, e_out, strict=False):
            cut = _cut(g, e)
            if cut is None:
                continue
            if first_difference(cut, e, rtol=rtol, atol=atol) is not None:
                return g_name
    return None


def locate_divergence(
    ctx: Any,
    desc: BatchDescriptor,
    inputs: Mapping[str, Any],
    batch: Any,
    *,
    against_real: bool,
) -> str | None:
    """The first submodule whose graph output differs from eager, or None.

    ``against_real``: compare with eager on the unpadded batch (real rows,
    within tolerance); else with eager on the same padded inputs, bit for bit.
    """
    manager = ctx.manager
    module = manager.module
    with ctx.preserved_state() as state0:
        diag = manager.sibling()
        graph_rec = _Recorder(module, clone=False)
        try:
            with graph_rec.attached():
                diag.capture([desc])
            held = graph_rec.records
            ctx.restore(state0)
            diag.load_inputs(desc, inputs, batch)
            padded = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                      for k, v in diag.forward_inputs(desc.num_tokens, diag.capture_reqs(desc)).items()}
            diag.replay(desc)
            diag.synchronize()
            graph = [(name, [t.detach().clone() for t in ts]) for name, ts in held]
        finally:
            diag.release()
        ctx.restore(state0)
        eager_rec = _Recorder(module, clone=True)
        with eager_rec.attached():
            if against_real:
                ctx.eager_real(inputs, batch)
            else:
                ctx.eager(padded, desc)
        if against_real:
            return _first_divergent(graph, eager_rec.records, rtol=ctx.rtol, atol=ctx.atol)
        return _first_divergent(graph, eager_rec.records, rtol=0.0, atol=0.0)
