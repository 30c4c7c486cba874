"""Training steps across data-parallel ranks: ``verify_data_parallel``.

A step under ``DistributedDataParallel`` captured whole, as PyTorch's CUDA-graph notes describe
(DDP built on a side stream, warm-up steps before the capture, NCCL's async error handling off),
verified on every rank: on ranks a launcher started, or on ranks spawned here
(``distributed.on_ranks`` either way). On each rank ``verify_training`` holds the graph to eager
step by step, with the rank's own batches (the seed plus the rank: each rank trains on a shard of
its own, as a data-parallel loader gives it); across the ranks the weights after every replayed
step must be equal (``rank_agreement``). And ``ddp_gradient_sync`` holds the graph's gradient
sync to eager's: DDP decides in Python, at each forward, whether backward all-reduces
(``require_backward_grad_sync``, which ``no_sync()`` turns off), so a graph captured with sync on
all-reduces at every replay, also where the loop runs it under ``no_sync()`` to accumulate
gradients, and one captured under ``no_sync()`` never all-reduces.

On the emulator (gloo on the CPU) the capture is emulated: DDP's all-reduce reaches the
emulator's dispatch mode, which records it and issues it again at every replay, as a CUDA graph
replays NCCL's kernel. The NCCL path (one GPU a rank) is written and has not run on GPUs yet.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks.report import Outcome, VerifyReport
from ..plan import BatchDescriptor
from ..training.replicas import LossFn, OptimizerFactory, StepFactory, TrainingStep, _made_step, _Replica
from ..training.verify import verify_training
from .rank import Seen
from .verify import on_ranks

__all__ = ["SYNC_CHECK", "verify_data_parallel"]

#: The check that holds the graph's gradient sync to eager's, step by step.
SYNC_CHECK = "ddp_gradient_sync"
#: Warm-up steps before the capture at least: DDP rebuilds its buckets at its second step, on the
#: host (the notes' example warms up on a side stream before capturing).
MIN_WARMUP = 2


@dataclass
class _Copy:
    """One copy of the DDP module ``verify_training`` made: what its forwards said and its steps left."""

    module: torch.nn.Module
    #: ``require_backward_grad_sync`` at each forward (the capture's among them), and whether it was the capture.
    forwards: list[tuple[bool, bool]] = field(default_factory=list)
    #: After each replayed step: its weights, on the CPU.
    after: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @property
    def captured(self) -> bool | None:
        """The sync the graph holds (None: this copy was not captured)."""
        return next((sync for sync, capturing in self.forwards if capturing), None)


class _Ledger:
    """The copies of one rank's verification, in the order ``verify_training`` made them."""

    def __init__(self) -> None:
        self.copies: list[_Copy] = []

    def steps(self, user: StepFactory | None) -> StepFactory:
        """``user``'s step (None: the default one), its copy watched: each forward's sync, and the
        weights after each step once the copy was captured."""

        def factory(module: torch.nn.Module, optimizer: Any, loss_fn: LossFn) -> TrainingStep:
            copy = _Copy(module)
            self.copies.append(copy)
            module.register_forward_pre_hook(
                lambda m, args: copy.forwards.append(
                    (bool(getattr(m, "require_backward_grad_sync", True)), _capturing())
                )
            )
            made = _made_step(user, module, optimizer, loss_fn)
            inner = made if made is not None else _default(module, optimizer, loss_fn)

            def between() -> None:
                if inner.between is not None:
                    inner.between()
                if copy.captured is not None:  # a replay's step: for the ranks' agreement
                    copy.after.append(_held_equal(module, bool(copy.captured)))

            return TrainingStep(run=inner.run, between=between, not_graphed=inner.not_graphed)

        return factory

    def outcomes(self, sizes: list[BatchDescriptor], warmups: int) -> list[Outcome]:
        """``ddp_gradient_sync`` at each captured size: every eager forward after the capture synced
        as the graph does (the eager copies made with the graph, before the next size's)."""
        out: list[Outcome] = []
        graphed = [i for i, c in enumerate(self.copies) if c.captured is not None]
        for n, index in enumerate(graphed):
            desc = sizes[n] if n < len(sizes) else None
            end = graphed[n + 1] if n + 1 < len(graphed) else len(self.copies)
            held = self.copies[index].captured
            eager = [c for c in self.copies[index + 1 : end] if c.captured is None]
            steps = eager[0].forwards[warmups:] if eager else []  # the steps after the capture
            first = next((k for k, (sync, _) in enumerate(steps) if sync != held), None)
            if first is None:
                out.append(Outcome(SYNC_CHECK, desc, True, figures={"forwards": len(steps)}))
                continue
            out.append(Outcome(SYNC_CHECK, desc, False, _sync_message(bool(held), first + 1)))
        return out


def _capturing() -> bool:
    """Whether a capture is running: on CUDA, the stream's; on the emulator, its guard's answer
    (a CPU build of torch raises outside it)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return False


#: Why ranks whose weights (or synced gradients) differ after a step are wrong.
_APART = (
    "data-parallel ranks start from the same weights and step on the same all-reduced gradients, so they "
    "hold the same weights after every step: a rank whose graph skipped the all-reduce, or an optimizer "
    "step on one rank's own gradients, sets them apart"
)


def _held_equal(module: torch.nn.Module, synced: bool) -> dict[str, Any]:
    """What every rank must hold alike after a step: the weights, and the gradients where the graph
    all-reduces them; copied to the CPU."""
    held: dict[str, Any] = {"weights": {n: p.detach().cpu().clone() for n, p in module.named_parameters()}}
    if synced:
        held["gradients"] = {
            n: p.grad.detach().cpu().clone() for n, p in module.named_parameters() if p.grad is not None
        }
    return held


def _sync_message(held: bool, forward: int) -> str:
    if held:
        return (
            f"the graph was captured with gradient sync on, and eager ran its step {forward} under no_sync() "
            "(require_backward_grad_sync False): the graph all-reduces the gradients anyway. DDP decides in "
            "Python, at each forward, whether backward all-reduces, and a graph holds what it decided at "
            "capture. Capture one graph under no_sync() for the accumulating steps and one with sync for the "
            "last, and replay each where it belongs (or all-reduce the gradients yourself outside the graph)"
        )
    return (
        f"the graph was captured under no_sync() (require_backward_grad_sync False), and eager ran its step "
        f"{forward} with gradient sync on: the graph never all-reduces, so each rank steps on its own "
        "gradients. DDP decides in Python, at each forward, whether backward all-reduces, and a graph holds "
        "what it decided at capture: capture the synced step on its own graph"
    )


def _default(module: torch.nn.Module, optimizer: Any, loss_fn: LossFn) -> TrainingStep:
    """``verify_training``'s default step (gradients zeroed in place, forward, loss, backward, the
    optimizer's step) as a ``TrainingStep``."""
    replica = _Replica(module, optimizer)
    return TrainingStep(run=lambda inputs: replica.run(loss_fn, inputs, None))


@dataclass(frozen=True)
class DataParallelWork:
    """What each rank runs: its DDP module's training step verified (see the module's docstring)."""

    build: Callable[[int, int], torch.nn.Module]
    make_inputs: Callable[[int, int], Mapping[str, Any]]
    loss_fn: LossFn
    optimizer: OptimizerFactory | None
    step: StepFactory | None
    ddp: Mapping[str, Any]
    keywords: Mapping[str, Any]

    def __call__(self, rank: int, world_size: int, device: Any, seen: list[Seen]) -> VerifyReport:
        from torch.nn.parallel import DistributedDataParallel

        seed = int(self.keywords.get("seed", 0))
        torch.manual_seed(seed)  # the same weights on every rank
        module = self.build(rank, world_size).to(device)
        on_gpu = str(device).startswith("cuda")
        # The notes: DDP built on a side stream, so that its setup is not on the stream a capture uses.
        if isinstance(module, DistributedDataParallel):  # the test wrapped it itself
            ddp, module = module, module.module
        else:
            stream = torch.cuda.Stream() if on_gpu else None  # type: ignore[no-untyped-call]
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                options: dict[str, Any] = {"device_ids": [device.index]} if on_gpu else {}
                ddp = DistributedDataParallel(module, **options, **dict(self.ddp))
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
        ledger = _Ledger()
        keywords = dict(self.keywords)
        keywords["warmup_steps"] = max(MIN_WARMUP, int(keywords.get("warmup_steps", MIN_WARMUP)))
        keywords["seed"] = seed + rank  # each rank its own batches
        report = verify_training(
            ddp,
            self.make_inputs,
            self.loss_fn,
            optimizer=self.optimizer,
            step=ledger.steps(self.step),
            backend="cuda" if on_gpu else "emulate",
            device=device,
            **keywords,
        )
        report.module = type(module).__name__ + " (DistributedDataParallel)"
        sizes = sorted(
            {
                o.descriptor
                for o in report.outcomes
                if o.check == "training_capture" and o.passed and o.descriptor
            },
            key=lambda d: -d.num_tokens,
        )
        report.checks = (*report.checks, SYNC_CHECK)
        report.add(ledger.outcomes(sizes, keywords["warmup_steps"]))
        graphed = [c for c in ledger.copies if c.captured is not None]
        for desc, copy in zip(sizes, graphed, strict=False):
            for k, after in enumerate(copy.after):
                at = f"the graph's step {k + 1} at {desc.label()}"
                seen.append(Seen(desc.num_tokens, desc.num_reqs or desc.num_tokens, at, after, at, _APART))
        return report


def verify_data_parallel(
    build: Callable[[int, int], torch.nn.Module],
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    loss_fn: LossFn,
    *,
    optimizer: OptimizerFactory | None = None,
    step: StepFactory | None = None,
    world_size: int | None = None,
    timeout: float = 120.0,
    backend: str = "auto",
    devices: list[int] | None = None,
    ddp: Mapping[str, Any] | None = None,
    **keywords: Any,
) -> VerifyReport:
    """Verify a training step under ``DistributedDataParallel`` on every rank (see the module's
    docstring). ``build(rank, world_size)`` returns the rank's module (the harness wraps it in DDP
    with ``ddp``'s keywords, on a side stream on CUDA), or a DDP module made already; ``optimizer``, ``step`` and ``keywords`` (``capture_sizes``,
    ``steps``, ``warmup_steps``, ``pad_values``, ``seed``) are ``verify_training``'s, and a step
    factory receives the DDP module. Under a launcher the ranks are its own (``world_size`` None, or
    theirs); otherwise ``world_size`` ranks are spawned, and ``build``, ``make_inputs``,
    ``loss_fn``, ``optimizer`` and ``step`` must be picklable (top-level functions)."""
    for name in ("device", "autocast", "backend_device"):
        if name in keywords:
            raise TypeError(f"verify_data_parallel: {name} is chosen per rank by the harness; do not pass it")
    if ddp is not None and not isinstance(ddp, Mapping):
        raise TypeError(
            f"verify_data_parallel: ddp must be a dict of DistributedDataParallel's keywords; got {ddp!r}"
        )
    if backend == "cuda":
        # Whole-network capture with NCCL needs its async error handling off (torch's CUDA-graph notes).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        os.environ.setdefault("NCCL_ASYNC_ERROR_HANDLING", "0")
    work = DataParallelWork(build, make_inputs, loss_fn, optimizer, step, dict(ddp or {}), keywords)
    picklable = {"build": build, "make_inputs": make_inputs, "loss_fn": loss_fn}
    picklable.update({k: v for k, v in (("optimizer", optimizer), ("step", step)) if v is not None})
    return on_ranks(
        work,
        world_size=world_size,
        timeout=timeout,
        backend=backend,
        replicated=True,
        devices=devices,
        where="verify_data_parallel",
        picklable=picklable,
    )
