"""What ``verify`` is given, checked before anything runs: the module, ``make_inputs``, every keyword
(an unknown one named with the nearest known one), the options, the checks chosen and the plan,
which must hold a graph to verify (``check_arguments``); the keywords alone for a launcher of
``verify`` elsewhere (``check_keywords``: ``verify_distributed``'s ranks); and ``verify``'s
signature as help() and IDEs show it."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import UsageError
from ..manager.layout import check_module
from ..options import VerifyOptions, capture_config, split_keywords
from ..plan import CaptureConfig, CapturePlan
from .builtin import BUILTIN
from .registry import Check, CheckRegistry, check_list

__all__ = ["check_arguments", "check_keywords", "registry_with", "verify_signature"]


def registry_with(extra_checks: Iterable[Check] | Check | None) -> CheckRegistry:
    """The built-in checks, then ``extra_checks`` (ValueError on anything that is not a ``Check``)."""
    extra = check_list(extra_checks)
    return BUILTIN.extended(extra) if extra else BUILTIN


def check_arguments(
    module: object,
    make_inputs: object,
    config: CaptureConfig | Mapping[str, Any] | None,
    options: VerifyOptions | None,
    keywords: Mapping[str, Any],
    where: str = "verify()",
) -> tuple[VerifyOptions, CaptureConfig, list[Check]]:
    """Everything ``verify`` is given, checked before anything runs: the module, ``make_inputs``,
    every keyword (one unknown is named with the nearest known one), the options, the checks
    chosen and the plan, which must hold a graph to verify. A ``UsageError`` for the first thing
    wrong; else (the options, the plan's configuration, the checks to run)."""
    check_module(module)
    if not callable(make_inputs):
        raise UsageError(
            f"make_inputs must be a callable (num_tokens, num_reqs) -> dict of inputs; got {type(make_inputs).__name__}"
        )
    return check_keywords(config, options, keywords, where)


def check_keywords(
    config: CaptureConfig | Mapping[str, Any] | None,
    options: VerifyOptions | None,
    keywords: Mapping[str, Any],
    where: str = "verify()",
) -> tuple[VerifyOptions, CaptureConfig, list[Check]]:
    """``verify``'s keywords checked (``check_arguments`` without the module): what a launcher of
    ``verify`` elsewhere (``verify_distributed``'s ranks) checks before it starts anything."""
    if options is not None and not isinstance(options, VerifyOptions):
        raise UsageError(f"options must be a pytest_cudagraph.VerifyOptions; got {type(options).__name__}")
    config_keywords, given = split_keywords(keywords, where)
    opts = dataclasses.replace(options or VerifyOptions(), **given)
    registry = registry_with(opts.extra_checks)
    selected = [registry[n] for n in registry.select(opts.checks)]
    plan_config = capture_config(config, config_keywords)
    plan = CapturePlan(plan_config)
    if not plan.descriptors:
        raise UsageError(f"{_nothing_planned(plan_config)}: nothing would be captured or verified")
    if opts.descriptors is not None:
        labels = [d.label() for d in plan.capture_order]
        unknown = [label for label in opts.descriptors if label not in labels]
        if unknown:
            raise UsageError(
                f"descriptors {unknown} are not in the plan; its descriptors are {', '.join(labels)}"
            )
    if opts.batches is not None and all(plan.dispatch_batch(b).mode.name == "NONE" for b in opts.batches):
        # Every check that runs real batches would have none, and pass having seen nothing.
        raise UsageError(
            f"none of the {len(opts.batches)} batches given is served by a graph of the plan (each runs "
            f"eagerly: {plan.dispatch_batch(opts.batches[0]).mode.name} for {opts.batches[0]}), so no check "
            "would run a real batch through a graph; give capture sizes that serve the trace's batches"
        )
    return opts, plan_config, selected


def _nothing_planned(config: CaptureConfig) -> str:
    """Why a configuration plans no graph, in words."""
    said = (
        f"the plan {config.mode.name} at capture_sizes {list(config.capture_sizes)} (max_num_reqs "
        f"{config.max_num_reqs}, decode_query_len {config.decode_query_len}) holds no graph"
    )
    if config.mode.name == "NONE":
        return f"{said}: mode NONE runs every batch eagerly; give FULL, PIECEWISE or a split mode"
    return (
        f"{said}: no capture size is a uniform decode batch (a multiple of decode_query_len, at most "
        "max_num_reqs requests); give sizes such as "
        f"{[config.decode_query_len * k for k in (1, 2, 4)]}"
    )


def verify_signature() -> inspect.Signature:
    """``verify``'s signature as help() and IDEs show it: every option and config field by name."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="torch.nn.Module"),
        inspect.Parameter(
            "make_inputs",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation="Callable[[int, int], Mapping[str, Any]]",
        ),
        inspect.Parameter(
            "config", keyword, default=None, annotation="CaptureConfig | Mapping[str, Any] | None"
        ),
        inspect.Parameter("options", keyword, default=None, annotation="VerifyOptions | None"),
        *(
            inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
            for f in dataclasses.fields(VerifyOptions)
        ),
        inspect.Parameter("config_keywords", inspect.Parameter.VAR_KEYWORD),
    ]
    return inspect.Signature(params, return_annotation="VerifyReport")
