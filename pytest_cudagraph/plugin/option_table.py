"""The plugin's options: what each one is, how its value is read and checked, and how pytest
is told of it (``add_options``: ``--cudagraph-<name>`` and the ini key ``cudagraph_<name>``, from
one table). The ``verify()`` keywords a whole run sets come from ``VerifyOptions.run_options()``,
with their help and their validation (``verify_option``); the plugin's own settings from
``OWN_OPTIONS``. Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal

import pytest

from ..options import MAX_SECONDS, MAX_WORLD_SIZE, RunOption, VerifyOptions
from ..plan.config import MAX_CAPTURE_TOKENS
from ..plan.validate import MAX_ITEMS, UsageError, short, text_items

__all__ = [
    "MAX_DEVICE_INDEX",
    "OWN_OPTIONS",
    "SPLITS",
    "OwnOption",
    "add_options",
    "option_name",
    "parse_backend",
    "parse_devices",
    "parse_progress",
    "parse_seconds",
    "parse_sizes",
    "parse_split",
    "parse_threshold",
    "parse_world_size",
    "run_default",
    "verify_option",
]


def option_name(name: str, option: RunOption) -> str:
    """A run option's name, ``verify`` for the field ``exhaustive``: ``--cudagraph-verify``."""
    return option.name or name


def run_default(name: str, default: Any) -> Any:
    """What a run option is when neither the command line nor the ini file gives it: a flag is off
    (``exhaustive``: quick mode), anything else the field's default."""
    return False if isinstance(default, bool) else default


def parse_backend(value: object, source: str) -> str:
    """'auto', 'cuda' or 'emulate' (case-insensitive), by ``VerifyOptions``' own validation;
    UsageError naming ``source`` otherwise."""
    return str(verify_option("backend", value, source))


def parse_sizes(value: object, source: str) -> tuple[int, ...]:
    """Capture sizes from '1,2,4' (commas and/or spaces) or an iterable of ints.

    Returns them sorted and without repeats; UsageError naming ``source`` when
    a size is not a whole number from 1 to ``MAX_CAPTURE_TOKENS``, or none is given (at most
    ``MAX_ITEMS`` are read: an endless range is refused, never materialised).
    """
    expected = "expected a comma-separated list of token counts >= 1, such as 1,2,4,8"
    if isinstance(value, str):
        items: list[object] = text_items(value)
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, Mapping)):
        items = list(islice(value, MAX_ITEMS + 1))
    else:
        raise pytest.UsageError(f"{source}: {expected}; got {short(value)}")
    if len(items) > MAX_ITEMS:
        raise pytest.UsageError(f"{source}: {expected}; got more than {MAX_ITEMS} sizes")
    sizes: list[int] = []
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool):
            raise pytest.UsageError(
                f"{source}: {expected}; got {short(value)} ({short(item)} is not a whole number)"
            )
        if item < 1:
            raise pytest.UsageError(f"{source}: {expected}; got {short(value)} ({item} is less than 1)")
        if item > MAX_CAPTURE_TOKENS:
            raise pytest.UsageError(
                f"{source}: {expected}; got {short(value)} ({item} is more than {MAX_CAPTURE_TOKENS}, far beyond "
                "any device)"
            )
        sizes.append(item)
    if not sizes:
        raise pytest.UsageError(f"{source}: {expected}; got {short(value)} (no size)")
    return tuple(sorted(set(sizes)))


SPLITS = ("test", "descriptor")


def verify_option(name: str, value: object, source: str) -> Any:
    """``value`` for the ``VerifyOptions`` field ``name``, as its own validation takes it and
    normalises it ('Emulate ' -> 'emulate', 'a,-b' -> ('a', '-b')); UsageError naming ``source``
    with its words otherwise."""
    given: dict[str, Any] = {name: value}
    try:
        return getattr(VerifyOptions(**given), name)
    except UsageError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None


#: The largest CUDA device index a setting may name.
MAX_DEVICE_INDEX = 1023


def _positive(text: str, value: object, source: str, expected: str, maximum: float = math.inf) -> float:
    """``text`` as a finite number above 0 (at most ``maximum``); UsageError naming ``source`` and
    ``value`` otherwise."""
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if not 0 < number <= maximum or not math.isfinite(number):
        raise pytest.UsageError(f"{source}: expected {expected}; got {short(value)}")
    return number


def parse_seconds(value: object, source: str) -> float:
    """A positive number of seconds, at most ``MAX_SECONDS``; UsageError naming ``source`` otherwise."""
    expected = f"a positive number of seconds up to {MAX_SECONDS:.0f} (a week), such as 600"
    return _positive(str(value).strip(), value, source, expected, MAX_SECONDS)


def parse_devices(value: object, source: str) -> tuple[int, ...]:
    """CUDA device indices from '0,1' (commas and/or spaces); UsageError naming ``source`` otherwise."""
    expected = (
        f"expected a comma-separated list of CUDA device indices from 0 to {MAX_DEVICE_INDEX}, such as 0,1"
    )
    items = [p for p in re.split(r"[,\s]+", str(value).strip()) if p] if isinstance(value, str) else None
    if not items or not all(re.fullmatch(r"\d{1,4}", p) and int(p) <= MAX_DEVICE_INDEX for p in items):
        raise pytest.UsageError(f"{source}: {expected}; got {short(value)}")
    devices = tuple(int(p) for p in items)
    if len(set(devices)) != len(devices):
        raise pytest.UsageError(f"{source}: {expected}, each once; got {value!r}")
    return devices


def parse_world_size(value: object, source: str) -> int:
    """A positive number of ranks, at most ``MAX_WORLD_SIZE``; UsageError naming ``source`` otherwise."""
    text = str(value).strip()
    if not re.fullmatch(r"\d{1,9}", text) or not 1 <= int(text) <= MAX_WORLD_SIZE:
        raise pytest.UsageError(
            f"{source}: expected a number of ranks from 1 to {MAX_WORLD_SIZE}, such as 2; got {short(value)}"
        )
    return int(text)


def _one_of(choices: tuple[str, ...], value: object, source: str) -> str:
    """``value`` (case-insensitive, spaces around it dropped) when it is one of ``choices``;
    UsageError naming ``source`` otherwise."""
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in choices:
        raise pytest.UsageError(f"{source}: expected one of {', '.join(choices)}; got {short(value)}")
    return str(text)


def parse_split(value: object, source: str) -> str:
    return _one_of(SPLITS, value, source)


PROGRESS = ("auto", "on", "off")


def parse_progress(value: object, source: str) -> str:
    return _one_of(PROGRESS, value, source)


def parse_threshold(value: object, source: str) -> float:
    """A fraction above 0 from '0.25' or '25%'; UsageError naming ``source`` otherwise."""
    text = str(value).strip()
    percent = text.endswith("%")
    expected = "a fraction of the kept value above 0, such as 0.25 or 25%"
    number = _positive(text[:-1] if percent else text, value, source, expected)
    return number / 100 if percent else number


@dataclass(frozen=True)
class OwnOption:
    """A setting of the plugin's own (not a ``verify()`` keyword): ``--cudagraph-<name>`` (``-`` for
    ``_``) and the ini key ``cudagraph_<name>``, read into ``Settings.<name>``."""

    name: str
    #: "flag" (store_true; a bool ini), "path" (relative to where it was given), "paths" (several,
    #: comma-separated), or "value" (``parse``).
    kind: Literal["flag", "path", "paths", "value"]
    help: str
    #: What the ini key holds, for ``--help``.
    ini_help: str
    metavar: str | None = None
    parse: Callable[[object, str], Any] | None = None


OWN_OPTIONS: tuple[OwnOption, ...] = (
    OwnOption(
        "sizes",
        "value",
        "capture sizes (token counts) for every test that does not set its own capture_sizes (marker or fixture "
        "keyword)",
        "capture sizes, such as 1,2,4,8",
        "1,2,4,...",
        parse_sizes,
    ),
    OwnOption(
        "report",
        "path",
        "write a JSON report of every test that used the plugin (descriptors, check outcomes, figures) keyed by "
        "test nodeid, with the settings",
        "path of the JSON report, relative to the ini file",
        "PATH",
    ),
    OwnOption(
        "bench_report",
        "path",
        "write the cudagraph_benchmark results as a Markdown table fit for a CI job summary (and PATH.png, "
        "speedup against tokens, when matplotlib is installed)",
        "path of the Markdown benchmark report",
        "PATH.md",
    ),
    OwnOption(
        "devices",
        "value",
        "CUDA devices for pytest-xdist workers: worker gw<N> uses the N-th (round robin); default every visible "
        "device. Without xdist the first is used",
        "CUDA devices for xdist workers, such as 0,1",
        "0,1,...",
        parse_devices,
    ),
    OwnOption(
        "world_size",
        "value",
        "ranks of cudagraph_verify_distributed calls that do not set world_size (one process a rank; on CUDA one "
        "GPU a rank: under pytest-xdist worker gw<K> takes N consecutive devices of --cudagraph-devices)",
        "ranks of distributed verifications",
        "N",
        parse_world_size,
    ),
    OwnOption(
        "rank_timeout",
        "value",
        "seconds each rank of a distributed verification may take (ranks spawned here, or those torchrun or srun "
        "started): a rank still running after it is named with the collective it waits in, and no rank waits "
        "longer. Default 120, or the call's timeout=",
        "seconds a rank may take",
        "SECONDS",
        parse_seconds,
    ),
    OwnOption(
        "all_ranks",
        "flag",
        "under torchrun or srun, every rank prints its terminal output (by default only rank 0 does, with every "
        "rank's findings, and only rank 0 writes --junitxml and --cudagraph-report)",
        "every rank prints",
    ),
    OwnOption(
        "split",
        "value",
        "test: one item per cudagraph_verify test (default); descriptor: one item per descriptor of tests whose "
        "marker (or --cudagraph-sizes) sets the capture sizes, so that pytest-xdist spreads one model's "
        "descriptors over workers",
        "test or descriptor",
        "test|descriptor",
        parse_split,
    ),
    OwnOption(
        "trace",
        "path",
        "a trace of real batches (JSON Lines or CSV, one batch a line: num_tokens, num_reqs, ...; see "
        "cudagraph-plan): verifications run its distinct shapes as their real batches, and the dispatch check "
        "holds each to the dispatch properties",
        "trace of real batches, relative to the ini file",
        "PATH",
    ),
    OwnOption(
        "isolate",
        "flag",
        "run each test that uses the plugin in a child process of its own, so that a fault that takes the CUDA "
        "context down (a device-side assert, an illegal address) costs that test only",
        "each plugin test in a child process",
    ),
    OwnOption(
        "isolate_timeout",
        "value",
        "with --cudagraph-isolate: a child still running after SECONDS is killed (with its process group) and its "
        "test fails, naming the phase it hung in. Default: pytest-timeout's timeout for the test (its marker, "
        "--timeout or ini timeout) plus 30 s, where pytest-timeout is installed; else none",
        "seconds before an isolated child is killed",
        "SECONDS",
        parse_seconds,
    ),
    OwnOption(
        "progress",
        "value",
        "a verification's stage and descriptor (k of n) on the terminal while it runs, past pytest's output capture "
        "and from pytest-xdist workers: auto (the default) shows it for a verification running longer than 2 s "
        "where the output is a terminal and not CI (the CI or BUILD_NUMBER environment variable) and not under -q; "
        "on always, from the first step (a line a stage and at most one every 10 s where the output is not a "
        "terminal); off never",
        "auto, on or off",
        "auto|on|off",
        parse_progress,
    ),
    OwnOption(
        "compare",
        "paths",
        "compare this run with the JSON report of an earlier one (--cudagraph-report), or several of the same "
        "code, comma-separated: the terminal summary lists what newly fails, what newly passes, then which "
        "figures (capture time, check time, peak and graph memory) moved beyond their run-to-run spread over the "
        "kept reports (and --cudagraph-compare-threshold); a timing of one kept report is judged only by the "
        "threshold",
        "JSON reports to compare the run with, comma-separated, relative to the ini file",
        "BASELINE.json[,...]",
    ),
    OwnOption(
        "compare_threshold",
        "value",
        "with --cudagraph-compare: a figure moved only when it changed by this fraction of its kept value or more "
        "(such as 0.5 or 50%%), besides lying beyond its run-to-run spread where several kept reports give one. "
        "Default: none for timings (one kept report: not judged), 10%% for memory",
        "fraction a figure must move by, such as 0.5",
        "FRACTION",
        parse_threshold,
    ),
    OwnOption(
        "compare_fail",
        "flag",
        "with --cudagraph-compare: fail the run (exit status 1) when a check or a test fails that did not fail in "
        "the baseline",
        "fail on a new failure",
    ),
)


def add_options(group: Any, parser: pytest.Parser) -> None:
    """Every ``--cudagraph-`` option and its ini twin, from the two tables: the ``verify()`` keywords a
    run sets (help and validation from ``VerifyOptions``), then the plugin's own."""
    entries: list[tuple[str, str | None, str, str]] = [  # (name, metavar or None for a flag, help, ini help)
        (option_name(name, option), option.metavar, option.help, option.help)
        # --cudagraph-verify first: the one a run is most often started with.
        for name, option, _ in sorted(VerifyOptions.run_options(), key=lambda o: o[0] != "exhaustive")
    ]
    entries += [
        (o.name, None if o.kind == "flag" else (o.metavar or o.name.upper()), o.help, o.ini_help)
        for o in OWN_OPTIONS
    ]
    for name, metavar, help_text, ini_help in entries:
        flag = "--cudagraph-" + name.replace("_", "-")
        key = f"cudagraph_{name}"
        if metavar is None:
            group.addoption(
                flag, action="store_true", default=None, dest=key, help=f"{help_text}. ini: {key}"
            )
            parser.addini(key, f"{ini_help} (as {flag})", type="bool", default=False)
        else:
            group.addoption(
                flag, action="store", default=None, dest=key, metavar=metavar, help=f"{help_text}. ini: {key}"
            )
            parser.addini(key, f"{ini_help} (as {flag})", default="")
