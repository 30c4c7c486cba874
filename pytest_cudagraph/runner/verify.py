"""``verify_runner``: an engine's own CUDA-graph runner held to the module's eager forward."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..backends.factory import as_device
from ..checks import kernel_references
from ..checks.builtin.common import finding_of
from ..checks.engine import capture_config, could_not_run, guarded
from ..checks.registry import Check, check_list
from ..checks.report import Finding, Outcome, VerifyReport
from ..manager.layout import check_module
from ..options import VerifyOptions
from ..plan import CaptureConfig
from ..plan.config import MAX_CAPTURE_TOKENS
from ..plan.validate import UsageError, int_list, optional_int
from ..references import References, normalized, registered
from .checks import RUNNER_CHECKS
from .runner_context import RunnerContext

__all__ = ["verify_runner"]

#: The check under which a runner's failing ``capture()`` is reported.
RUNNER_CAPTURE = "runner_capture"


def _device_of(module: torch.nn.Module, device: torch.device | str | None) -> torch.device:
    given = as_device(device)  # a UsageError for a device this torch lacks
    if given is not None:
        return given
    found = next((t.device for t in (*module.parameters(), *module.buffers())), None)
    return found if found is not None else torch.device("cpu")


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


def _capture_state(ctx: RunnerContext, before: Mapping[str, torch.Tensor]) -> list[Outcome]:
    """A failed ``state`` outcome when the runner's ``capture()`` (its warm-ups) wrote the module's
    state outside ``scratch_state``: what an engine's dummy batches write must go to padding slots."""
    diff = ctx.state_difference(ctx.snapshot(), before, use_scratch=True)
    if diff is None:
        return []
    return [
        Outcome(
            "state",
            None,
            False,
            f"runner.capture() changed module state '{diff.path}' outside scratch_state ({diff.reason}): "
            "its warm-up or capture batches wrote where real requests live (a padded token given a live "
            "slot, say). Send dummy and padded tokens to a scratch region and declare it with "
            "scratch_state",
            finding_of(diff),
        )
    ]


def verify_runner(
    runner: Callable[..., Any],
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    *,
    capture_sizes: Sequence[int] | None = None,
    max_num_reqs: int | None = None,
    max_tokens: int | None = None,
    config: CaptureConfig | Mapping[str, Any] | None = None,
    checks: Sequence[str] | str | None = None,
    extra_checks: Check | Sequence[Check] | None = None,
    scratch_state: Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    batch_invariant: bool = False,
    seed: int = 0,
    device: torch.device | str | None = None,
    references: Mapping[Any, Callable[..., Any]] | None = None,
) -> VerifyReport:
    """Verify a CUDA-graph runner someone else wrote against ``module``'s eager forward.

    ``runner(**inputs)`` takes the keyword inputs of one real (unpadded)
    batch, as ``make_inputs(num_tokens, num_reqs)`` gives them, and returns
    the outputs for its real rows; a runner with a ``capture()`` method has
    it called once first. ``module(**inputs)`` on the same batch is the
    reference. The two may share state (a KV cache buffer): the module's
    parameters and buffers are snapshot and restored around each comparison,
    and compared outside ``scratch_state``.

    Real batches: every token count from ``max_tokens`` (default: one past
    the largest capture size, the eager fallback) down to 1; a batch of n
    tokens has n requests, or ``min(n, max_num_reqs)``. Each capture size is
    reported as a FULL descriptor standing for the token counts above the
    next smaller size; the eager fallback as a NONE descriptor. ``checks``
    selects among ``RUNNER_CHECKS`` by name; ``extra_checks`` adds checks of
    the same signatures (``run(ctx: RunnerContext, descriptor)``). ``references`` (kernel ->
    plain-torch function, as ``verify`` takes them) are held against their kernels on a forward of
    the module at the largest capture size; a runner's verification asks no float64 question, so
    they stand in for nothing, and the report says so.
    """
    if not callable(runner):
        raise UsageError(
            f"verify_runner: runner must be callable as runner(**inputs); got {type(runner).__name__}"
        )
    check_module(module, "verify_runner: module")
    if not callable(make_inputs):
        raise UsageError(
            "verify_runner: make_inputs must be a function (num_tokens, num_reqs) -> dict of inputs; "
            f"got {type(make_inputs).__name__}"
        )
    if config is not None:
        # The plan the runner captured, as verify() and GraphManager take it: its sizes and
        # request count (the runner's own modes are its business).
        if capture_sizes is not None or max_num_reqs is not None:
            raise UsageError("verify_runner: pass config or capture_sizes/max_num_reqs, not both")
        plan = capture_config(config, {})
        capture_sizes, max_num_reqs = plan.capture_sizes, plan.max_num_reqs
    if capture_sizes is None:
        raise UsageError(
            "verify_runner: needs capture_sizes (the token counts the runner captured graphs for) or a config"
        )
    sizes = int_list(
        "verify_runner: capture_sizes",
        capture_sizes,
        what="the token counts the runner captured graphs for",
        maximum=MAX_CAPTURE_TOKENS,
    )
    optional_int("verify_runner: max_num_reqs", max_num_reqs, maximum=MAX_CAPTURE_TOKENS)
    optional_int("verify_runner: max_tokens", max_tokens, maximum=MAX_CAPTURE_TOKENS)
    top = max_tokens if max_tokens is not None else sizes[-1] + 1
    # The keywords verify() takes too, checked as verify() checks them (one place: VerifyOptions).
    opts = VerifyOptions(
        checks=checks,  # type: ignore[arg-type]  # a string or names: VerifyOptions takes both
        rtol=rtol,
        atol=atol,
        batch_invariant=batch_invariant,
        seed=seed,
        scratch_state=scratch_state,
        references=references,
    )
    rtol, atol, batch_invariant = opts.rtol, opts.atol, opts.batch_invariant
    registry = RUNNER_CHECKS.extended(check_list(extra_checks))
    selected = registry.select(opts.checks)
    dev = _device_of(module, device)
    ctx = RunnerContext(
        runner,
        module,
        make_inputs,
        capture_sizes=sizes,
        max_num_reqs=max_num_reqs,
        max_tokens=top,
        rtol=rtol,
        atol=atol,
        batch_invariant=batch_invariant,
        seed=seed,
        scratch_state=scratch_state or {},
        device=dev,
    )
    report = VerifyReport(
        module=f"{_name(runner)} for {type(module).__name__}",
        backend=dev.type,
        device=str(dev),
        mode="runner",
        exhaustive=True,
        checks=selected,
        descriptors=tuple(ctx.descriptors),
        planned=len(ctx.descriptors),
        config={"capture_sizes": sizes, "max_num_reqs": max_num_reqs, "max_tokens": top},
        kind="runner",
        training="train" if module.training else "eval",
    )
    started = time.perf_counter()
    # What the module's forward writes (and nothing else) is copied, compared and restored.
    ctx.learn()
    report.notes.extend(
        f"forward writes {name!r} where no op shows it to torch's dispatcher (a Triton kernel or "
        "an extension called directly); found by its fingerprint, it is compared from then on"
        for name in ctx.unseen
    )
    refs = normalized(opts.references).merged_over(registered())
    if refs:
        report.add(_held_references(ctx, refs, sizes[-1], seed))
        report.references = kernel_references.summarized(refs, report.outcomes, {})
        report.notes.append(
            kernel_references.NO_FLOAT64_QUESTION.format(where="verify_runner", what="the runner's outputs")
        )
    capture = getattr(runner, "capture", None)
    if callable(capture):
        before = ctx.snapshot()
        try:
            capture()
        except Exception as exc:  # the runner's own capture failed: nothing after it can be trusted
            report.capture_seconds = time.perf_counter() - started
            report.add(
                [Outcome(RUNNER_CAPTURE, None, False, f"runner.capture() raised {type(exc).__name__}: {exc}")]
            )
            return report
        ctx.synchronize()
        if "state" in selected:
            report.add(_capture_state(ctx, before))
        # The checks start from the state the caller handed over.
        ctx.restore(before)
    report.capture_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for name in selected:
        check = registry[name]
        if check.scope == "module":
            report.add([guarded(check, None, functools.partial(check.run, ctx, list(ctx.descriptors)))])
        elif check.scope == "descriptor":
            for desc in ctx.descriptors:
                report.add([guarded(check, desc, functools.partial(check.run, ctx, desc))])
        else:
            report.add(
                [
                    could_not_run(
                        check,
                        None,
                        ValueError(
                            f"scope {check.scope!r} has no meaning for a runner (its capture is its own)"
                        ),
                    )
                ]
            )
    report.check_seconds = time.perf_counter() - started
    report.real_batches = ctx.runner_calls
    changed = ctx.unseen_writes()
    if changed and "state" in selected:
        report.add(
            [
                Outcome(
                    "state",
                    None,
                    False,
                    f"module tensor(s) {', '.join(repr(n) for n in changed)} hold other values after the "
                    "runner ran than before, though the module's eager forward never writes them: the "
                    "runner (its capture or its replays) wrote where eager does not",
                    Finding(output=changed[0]),
                )
            ]
        )
    return report


def _held_references(ctx: RunnerContext, refs: References, tokens: int, seed: int) -> list[Outcome]:
    """Each reference against its kernel on a forward of the module at ``tokens`` tokens, the
    module's state put back after."""
    before = ctx.snapshot()
    try:
        torch.manual_seed(seed)
        inputs = ctx.make(ctx.batch(tokens))
        return kernel_references.held(refs, lambda: ctx.eager(inputs), tokens, seed)
    finally:
        ctx.restore(before)
