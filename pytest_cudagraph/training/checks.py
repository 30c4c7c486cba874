"""The training checks, after the capture: each holds the captured step's replays to eager.

``optimizer_capturable`` (the optimizer keeps its step count on the device),
``training_replay_matches_eager`` (replays on fresh inputs against as many eager steps),
``training_padding`` (padded rows change nothing) and ``training_real_batches`` (a padded real
batch against eager on the real batch alone, within the floor across shapes). ``TRAINING_CHECKS``
names them with ``training_capture``, in the order they run; the capture itself, and the order
the checks run in at each size, are the entry point's (``verify.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..checks.compare import first_difference, largest_difference, last_place
from ..checks.floor import across_shapes
from ..checks.report import Finding, Outcome
from ..errors import InternalError
from ..manager.layout import padded_inputs
from ..observe import ForwardObserver, observing, unit_roundoff
from ..plan import BatchDescriptor
from ..units import counted
from .compare import FLOOR_FACTOR, Drift, _held, _up_to_gradients
from .host_state import _frozen_since_capture, _python_state_differs, _random_state, _set_random_state
from .host_state import python_values as python_values  # re-exported: verify.py imports it from here
from .replicas import LossFn, _inputs, _Replica, _Sides, _step
from .rounding import jittered

#: The checks of a training verification, in the order they run.
TRAINING_CHECKS = (
    "optimizer_capturable",
    "training_capture",
    "training_replay_matches_eager",
    "training_padding",
    "training_real_batches",
)


@dataclass(frozen=True)
class _Options:
    """``verify_training``'s keywords, checked (``verify.py``'s ``_options``). Here, below the
    entry point, because the checks read them too (``steps``, ``seed``, ``autocast``)."""

    autocast: torch.dtype | None
    steps: int
    capture_sizes: tuple[int, ...]
    max_num_reqs: int
    warmup_steps: int
    seed: int


# -- outcomes (the entry point's training_capture says its own with these too) ----------------
def _fail(check: str, desc: BatchDescriptor | None, message: str, finding: Finding | None = None) -> Outcome:
    return Outcome(check, desc, passed=False, message=message, finding=finding)


def _skip(check: str, desc: BatchDescriptor | None, message: str, detail: str = "") -> Outcome:
    return Outcome(check, desc, passed=True, message=message, skipped=True, detail=detail)


# -- optimizer_capturable ---------------------------------------------------------------------
def keeps_step_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer takes a ``capturable`` flag and some parameter group has it off."""
    groups = optimizer.param_groups
    return all("capturable" in g for g in groups) and not all(bool(g.get("capturable")) for g in groups)


def _optimizer_capturable(replica: _Replica, own: bool) -> Outcome:
    check = "optimizer_capturable"
    opt = replica.optimizer
    if opt is None:
        return _skip(
            check, None, "no optimizer: forward and backward are captured, as make_graphed_callables does"
        )
    if own:
        return _skip(check, None, "the optimizer steps between the runner's graphs, outside them")
    # capturable=True alone: a fused Adam or AdamW with capturable=False is refused by torch's capture
    # (seen on an NVIDIA H200, torch 2.11, 2026-12-03: scripts/optimizer_capture.py), though on a CPU
    # build torch does not check, so the emulator would pass it.
    if keeps_step_on_host(opt):
        fused = any(g.get("fused") for g in opt.param_groups)
        return _fail(
            check,
            None,
            f"{type(opt).__name__} keeps its step count on the host (capturable=False"
            f"{', fused=True does not change that' if fused else ''}): a captured step reads it once, so every "
            "replay applies the first step's bias correction and learning-rate schedule (CUDA refuses the "
            "capture); build it with capturable=True",
        )
    return Outcome(check, None, passed=True)


# -- training_replay_matches_eager ------------------------------------------------------------
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
    # Step by step, each side's state held in its own copy and compared where it lies, never
    # snapshotted: at the size users train at, a snapshot of every step on every side (parameters,
    # gradients, optimizer state) took some sixty times the weights' memory (a 1B Llama, 295 GiB).
    # Each side draws the same random numbers at a step: the generators are put back to where the
    # step began before each side runs it (a replay reads the generator's seed and offset as an
    # eager step does).
    #
    # The same eager step twice from the same start (``eager`` and ``twin``): where they differ,
    # eager is not reproducible, and its drift is measured (see _held). With the default step each
    # eager step is held to the graph's in two parts. Up to the gradients, a GPU may run another
    # program under capture than in eager (an embedding's backward has a capture path of its own,
    # which rounds otherwise): a third copy runs each step with one unit of rounding at each op
    # that rounds in a kernel's order (rounding.py), and a tensor that differs is held within a few
    # times what that moves it by, said in a note. Then the optimizer's step, given the graph's
    # very gradients, is the same program on both sides, held bit for bit; so a difference of the
    # last bit in a gradient, which Adam turns into a step of the learning rate's size, is not
    # taken for a bug. A step the caller wrote cannot be cut there, and is held whole.
    graphed, eager, twin = sides.graphed, sides.eager, sides.twin
    # The third copy: the twin's Python state, taken before the twin runs (where the step starts),
    # over the twin's own tensors; it runs just before the twin at each step.
    third = twin.over_the_same_tensors()
    whole = eager.custom is not None
    torch.manual_seed(opts.seed + 1000)
    drifts: list[Drift] = []
    for k, batch in enumerate(batches):
        began = _random_state()
        load(batch)
        graph.replay()
        loss = graph.output.detach().clone()
        graphed.between()
        let_go = _let_go(sides, k + 1)
        if let_go is not None:
            return _fail(check, desc, *let_go)
        skipped = graphed.not_graphed()
        if skipped:
            return _fail(check, desc, f"the replayed steps ran without their CUDA graphs: {skipped}")
        got = {"loss": loss, **graphed.state()}
        _set_random_state(began)
        want = _eager_step(eager, loss_fn, batch, opts)
        moved: dict[str, Any] = {}
        counted = 0
        if third is not None:
            # The third copy writes the twin's tensors: its buffers are put back before the twin runs.
            buffers = twin.snapshot(lambda key: key.startswith("buffer "))
            _set_random_state(began)
            with jittered(opts.seed + k) as mode:
                made = _eager_step(third, loss_fn, batch, opts)
            moved = {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in made.items()}
            counted = mode.moved
            twin.restore(buffers)
        _set_random_state(began)
        again = _eager_step(twin, loss_fn, batch, opts)
        if k == 0 and first_difference(again["loss"], want["loss"], rtol=0.0, atol=0.0) is not None:
            # Step 1 starts from one state: only the forward and the loss made its loss, and those
            # are held to reproduce themselves bit for bit, as verify's determinism check holds a
            # forward.
            once, twice = want["loss"].item(), again["loss"].item()
            return _fail(
                check,
                desc,
                f"eager differs from itself from the same start and seed: step 1's loss is {once!r} once "
                f"and {twice!r} again; the step draws from something torch's seed does not set (Python's "
                "random, numpy, a clock, a host counter), which a graph reads once, at capture, so every "
                "replay repeats one draw (a dropout mask the same on every step): draw with torch's "
                "generator (torch.rand, F.dropout), which each replay advances; or its forward runs a "
                "nondeterministic kernel (torch.use_deterministic_algorithms(True) names it)",
                Finding(output="loss", got=twice, expected=once),
            )

        def floor(
            key: str, want: Mapping[str, Any] = want, moved: Mapping[str, Any] = moved, counted: int = counted
        ) -> float:
            w = want.get(key)
            # At least one unit in the last place of the tensor's largest element, where the step
            # rounds in a kernel's order at all: the last op's own rounding, which the moves made
            # upstream can cancel in a tensor of few elements (a loss that is a ratio of two sums).
            least = last_place(w) if counted and isinstance(w, torch.Tensor) else 0.0
            return max(_spread(moved.get(key), w), least)

        part = {key: v for key, v in got.items() if key in want}
        diff = _held(part, want, again, floor if third is not None else None, drifts)
        if diff is None and not whole:
            # The optimizer's step on the graph's own gradients, on both eager copies.
            for replica in (eager, twin):
                with torch.no_grad():
                    for name, p in replica.params():
                        grad = got.get(f"grad of {name}")
                        if p.grad is not None and isinstance(grad, torch.Tensor):
                            p.grad.copy_(grad)
                if replica.optimizer is not None:
                    replica.optimizer.step()
            after = {key: v for key, v in got.items() if not _up_to_gradients(key)}
            diff = _held(after, _after(eager, after), _after(twin, after))
            if diff is not None:
                diff = (f"{diff[0]} after the optimizer's step, given the graph's own gradients", diff[1])
        if diff is not None:
            return _fail(
                check,
                desc,
                f"step {k + 1} of {opts.steps} replayed on fresh inputs differs from eager "
                f"from the same start: {diff[0]}{_python_state_differs(graphed.module, eager.module)}"
                f"{_frozen_since_capture(sides)}",
                diff[1],
            )
    if drifts:
        worst: dict[str, Drift] = {}
        for d in drifts:  # each tensor once, at the step it differed most
            if d.tensor not in worst or d.graph > worst[d.tensor].graph:
                worst[d.tensor] = d
        named = sorted(worst.values(), key=lambda d: -d.graph)
        more = f" and {len(named) - 3} more" if len(named) > 3 else ""
        return Outcome(
            check,
            desc,
            passed=True,
            message=f"not bit for bit in {len(named)} tensor(s), each within {FLOOR_FACTOR}x what eager moves by "
            f"there (run again from the same start, and with one unit of rounding at each product: the "
            f"device may run another kernel under capture, or one that accumulates in no fixed order): "
            f"{'; '.join(d.describe() for d in named[:3])}{more}",
            figures={
                "drift": {
                    d.tensor: {"graph": d.graph, "eager": d.eager, "rounding": d.rounding} for d in named
                }
            },
        )
    return Outcome(check, desc, passed=True)


def _eager_step(
    replica: _Replica, loss_fn: LossFn, batch: Mapping[str, Any], opts: _Options
) -> dict[str, Any]:
    """One eager step on ``batch``: what it made up to the gradients, where it lies (not copied). A
    step the caller wrote is run whole, ``between`` too: everything it leaves."""
    if replica.custom is not None:
        loss = replica.run(loss_fn, batch, opts.autocast)
        replica.between()
        return {"loss": loss, **replica.state()}
    loss = _step(replica, loss_fn, batch, opts.autocast, optimize=False)
    return {"loss": loss, **{key: v for key, v in replica.state().items() if _up_to_gradients(key)}}


def _after(replica: _Replica, like: Mapping[str, Any]) -> dict[str, Any]:
    """What ``replica`` holds under the names of ``like``, where it lies."""
    state = replica.state()
    return {key: state.get(key) for key in like}


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


# -- training_padding and training_real_batches: padded rows ----------------------------------
def _real_size(desc: BatchDescriptor) -> tuple[int, int]:
    """The real batch the padding checks pad to ``desc``: a quarter of its rows padded (at least one)."""
    tokens, reqs = desc.num_tokens, desc.num_reqs or desc.num_tokens
    real = max(1, tokens - max(1, tokens // 4))
    return real, min(real, reqs)


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
    # The inputs that look like row markers, with the least and largest value of their real rows.
    marker_like: dict[str, tuple[Any, Any]] = {}
    for name, spec in specs.items():
        value = padded[name]
        if spec.kind not in ("tokens", "reqs") or name not in named or name in declared:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype == torch.bool:
            continue
        held = value.narrow(spec.dim, 0, spec.rows(real, real_reqs))
        extent = (held.min().item(), held.max().item()) if held.numel() else None
        if extent is not None and _looks_like_a_marker(*extent, floating=value.is_floating_point()):
            marker_like[name] = extent
        if value.is_floating_point():
            fills[name] = 1e4
            continue
        top = int(extent[1]) if extent is not None else 0
        if top != spec.pad:
            fills[name] = top
    if not fills:
        return _skip(
            check,
            desc,
            "no input that forward names has padded rows that can hold other values",
            "padded rows keep their pad value in the inputs forward does not name (only the loss reads them, "
            "or they reach forward through **kwargs), those in pad_values, those that do not follow the batch, "
            "boolean ones, and integer ones whose largest real value is the pad value",
        )
    runs: dict[frozenset[str], list[dict[str, Any]]] = {}

    def run(stressed: frozenset[str]) -> dict[str, Any]:
        """The step with the padded rows of ``stressed`` at their other fill, the rest at their pad
        value, replayed once."""
        batch = dict(padded)
        for name in stressed:
            spec = specs[name]
            t = batch[name].clone()
            rows, full = spec.rows(real, real_reqs), spec.rows(tokens, reqs)
            if full > rows:
                t.narrow(spec.dim, rows, full - rows).fill_(fills[name])
            batch[name] = t
        graphed.restore(start)
        torch.manual_seed(opts.seed + 2000)
        load(batch)
        graph.replay()
        # What the default step made before its optimizer ran: the optimizer on given gradients
        # is one program whatever the padding, and Adam turns a gradient's last bit into a step
        # of the learning rate's size. A step the caller wrote is held whole.
        kept = None if graphed.custom is not None else _up_to_gradients
        return {"loss": graph.output.detach().clone(), **graphed.snapshot(kept)}

    def replay(stressed: frozenset[str], again: bool = False) -> dict[str, Any]:
        """``run(stressed)``, kept (``again``: a second run, what the graph's replays vary by)."""
        done = runs.setdefault(stressed, [])
        while len(done) < 1 + again:
            done.append(run(stressed))
        return done[int(again)]

    def widest(stressed: frozenset[str], base: frozenset[str]) -> dict[str, Any]:
        """``base``'s step as far from its first run as the replays were seen to vary, tensor by
        tensor: over RERUNS more runs of ``base``, and two of ``stressed`` (its own drift, moved
        onto ``base``'s values). Two runs of a step whose kernels add in no fixed order (atomics
        in an attention's or an embedding's backward) can agree by chance on a tensor the third
        moves: noise, not padded rows reaching the step."""
        first = replay(base)
        far = dict(replay(base, again=True))
        spread = {key: _spread(far.get(key), v) for key, v in first.items()}
        for _ in range(RERUNS):
            other = run(base)
            for key, v in first.items():
                d = _spread(other.get(key), v)
                if d > spread[key]:
                    spread[key], far[key] = d, other[key]
        once, twice = replay(stressed), run(stressed)
        for key, v in first.items():
            d = _spread(twice.get(key), once.get(key))
            if d > spread[key] and isinstance(v, torch.Tensor):
                spread[key], far[key] = d, v + (twice[key] - once[key])
        return far

    def changes(stressed: frozenset[str], base: frozenset[str]) -> tuple[str, Finding] | None:
        found = _held(replay(stressed), replay(base), replay(base, again=True))
        if found is None:
            return None
        # Before a finding, a closer look at how far the replays vary by themselves.
        return _held(replay(stressed), replay(base), widest(stressed, base))

    none: frozenset[str] = frozenset()
    # Each input on its own: which one's padded rows reach the step.
    reach = {name: found for name in fills if (found := changes(frozenset({name}), none)) is not None}
    quiet = [name for name in fills if name not in reach]
    # An input that looks like it marks rows (a mask, a per-token weight, labels with an ignore
    # index) changes the step when its padded rows are set, by design: it marks rows. It is taken
    # as one where the padded rows of data that change nothing at its pad value change the step
    # once it lets them in (with every other such input let in too, and not without it: a loss
    # weighted by a mask and labels with an ignore index takes both).
    gates = frozenset(name for name in reach if name in marker_like)
    markers: dict[str, str] = {}
    for name in gates:
        for data in quiet:
            if (
                changes(gates | {data}, gates) is not None
                and changes((gates - {name}) | {data}, gates - {name}) is None
            ):
                markers[name] = data
                break
    graphed.restore(start)
    # Data first: an input that may mark rows is named only where no data's padded rows reach the step.
    leaks = sorted((n for n in reach if n not in markers), key=lambda n: n in marker_like)
    if not leaks:
        note = "; ".join(
            f"{name!r} taken as marking rows: padded rows of {data!r} reach the step only where {name!r} "
            f"lets them, so its padded rows keep their pad value (pad_values={{{name!r}: {specs[name].pad!r}}} "
            "says so without this test)"
            for name, data in markers.items()
        )
        return Outcome(check, desc, passed=True, message=note)
    name = leaks[0]
    where, finding = reach[name]
    values = (
        f" ({finding.got!r} against {finding.expected!r} at the pad value)" if finding.got is not None else ""
    )
    said = (
        f"padded rows reach the training step: with {counted(real, 'real token')} of {tokens}, padded rows of "
        f"{name!r} at {fills[name]!r} instead of its pad value change {where.partition(':')[0]}{values}"
    )
    also = [n for n in leaks[1:] if n not in marker_like]
    others = f" (so do those of {', '.join(repr(n) for n in also)})" if also else ""
    norms = _batch_norms(graphed.module)
    mask_loss = "mask them out of the loss (a per-token weight that is 0 on padded rows)"
    unmasked = f"{mask_loss} and out of any statistic over the batch{norms}"
    # Advice the step may follow already is said as a condition, never as the fix.
    maybe = [n for n in leaks if n in marker_like]
    if name in marker_like:
        # Whether it marks rows or is data that reaches the step, the tool cannot tell: say both.
        low, high = marker_like[name]
        kept = f"{low!r} only" if low == high else f"values from {low!r} to {high!r}"
        advice = (
            f"{name!r} may mark rows (its real rows hold {kept}), but no other input's padded rows were "
            "seen to count only where it lets them: if it marks rows, declare its pad value "
            f"(pad_values={{{name!r}: {specs[name].pad!r}}}) and it keeps it; if it is data, {unmasked}"
        )
    elif markers or maybe:
        marked = ", ".join(repr(n) for n in markers) or ", ".join(repr(n) for n in maybe)
        past = f"through a statistic over the batch{norms} or a term of the loss that {marked} does not weigh"
        advice = (
            f"the step masks rows with {marked}, and these reach it past that: {past}"
            if markers
            else f"if {marked} masks the loss's rows (0 on padded rows), these reach the step past it: {past}; "
            f"if nothing masks them, {mask_loss}"
        )
    else:
        advice = unmasked
    return _fail(
        check, desc, f"{said}{others}; {advice}", Finding(output=finding.output, index=finding.index)
    )


#: Before training_padding names padded rows, the step it compares against is replayed this many
#: more times (and the stressed one once more): how far the replays vary by themselves.
RERUNS = 3


def _spread(a: Any, b: Any) -> float:
    """The largest difference of two floating tensors of one shape; 0.0 for anything else."""
    if not (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.is_floating_point()
        and a.shape == b.shape
        and a.dtype == b.dtype
    ):
        return 0.0
    return largest_difference(a, b, ulp=False)[0]


def _looks_like_a_marker(low: Any, high: Any, *, floating: bool) -> bool:
    """Whether an input whose real rows hold values from ``low`` to ``high`` looks like a row
    marker, where its padded rows hold 0 (no pad value declared): one value on every real row (a
    mask, in any encoding) or a floating weight that is never negative."""
    return bool(low == high or (floating and low >= 0))


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
    kept = None if whole else _up_to_gradients
    got = held({"loss": loss, **sides.graphed.snapshot(kept)})
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
        return held({"loss": loss, **replica.snapshot(kept)})

    try:
        expected = eager_on(sides.eager, unpadded, watched=True)
    except InternalError:
        raise  # the harness's own failure, never the module's step
    except Exception as exc:  # BatchNorm over one row, say: the module cannot take the real batch
        return _skip(
            check,
            desc,
            f"eager's step fails on the real batch of {counted(real, 'token')} alone, so there is nothing to "
            "hold the graph to",
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
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
            f"a step on {counted(real, 'real token')} padded to {tokens} differs from eager's step on the {counted(real, 'token')} "
            f"alone in {key}: {verdict.why}{_across_or_at(sides, got[key], want, padded_step()[key])}",
            Finding(
                output=key,
                index=diff.index if diff is not None else None,
                got=diff.got if diff is not None else None,
                expected=diff.expected if diff is not None else None,
            ),
        )
    return Outcome(check, desc, passed=True, figures={"floor_used": bool(floor)})


def _across_or_at(sides: _Sides, got: Any, want: Any, padded: Any) -> str:
    """Where the graph's step on the padded batch differs from eager's on the real batch: across the
    shapes (eager at the padded shape differs as well: a loss or a statistic over every row), or at
    the padded shape itself (the graph differs from eager there too: the replay, not the padding),
    each said where it carries at least half of the difference (one of them always does: the
    difference is at most their sum)."""
    total = _spread(got, want)
    across, at = _spread(padded, want), _spread(got, padded)
    said = ""
    if not total or 2 * across >= total:
        said += (
            "; look for a loss or a statistic over every row (a mean over the padded ones too, a sum divided by "
            f"the padded count){_batch_norms(sides.graphed.module)}"
        )
    if total and 2 * at >= total:
        said += (
            f"; the replayed step differs from eager's at the padded shape itself too (by up to {at:.3g}, where "
            f"eager moves by {across:.3g} between the two shapes), so the cause is not the padding: the replay "
            f"departs from eager, as training_replay_matches_eager holds at the captured shape"
            f"{_frozen_since_capture(sides)}"
        )
    return said


def _batch_norms(module: torch.nn.Module) -> str:
    """Where the module normalises over the batch in train mode: padded rows enter those statistics."""
    found = [
        name or "the top-level module"
        for name, sub in module.named_modules()
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm) and sub.training
    ]
    return f" (BatchNorm in train mode: {', '.join(repr(n) for n in found)})" if found else ""
