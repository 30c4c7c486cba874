"""``verify``: capture every descriptor of a module and run the checks on each."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch

from ..errors import CaptureError
from ..manager import GraphManager
from ..manager.layout import not_a_module
from ..manager.pieces import EagerSpec
from ..plan import BatchDescriptor, CaptureConfig, GraphMode
from ..plan.selection import select_descriptors
from .context import ScratchRegion, VerifyContext
from .report import Finding, Outcome, VerifyReport
from .suite import (
    DESCRIPTOR_CHECKS,
    address_stability,
    attributes_restored,
    capture_safety,
    output_lifetime,
    record_addresses,
    tensor_attributes,
)

__all__ = ["CHECKS", "DISPATCH_CHECK", "select_descriptors", "verify"]

#: Every check, in the order it runs.
CHECKS: tuple[str, ...] = (
    "capture_safety",
    "replay_matches_eager",
    "fresh_inputs",
    "real_batches",
    "padding_isolation",
    "state",
    "side_outputs",
    "determinism",
    "output_lifetime",
    "address_stability",
    "rng",
)


#: Property-tests the manager's dispatch; runs in exhaustive verification.
DISPATCH_CHECK = "dispatch"


def _check_names(checks: Iterable[str] | None) -> tuple[str, ...]:
    if checks is None:
        return (*CHECKS, DISPATCH_CHECK)
    if isinstance(checks, str):
        checks = [c.strip() for c in checks.split(",") if c.strip()]
    chosen = tuple(checks)
    known = (*CHECKS, DISPATCH_CHECK)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; the checks are {', '.join(known)}")
    if not chosen:
        raise ValueError(f"checks must name at least one of {', '.join(known)}")
    return tuple(c for c in known if c in chosen)


def _labels(descriptors: Iterable[str] | str | None) -> tuple[str, ...] | None:
    if descriptors is None:
        return None
    if isinstance(descriptors, str):
        return (descriptors,)  # one label, not its characters
    labels = tuple(descriptors)
    if not labels or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"descriptors must be descriptor labels such as 'FULL-T8-R4'; got {descriptors!r}")
    return labels


def verify(
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    *,
    capture_sizes: Iterable[int],
    max_num_reqs: int | None = None,
    mode: GraphMode | str = "FULL",
    decode_query_len: int = 1,
    lora_cases: Iterable[int] = (0,),
    varlen_decode: bool = False,
    max_capture_size: int | None = None,
    num_ubatches: int = 1,
    ubatch_min_tokens: int = 1,
    backend: str | None = None,
    device: torch.device | str | None = None,
    checks: Iterable[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    batch_invariant: bool = False,
    exhaustive: bool = True,
    pad_values: Mapping[str, Any] | None = None,
    scratch_state: Mapping[str, ScratchRegion] | None = None,
    eager_submodules: EagerSpec = None,
    descriptors: Iterable[str] | str | None = None,
    seed: int = 0,
    nonfinite_padding: bool = False,
    batch_dims: Mapping[str, int] | None = None,
    progress: bool | None = None,
) -> VerifyReport:
    """Capture every descriptor of ``module`` and check each against eager.

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
    probes should not learn it (see ``GraphManager``). ``progress`` shows a
    bar per descriptor checked on stderr: True always, False never, None (the
    default) when stderr is a terminal and the checks run longer than
    ``PROGRESS_DELAY`` seconds. Bad arguments raise ``ValueError``.
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(not_a_module(module))
    names = _check_names(checks)
    sizes = tuple(capture_sizes)
    config = CaptureConfig(
        capture_sizes=sizes,
        max_num_reqs=max_num_reqs if max_num_reqs is not None else (max(sizes) if sizes else 1),
        mode=mode,
        decode_query_len=decode_query_len,
        lora_cases=lora_cases,
        varlen_decode=varlen_decode,
        max_capture_size=max_capture_size,
        num_ubatches=num_ubatches,
        ubatch_min_tokens=ubatch_min_tokens,
    )
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name} must be a number >= 0 or None (dtype default); got {value!r}")
    # Verification runs make_inputs and the module many times (probes,
    # warm-ups, captures, eager references): the random generators are put
    # back afterwards, and so are the module's buffers.
    rng_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=rng_devices):
        return _verify(module, make_inputs, config, names, backend=backend, device=device, rtol=rtol, atol=atol,
                       batch_invariant=batch_invariant, exhaustive=exhaustive, pad_values=pad_values,
                       scratch_state=scratch_state, eager_submodules=eager_submodules,
                       descriptors=_labels(descriptors), seed=seed, nonfinite_padding=bool(nonfinite_padding),
                       batch_dims=batch_dims, progress=progress)


def _verify(
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    config: CaptureConfig,
    names: tuple[str, ...],
    *,
    backend: str | None,
    device: torch.device | str | None,
    rtol: float | None,
    atol: float | None,
    batch_invariant: bool,
    exhaustive: bool,
    pad_values: Mapping[str, Any] | None,
    scratch_state: Mapping[str, ScratchRegion] | None,
    eager_submodules: EagerSpec,
    descriptors: tuple[str, ...] | None,
    seed: int,
    nonfinite_padding: bool,
    batch_dims: Mapping[str, int] | None,
    progress: bool | None = None,
) -> VerifyReport:
    torch.manual_seed(seed)
    # The module is verified as it will run: a module left in train mode
    # (batch statistics, dropout) is a different program from its eval twin,
    # and switching it silently would verify the wrong one. The report says
    # which mode it was.
    training = _training_mode(module)
    # Checked capture: verification is where an op that cannot be captured
    # should be named before the device sees it.
    manager = GraphManager(module, make_inputs, config, backend=backend or "auto", device=device,
                           pad_values=pad_values, checked_capture=True, eager_submodules=eager_submodules,
                           batch_dims=batch_dims)
    selected = select_descriptors(manager.plan.capture_order, exhaustive=exhaustive)
    # The dispatch check concerns the whole plan: in a verification split by
    # descriptor it runs once, with the plan's first descriptor, on the plan.
    run_dispatch = True
    if descriptors is not None:
        order = manager.plan.capture_order
        labels = [d.label() for d in order]
        unknown = [label for label in descriptors if label not in labels]
        if unknown:
            raise ValueError(f"descriptors {unknown} are not in the plan; its descriptors are {', '.join(labels)}")
        # Named descriptors are verified whatever the quick selection says.
        selected = [d for d in order if d.label() in descriptors]
        run_dispatch = labels[0] in descriptors
    report = VerifyReport(
        module=type(module).__name__,
        backend=manager.backend,
        device=str(manager.device),
        mode=config.mode.name,
        exhaustive=exhaustive,
        checks=names,
        planned=len(manager.plan.descriptors),
        training=training,
        config={
            "capture_sizes": list(config.capture_sizes),
            "max_num_reqs": config.max_num_reqs,
            "mode": config.mode.name,
            "decode_query_len": config.decode_query_len,
            "lora_cases": list(config.lora_cases),
            "varlen_decode": config.varlen_decode,
            "max_capture_size": config.max_capture_size,
            "num_ubatches": config.num_ubatches,
            "ubatch_min_tokens": config.ubatch_min_tokens,
        },
    )
    ctx = VerifyContext(manager, rtol=rtol, atol=atol, batch_invariant=batch_invariant, seed=seed,
                        exhaustive=exhaustive, scratch_state=scratch_state or {},
                        nonfinite_padding=nonfinite_padding)
    try:
        # Probes, warm-ups and captures run forward many times: the tensors it
        # stores on the module (side outputs) are put back, as its buffers are.
        with ctx.preserved_state(), attributes_restored(module):
            _run(ctx, report, selected, names if run_dispatch else tuple(n for n in names if n != DISPATCH_CHECK),
                 plan_dispatch=descriptors is not None, progress=progress)
        report.real_batches = ctx.real_batches_run
    finally:
        manager.release()
    return report


def _training_mode(module: torch.nn.Module) -> str:
    """'eval', 'train', or 'mixed' (submodules in both modes), as the report states it."""
    modes = {m.training for m in module.modules()}
    if modes == {False}:
        return "eval"
    if modes == {True}:
        return "train"
    return "mixed"


#: Seconds the checks run before an automatic progress bar appears.
PROGRESS_DELAY = 2.0


def progress_over(items: list[BatchDescriptor], progress: bool | None, *, desc: str) -> Iterable[BatchDescriptor]:
    """``items``, through a tqdm bar on stderr when ``progress`` is True, or
    None and stderr is a terminal (then after ``PROGRESS_DELAY`` seconds, so
    quick runs stay quiet). Captured output is not a terminal: pytest's
    capture keeps it quiet, and the plugin passes False under ``-q``."""
    auto = progress is None
    if auto:
        try:
            progress = sys.stderr.isatty()
        except (AttributeError, ValueError):  # a replaced or closed stderr
            progress = False
    if not progress:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but progress is optional
        return items
    bar: Iterable[BatchDescriptor] = tqdm(items, desc=desc, unit="descriptor", file=sys.stderr,
                                          delay=PROGRESS_DELAY if auto else 0.0, leave=False)
    return bar


def _run(ctx: VerifyContext, report: VerifyReport, selected: list[BatchDescriptor], names: tuple[str, ...],
         *, plan_dispatch: bool = False, progress: bool | None = None) -> None:
    manager = ctx.manager
    if not selected:
        return
    if "capture_safety" in names:
        safety = capture_safety(ctx, selected)
        report.add(safety)
        if not all(o.passed for o in safety):
            _skip_rest(report, names, "capture_safety failed: nothing was captured")
            return
    before = record_addresses(ctx)
    try:
        manager.capture(selected)
    except CaptureError as exc:
        report.add([Outcome(
            "capture_safety", exc.descriptor, False, str(exc),
            Finding(submodule=exc.module_path, ops=[f"{exc.op} ({exc.reason})"] if exc.op else []),
        )])
        _skip_rest(report, names, "capture failed: nothing was verified")
        return
    # What forward stored on the module during capture: after a replay these
    # attributes still hold it (Python does not run on replay).
    ctx.captured_attributes = tensor_attributes(ctx.module)
    report.descriptors = manager.captured_descriptors
    report.capture_seconds = manager.capture_seconds
    report.graph_memory = manager.graph_memory
    started = time.perf_counter()
    label = f"Verifying {report.module} ({manager.backend})"
    for desc in progress_over(selected, progress, desc=label):
        for name in names:
            check = DESCRIPTOR_CHECKS.get(name)
            if check is not None:
                report.add([_guarded(name, desc, partial(check, ctx, desc))])
    if "output_lifetime" in names:
        report.add([_guarded("output_lifetime", None, partial(output_lifetime, ctx, selected))])
    if "address_stability" in names:
        report.add([address_stability(ctx, before)])
    if ctx.exhaustive and DISPATCH_CHECK in names:
        # Exhaustive runs also prove the dispatcher over the graphs captured;
        # an item of a split verification proves the plan's.
        from .dispatch import dispatch_properties

        report.add([dispatch_properties(manager, max_examples=200, plan_only=plan_dispatch)])
    report.check_seconds = time.perf_counter() - started


def _guarded(name: str, desc: BatchDescriptor | None, fn: Callable[[], Outcome | None]) -> Any:
    try:
        return fn()
    except Exception as exc:  # a check that cannot run is a finding, not a crash of verify()
        return Outcome(name, desc, False, f"the check could not run: {type(exc).__name__}: {exc}")


def _skip_rest(report: VerifyReport, names: tuple[str, ...], why: str) -> None:
    for name in names:
        if name == "capture_safety":
            continue
        report.add([Outcome(name, None, True, why, skipped=True)])
