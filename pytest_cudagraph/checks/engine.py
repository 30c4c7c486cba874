"""``verify``: capture every descriptor of a module and run the checks on each."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import torch

from .. import faults, peers
from ..errors import EagerFailure, InternalError, UsageError
from ..guard import Violation, capturability_table, host_methods_watched
from ..manager import GraphManager, tree
from ..manager.inputs import check_forward_takes
from ..manager.layout import MakeInputsError
from ..options import VerifyOptions, capture_config
from ..plan import BatchDescriptor, CaptureConfig
from ..plan.selection import select_descriptors
from ..progress import over, progress_label, stage
from . import kernel_references
from .arguments import check_arguments, registry_with, verify_signature
from .builtin import BUILTIN, CAPTURE_CHECK, DISPATCH_CHECK
from .builtin.capture_safety import capture_safety, fix_of
from .builtin.padded_size import CHECK as PADDED_SIZE_CHECK
from .builtin.padded_size import queue_every_size
from .builtin.side_outputs import attributes_restored, tensor_attributes
from .compare import nothing_finite
from .cost import Meter, peak_memory, start_peak
from .registry import Check
from .report import Finding, Outcome, VerifyReport
from .verify_context import VerifyContext

# could_not_run and guarded are the seams runner/ runs its checks through: a check that raises
# is a failure that says so, never a pass.
__all__ = [
    "CHECKS",
    "DISPATCH_CHECK",
    "capture_config",
    "check_arguments",
    "could_not_run",
    "guarded",
    "registry_with",
    "select_descriptors",
    "verify",
]

#: How a CUDA capture after the checked sequence's first was guarded (capture_safety's figures).
LIGHT_CAPTURE = (
    "every op of its capture observed, the rules left to the device: an op it refuses fails the capture, "
    "named by that op and an eager run under the full guard"
)

#: The built-in checks of a module's graphs, in the order they run (the
#: dispatch check, which concerns the plan, is ``DISPATCH_CHECK``).
CHECKS: tuple[str, ...] = tuple(name for name in BUILTIN.names() if name != DISPATCH_CHECK)


def verify(
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    *,
    config: CaptureConfig | Mapping[str, Any] | None = None,
    options: VerifyOptions | None = None,
    **keywords: Any,
) -> VerifyReport:
    """Capture every descriptor of ``module`` and check each against eager.

    The capture plan is ``config`` (a ``CaptureConfig`` or a dict of its
    keywords), or ``CaptureConfig``'s keywords given here: ``capture_sizes``
    (required), ``max_num_reqs`` (default: the largest capture size),
    ``mode``, ``decode_query_len``, ``lora_cases``, ... How it runs is
    ``options`` (a ``VerifyOptions``) or its keywords given here (they win over
    ``options``'s): ``checks`` selects checks by name (default: every default
    check; ``-name`` deselects one); ``extra_checks`` adds ``Check``s of your
    own (see ``pytest_cudagraph.checks.registry``), run after the built-ins
    and selectable by name.
    Returns a ``VerifyReport``; ``report.ok`` is False when a check failed, and
    ``report.format()`` names the check, the descriptor, the real batch, the
    output and first differing index, and the first divergent submodule.
    ``exhaustive=False`` verifies only the smallest and largest descriptor of
    each mode. ``eager_submodules`` (see ``GraphManager``) captures PIECEWISE
    descriptors as graph segments around those submodules. ``descriptors``
    (labels such as ``"FULL-T8-R4"``) verifies only those; the dispatch check
    then runs only with the first descriptor verified in full.
    ``nonfinite_padding=True`` also fills padded rows with NaN and inf in the
    padding_isolation check (a strictness beyond what engines do: they pad
    with finite values). The module is verified in the mode it is in
    (``module.training``), which the report states. ``batch_dims`` (input
    name -> dimension) names the dimension that follows the batch where the
    probes should not learn it (see ``GraphManager``). ``progress`` shows the
    stage and the descriptor (k of n) of the capture and the checks: under
    the pytest plugin as ``--cudagraph-progress`` says, elsewhere as a bar
    on stderr, True always, None (the default) when stderr is a terminal and
    a stage runs longer than ``progress.PROGRESS_DELAY`` seconds; False
    never. ``batches`` (``Batch``es, such as a trace's shapes: ``pytest_cudagraph.plan.trace.read_trace(path).shapes``) are the
    real batches the checks run, each with the descriptor that serves it, in
    place of the sweep of every token count; the dispatch check also holds
    each of them to the dispatch properties. Bad arguments raise a ``UsageError`` (a
    ``ValueError``): one line, before anything runs.
    """
    opts, plan_config, selected = check_arguments(module, make_inputs, config, options, keywords)
    # Verification runs make_inputs and the module many times (probes,
    # warm-ups, captures, eager references): the random generators are put
    # back afterwards, and so are the module's buffers.
    rng_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with _lost_context_told(), torch.random.fork_rng(devices=rng_devices):
            return _verify(module, make_inputs, plan_config, selected, opts)
    except faults.ContextLost as lost:
        # Told from here, without the frames of the harness it went through.
        raise faults.ContextLost(lost.code, lost.error, lost.where) from None


verify.__signature__ = verify_signature()  # type: ignore[attr-defined]


@contextlib.contextmanager
def _lost_context_told() -> Iterator[None]:
    """A sticky CUDA error, from wherever it came, leaves as ``ContextLost``
    (the first the process saw, with the phase it showed in); on CUDA every
    phase of the verification ends with a synchronize, so it shows where its
    kernel ran."""
    cuda = torch.cuda.is_available()
    if cuda:
        faults.watch_out_of_memory()
    try:
        with faults.synchronizing(cuda):
            if cuda:
                # A kernel an earlier test (or the test's own code) launched and
                # nothing waited for shows here, not in this verification's first phase.
                with faults.phase(
                    "a kernel launched before this verification",
                    "the test",
                    None,
                    torch.device("cuda", torch.cuda.current_device()),
                ):
                    pass
            yield
    except Exception as exc:
        lost = faults.context_lost_error(exc)
        if lost is None:
            raise
        raise faults.note_loss(lost) from None


def _verify(
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    config: CaptureConfig,
    checks: list[Check],
    options: VerifyOptions,
) -> VerifyReport:
    seed, exhaustive, descriptors, progress = (
        options.seed,
        options.exhaustive,
        options.descriptors,
        options.progress,
    )
    torch.manual_seed(seed)
    # The module is verified as it will run: a module left in train mode
    # (batch statistics, dropout) is a different program from its eval twin,
    # and switching it silently would verify the wrong one. The report says
    # which mode it was.
    training = _training_mode(module)
    # Checked capture: verification is where an op that cannot be captured
    # should be named before the device sees it.
    manager = GraphManager(
        module,
        make_inputs,
        config,
        backend=options.backend,
        device=options.device,
        pad_values=options.pad_values,
        checked_capture=True,
        eager_submodules=options.eager_submodules,
        batch_dims=options.batch_dims,
        progress=progress,
    )
    selected = select_descriptors(manager.plan.capture_order, exhaustive=exhaustive)
    # The dispatch check concerns the whole plan: in a verification split by
    # descriptor it runs once, in the item of the plan's first descriptor.
    dispatch_here = True
    if descriptors is not None:  # each is in the plan (check_arguments)
        order = manager.plan.capture_order
        labels = [d.label() for d in order]
        # Named descriptors are verified whatever the quick selection says.
        selected = [d for d in order if d.label() in descriptors]
        dispatch_here = labels[0] in descriptors
    report = VerifyReport(
        module=type(module).__name__,
        backend=manager.backend,
        device=str(manager.device),
        mode=config.mode.name,
        exhaustive=exhaustive,
        checks=tuple(c.name for c in checks),
        planned=len(manager.plan.descriptors),
        training=training,
        config=config.to_dict(),
    )
    ctx = VerifyContext(manager, options, plan_dispatch=descriptors is not None, dispatch_here=dispatch_here)
    meter = Meter(module, lambda: manager.replays)
    report.memory_at_start = start_peak(manager.device)
    try:
        # Probes, warm-ups and captures run forward many times: the tensors it
        # stores on the module (side outputs) are put back, as the tensors
        # its forwards write are (learned first: nothing else is copied).
        # The host methods stay wrapped for the whole verification (the wrappers pass calls straight
        # through when no guard is active): replacing them for each eager run on the captured path
        # would flush the interpreter's attribute caches every time.
        with meter.watching(), attributes_restored(module), host_methods_watched():
            check_forward_takes(module, manager.state.inputs)
            stage(progress_label(report.module, manager.backend), "learning what forwards write", progress)
            with meter.step("learn"):
                _learn_writes(ctx, selected)
            if selected and {c.name for c in checks} & _ASK_HOST_NUMBERS:
                # Whether a kernel is handed host numbers that move on every call (a seed or offset kept
                # in Python): two eager forwards, once, which these checks read.
                with meter.step("host_numbers"):
                    ctx.host_draws()
            with ctx.preserved_state():
                _run(ctx, report, selected, checks, progress=progress, meter=meter)
            _tell_unseen_writes(ctx, report, checks)
            _tell_not_known(ctx, report)
        report.real_batches = ctx.real_batches_run
        report.costs = meter.costs
        if not report.peak_memory:  # read by _run before the graphs went, when a later stage ran
            report.peak_memory, report.memory_kind = peak_memory(manager.device)
    finally:
        try:
            manager.release()
        except Exception as exc:
            if not faults.is_sticky(exc):
                raise  # else: the context is gone, and the error that took it is on its way up
    return report


#: The checks that read ``VerifyContext.host_draws``: rng names what it finds, the others defer to it.
_ASK_HOST_NUMBERS = frozenset({"rng", "replay_matches_eager", "fresh_inputs", "real_batches", "padded_size"})


def _learn_writes(ctx: VerifyContext, selected: list[BatchDescriptor]) -> None:
    """What forwards write, learned from eager runs at the smallest and largest
    selected shapes (put back after), so that snapshots copy that and nothing
    more. A forward that fails here is left to capture_safety to tell."""
    if not selected:
        return
    shapes = sorted(
        {min(selected, key=lambda d: d.num_tokens), max(selected, key=lambda d: d.num_tokens)},
        key=lambda d: d.num_tokens,
    )

    failures: list[tuple[BatchDescriptor, Exception]] = []
    outputs: dict[BatchDescriptor, Any] = {}

    # make_inputs runs outside the pass: what it draws is not the module's randomness.
    made = {desc: ctx.make(ctx.exact_batch(desc)) for desc in shapes}

    def forward(desc: BatchDescriptor) -> None:
        batch = ctx.exact_batch(desc)
        try:
            # As users run it, tagged with the descriptor it stands for (a lost context names it).
            outputs[desc] = ctx.eager(
                ctx.manager.eager_kwargs(made[desc], batch.num_tokens), desc, captured_path=False
            )
        except Exception as exc:
            _raise_if_lost(exc)
            InternalError.raise_if_in(exc)  # the harness's bookkeeping under the forward failed
            failures.append((desc, exc))

    ctx.learn_writes([partial(forward, desc) for desc in shapes])
    if len(failures) == len(shapes):
        desc, exc = failures[0]
        told = capture_safety(ctx, [desc])[0].finding
        if told is not None and told.ops:
            # It fails at an op a graph cannot hold (on a GPU, a CPU tensor as a device op's operand):
            # a capture bug, which capture_safety names at each descriptor.
            return
        # Eager fails at every shape tried: one error that says how, not a failed capture per descriptor.
        shown = ", ".join(
            f"(num_tokens={d.num_tokens}, num_reqs={ctx.manager.capture_reqs(d)})" for d in shapes
        )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise EagerFailure(
            f"{type(ctx.module).__name__}'s eager forward fails on make_inputs' batches at {shown}, before "
            f"anything is captured: {type(exc).__name__}: {first}.{_dtype_hint(ctx)} Nothing can be captured "
            f"or compared; run module(**make_inputs({desc.num_tokens}, {ctx.manager.capture_reqs(desc)})) "
            "eagerly to see it"
        ) from exc
    if len(outputs) == len(shapes) and all(nothing_finite(out) for out in outputs.values()):
        shown = ", ".join(
            f"(num_tokens={d.num_tokens}, num_reqs={ctx.manager.capture_reqs(d)})" for d in shapes
        )
        inputs = [
            t for t in tree.leaves(made[shapes[0]]) if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        cause = (
            "make_inputs' floating inputs are NaN or inf everywhere"
            if inputs and all(nothing_finite(t) for t in inputs)
            else "the forward makes them so"
        )
        raise UsageError(
            f"{type(ctx.module).__name__}'s outputs are NaN or inf in every element at {shown} ({cause}): every "
            "check would compare NaN with NaN and inf with inf, equal bit for bit, and nothing would be verified; "
            "build inputs with finite values (torch.randn(...)) on which the forward's outputs are finite"
        )
    if ctx.unseen:
        names = ", ".join(repr(n) for n in ctx.unseen)
        ctx.notes.append(
            f"forward writes {names} where no op shows it to torch's dispatcher (a Triton kernel or an "
            "extension called directly); found by its fingerprint after a first eager pass, it is copied and put "
            "back from then on, but what that first pass wrote there stays"
        )


def _dtype_hint(ctx: VerifyContext) -> str:
    """Where make_inputs' floating inputs and the module's floating parameters differ in dtype (a
    float64 module given float32 inputs), the likely cause, said."""
    params = {t.dtype for t in (*ctx.module.parameters(), *ctx.module.buffers()) if t.is_floating_point()}
    given = {t.dtype for t in ctx.manager.static_inputs.values() if t.is_floating_point()}
    if len(params) != 1 or not given or given <= params:
        return ""
    want = str(next(iter(params))).replace("torch.", "")
    have = ", ".join(sorted(str(d).replace("torch.", "") for d in given))
    return (
        f" make_inputs' floating inputs are {have} and the module's parameters {want}: build the inputs in "
        f"{want} (torch.randn(..., dtype=torch.{want})), or convert the module (module.to(torch.{have.split(',')[0]}))."
    )


def _tell_not_known(ctx: VerifyContext, report: VerifyReport) -> None:
    """Ops whose capture on a GPU the emulator cannot vouch for: said, never passed in silence."""
    unknown = ctx.manager.not_known_ops
    if not unknown:
        return
    table = capturability_table()
    shown = ", ".join(f"{op} (in {path or 'the top-level module'})" for op, path in list(unknown.items())[:8])
    more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
    report.notes.append(
        f"capture_safety: whether a CUDA graph capture holds {len(unknown)} op(s) is not known to the emulator: "
        f"{shown}{more}. Its table of what CUDA captures ({table.source if table else 'none'}) has not seen them "
        "with these kinds of arguments; verify on a GPU to be sure"
    )


def _tell_unseen_writes(ctx: VerifyContext, report: VerifyReport, checks: list[Check]) -> None:
    """A tensor no forward was seen writing before verification began, but changed since: it
    could not be put back, so the module leaves verification changed. Said, never passed over."""
    changed = ctx.unseen_writes()
    report.notes.extend(ctx.notes)
    selected = {c.name for c in checks}
    if ctx.synced:
        report.notes.append(
            f"make_inputs writes module tensor(s) {', '.join(repr(n) for n in ctx.synced)} in place (a weight "
            "sync): each run starts from what it wrote, and no forward is held to have written it"
        )
    moved = list(dict.fromkeys([*ctx.rebound_outside, *ctx.rebound()]))
    if moved and "address_stability" not in selected:
        message = (
            f"module tensor(s) {', '.join(repr(n) for n in moved)} were rebound to new memory during "
            "verification (param.data = new, or a new tensor assigned, in forward or in make_inputs): graphs "
            "captured before keep reading the old memory. Update them in place (copy_)"
        )
        _state_failure_or_note(report, selected, message, moved[0])
    if not changed:
        return
    names = ", ".join(repr(n) for n in changed)
    message = (
        f"module tensor(s) {names} hold other values after verification than before it: a forward writes "
        "them where the first pass saw no write (at another shape, or outside torch's dispatcher), or code "
        "between forwards did outside torch's dispatcher, so they were not copied before and could not be "
        "put back"
    )
    _state_failure_or_note(report, selected, message, changed[0])


def _state_failure_or_note(report: VerifyReport, selected: set[str], message: str, output: str) -> None:
    """What verification left changed in the module: a failure of ``state`` when it runs, else a note."""
    if "state" in selected:
        report.add([Outcome("state", None, False, message, Finding(output=output))])
    else:
        report.notes.append(message)


def _training_mode(module: torch.nn.Module) -> str:
    """'eval', 'train', or 'mixed' (submodules in both modes), as the report states it."""
    modes = {m.training for m in module.modules()}
    if modes == {False}:
        return "eval"
    if modes == {True}:
        return "train"
    return "mixed"


def _run(
    ctx: VerifyContext,
    report: VerifyReport,
    selected: list[BatchDescriptor],
    checks: list[Check],
    *,
    progress: bool | None = None,
    meter: Meter | None = None,
) -> None:
    """Every check of ``checks`` on ``selected``: one outcome per check and descriptor.

    A descriptor that a before-capture check fails, or whose capture fails,
    is that descriptor's failure: the others are still captured and checked,
    and its own descriptor checks are reported skipped with the reason.
    """
    manager = ctx.manager
    if not selected:
        return
    meter = meter or Meter(ctx.module, lambda: manager.replays)
    # desc -> why it was not captured, for the outcomes of its other checks
    blocked: dict[BatchDescriptor, str] = {}
    # capture_safety runs in the capture: its guard sees every op of each descriptor's forward as
    # it is captured and stops at the first a graph cannot hold, before the device runs it. Only a
    # descriptor it stops pays for the eager run under the guard that lists every such op.
    capture_check = next((c for c in checks if c.name == CAPTURE_CHECK), None)
    for check in (c for c in checks if c.scope == "before_capture" and c is not capture_check):
        with meter.step(check.name):
            outcomes = _guarded_each(check, ctx, selected)
        for outcome in outcomes:
            report.add([outcome])
            if not outcome.passed and not outcome.skipped and outcome.descriptor is not None:
                blocked.setdefault(
                    outcome.descriptor, f"not captured: {check.name} failed for this descriptor"
                )
    runnable = []
    for check in checks:
        if check.prepare is None:
            runnable.append(check)
            continue
        try:
            with meter.step(check.name):
                check.prepare(ctx)
        except Exception as exc:  # a check that cannot prepare cannot run: said, not skipped in silence
            _raise_if_lost(exc)
            report.add([could_not_run(check, None, exc, "its prepare step raised ")])
        else:
            runnable.append(check)
    if ctx.reference is not None and ctx.reference.held:
        report.add(ctx.reference.held)  # each reference held against its kernel (kernel_references)
    to_capture = [d for d in selected if d not in blocked]
    ctx.checks_run = frozenset(c.name for c in runnable if c.scope == "descriptor")
    if to_capture:
        # replay_matches_eager takes each capture's warm-up, an eager run on the capture's own
        # inputs, as its eager side where nothing but the kernels could make another differ.
        watch = "replay_matches_eager" in ctx.checks_run
        manager.state.warmup_watch = ctx.watch_warmup if watch else None
        try:
            with meter.step("capture"):
                manager.capture(to_capture, keep_going=True)
        finally:
            manager.state.warmup_watch = None
        for desc, error in manager.capture_failures.items():
            listed = None
            if capture_check is not None and error.op:
                with meter.step(CAPTURE_CHECK):
                    listed = next(
                        (
                            o
                            for o in _guarded_each(capture_check, ctx, [desc])
                            if not o.passed and not o.skipped
                        ),
                        None,
                    )
            report.add(
                [
                    listed
                    or Outcome(
                        CAPTURE_CHECK,
                        desc,
                        False,
                        str(error),
                        Finding(
                            submodule=error.module_path,
                            ops=[f"{error.op} ({error.reason})"] if error.op else [],
                            fix=fix_of(Violation(error.op, error.reason or "", error.module_path or ""))
                            if error.op
                            else None,
                        ),
                    )
                ]
            )
            blocked[desc] = f"not captured: its capture failed ({CAPTURE_CHECK} says why)"
        if capture_check is not None:
            every_op = manager.guarded_every_op
            report.add(
                [
                    Outcome(
                        CAPTURE_CHECK,
                        d,
                        True,
                        figures={"guarded": "every op of its capture" if d in every_op else LIGHT_CAPTURE},
                    )
                    for d in to_capture
                    if d not in manager.capture_failures
                ]
            )
    captured = [d for d in selected if d not in blocked]
    # What forward stored on the module during capture: after a replay these
    # attributes still hold it (Python does not run on replay).
    ctx.captured_attributes = tensor_attributes(ctx.module)
    report.descriptors = manager.captured_descriptors
    report.capture_seconds = manager.capture_seconds
    report.graph_memory = manager.graph_memory
    started = time.perf_counter()
    label = progress_label(report.module, manager.backend)
    per_descriptor = [c for c in runnable if c.scope == "descriptor"]
    for desc in over(selected, progress, label=label, stage="checks", unit="descriptor"):
        for check in per_descriptor:
            if desc in blocked:
                peers.step(f"{check.name} at {desc.label()}")  # the steps are the same on every rank
                report.add([Outcome(check.name, desc, True, blocked[desc], skipped=True)])
            else:
                with meter.step(check.name, desc.label()):
                    outcome = guarded(check, desc, partial(check.run, ctx, desc))
                report.add([_named(ctx, outcome)])
        # Nothing a descriptor kept outlives its checks: the eager run state reuses, the capture sample.
        ctx.exact_eager.pop(desc, None)
        ctx.fresh_eager.pop(desc, None)
        ctx.seed_free.discard(desc)
        ctx.padding_base.pop(desc, None)
        ctx.first_replay.pop(desc, None)
        ctx.warm_prints.pop(desc, None)
        manager.drop_sample(desc)
    for check in (c for c in runnable if c.scope == "module"):
        stage(label, check.name, progress)
        if not captured:
            report.add(
                [
                    Outcome(
                        check.name, None, True, "nothing was captured (capture_safety says why)", skipped=True
                    )
                ]
            )
        else:
            with meter.step(check.name):
                outcome = guarded(check, None, partial(check.run, ctx, captured))
            report.add([outcome])
    later = [c for c in runnable if c.scope == "after_release"]
    # Quick mode captures the smallest and largest descriptor of each mode; the cross-shape question
    # is still asked of eager at every other size, on its most padded real batch (a branch on the
    # token count between them shows there), at the cost of eager runs only.
    every_size: list[BatchDescriptor] = []
    if (
        captured
        and not ctx.exhaustive
        and not ctx.plan_dispatch
        and any(c.name == PADDED_SIZE_CHECK for c in later)
    ):
        with meter.step(PADDED_SIZE_CHECK):
            every_size = queue_every_size(ctx, [d for d in manager.plan.capture_order if d not in selected])
    if later:
        _after_release(ctx, report, selected, captured, blocked, later, meter, every_size, progress)
    report.references = _references(ctx)
    _tell_draws_anew(ctx, report)
    report.check_seconds = time.perf_counter() - started


def _tell_draws_anew(ctx: VerifyContext, report: VerifyReport) -> None:
    """Where the module draws anew on every call (a generator, host numbers a kernel is handed that
    move, Python state forward moves), a float64 floor across shapes is one number among many draws:
    padded_size's figures say why, and the summary prints none (``VerifyReport._reference``)."""
    if ctx.python_written:
        why = f"forward moves Python state on every call: {', '.join(ctx.python_written[:3])}"
    elif ctx.observer.random_ops:
        why = "the module draws random numbers on every call"
    elif ctx._host_draws:
        why = "a kernel is handed host numbers that move on every call"
    else:
        return
    for outcome in report.outcomes:
        if outcome.check == "padded_size" and "limit" in outcome.figures:
            outcome.figures["draws_anew"] = why


def _references(ctx: VerifyContext) -> list[dict[str, Any]]:
    """The JSON report's ``references``: each with how it held and whether it stood in."""
    ref = ctx.reference
    if ref is None or not ref.references:
        return []
    return kernel_references.summarized(ref.references, ref.held, ref.record.stood_in)


def _after_release(
    ctx: VerifyContext,
    report: VerifyReport,
    selected: list[BatchDescriptor],
    captured: list[BatchDescriptor],
    blocked: dict[BatchDescriptor, str],
    checks: list[Check],
    meter: Meter,
    every_size: Iterable[BatchDescriptor] = (),
    progress: bool | None = None,
) -> None:
    """The checks that need the graphs' memory: the graphs are released first (the verification's
    peak read before), and this stage's peak is reported apart (``report.reference_peak_memory``)."""
    manager = ctx.manager
    report.peak_memory, report.memory_kind = peak_memory(manager.device)
    manager.release()
    report.reference_memory_at_start = start_peak(manager.device)
    for check in checks:
        stage(progress_label(report.module, manager.backend), check.name, progress)
        with meter.step(check.name):
            descs = [*captured, *every_size] if check.name == PADDED_SIZE_CHECK else captured
            outcomes = _guarded_each(check, ctx, descs) if descs else []
        report.add([_named(ctx, o) for o in outcomes])
        report.add([Outcome(check.name, d, True, blocked[d], skipped=True) for d in selected if d in blocked])
    report.reference_peak_memory = peak_memory(manager.device)[0]


def _named(ctx: VerifyContext, outcome: Outcome) -> Outcome:
    """A failure of a module that reads memory nobody wrote says so first: any difference a check
    then sees may be the allocator's leftovers, not what the check names."""
    if outcome.passed or outcome.skipped:
        return outcome
    uninitialized = ctx.uninitialized()
    if uninitialized and uninitialized not in outcome.message:
        outcome.message = f"{uninitialized}. What the check saw: {outcome.message}"
    return outcome


def _raise_if_lost(exc: Exception) -> None:
    """A sticky CUDA error is no check's failure: every later check would fail the same way."""
    if faults.is_sticky(exc):
        raise exc


def could_not_run(check: Check, desc: BatchDescriptor | None, exc: Exception, step: str = "") -> Outcome:
    """A check that raised: a failure that says so, never a pass (nor a crash of verify())."""
    return Outcome(check.name, desc, False, f"the check could not run: {step}{faults.described(exc)}")


def guarded(check: Check, desc: BatchDescriptor | None, fn: Callable[[], Any]) -> Outcome:
    try:
        return check.outcome(fn(), desc)
    except MakeInputsError:
        raise  # the caller's make_inputs is wrong: told plainly, as verify's other bad arguments are
    except peers.StepLeft as exc:  # a peer rank's check ended this step early: no forward pairs with ours
        return Outcome(check.name, desc, True, str(exc), skipped=True)
    except Exception as exc:
        _raise_if_lost(exc)
        return could_not_run(check, desc, exc)


def _guarded_each(check: Check, ctx: VerifyContext, descs: list[BatchDescriptor]) -> list[Outcome]:
    """A before-capture check's outcomes, one per descriptor; a crash fails every descriptor it left."""
    try:
        results = check.run(ctx, descs)
        outcomes = [check.outcome(r, None) for r in results]
    except MakeInputsError:
        raise
    except peers.StepLeft as exc:
        return [Outcome(check.name, d, True, str(exc), skipped=True) for d in descs]
    except Exception as exc:
        _raise_if_lost(exc)
        return [could_not_run(check, d, exc) for d in descs]
    seen = {o.descriptor for o in outcomes}
    missing = [d for d in descs if d not in seen]
    # An outcome per descriptor, or the check says nothing about some: that is a defect of the check, told.
    return outcomes + [
        Outcome(check.name, d, False, "the check returned no outcome for this descriptor") for d in missing
    ]
