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
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import os
import pkgutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import Backend
from ..backends.factory import make_backend
from ..checks.compare import Difference, first_difference, largest_difference
from ..checks.floor import across_shapes
from ..checks.report import Finding, Outcome, VerifyReport
from ..errors import EagerFailure
from ..guard import CaptureGuard, ModuleTracker, Violation
from ..manager.layout import infer_layout, padded_inputs
from ..observe import MODULE_INTERNALS, ForwardObserver, observing, unit_roundoff
from ..plan import BatchDescriptor, GraphMode
from ..plan.validate import check_int, int_list, is_int

__all__ = ["TRAINING_CHECKS", "TrainingStep", "verify_training"]

#: The checks of a training verification, in the order they run.
TRAINING_CHECKS = (
    "optimizer_capturable",
    "training_capture",
    "training_replay_matches_eager",
    "training_padding",
    "training_real_batches",
)

LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclass(frozen=True)
class TrainingStep:
    """A training step the caller writes, as a training loop runs it: ``run(inputs)`` returns the
    scalar loss and is what a graph captures (forward, backward, and whatever optimizer work the
    loop captures with them); ``between()`` is the loop's host code after each step, run eagerly
    after every replay and every eager step (an optimizer step kept outside the graph, a
    ``zero_grad``, an accumulation counter)."""

    run: Callable[[Mapping[str, Any]], torch.Tensor]
    between: Callable[[], Any] | None = None
    #: For a step that replays graphs of its own (``training/adapters.py``): why its last calls ran
    #: without them ("" when they ran), asked after its first call at a size and after its replays.
    not_graphed: Callable[[], str] | None = None


#: ``step(module, optimizer, loss_fn)``: a step for one copy of the module (its optimizer is None
#: without an optimizer factory); a plain callable is taken as ``TrainingStep(run=it)``.
StepFactory = Callable[
    [torch.nn.Module, "torch.optim.Optimizer | None", LossFn],
    "TrainingStep | Callable[[Mapping[str, Any]], torch.Tensor]",
]


@dataclass(frozen=True)
class _Options:
    autocast: torch.dtype | None
    steps: int
    capture_sizes: tuple[int, ...]
    max_num_reqs: int
    warmup_steps: int
    seed: int


def _options(
    steps: Any, capture_sizes: Any, max_num_reqs: Any, warmup_steps: Any, seed: Any, autocast: Any
) -> _Options:
    """Every keyword checked in one place, by the package's validators (plan/validate.py)."""
    sizes = int_list("capture_sizes", capture_sizes)
    # A step runs before capture: gradients and the optimizer's state are made there, outside the
    # graph's pool, as torch's documentation of whole-network capture asks.
    check_int("warmup_steps", warmup_steps)
    if not is_int(seed):
        raise ValueError(f"seed must be an integer; got {seed!r}")
    reqs = max(sizes) if max_num_reqs is None else check_int("max_num_reqs", max_num_reqs)
    if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
        raise ValueError(
            f"autocast must be None or a floating dtype such as torch.bfloat16; got {autocast!r}"
        )
    return _Options(autocast, check_int("steps", steps), tuple(reversed(sizes)), reqs, warmup_steps, seed)


# -- a copy of the module that trains -----------------------------------------------------------
@dataclass
class _Replica:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    #: The caller's step for this copy (None: the default one, ``_step``).
    custom: TrainingStep | None = None

    def run(self, loss_fn: LossFn, inputs: Mapping[str, Any], autocast: torch.dtype | None) -> torch.Tensor:
        """One whole step: the caller's, or the default one."""
        if self.custom is None:
            return _step(self, loss_fn, inputs, autocast)
        return _scalar(self.custom.run(inputs), "the step's run(inputs)")

    def between(self) -> None:
        if self.custom is not None and self.custom.between is not None:
            self.custom.between()

    def not_graphed(self) -> str:
        told = self.custom.not_graphed if self.custom is not None else None
        return told() if told is not None else ""

    @functools.cached_property
    def forward_parameters(self) -> tuple[frozenset[str], bool]:
        """See ``_forward_parameters``; read once, not at every step."""
        return _forward_parameters(self.module)

    def taken(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return _taken(inputs, self.forward_parameters)

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def state(self) -> dict[str, Any]:
        """Every tensor a step changes, by a name that says what it is."""
        out: dict[str, Any] = {}
        for name, p in self.params():
            out[name] = p.detach()
            out[f"grad of {name}"] = p.grad
        for name, b in self.module.named_buffers():
            out[f"buffer {name}"] = b
        if self.optimizer is not None:
            names = {id(param): n for n, param in self.module.named_parameters()}
            for owner, slots in self.optimizer.state.items():
                for key, value in slots.items():
                    out[f"optimizer state {key!r} of {names.get(id(owner), '?')}"] = value
        return out

    def snapshot(self) -> dict[str, Any]:
        return {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.copy(v)
            for k, v in self.state().items()
        }

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Put a snapshot back into the very tensors it came from: a graph keeps their addresses."""
        with torch.no_grad():
            for key, value in self.state().items():
                old = saved.get(key)
                if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
                    value.copy_(old)


def _taken(inputs: Mapping[str, Any], params: tuple[frozenset[str], bool]) -> dict[str, Any]:
    """The inputs ``forward`` takes (``params``: what ``_forward_parameters`` read of it): the rest
    (a per-token loss weight, labels) are the loss's."""
    named, everything = params
    return dict(inputs) if everything else {k: v for k, v in inputs.items() if k in named}


def _forward_parameters(module: torch.nn.Module) -> tuple[frozenset[str], bool]:
    """The inputs ``forward`` names, and whether it takes ``**kwargs`` too (where its signature cannot
    be read: no names, and every input is passed)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return frozenset(), True
    named = frozenset(n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())


def _step(
    replica: _Replica,
    loss_fn: LossFn,
    inputs: Mapping[str, Any],
    autocast: torch.dtype | None = None,
    *,
    optimize: bool = True,
) -> torch.Tensor:
    """One training step (``optimize=False``: up to the gradients). Gradients are zeroed in place,
    never set to None: a graph writes them where it captured them."""
    if replica.optimizer is not None:
        replica.optimizer.zero_grad(set_to_none=False)
    else:
        for _, p in replica.params():
            if p.grad is not None:
                p.grad.zero_()
    if autocast is None:
        loss = loss_fn(replica.module(**replica.taken(inputs)), inputs)
    else:
        device = next((p.device.type for _, p in replica.params()), "cpu")
        with torch.autocast(device, dtype=autocast):
            loss = loss_fn(replica.module(**replica.taken(inputs)), inputs)
    _scalar(loss, "loss_fn")
    loss.backward()  # type: ignore[no-untyped-call]
    if replica.optimizer is not None and optimize:
        replica.optimizer.step()
    return loss.detach()


def _scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            f"{what} must return the scalar loss as a 0-dim tensor; got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss.detach()


def _made_step(
    factory: StepFactory | None, module: torch.nn.Module, opt: torch.optim.Optimizer | None, loss_fn: LossFn
) -> TrainingStep | None:
    if factory is None:
        return None
    made = factory(module, opt, loss_fn)
    if isinstance(made, TrainingStep):
        return made
    if callable(made):
        return TrainingStep(run=made)
    raise ValueError(
        "step(module, optimizer, loss_fn) must return a TrainingStep or a callable run(inputs) -> loss; "
        f"got {type(made).__name__}"
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
    "unless the optimizer takes the scale and the flag on the device itself; build the optimizer with "
    "fused=True (AdamW, Adam, SGD)"
)


def _in_grad_scaler_step() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step" and os.path.basename(frame.f_code.co_filename) == "grad_scaler.py":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _fail(check: str, desc: BatchDescriptor | None, message: str, finding: Finding | None = None) -> Outcome:
    return Outcome(check, desc, passed=False, message=message, finding=finding)


def _skip(check: str, desc: BatchDescriptor | None, message: str) -> Outcome:
    return Outcome(check, desc, passed=True, message=message, skipped=True)


def _optimizer_capturable(replica: _Replica, own: bool) -> Outcome:
    check = "optimizer_capturable"
    opt = replica.optimizer
    if opt is None:
        return _skip(
            check, None, "no optimizer: forward and backward are captured, as make_graphed_callables does"
        )
    if own:
        return _skip(check, None, "the optimizer steps between the runner's graphs, outside them")
    # A fused optimizer keeps its step count on the device as a capturable one does.
    held = [bool(g.get("capturable")) or bool(g.get("fused")) for g in opt.param_groups]
    if not all(held) and all("capturable" in g for g in opt.param_groups):
        return _fail(
            check,
            None,
            f"{type(opt).__name__} keeps its step count on the host (capturable=False): a captured step reads "
            "it once, so every replay applies the first step's bias correction and learning-rate schedule "
            "(CUDA refuses the capture); build it with capturable=True (or fused=True)",
        )
    return Outcome(check, None, passed=True)


def _up_to_gradients(key: str) -> bool:
    """What a step has made before its optimizer runs: the loss, the gradients, the buffers."""
    return key == "loss" or key.startswith(("grad of ", "buffer "))


def _difference(
    got: Mapping[str, Any], expected: Mapping[str, Any], *, tolerance: bool = False
) -> tuple[str, Finding] | None:
    keys = [k for k in expected if k in got]
    missing = sorted(set(expected) ^ set(got))
    if missing:
        return f"the graph's step leaves {missing[0]!r} where eager's does not (or the reverse)", Finding(
            output=missing[0]
        )
    bound = None if tolerance else 0.0  # None: each dtype's default tolerance
    diff = first_difference({k: got[k] for k in keys}, {k: expected[k] for k in keys}, rtol=bound, atol=bound)
    if diff is None:
        return None
    return _found(diff.path.strip("[]'") if diff.path else "", diff)


def _found(where: str, diff: Difference, why: str = "") -> tuple[str, Finding]:
    """What a check says of a difference in the tensor ``where``, and its finding."""
    return f"{where}: {diff.reason}{why}", Finding(
        output=where, index=diff.index, got=diff.got, expected=diff.expected, max_abs=diff.max_abs
    )


#: Where eager differs from itself, the graph may differ from eager by this many times as much.
FLOOR_FACTOR = 4


def _held(
    got: Mapping[str, Any], want: Mapping[str, Any], again: Mapping[str, Any]
) -> tuple[str, Finding] | None:
    """``got`` against ``want``: bit for bit where ``want`` reproduced itself (``again``, the same
    step run again from the same start); else each tensor within FLOOR_FACTOR times what it differed
    from itself by, or its dtype's tolerance where it did not differ (the step is not reproducible:
    kernels that accumulate in no fixed order, as an embedding's backward on a GPU does)."""
    if _difference(again, want) is None:
        return _difference(got, want)
    for key, w in want.items():
        g, a = got.get(key), again.get(key)
        if not (
            isinstance(w, torch.Tensor)
            and isinstance(g, torch.Tensor)
            and isinstance(a, torch.Tensor)
            and w.is_floating_point()
            and w.shape == a.shape
        ):
            found = _difference({key: g}, {key: w})
        else:
            drift = largest_difference(a, w, ulp=False)[0]
            if drift > 0:
                diff = first_difference(g, w, rtol=0.0, atol=FLOOR_FACTOR * drift)
                why = f"eager differs from itself here by up to {drift:.3g}; held within {FLOOR_FACTOR}x that"
            else:
                diff = first_difference(g, w, rtol=None, atol=None)
                why = "eager is not reproducible elsewhere in the step; held within the dtype's tolerance"
            found = None if diff is None else _found(key, diff, f" ({why})")
        if found is not None:
            return found
    return None


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
) -> VerifyReport:
    """Capture a training step per capture size and hold its replays to eager (see the module's
    docstring). ``loss_fn(output, inputs)`` returns the scalar loss (``inputs`` is the padded dict:
    a per-token weight input whose padded rows are 0 masks them out); ``optimizer`` builds a
    ``torch.optim.Optimizer`` from the parameters (None: forward and backward only). ``pad_values``
    maps inputs to the value their padded rows hold by meaning (as ``verify``'s): those, and inputs
    only the loss reads, keep it in the padding check. ``autocast`` (``torch.bfloat16``, say) runs the
    forward and the loss under ``torch.autocast`` on the device, as mixed-precision training does.

    ``step(module, optimizer, loss_fn)`` gives the step of a loop you write, for each copy of the
    module: a ``TrainingStep`` whose ``run(inputs)`` is captured and whose ``between()`` runs
    eagerly after every step (None: the default step, which zeroes the gradients in place, runs the
    forward, the loss and backward, and the optimizer's step, all captured)."""
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if not callable(make_inputs) or not callable(loss_fn):
        raise ValueError(
            "make_inputs and loss_fn must be callables: make_inputs(num_tokens, num_reqs) -> dict, "
            "loss_fn(output, inputs) -> scalar loss"
        )
    if optimizer is not None and not callable(optimizer):
        raise ValueError(
            "optimizer must build a torch.optim.Optimizer from the parameters, e.g. "
            "lambda params: torch.optim.AdamW(params, capturable=True)"
        )
    if step is not None and not callable(step):
        raise ValueError(
            "step must be a callable step(module, optimizer, loss_fn) -> TrainingStep; got "
            f"{type(step).__name__}"
        )
    if step is not None and autocast is not None:
        raise ValueError(
            "autocast applies to the default step only: a step you give runs torch.autocast itself; "
            "leave autocast=None"
        )
    opts = _options(steps, capture_sizes, max_num_reqs, warmup_steps, seed, autocast)
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


def _inputs(
    make_inputs: Callable[[int, int], Mapping[str, Any]], tokens: int, reqs: int, seed: int
) -> dict[str, Any]:
    torch.manual_seed(seed)
    return dict(make_inputs(tokens, reqs))


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
        name: spec.window(tokens, reqs) if spec.kind != "const" else spec.value
        for name, spec in specs.items()
    }

    def load(inputs: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for name, spec in specs.items():
                if spec.kind != "const":
                    static[name].copy_(inputs[name])

    # Warm-up: the same steps on both copies from the same seed.
    warm = _inputs(make_inputs, tokens, reqs, opts.seed)
    try:
        for copy_ in (eager, twin):
            torch.manual_seed(opts.seed)
            for _ in range(opts.warmup_steps):
                copy_.run(loss_fn, warm, opts.autocast)
                copy_.between()
    except Exception as exc:
        raise EagerFailure(
            f"the training step fails eagerly at {tokens} tokens and {reqs} requests, before anything is "
            f"captured: {type(exc).__name__}: {exc}; fix the step, or leave this size out of capture_sizes"
        ) from exc
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
    found: list[Violation] = []
    # Which violations GradScaler's step made: told while its frames are on the stack.
    in_scaler: list[Violation] = []

    def noted(violation: Violation) -> None:
        found.append(violation)
        if _in_grad_scaler_step():
            in_scaler.append(violation)

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
        error = exc
    seconds = time.perf_counter() - began
    skipped = graphed.not_graphed() if error is None else ""
    if error is not None or found or skipped:
        # The guard names the first op a graph cannot hold; without one, the capture's own error.
        if found:
            message = (
                f"{len(found)} op(s) of the training step cannot be captured in a graph; the first is "
                f"{found[0].describe()}" + (_SCALER_SYNC if found[0] in in_scaler else "")
            )
        elif skipped:
            message = f"the step ran without its CUDA graphs: {skipped}"
        else:
            message = f"the training step's capture fails: {type(error).__name__}: {error}"
        why = "not verified: training_capture failed for this size"
        after = TRAINING_CHECKS[TRAINING_CHECKS.index("training_capture") + 1 :]  # what needs the graph
        return (
            [
                _fail("training_capture", desc, message, Finding(ops=[v.describe() for v in found])),
                *(_skip(check, desc, why) for check in after),
            ],
            seconds,
            0,
        )
    out = [Outcome("training_capture", desc, passed=True)]
    # The gradients the graph writes: whatever reads p.grad between replays must find these.
    written = {name: p.grad for name, p in graphed.params()}
    graphed.restore(start)  # the emulator's capture ran the step; CUDA's did not
    sides = _Sides(graphed, eager, twin, written)
    out.append(_replay_matches_eager(graph, sides, make_inputs, loss_fn, load, desc, opts))
    out.append(_padding(graph, graphed, specs, make_inputs, load, start, desc, opts, declared))
    out.append(_real_batches(graph, sides, specs, make_inputs, loss_fn, load, start, desc, opts))
    return out, seconds, int(getattr(graph, "nbytes", 0))


class _OwnGraphs:
    """A step that replays graphs of its own, called where a captured step is replayed: on the
    static inputs ``load`` fills, its loss the output."""

    nbytes = 0  # its graphs' memory is its own, not counted here

    def __init__(self, replica: _Replica, loss_fn: LossFn, static: Mapping[str, Any]) -> None:
        self.replica, self.loss_fn, self.static = replica, loss_fn, static
        self.output: torch.Tensor | None = None

    def replay(self) -> None:
        self.output = self.replica.run(self.loss_fn, self.static, None)


@dataclass(frozen=True)
class _Sides:
    """The copies a size is verified with."""

    graphed: _Replica
    eager: _Replica
    twin: _Replica  # eager again from the same start: whether eager reproduces itself
    #: Each parameter's ``p.grad`` right after capture: the tensors the graph's backward writes.
    written: Mapping[str, torch.Tensor | None]


def _let_go(sides: _Sides, replay: int) -> tuple[str, Finding] | None:
    """Where the code between replays let go of a gradient the graph writes."""
    for name, p in sides.graphed.params():
        held = sides.written.get(name)
        if held is None or p.grad is held:
            continue
        now, effect = (
            ("None", "finds None and skips the parameter")
            if p.grad is None
            else ("another tensor", "reads a tensor no replay writes")
        )
        return (
            f"after replay {replay}, the gradient of {name!r} is {now}, not the tensor the graph writes: the "
            "code between replays let go of it (optimizer.zero_grad(set_to_none=True), or p.grad assigned), "
            f"so what reads p.grad after the next replay (an optimizer step outside the graph, clipping, "
            f"logging) {effect}; zero the gradients in place between replays (zero_grad(set_to_none=False))",
            Finding(output=f"grad of {name}"),
        )
    return None


def _eager_steps(
    replica: _Replica,
    got: Sequence[Mapping[str, Any]],
    batches: Sequence[Mapping[str, Any]],
    loss_fn: LossFn,
    opts: _Options,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Eager's steps on ``batches``: per step what it made up to the gradients and what it left
    after the optimizer, given the graph's own gradients (see _replay_matches_eager). A step the
    caller wrote is run whole: the first part is everything, the second empty."""
    torch.manual_seed(opts.seed + 1000)
    steps: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for k, batch in enumerate(batches):
        if replica.custom is not None:
            loss = replica.run(loss_fn, batch, opts.autocast)
            replica.between()
            steps.append(({"loss": loss, **replica.snapshot()}, {}))
            continue
        loss = _step(replica, loss_fn, batch, opts.autocast, optimize=False)
        made = {"loss": loss, **replica.snapshot()}
        before = {key: v for key, v in made.items() if _up_to_gradients(key)}
        with torch.no_grad():
            for name, p in replica.params():
                grad = got[k].get(f"grad of {name}")
                if p.grad is not None and isinstance(grad, torch.Tensor):
                    p.grad.copy_(grad)
        if replica.optimizer is not None:
            replica.optimizer.step()
        steps.append((before, replica.snapshot()))
    return steps


def _replay_matches_eager(
    graph: Any,
    sides: _Sides,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    loss_fn: LossFn,
    load: Callable[[Mapping[str, Any]], None],
    desc: BatchDescriptor,
    opts: _Options,
) -> Outcome:
    check = "training_replay_matches_eager"
    tokens, reqs = desc.num_tokens, desc.num_reqs or desc.num_tokens
    batches = [_inputs(make_inputs, tokens, reqs, opts.seed + 1 + k) for k in range(opts.steps)]
    got = []
    torch.manual_seed(opts.seed + 1000)
    for k, batch in enumerate(batches):
        load(batch)
        graph.replay()
        loss = graph.output.detach().clone()
        sides.graphed.between()
        let_go = _let_go(sides, k + 1)
        if let_go is not None:
            return _fail(check, desc, *let_go)
        got.append({"loss": loss, **sides.graphed.snapshot()})
    skipped = sides.graphed.not_graphed()
    if skipped:
        return _fail(check, desc, f"the replayed steps ran without their CUDA graphs: {skipped}")
    # The same eager steps twice from the same start: where they differ, eager is not
    # reproducible and the floor is measured (see _held). With the default step each eager step
    # is held to the graph's in two parts. Up to the gradients, a GPU may run another program
    # under capture than in eager (an embedding's backward has a capture path of its own, which
    # rounds otherwise): bit for bit, else within the dtype's tolerance, said in a note. Then the
    # optimizer's step, given the graph's very gradients, is the same program on both sides, held
    # bit for bit; so a difference of the last bit in a gradient, which Adam turns into a step of
    # the learning rate's size, is not taken for a bug. A step the caller wrote cannot be cut
    # there, and is held whole.
    runs = [_eager_steps(copy_, got, batches, loss_fn, opts) for copy_ in (sides.eager, sides.twin)]
    once, again = runs[0][0][0]["loss"], runs[1][0][0]["loss"]
    if first_difference(again, once, rtol=0.0, atol=0.0) is not None:
        # Step 1 starts from one state: only the forward and the loss made its loss, and those are
        # held to reproduce themselves bit for bit, as verify's determinism check holds a forward.
        return _fail(
            check,
            desc,
            f"eager differs from itself from the same start and seed: step 1's loss is {once.item()!r} once "
            f"and {again.item()!r} again; the step draws from something torch's seed does not set (Python's "
            "random, numpy, a clock, a host counter), which a graph reads once, at capture, so every replay "
            "repeats one draw (a dropout mask the same on every step): draw with torch's generator "
            "(torch.rand, F.dropout), which each replay advances; or its forward runs a nondeterministic "
            "kernel (torch.use_deterministic_algorithms(True) names it)",
            Finding(output="loss", got=again.item(), expected=once.item()),
        )
    notes = []
    for k in range(opts.steps):
        (want, want_after), (again_, again_after) = runs[0][k], runs[1][k]
        part = {key: v for key, v in got[k].items() if key in want}
        diff = _held(part, want, again_)
        if diff is not None and want_after:
            loose = _difference(part, want, tolerance=True)
            if loose is None:
                notes.append(f"step {k + 1}: {diff[0]}")
                diff = None
        if diff is None and want_after:
            after = {
                key: v for key, v in got[k].items() if key in want_after and not key.startswith("grad of ")
            }
            diff = _held(
                after,
                {key: want_after[key] for key in after},
                {key: again_after[key] for key in after},
            )
            if diff is not None:
                diff = (f"{diff[0]} after the optimizer's step, given the graph's own gradients", diff[1])
        if diff is not None:
            return _fail(
                check,
                desc,
                f"step {k + 1} of {opts.steps} replayed on fresh inputs differs from eager "
                f"from the same start: {diff[0]}{_python_state_differs(sides.graphed.module, sides.eager.module)}",
                diff[1],
            )
    if notes:
        return Outcome(
            check,
            desc,
            passed=True,
            message=f"not bit for bit up to the gradients, within the dtype's tolerance (the device runs "
            f"another kernel under capture): {notes[0]}",
        )
    return Outcome(check, desc, passed=True)


def _real_size(desc: BatchDescriptor) -> tuple[int, int]:
    """The real batch the padding checks pad to ``desc``: a quarter of its rows padded (at least one)."""
    tokens, reqs = desc.num_tokens, desc.num_reqs or desc.num_tokens
    real = max(1, tokens - max(1, tokens // 4))
    return real, min(real, reqs)


def _real_batches(
    graph: Any,
    sides: _Sides,
    specs: Mapping[str, Any],
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    loss_fn: LossFn,
    load: Callable[[Mapping[str, Any]], None],
    start: Mapping[str, Any],
    desc: BatchDescriptor,
    opts: _Options,
) -> Outcome:
    """A replayed step on a real batch padded to ``desc``, against eager's step on the real batch
    itself: another shape, so another program, held to the floor across shapes (checks/floor.py),
    measured by eager's step at the padded shape. Held: what the step made before its optimizer
    ran (the loss, gradients, buffers); the optimizer's step on given gradients is the same
    program at any batch size, and training_replay_matches_eager holds it. A step the caller wrote
    is held whole."""
    check = "training_real_batches"
    tokens, reqs = desc.num_tokens, desc.num_reqs or desc.num_tokens
    real, real_reqs = _real_size(desc)
    if real >= tokens:
        return _skip(check, desc, "no real batch of this size leaves padded rows")
    unpadded = _inputs(make_inputs, real, real_reqs, opts.seed + 11)
    padded = padded_inputs(specs, unpadded, tokens, reqs)
    whole = sides.eager.custom is not None

    def held(made: Mapping[str, Any]) -> dict[str, Any]:
        # A scalar loss as one row: the floor's comparison works row by row.
        return {
            key: v.reshape(1) if key == "loss" else v
            for key, v in made.items()
            if isinstance(v, torch.Tensor) and (whole or _up_to_gradients(key))
        }

    sides.graphed.restore(start)
    torch.manual_seed(opts.seed + 3000)
    load(padded)
    graph.replay()
    loss = graph.output.detach().clone()
    if whole:
        sides.graphed.between()
    got = held({"loss": loss, **sides.graphed.snapshot()})
    sides.graphed.restore(start)
    observer = ForwardObserver(sides.eager.module)

    def eager_on(replica: _Replica, batch: Mapping[str, Any], watched: bool = False) -> dict[str, Any]:
        replica.restore(start)
        torch.manual_seed(opts.seed + 3000)
        with observing(observer) if watched else contextlib.nullcontext():
            if whole:
                loss = replica.run(loss_fn, batch, opts.autocast)
                replica.between()
            else:
                loss = _step(replica, loss_fn, batch, opts.autocast, optimize=False)
        return held({"loss": loss, **replica.snapshot()})

    try:
        expected = eager_on(sides.eager, unpadded, watched=True)
    except Exception as exc:  # BatchNorm over one row, say: the module cannot take the real batch
        return _skip(
            check,
            desc,
            f"eager's step fails on the real batch of {real} tokens alone ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}), so there is nothing to hold the graph to",
        )
    if observer.random_ops:
        return _skip(
            check,
            desc,
            "the step draws random numbers, which cannot match eager on the unpadded batch draw for draw "
            "(training_replay_matches_eager holds them at the captured shape)",
        )
    floor: list[dict[str, Any]] = []  # eager at the padded shape, run once if a tolerance does not settle it

    def padded_step() -> dict[str, Any]:
        if not floor:
            floor.append(eager_on(sides.twin, padded))
        return floor[0]

    roundoff = max(observer.roundoff, unit_roundoff(opts.autocast) if opts.autocast else 0.0)
    for key, want in expected.items():
        # Tensor by tensor, so that the failure names the one it shows in first.
        verdict = across_shapes(
            {key: got.get(key)},
            {key: want},
            lambda key=key: {key: padded_step().get(key)},  # type: ignore[misc]
            rtol=None,
            atol=None,
            roundoff=roundoff,
        )
        if verdict.passed:
            continue
        diff = verdict.diff
        return _fail(
            check,
            desc,
            f"a step on {real} real tokens padded to {tokens} differs from eager's step on the {real} tokens "
            f"alone in {key}: {verdict.why}; look for a loss or a statistic over every row (a mean over the "
            f"padded ones too, a sum divided by the padded count){_batch_norms(sides.graphed.module)}",
            Finding(
                output=key,
                index=diff.index if diff is not None else None,
                got=diff.got if diff is not None else None,
                expected=diff.expected if diff is not None else None,
            ),
        )
    return Outcome(check, desc, passed=True, figures={"floor_used": bool(floor)})


def _batch_norms(module: torch.nn.Module) -> str:
    """Where the module normalises over the batch in train mode: padded rows enter those statistics."""
    found = [
        name or "the top-level module"
        for name, sub in module.named_modules()
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm) and sub.training
    ]
    return f" (BatchNorm in train mode: {', '.join(repr(n) for n in found)})" if found else ""


def _python_state(module: torch.nn.Module) -> dict[str, Any]:
    """The plain Python values the module keeps on itself (counters, flags), by dotted name."""
    return {
        f"{prefix}.{key}" if prefix else key: value
        for prefix, sub in module.named_modules()
        for key, value in vars(sub).items()
        if key not in MODULE_INTERNALS and isinstance(value, (bool, int, float, str))
    }


def _python_state_differs(graphed: torch.nn.Module, eager: torch.nn.Module) -> str:
    """Why, where a Python value of the module differs: the step changed it, and a graph runs no Python."""
    got, want = _python_state(graphed), _python_state(eager)
    changed = [k for k in want if got.get(k) != want[k]]
    if not changed:
        return ""
    name = changed[0]
    return (
        f"; the module's Python state differs too: {name!r} is {got.get(name)!r} after the replays and "
        f"{want[name]!r} in eager (Python runs at capture only: a value the step changes belongs in a buffer "
        "it updates in place, and a branch on it, such as an optimizer step every k micro-steps of gradient "
        "accumulation, in the loop's code between replays)"
    )


def _padding(
    graph: Any,
    graphed: _Replica,
    specs: Mapping[str, Any],
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    load: Callable[[Mapping[str, Any]], None],
    start: Mapping[str, Any],
    desc: BatchDescriptor,
    opts: _Options,
    declared: set[str],
) -> Outcome:
    check = "training_padding"
    tokens, reqs = desc.num_tokens, desc.num_reqs or desc.num_tokens
    real, real_reqs = _real_size(desc)
    if real >= tokens:
        return _skip(check, desc, "no real batch of this size leaves padded rows")
    padded = padded_inputs(specs, _inputs(make_inputs, real, real_reqs, opts.seed + 7), tokens, reqs)
    # Padded rows an engine leaves stale are those of the forward's own inputs (hidden states);
    # an input only the loss reads (a per-token weight, labels) holds its pad value by design, as
    # does one declared in pad_values.
    # An input that only reaches forward through **kwargs (a loss weight passed along to a
    # transformers model) is the loss's, as far as padding goes.
    named = graphed.forward_parameters[0]
    # Each input's other fill: 1e4 for a floating one; for an integer one (ids, positions) the
    # largest value its real rows hold, where that is not its pad value.
    fills: dict[str, float | int] = {}
    for name, spec in specs.items():
        value = padded[name]
        if spec.kind not in ("tokens", "reqs") or name not in named or name in declared:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype == torch.bool:
            continue
        if value.is_floating_point():
            fills[name] = 1e4
            continue
        rows = spec.rows(real, real_reqs)
        top = int(value.narrow(spec.dim, 0, rows).max()) if rows else 0
        if top != spec.pad:
            fills[name] = top
    if not fills:
        return _skip(
            check,
            desc,
            "no input that forward names has padded rows that can hold other values (inputs only the loss "
            "reads, those reaching forward through **kwargs, and those in pad_values keep their pad value)",
        )
    results = []
    for other in (False, False, True):  # the pad value twice: what the graph's replays vary by
        batch = dict(padded)
        for name, fill in fills.items():
            spec = specs[name]
            t = batch[name].clone()
            rows = spec.rows(real, real_reqs)
            full = spec.rows(tokens, reqs)
            if other and full > rows:
                t.narrow(spec.dim, rows, full - rows).fill_(fill)
            batch[name] = t
        graphed.restore(start)
        torch.manual_seed(opts.seed + 2000)
        load(batch)
        graph.replay()
        results.append({"loss": graph.output.detach().clone(), **graphed.snapshot()})
    graphed.restore(start)
    diff = _held(results[2], results[0], results[1])
    if diff is None:
        return Outcome(check, desc, passed=True)
    where, finding = diff
    values = (
        f" ({finding.got!r} against {finding.expected!r} at the pad value)" if finding.got is not None else ""
    )
    return _fail(
        check,
        desc,
        f"padded rows reach the training step: with {real} real tokens of {tokens}, padded rows of "
        f"{', '.join(f'{n!r} at {v!r}' for n, v in fills.items())} instead of their pad value change "
        f"{where.partition(':')[0]}{values}; mask them out of the loss (a per-token weight that is 0 on "
        f"padded rows) and out of any statistic over the batch{_batch_norms(graphed.module)}",
        Finding(output=finding.output, index=finding.index),
    )
