"""``verify_training``: a training step captured as one graph and held to eager, step by step.

For each capture size the step (by default: zero the gradients in place, forward, the loss,
backward, and the optimizer's step when there is an optimizer; or a ``TrainingStep`` the caller
writes, whose ``between`` runs after every step) is warmed up and captured on one copy of the
module, while two others train eagerly from the same start (the second tells whether eager
reproduces itself). Then ``steps`` replays on fresh inputs are held to as many eager steps: the
loss, every gradient, every parameter and buffer, and the optimizer's state, bit for bit where
the program is the same. Then the padding: one replayed step with the padded rows of the
floating inputs at zero and one with them at other values must leave the same loss, gradients,
parameters and state; and a replayed step on a padded real batch is held to eager's step on the
real batch alone, within the floor across shapes (``checks/floor.py``). A step that replays
graphs of its own (``adapters.py``) is called where another is captured, and held to the
default step.

The caller's module is never trained: every copy is a deep copy of it.

Random ops draw the same numbers in the graph and in eager from one seed: the graph's replays run
first from the seed, then the eager steps from it again, as the ``rng`` check of ``verify`` does.
On the emulator the CPU stands in for the GPU, so an optimizer built with ``capturable=True`` runs
torch's capturable code path there (torch allows it on accelerators only; the check is lifted for
the verification alone).

The parts live apart: the copies and their steps in ``replicas.py``, how what a step leaves is
held to eager's in ``compare.py``, the checks after the capture in ``checks.py``; here, the entry
point, the capture at each size and the report.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import pkgutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..backends.base import Backend
from ..backends.factory import as_device, make_backend
from ..checks import kernel_references
from ..checks.report import Finding, Outcome, VerifyReport
from ..errors import EagerFailure, InternalError
from ..guard import CaptureGuard, ModuleTracker, Violation
from ..manager.inputs import check_forward_takes, forward_mismatch
from ..manager.layout import check_module, infer_layout
from ..options import VerifyOptions
from ..plan import BatchDescriptor, GraphMode
from ..plan.config import MAX_CAPTURE_TOKENS
from ..plan.validate import UsageError, check_int, int_list, short
from ..references import normalized, registered
from .checks import (
    TRAINING_CHECKS,
    _fail,
    _optimizer_capturable,
    _Options,
    _padding,
    _real_batches,
    _replay_matches_eager,
    _skip,
    keeps_step_on_host,
    python_values,
)
from .compare import FLOOR_FACTOR as FLOOR_FACTOR  # re-exported: imported from here (tests)
from .compare import _held as _held  # re-exported: imported from here (tests)
from .replicas import (
    LossFn,
    OptimizerFactory,
    StepFactory,
    TrainingStep,
    _inputs,
    _made_step,
    _OwnGraphs,
    _Replica,
    _Sides,
)

__all__ = ["MAX_STEPS", "TRAINING_CHECKS", "TrainingStep", "verify_training"]

#: The most steps (and warm-up steps) a verification takes: each is a training step of the module,
#: and beyond this a count is a typo (10**9), not a test.
MAX_STEPS = 10_000


def _options(
    steps: Any, capture_sizes: Any, max_num_reqs: Any, warmup_steps: Any, seed: Any, autocast: Any
) -> _Options:
    """Every keyword checked in one place, by the package's validators (plan/validate.py; the seed
    as ``VerifyOptions`` checks it); a ``UsageError`` for the first one wrong."""
    sizes = int_list("capture_sizes", capture_sizes, maximum=MAX_CAPTURE_TOKENS)
    # A step runs before capture: gradients and the optimizer's state are made there, outside the
    # graph's pool, as torch's documentation of whole-network capture asks.
    check_int("warmup_steps", warmup_steps, maximum=MAX_STEPS)
    VerifyOptions(seed=seed)
    reqs = (
        max(sizes)
        if max_num_reqs is None
        else check_int("max_num_reqs", max_num_reqs, maximum=MAX_CAPTURE_TOKENS)
    )
    if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
        raise UsageError(
            f"autocast must be None or a floating dtype such as torch.bfloat16; got {short(autocast)}"
        )
    return _Options(
        autocast,
        check_int("steps", steps, maximum=MAX_STEPS),
        tuple(reversed(sizes)),
        reqs,
        warmup_steps,
        seed,
    )


@contextlib.contextmanager
def _capturable_on_cpu(backend: Backend) -> Iterator[None]:
    """On the emulator, torch's capturable optimizer path is let run on the CPU, which stands in
    for the GPU there (torch checks the device against a list of accelerators)."""
    if backend.name != "emulate":
        yield
        return
    patched: list[tuple[Any, Callable[..., list[str]]]] = []
    for info in pkgutil.iter_modules(torch.optim.__path__):
        try:
            module = importlib.import_module(f"torch.optim.{info.name}")
        except Exception:
            continue
        original = getattr(module, "_get_capturable_supported_devices", None)
        if callable(original):

            def with_cpu(*args: Any, _original: Any = original, **kwargs: Any) -> list[str]:
                return [*_original(*args, **kwargs), "cpu"]

            patched.append((module, original))
            module._get_capturable_supported_devices = with_cpu  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, original in patched:
            module._get_capturable_supported_devices = original  # type: ignore[attr-defined]


#: Why GradScaler's step syncs, and the optimizer it does not sync with.
_SCALER_SYNC = (
    ", inside GradScaler.step: it reads the overflow flag on the host (found_inf.item()) to skip the step, "
    "unless the optimizer takes the scale and the flag on the device itself. Of the optimizers measured on "
    "an NVIDIA H200 (torch 2.11, 2026-12-03, scripts/optimizer_capture.py) only SGD(fused=True) captured "
    "under GradScaler; with Adam or AdamW drop GradScaler instead: bf16 autocast needs no loss scaling, "
    "and AdamW(capturable=True) captured without it"
)


def _inside_step() -> str:
    """Whose step the op the guard reports runs in, the innermost first: "optimizer" (a
    ``torch.optim`` optimizer's), "GradScaler" or ""."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step":
            path = frame.f_code.co_filename
            if os.path.basename(path) == "grad_scaler.py":
                return "GradScaler"
            if f"{os.sep}torch{os.sep}optim{os.sep}" in path and os.path.basename(path) != "lr_scheduler.py":
                return "optimizer"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def _described(violation: Violation, inside: str, graphed: _Replica) -> str:
    """An op the guard met, and where (``inside``: ``_inside_step``'s answer when it was met). In
    the default step's optimizer no submodule runs and no line of the caller's calls it (the first
    frame outside torch and this package would be the call of verify_training): the optimizer's step
    is named instead."""
    opt = graphed.optimizer
    if inside != "optimizer" or opt is None:
        return violation.describe()
    where = f"{violation.op} ({violation.reason})" if graphed.custom is None else violation.describe()
    return f"{where}, inside {type(opt).__name__}.step"


def _sync_cause(inside: str, optimizer: torch.optim.Optimizer | None) -> str:
    """Why the step GradScaler's or the optimizer's step syncs in, where it is known."""
    if inside == "GradScaler":
        return _SCALER_SYNC
    if inside == "optimizer" and optimizer is not None and keeps_step_on_host(optimizer):
        return (
            ": with capturable=False it reads its step count on the host (optimizer_capturable's finding); "
            "build it with capturable=True"
        )
    return ""


def _misses_forward(module: torch.nn.Module, positional: int, keywords: list[str]) -> str:
    """How the step's call of ``module``'s forward misses its arguments ("" where it does not)."""
    found = forward_mismatch(module, keywords, positional)
    if found is None or not (found[1] or found[2]):
        return ""
    takes, unknown, missing = found
    given = ", ".join(
        [*([f"{positional} argument(s) by position"] if positional else []), f"keyword(s) {keywords}"]
    )
    wrong = "; ".join(
        [
            *([f"it takes no keyword {', '.join(map(repr, unknown))}"] if unknown else []),
            *([f"its argument(s) {', '.join(map(repr, missing))} are not given"] if missing else []),
        ]
    )
    return (
        f"the training step calls {type(module).__name__}.forward with {given}: {wrong} (forward's "
        f"arguments: {', '.join(takes) or 'none'}); pass forward its own argument names"
    )


def verify_training(
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    loss_fn: LossFn,
    *,
    optimizer: OptimizerFactory | None = None,
    steps: int = 3,
    capture_sizes: Sequence[int] = (1, 2, 4, 8),
    max_num_reqs: int | None = None,
    warmup_steps: int = 1,
    pad_values: Mapping[str, Any] | None = None,
    autocast: torch.dtype | None = None,
    step: StepFactory | None = None,
    backend: str = "auto",
    device: torch.device | str | None = None,
    seed: int = 0,
    references: Mapping[Any, Callable[..., Any]] | None = None,
) -> VerifyReport:
    """Capture a training step per capture size and hold its replays to eager (see the module's
    docstring). ``loss_fn(output, inputs)`` returns the scalar loss (``inputs`` is the padded dict:
    a per-token weight input whose padded rows are 0 masks them out); ``optimizer`` builds a
    ``torch.optim.Optimizer`` from the parameters (None: forward and backward only). ``pad_values``
    maps inputs to the value their padded rows hold by meaning (as ``verify``'s): those, and inputs
    only the loss reads, keep it in the padding check, as does a mask or weight forward receives
    where the check sees it let the data's padded rows in (see ``training_padding``). ``autocast``
    (``torch.bfloat16``, say) runs the forward and the loss under ``torch.autocast`` on the device,
    as mixed-precision training does.

    ``step(module, optimizer, loss_fn)`` gives the step of a loop you write, for each copy of the
    module: a ``TrainingStep`` whose ``run(inputs)`` is captured and whose ``between()`` runs
    eagerly after every step (None: the default step, which zeroes the gradients in place, runs the
    forward, the loss and backward, and the optimizer's step, all captured).

    ``references`` (kernel -> plain-torch function, as ``verify`` takes them) are held against their
    kernels on an eager step at the largest capture size; a training verification asks no float64
    question, so they stand in for nothing, and the report says so."""
    check_module(module)
    for name, value, what in (
        ("make_inputs", make_inputs, "make_inputs(num_tokens, num_reqs) -> dict of inputs"),
        ("loss_fn", loss_fn, "loss_fn(output, inputs) -> scalar loss"),
    ):
        if not callable(value):
            raise UsageError(f"{name} must be a callable {what}; got {short(value)}")
    if optimizer is not None and not callable(optimizer):
        raise UsageError(
            "optimizer must build a torch.optim.Optimizer from the parameters, e.g. "
            f"lambda params: torch.optim.AdamW(params, capturable=True); got {short(optimizer)}"
        )
    if step is not None and not callable(step):
        raise UsageError(
            "step must be a callable step(module, optimizer, loss_fn) -> TrainingStep; got "
            f"{type(step).__name__}"
        )
    if step is not None and autocast is not None:
        raise UsageError(
            "autocast applies to the default step only: a step you give runs torch.autocast itself; "
            "leave autocast=None"
        )
    refs = normalized(references).merged_over(registered())  # a UsageError for a key it cannot take
    opts = _options(steps, capture_sizes, max_num_reqs, warmup_steps, seed, autocast)
    device = as_device(device)  # a UsageError for a device this torch lacks
    if device is None:
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None else None
    engine = make_backend(backend, device)
    engine.grad_enabled = True
    engine.checked = True
    dev = engine.device
    top = opts.capture_sizes[0]
    specs = infer_layout(
        make_inputs,
        max_tokens=top,
        max_reqs=min(top, opts.max_num_reqs),
        device=dev,
        pad_values=dict(pad_values or {}),
    )
    if step is None:
        # The default step passes forward the inputs it names: one that forward needs and no key
        # gives is one line now, not a TypeError at the first eager step.
        check_forward_takes(module, list(specs), rest_to_loss=True)
    report = VerifyReport(
        module=type(module).__name__,
        backend=engine.name,
        device=str(dev),
        mode="training",
        exhaustive=True,
        checks=TRAINING_CHECKS,
        planned=len(opts.capture_sizes),
        config={
            "capture_sizes": list(opts.capture_sizes),
            "max_num_reqs": opts.max_num_reqs,
            "steps": opts.steps,
            "optimizer": optimizer is not None,
            "step": "default" if step is None else getattr(step, "__name__", type(step).__name__),
        },
        kind="training",
        training="train" if module.training else "eval",
    )
    started = time.perf_counter()

    # A step that replays graphs of its own (training/adapters.py) is held to the default step.
    own = bool(getattr(step, "graphs_itself", False))

    def replica(graphed: bool = False) -> _Replica:
        copy_ = copy.deepcopy(module).to(dev)
        opt = optimizer(copy_.parameters()) if optimizer is not None else None
        made = _made_step(step, copy_, opt, loss_fn) if graphed or not own else None
        return _Replica(copy_, opt, made)

    with _capturable_on_cpu(engine):
        if refs:
            top, spied_on = opts.capture_sizes[-1], replica()
            batch = _inputs(make_inputs, top, min(top, opts.max_num_reqs), opts.seed)
            report.add(
                kernel_references.held(
                    refs, lambda: spied_on.run(loss_fn, batch, opts.autocast), top, opts.seed
                )
            )
            report.references = kernel_references.summarized(refs, report.outcomes, {})
            report.notes.append(
                kernel_references.NO_FLOAT64_QUESTION.format(
                    where="verify_training", what="each training step"
                )
            )
            del spied_on, batch
        report.add([_optimizer_capturable(replica(), own)])
        verified = []
        for size in opts.capture_sizes:
            reqs = min(size, opts.max_num_reqs)
            desc = BatchDescriptor(mode=GraphMode.FULL, num_tokens=size, num_reqs=reqs)
            outcomes, seconds, nbytes = _verify_size(
                engine, specs, replica, make_inputs, loss_fn, desc, opts, set(pad_values or {}), own
            )
            report.add(outcomes)
            for o in outcomes:
                if o.passed and not o.skipped and o.message:
                    report.notes.append(f"{o.check} at {desc.label()}: {o.message}")
            report.capture_seconds += seconds
            if nbytes:
                report.graph_memory[desc] = nbytes
            if not any(o.check == "training_capture" and not o.passed for o in outcomes):
                verified.append(desc)
                report.real_batches += opts.steps
            engine.release()
        report.descriptors = tuple(verified)
    report.check_seconds = time.perf_counter() - started
    return report


def _verify_size(
    engine: Backend,
    specs: Mapping[str, Any],
    replica: Callable[..., _Replica],
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    loss_fn: LossFn,
    desc: BatchDescriptor,
    opts: _Options,
    declared: set[str],
    own: bool,
) -> tuple[list[Outcome], float, int]:
    """The outcomes at this size, the seconds its capture took and the graph's memory. ``own``: the
    step replays graphs of its own, and is called where another is captured and replayed."""
    tokens, reqs = desc.num_tokens, desc.num_reqs or desc.num_tokens
    # Eager twice (its twin measures whether eager reproduces itself), and the copy that is captured.
    graphed, eager, twin = replica(graphed=True), replica(), replica()
    # The graph reads the static buffers: views of the layout's, at this size.
    static = {
        name: spec.window(tokens, reqs) if not spec.is_python else spec.value for name, spec in specs.items()
    }

    def load(inputs: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for name, spec in specs.items():
                if not spec.is_python:
                    static[name].copy_(inputs[name])

    # Warm-up: the same steps on both copies from the same seed.
    warm = _inputs(make_inputs, tokens, reqs, opts.seed)
    # A Python value that changes with the batch: the graph holds what this size's inputs give.
    static.update({name: warm[name] for name, spec in specs.items() if spec.kind == "value"})
    # What the step passes the module's forward (how many arguments by position, the keywords): a
    # call that misses forward's arguments is named as such, not as a failure of the step.
    calls: list[tuple[int, list[str]]] = []
    hook = eager.module.register_forward_pre_hook(
        lambda _module, args, kwargs: calls.append((len(args), list(kwargs))), with_kwargs=True
    )
    try:
        for copy_ in (eager, twin):
            torch.manual_seed(opts.seed)
            for _ in range(opts.warmup_steps):
                copy_.run(loss_fn, warm, opts.autocast)
                copy_.between()
    except Exception as exc:
        InternalError.raise_if_in(exc)  # the harness's bookkeeping under the step failed: never loss_fn's
        told = _misses_forward(eager.module, *calls[-1]) if calls and isinstance(exc, TypeError) else ""
        if told:
            raise UsageError(told) from exc
        raise EagerFailure(
            f"the training step fails eagerly at {tokens} tokens and {reqs} requests, before anything is "
            f"captured: {type(exc).__name__}: {exc}; fix the step, or leave this size out of capture_sizes"
        ) from exc
    finally:
        hook.remove()
    torch.manual_seed(opts.seed)
    for _ in range(opts.warmup_steps):
        load(warm)
        if own:
            graphed.run(loss_fn, static, opts.autocast)
        else:
            engine.warmup(lambda: graphed.run(loss_fn, static, opts.autocast))
        graphed.between()
    # Both copies start from eager's state, bit for bit (a GPU's warm-ups may differ in the last
    # bits where a kernel accumulates in no fixed order).
    start = eager.snapshot()
    graphed.restore(start)
    twin.restore(start)
    # Which violations GradScaler's step and the optimizer's made: told while their frames are on
    # the stack.
    inside: dict[Violation, str] = {}

    def noted(violation: Violation) -> None:
        inside.setdefault(violation, _inside_step())

    guard = CaptureGuard(ModuleTracker(graphed.module), engine.device, on_violation=noted)
    began = time.perf_counter()
    error: Exception | None = None
    graph: Any = None
    try:
        if own:
            load(warm)
            graph = _OwnGraphs(graphed, loss_fn, static)
            graph.replay()  # its first call at this size after the warm-up: where it records
        else:
            graph = engine.capture(lambda: graphed.run(loss_fn, static, opts.autocast), guard)
    except Exception as exc:
        InternalError.raise_if_in(exc)  # ours, not the step's capture failing
        error = exc
    seconds = time.perf_counter() - began
    # Each op once where it is called (the guard's list): an optimizer's loop over the parameters
    # meets one line once per parameter.
    found = guard.violations
    skipped = graphed.not_graphed() if error is None else ""
    if error is not None or found or skipped:
        # The guard names the first op a graph cannot hold; without one, the capture's own error.
        if found:
            message = (
                f"{len(found)} op(s) of the training step cannot be captured in a graph; the first is "
                f"{_described(found[0], inside.get(found[0], ''), graphed)}"
                + _sync_cause(inside.get(found[0], ""), graphed.optimizer)
            )
        elif skipped:
            message = f"the step ran without its CUDA graphs: {skipped}"
        else:
            message = f"the training step's capture fails: {type(error).__name__}: {error}"
        why = "not verified: training_capture failed for this size"
        after = TRAINING_CHECKS[TRAINING_CHECKS.index("training_capture") + 1 :]  # what needs the graph
        return (
            [
                _fail(
                    "training_capture",
                    desc,
                    message,
                    Finding(ops=[_described(v, inside.get(v, ""), graphed) for v in found]),
                ),
                *(_skip(check, desc, why) for check in after),
            ],
            seconds,
            0,
        )
    out = [Outcome("training_capture", desc, passed=True)]
    # The gradients the graph writes: whatever reads p.grad between replays must find these.
    written = {name: p.grad for name, p in graphed.params()}
    graphed.restore(start)  # the emulator's capture ran the step; CUDA's did not
    sides = _Sides(graphed, eager, twin, written, {} if own else python_values(graphed))
    out.append(_replay_matches_eager(graph, sides, make_inputs, loss_fn, load, desc, opts))
    out.append(_padding(graph, graphed, specs, make_inputs, load, start, desc, opts, declared))
    out.append(_real_batches(graph, sides, specs, make_inputs, loss_fn, load, start, desc, opts))
    return out, seconds, int(getattr(graph, "nbytes", 0))
