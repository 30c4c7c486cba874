"""What every check needs: the manager, real batches, state snapshots, eager runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import faults
from ..context import running
from ..guard import as_captured
from ..manager import GraphManager, tree
from ..manager.layout import call_make_inputs
from ..plan import Batch, BatchDescriptor, GraphMode
from ..plan.properties import exact_batch
from .compare import Difference, first_difference

__all__ = ["ModuleState", "VerifyContext", "clone_tree"]

# A region of a buffer that padded rows may legitimately write (a KV cache's
# padding slot): an index, a slice, or a callable returning a boolean mask.
ScratchRegion = int | slice | Callable[[torch.Tensor], torch.Tensor]


def clone_tree(value: Any) -> Any:
    """``value`` with every tensor cloned, dataclass fields included, in the same structure."""
    return tree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


class ModuleState:
    """The module's state as the checks see it: its parameters and buffers,
    snapshot and restored around each comparison, compared outside the
    declared ``scratch_state`` regions. Shared by ``VerifyContext`` (our
    manager) and the runner verification's context (someone else's runner)."""

    def __init__(self, module: torch.nn.Module, scratch_state: Mapping[str, ScratchRegion], seed: int) -> None:
        self.module = module
        self.seed = seed
        self.scratch_state = dict(scratch_state)
        names = {name for name, _ in self._state_items()}
        unknown = set(self.scratch_state) - names
        if unknown:
            raise ValueError(
                f"scratch_state names {sorted(unknown)}, which are not buffers or parameters of the "
                f"module; it has {sorted(names)}"
            )

    # -- module state -------------------------------------------------------
    def _state_items(self) -> list[tuple[str, torch.Tensor]]:
        items: list[tuple[str, torch.Tensor]] = []
        items.extend(self.module.named_parameters())
        items.extend(self.module.named_buffers())
        return items

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self._state_items()}

    def restore(self, snap: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in self._state_items():
                if name in snap:
                    t.copy_(snap[name])

    @contextlib.contextmanager
    def preserved_state(self) -> Iterator[dict[str, torch.Tensor]]:
        """Snapshot the module's state and put it back afterwards."""
        snap = self.snapshot()
        try:
            yield snap
        finally:
            self.restore(snap)

    def state_difference(self, got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                         *, use_scratch: bool, rtol: float | None = 0.0,
                         atol: float | None = 0.0) -> Difference | None:
        for name in expected:
            g, e = got[name], expected[name]
            if use_scratch and name in self.scratch_state:
                g, e = g.clone(), e.clone()
                region = self.scratch_state[name]
                if callable(region):
                    mask = region(g)
                    g[mask] = 0
                    e[mask] = 0
                else:
                    g[region] = 0
                    e[region] = 0
            found = first_difference(g, e, rtol=rtol, atol=atol)
            if found is not None:
                found.path = name
                return found
        return None

    def seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def twice_from_one_state(self, run: Callable[[], Any]) -> list[Any]:
        """``run()`` twice, each from the same module state and seed (the determinism checks)."""
        outs = []
        with self.preserved_state() as state0:
            for _ in range(2):
                self.restore(state0)
                self.seed_all(self.seed)
                outs.append(run())
        return outs


class VerifyContext(ModuleState):
    """Helpers shared by the checks; one per ``verify`` call."""

    def __init__(
        self,
        manager: GraphManager,
        *,
        rtol: float | None,
        atol: float | None,
        batch_invariant: bool,
        seed: int,
        exhaustive: bool,
        scratch_state: Mapping[str, ScratchRegion],
        nonfinite_padding: bool = False,
        plan_dispatch: bool = False,
        dispatch_here: bool = True,
        batches: Sequence[Batch] | None = None,
    ) -> None:
        super().__init__(manager.module, scratch_state, seed)
        self.manager = manager
        self.rtol = rtol
        self.atol = atol
        self.batch_invariant = batch_invariant
        self.exhaustive = exhaustive
        #: padding_isolation also fills padded rows with NaN and inf.
        self.nonfinite_padding = nonfinite_padding
        self.real_batches_run = 0
        self._random: dict[BatchDescriptor, bool] = {}
        #: Plain tensor attributes of the module tree right after capture,
        #: by dotted name (what a replay leaves there).
        self.captured_attributes: dict[str, Any] = {}
        #: Attributes forward rebinds on every call (found once, lazily).
        self.rebound_attributes: list[str] | None = None
        #: A verification split by descriptor: the dispatch check tests the
        #: plan's dispatch, and only in the item of the plan's first descriptor.
        self.plan_dispatch = plan_dispatch
        self.dispatch_here = dispatch_here
        #: What checks prepared before capture, by check name (address_stability: the addresses).
        self.prepared: dict[str, Any] = {}
        #: Real batches given by the caller (a trace's shapes) in place of the sweep, and which
        #: descriptor serves each (found once).
        self.given_batches = tuple(batches) if batches is not None else None
        self._served: dict[BatchDescriptor, list[Batch]] | None = None

    def module_is_random(self, desc: BatchDescriptor) -> bool:
        """Whether eager output depends on the seed at this descriptor's shape."""
        if desc not in self._random:
            batch = self.exact_batch(desc)
            inputs = self.make(batch)
            outs = []
            with self.preserved_state() as state0:
                for seed in (self.seed, self.seed + 1):
                    self.restore(state0)
                    self.seed_all(seed)
                    outs.append(self.eager_real(inputs, batch))
            self._random[desc] = first_difference(outs[0], outs[1]) is not None
        return self._random[desc]

    # -- real batches ---------------------------------------------------
    def real_batches(self, desc: BatchDescriptor) -> list[Batch]:
        """Every real batch ``desc`` serves, one per token count, smallest first; or, when the
        caller gave batches (a trace's), those of them ``desc`` serves."""
        if self.given_batches is not None:
            if self._served is None:
                self._served = {}
                for batch in sorted(self.given_batches, key=lambda b: (b.num_tokens, b.num_reqs)):
                    # The plan's answer: a verification split by descriptor captures one graph only.
                    self._served.setdefault(self.manager.plan.dispatch_batch(batch), []).append(batch)
            return list(self._served.get(desc, ()))
        plan = self.manager.plan
        reqs_cap = self.manager.capture_reqs(desc)
        found: list[Batch] = []
        for n in plan.candidate_range(desc):
            candidate = self._batch_for(desc, n, reqs_cap)
            if candidate is not None and self.manager.dispatch_batch(candidate) == desc:
                found.append(candidate)
        return found

    def _batch_for(self, desc: BatchDescriptor, n: int, reqs_cap: int) -> Batch | None:
        loras = desc.num_active_loras
        if desc.uniform_token_count is not None:
            u = desc.uniform_token_count
            if n % u:
                return None
            return Batch(num_tokens=n, num_reqs=n // u, uniform_token_count=u, max_query_len=u,
                         num_active_loras=loras, num_ubatches=desc.num_ubatches)
        if desc.max_query_len is not None:
            # Varlen decode: as many requests as fit, so no request exceeds q.
            r = min(n, reqs_cap)
            longest = -(-n // r)
            if longest > desc.max_query_len:
                return None
            return Batch(num_tokens=n, num_reqs=r, max_query_len=longest, num_active_loras=loras,
                         num_ubatches=desc.num_ubatches)
        # Mixed batches: requests of about two tokens, like a prefill mix.
        r = min(reqs_cap, max(1, (n + 1) // 2), self.manager.config.max_num_reqs)
        return Batch(num_tokens=n, num_reqs=r, num_active_loras=loras, num_ubatches=desc.num_ubatches)

    def padded_batch(self, desc: BatchDescriptor) -> Batch | None:
        """The smallest real batch of ``desc`` (the most padding), or None."""
        batches = self.real_batches(desc)
        return batches[0] if batches else None

    def exact_batch(self, desc: BatchDescriptor) -> Batch:
        """A real batch of exactly the descriptor's shape (no padding)."""
        return exact_batch(self.manager.plan, desc)

    def make(self, batch: Batch) -> dict[str, Any]:
        return call_make_inputs(self.manager.make_inputs, batch.num_tokens, batch.num_reqs)

    # -- running ----------------------------------------------------------
    def load(self, desc: BatchDescriptor, inputs: Mapping[str, Any], batch: Batch) -> dict[str, Any]:
        """Load a real batch into the static buffers; return a copy of the padded inputs."""
        self.manager.load_inputs(desc, inputs, batch)
        reqs = self.manager.capture_reqs(desc)
        padded: dict[str, Any] = clone_tree(self.manager.forward_inputs(desc.num_tokens, reqs))
        return padded

    def replay(self, desc: BatchDescriptor) -> Any:
        """Replay on whatever the static buffers hold; a copy of the full output."""
        with self.phase("replay", desc):
            out = self.manager.replay(desc)
            self.manager.synchronize()
            return clone_tree(out)

    def phase(self, name: str, desc: Any) -> Any:
        """``faults.phase`` for this module: where a lost CUDA context showed."""
        return faults.phase(name, type(self.module).__name__, desc, self.manager.device)

    def eager(self, kwargs: Mapping[str, Any], desc: BatchDescriptor | None = None, *,
              captured_path: bool = True, served_by: BatchDescriptor | None = None) -> Any:
        """Run the module eagerly on exactly these keyword inputs.

        ``captured_path``: on the path a capture takes (``as_captured``), the
        program the graph holds, which bit-for-bit comparisons need; the eager
        pieces of the descriptor that serves the batch (``served_by``, else
        ``desc``) answer as they do on replay.
        """
        marker = desc or BatchDescriptor(mode=GraphMode.NONE, num_tokens=0)
        where = served_by or desc
        if not captured_path:
            with self.phase("eager", where), torch.no_grad(), running(marker):
                return clone_tree(self.module(**dict(kwargs)))
        graph = served_by or desc
        exempt = self.manager.eager_modules(graph) if graph is not None else []
        with self.phase("eager", where), torch.no_grad(), running(marker), \
                as_captured(exempt, emulated=self.manager.backend == "emulate"):
            return clone_tree(self.module(**dict(kwargs)))

    def eager_real(self, inputs: Mapping[str, Any], batch: Batch, *, captured_path: bool = True) -> Any:
        """Eager on an unpadded real batch, with an all-False mask if the module takes one.

        ``captured_path=False`` runs it as users run the module without graphs
        (``real_batches`` compares with that, within tolerance)."""
        kwargs = self.manager.eager_kwargs(inputs, batch.num_tokens)
        desc = BatchDescriptor(mode=GraphMode.NONE, num_tokens=batch.num_tokens, num_reqs=batch.num_reqs,
                               num_active_loras=self.manager.plan.effective_loras(batch.num_active_loras))
        return self.eager(kwargs, desc, captured_path=captured_path,
                          served_by=self.manager.dispatch_batch(batch))

    def run(self, inputs: Mapping[str, Any], batch: Batch) -> Any:
        """The user's path: ``GraphManager.run_batch``."""
        self.real_batches_run += 1
        desc = self.manager.dispatch_batch(batch)
        with self.phase("replay" if desc.is_graphed else "eager fallback", desc):
            return self.manager.run_batch(inputs, batch)
