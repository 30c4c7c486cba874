"""What the runner checks need: the real batches, the runner's and eager's calls, state snapshots."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import faults
from ..checks.floor import cut_to
from ..checks.module_state import ModuleState, ScratchRegion, clone_tree
from ..errors import EagerFailure, InternalError
from ..guard.tracker import raised_at
from ..manager.layout import InputSpec, call_make_inputs, infer_layout, padded_inputs
from ..plan import Batch, BatchDescriptor, GraphMode
from .coverage import ReplayCounter

__all__ = ["Call", "RunnerContext"]


@dataclass
class Call:
    """One real batch through the runner and through eager, from the same state and seed."""

    batch: Batch
    inputs: dict[str, Any]
    got: Any = None  # the runner's outputs, cloned right after the call
    expected: Any = None  # eager's outputs
    got_state: dict[str, torch.Tensor] | None = None
    expected_state: dict[str, torch.Tensor] | None = None
    replays: int = 0  # CUDA graphs the runner's call replayed
    error: Exception | None = None  # what the runner raised, if it did
    #: Eager at the capture size on these inputs padded (cut to the real rows), and the state it
    #: left: the floor across shapes (``RunnerContext.padded``); None until asked, or where the
    #: inputs cannot be padded.
    padded: tuple[Any, dict[str, torch.Tensor]] | None = None
    padded_tried: bool = False


class RunnerContext(ModuleState):
    """Helpers shared by the runner checks; one per ``verify_runner`` call.

    Each capture size is a FULL descriptor that serves the real batches of
    token counts above the next smaller size, up to its own; a NONE
    descriptor stands for the eager fallback, past the largest size. The
    sweep (``calls``) runs every real batch once, largest first, so that a
    smaller batch meets what a larger one left in the runner's buffers, as
    it would in an engine's next step.
    """

    def __init__(
        self,
        runner: Callable[..., Any],
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        *,
        capture_sizes: Sequence[int],
        max_num_reqs: int | None,
        max_tokens: int,
        rtol: float | None,
        atol: float | None,
        batch_invariant: bool,
        seed: int,
        scratch_state: Mapping[str, ScratchRegion],
        device: torch.device,
    ) -> None:
        super().__init__(module, scratch_state, seed)
        self.runner = runner
        self.make_inputs = make_inputs
        self.capture_sizes = sorted(set(capture_sizes))
        self.max_num_reqs = max_num_reqs
        self.max_tokens = max_tokens
        self.rtol = rtol
        self.atol = atol
        self.batch_invariant = batch_invariant
        self.device = device
        self.descriptors: list[BatchDescriptor] = [
            BatchDescriptor(mode=GraphMode.FULL, num_tokens=s) for s in self.capture_sizes
        ]
        if max_tokens > self.capture_sizes[-1]:
            self.descriptors.append(BatchDescriptor(mode=GraphMode.NONE, num_tokens=max_tokens))
        self.runner_calls = 0
        self._calls: dict[int, Call] | None = None
        #: The module's state before the sweep: every call starts from it.
        self.state0: dict[str, torch.Tensor] = {}
        self._layout: dict[str, InputSpec] | None = None
        self._layout_tried = False

    # -- batches -----------------------------------------------------------
    def token_counts(self, desc: BatchDescriptor) -> list[int]:
        """The real token counts ``desc`` stands for, smallest first."""
        sizes = self.capture_sizes
        if desc.mode is GraphMode.NONE:
            return list(range(sizes[-1] + 1, self.max_tokens + 1))
        i = sizes.index(desc.num_tokens)
        low = sizes[i - 1] if i else 0
        return list(range(low + 1, desc.num_tokens + 1))

    def batch(self, num_tokens: int) -> Batch:
        reqs = num_tokens if self.max_num_reqs is None else min(num_tokens, self.max_num_reqs)
        return Batch(num_tokens=num_tokens, num_reqs=reqs)

    def make(self, batch: Batch) -> dict[str, Any]:
        return call_make_inputs(self.make_inputs, batch.num_tokens, batch.num_reqs)

    # -- running -------------------------------------------------------------
    def call_runner(self, inputs: Mapping[str, Any]) -> tuple[Any, int]:
        """The runner on these inputs (its own copy of them): (its outputs as returned, graphs replayed)."""
        self.runner_calls += 1
        with ReplayCounter() as counter, torch.no_grad():
            out = self.runner(**clone_tree(dict(inputs)))
        return out, counter.count

    def eager(self, inputs: Mapping[str, Any]) -> Any:
        """The module's forward on these inputs (its own copy of them), cloned."""
        with torch.no_grad():
            return clone_tree(self.module(**clone_tree(dict(inputs))))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def learn(self) -> None:
        """What the module's forward writes, from eager runs at the smallest and largest
        batch (put back after): the state the checks copy, compare and restore."""

        made = {n: self.make(self.batch(n)) for n in (1, self.max_tokens)}  # outside the observed forwards

        def forward(n: int) -> None:
            try:
                self.eager(made[n])
            except Exception as exc:
                if faults.is_sticky(exc):
                    raise  # the CUDA context is gone: told as such, not as the module's exception
                InternalError.raise_if_in(exc)  # the harness's own bookkeeping failed: never the module's
                raise self._forward_raises(exc, self.batch(n)) from exc

        self.learn_writes([functools.partial(forward, n) for n in made])

    def _forward_raises(self, exc: Exception, batch: Batch) -> EagerFailure:
        """The module's eager forward raised: the user's exception and the line of their code it left,
        in one line (nothing can be compared with the runner)."""
        site = raised_at(exc)
        said = (faults.described(exc, self.device).strip().splitlines() or [type(exc).__name__])[0]
        return EagerFailure(
            f"{type(self.module).__name__}'s forward raises{f' at {site}' if site else ''}, eagerly at "
            f"(num_tokens={batch.num_tokens}, num_reqs={batch.num_reqs}), before anything is compared: {said}. "
            "Nothing can be compared with the runner; run "
            f"module(**make_inputs({batch.num_tokens}, {batch.num_reqs})) eagerly to see it"
        )

    def calls(self) -> dict[int, Call]:
        """Every real batch, run once through the runner and once eagerly (the sweep; made once)."""
        if self._calls is None:
            self._calls = {}
            self.state0 = self.snapshot()
            for n in range(self.max_tokens, 0, -1):
                self._calls[n] = self._one(self.batch(n))
        return self._calls

    def _one(self, batch: Batch) -> Call:
        call = Call(batch, self.make(batch))
        with self.preserved_state() as state0:
            self.seed_all(self.seed)
            try:
                out, call.replays = self.call_runner(call.inputs)
                self.synchronize()
                call.got = clone_tree(out)
            except Exception as exc:  # the runner's failure on this batch is the finding
                call.error = exc
            call.got_state = self.snapshot()
            self.restore(state0)
            self.seed_all(self.seed)
            call.expected = self.eager(call.inputs)
            call.expected_state = self.snapshot()
        return call

    def _specs(self) -> dict[str, InputSpec] | None:
        """Which dimensions of each input follow the batch, learned from make_inputs as the
        manager learns them; None where that fails (the floor is then not measured)."""
        if not self._layout_tried:
            self._layout_tried = True
            top = self.batch(self.capture_sizes[-1])
            try:
                self._layout = infer_layout(
                    self.make_inputs,
                    max_tokens=top.num_tokens,
                    max_reqs=top.num_reqs,
                    device=self.device,
                    pad_values={},
                )
            except (ValueError, TypeError):
                self._layout = None
        return self._layout

    def padded(self, call: Call, desc: BatchDescriptor) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """Eager at ``desc``'s capture size on the call's inputs padded (zeros, as the manager
        pads), cut to the real rows, and the state it leaves: how far eager is from itself
        across the two shapes. None for the eager fallback, or where inputs cannot be padded."""
        if desc.mode is GraphMode.NONE:
            return None
        if not call.padded_tried:
            call.padded_tried = True
            specs = self._specs()
            if specs is not None:
                batch = self.batch(desc.num_tokens)
                padded = padded_inputs(specs, call.inputs, batch.num_tokens, batch.num_reqs)
                with self.preserved_state():
                    self.restore(self.state0)
                    self.seed_all(self.seed)
                    out = self.eager(padded)
                    call.padded = (cut_to(out, call.expected), self.snapshot())
        return call.padded

    def tolerance(self) -> tuple[float | None, float | None]:
        """(rtol, atol) for real rows against unpadded eager: bit for bit with ``batch_invariant``."""
        return (0.0, 0.0) if self.batch_invariant else (self.rtol, self.atol)
