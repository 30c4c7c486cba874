"""The plugin's settings, resolved in one place.

Precedence, highest first: keywords given to the fixture call, keywords of the
closest ``@pytest.mark.cudagraph(...)`` marker (a function's marker beats its
class's, which beats its module's), the command-line option, the ini value,
the default. A keyword given as ``None`` counts as not given.

Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest

from .. import environment
from ..files import check_output_path
from ..options import BACKENDS, RUN_SETTINGS, VerifyOptions, concrete_backend
from ..plan.batch import Batch
from ..plan.config import CaptureConfig
from ..plan.modes import GraphMode
from ..plan.validate import UsageError, check_keywords, unknown_keyword
from .option_table import (
    OWN_OPTIONS,
    OwnOption,
    add_options,
    option_name,
    parse_backend,
    parse_sizes,
    run_default,
    verify_option,
)

__all__ = [
    "BACKENDS",
    "MARKER_ERROR_KEY",
    "MARKER_KEYWORDS",
    "MARKER_SIGNATURE",
    "OWN_OPTIONS",
    "VERIFY_KEYWORDS",
    "OwnOption",
    "Settings",
    "add_options",
    "check_environment",
    "check_keywords",
    "check_report_path",
    "check_session",
    "concrete_backend",
    "marker_keywords",
    "option_name",
    "parse_backend",
    "parse_sizes",
    "resolve",
    "session_settings",
    "verify_keywords",
    "verify_option",
]


def _shown_default(value: object) -> str:
    """A config field's default as the marker's signature shows it: a required
    field as None (the plugin's options fill it), the mode by its name."""
    if value is MISSING:
        return "None"
    if isinstance(value, GraphMode):
        return repr(value.name)
    return repr(value)


#: ``CaptureConfig``'s keywords: the part of the marker's that sets the plan.
CONFIG_KEYWORDS: tuple[str, ...] = CaptureConfig.field_names()
#: The marker's keywords and the defaults it shows: ``CaptureConfig``'s fields
#: (the plan), then ``VerifyOptions``'s (how it runs) except the run's own
#: settings (``exhaustive``: ``--cudagraph-verify``). ``capture_sizes=None``
#: means "from --cudagraph-sizes / ini cudagraph_sizes".
_MARKER_DEFAULTS: tuple[tuple[str, str], ...] = (
    *((name, _shown_default(CaptureConfig.defaults().get(name, MISSING))) for name in CONFIG_KEYWORDS),
    *(
        (name, _shown_default(value))
        for name, value in VerifyOptions.defaults().items()
        if name not in RUN_SETTINGS
    ),
)
MARKER_KEYWORDS: tuple[str, ...] = tuple(name for name, _ in _MARKER_DEFAULTS)
#: Keywords the ``cudagraph_verify`` fixture takes: the marker's and the run's (``exhaustive``).
VERIFY_KEYWORDS: tuple[str, ...] = (*MARKER_KEYWORDS, *RUN_SETTINGS)
#: On an xdist worker, a malformed marker's message: the test errors with it at
#: set-up (a UsageError raised while a worker collects crashes the worker).
MARKER_ERROR_KEY = pytest.StashKey[str]()
#: The ``VerifyOptions`` fields a marker may give (validated by ``VerifyOptions`` itself).
_VERIFY_FIELDS = frozenset(VerifyOptions.field_names())
MARKER_SIGNATURE = "cudagraph(*, " + ", ".join(f"{n}={d}" for n, d in _MARKER_DEFAULTS) + ")"


@dataclass(frozen=True)
class Settings:
    """Run settings (option > ini > default), or one test's (see ``resolve``).

    ``options``: the ``VerifyOptions`` fields a whole run sets (``VerifyOptions.run_options()``:
    ``exhaustive`` from ``--cudagraph-verify``, ``backend``, ``checks``, ``nonfinite_padding``), by
    field name, each holding its value; the rest are the plugin's own. ``sizes``: capture sizes
    that replace the tests' own (None: each test's). ``report``: where the JSON report goes.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    sizes: tuple[int, ...] | None = None
    report: Path | None = None
    bench_report: Path | None = None
    #: CUDA device indices workers take in turn (None: every visible device).
    devices: tuple[int, ...] | None = None
    #: Seconds a rank of a distributed verification may take (None: the call's timeout, else 120).
    rank_timeout: float | None = None
    #: Under a launcher, every rank prints (by default rank 0 only).
    all_ranks: bool = False
    #: "test": one item per verification; "descriptor": one per descriptor.
    split: str = "test"
    #: Ranks of distributed verifications that do not set world_size (None: they must).
    world_size: int | None = None
    #: A trace of real batches (--cudagraph-trace): verifications run its shapes.
    trace: Path | None = None
    #: The trace's distinct batch shapes, read once for the session.
    trace_shapes: tuple[Batch, ...] | None = field(default=None, repr=False, compare=False)
    #: Each test that uses the plugin runs in a child process of its own.
    isolate: bool = False
    #: Seconds an isolated child may run (None: pytest-timeout's, if any, else no limit).
    isolate_timeout: float | None = None
    #: A verification's progress on the terminal: "auto", "on" or "off" (--cudagraph-progress).
    progress: str = "auto"
    #: JSON reports of earlier runs to compare this one with (--cudagraph-compare): one, or several
    #: of the same code, whose spread is each figure's run-to-run noise.
    compare: tuple[Path, ...] | None = None
    #: A figure moved only when it changed by this fraction or more (--cudagraph-compare-threshold).
    compare_threshold: float | None = None
    #: Fail the run when the comparison finds a new failure.
    compare_fail: bool = False

    @property
    def verify(self) -> bool:
        """Exhaustive mode (every descriptor and every check) instead of quick mode."""
        return bool(self.options.get("exhaustive", False))

    @property
    def backend(self) -> str:
        """'auto', 'cuda' or 'emulate'."""
        return str(self.options.get("backend", "auto"))

    def to_dict(self) -> dict[str, Any]:
        """The JSON report's record: each run option under its option's name, then the plugin's own."""
        record: dict[str, Any] = {
            option_name(name, option): _plain(self.options.get(name, run_default(name, default)))
            for name, option, default in VerifyOptions.run_options()
        }
        for own in OWN_OPTIONS:
            record[own.name] = _plain(getattr(self, own.name))
        return record


def _plain(value: Any) -> Any:
    """A setting as JSON holds it: paths as strings, tuples as lists."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def rank_devices(
    worker: str | None, devices: tuple[int, ...] | None, count: int, world_size: int
) -> list[int]:
    """The CUDA devices of one distributed verification's ranks: ``world_size``
    consecutive devices of ``devices`` (every visible device by default), the
    block of xdist worker ``gw<N>`` being the N-th, round robin."""
    pool = devices if devices is not None else tuple(range(count))
    blocks = max(1, len(pool) // world_size)
    match = re.fullmatch(r"gw(\d+)", worker or "")
    block = (int(match.group(1)) if match else 0) % blocks
    return list(pool[block * world_size : (block + 1) * world_size])


def worker_device_index(worker: str | None, devices: tuple[int, ...] | None, count: int) -> int | None:
    """The CUDA device an xdist worker uses: ``gw<N>`` takes the N-th of ``devices``
    (every visible device by default), round robin. None without xdist and without
    ``devices`` (the current device stays), or without a device."""
    pool = devices if devices is not None else tuple(range(count))
    if not pool:
        return None
    if worker is None:
        return pool[0] if devices is not None else None
    match = re.fullmatch(r"gw(\d+)", worker)
    number = int(match.group(1)) if match else 0
    return pool[number % len(pool)]


def _ini_bool(config: pytest.Config, name: str) -> bool:
    try:
        return bool(config.getini(name))
    except (ValueError, pytest.UsageError) as exc:  # pytest 9 raises UsageError, without the key
        raise pytest.UsageError(f"ini option {name}: expected true or false; {exc}") from None


def _ini_str(config: pytest.Config, name: str) -> str | None:
    value = config.getini(name)
    text = str(value).strip() if value is not None else ""
    return text or None


_T = TypeVar("_T")


def _option_or_ini(config: pytest.Config, name: str, parse: Callable[[object, str], _T]) -> _T | None:
    """``--cudagraph-NAME``, else ini ``cudagraph_NAME``, parsed; None when neither is set."""
    option = config.getoption(f"cudagraph_{name}", default=None)
    if option is not None:
        return parse(option, f"--cudagraph-{name.replace('_', '-')}")
    ini = _ini_str(config, f"cudagraph_{name}")
    if ini is not None:
        return parse(ini, f"ini option cudagraph_{name}")
    return None


def session_settings(config: pytest.Config) -> Settings:
    """The run's settings: command-line option > ini value > default, each read as its table
    entry says (``VerifyOptions.run_options()``, then ``OWN_OPTIONS``).

    Relative report paths are taken from the invocation directory (option) or
    the ini file's directory (ini), as pytest does for its own paths.
    """
    options: dict[str, Any] = {}
    for name, option, default in VerifyOptions.run_options():
        flag = option_name(name, option)
        if option.metavar is None:
            options[name] = _flag(config, f"cudagraph_{flag}")
        else:
            given = _option_or_ini(config, flag, partial(verify_option, name))
            options[name] = run_default(name, default) if given is None else given
    own: dict[str, Any] = {}
    for entry in OWN_OPTIONS:
        if entry.kind == "flag":
            own[entry.name] = _flag(config, f"cudagraph_{entry.name}")
        elif entry.kind == "path":
            own[entry.name] = _path(config, f"cudagraph_{entry.name}")
        elif entry.kind == "paths":
            own[entry.name] = _paths(config, f"cudagraph_{entry.name}")
        else:
            assert entry.parse is not None
            value = _option_or_ini(config, entry.name, entry.parse)
            if value is not None:
                own[entry.name] = value
    trace = own.get("trace")
    return Settings(
        options=options,
        trace_shapes=read_trace_shapes(trace, config) if trace is not None else None,
        **own,
    )


def _flag(config: pytest.Config, name: str) -> bool:
    """A store_true option (None when not given), else its ini twin."""
    option = config.getoption(name, default=None)
    return bool(option) if option is not None else _ini_bool(config, name)


def read_trace_shapes(path: Path, config: pytest.Config) -> tuple[Batch, ...]:
    """The distinct batch shapes of the trace at ``path``; a trace that cannot be read is a UsageError."""
    from ..plan.trace import TraceError, read_trace

    source = (
        "--cudagraph-trace"
        if config.getoption("cudagraph_trace", default=None)
        else "ini option cudagraph_trace"
    )
    try:
        return tuple(read_trace(path).shapes)
    except TraceError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None


def _empty_path(name: str) -> pytest.UsageError:
    """The usage error of a path option given empty (``--cudagraph-report=``): it would write nothing."""
    flag = "--" + name.replace("_", "-")
    return pytest.UsageError(
        f"{flag}: an empty path; give a file path, such as {flag}=out.json, or leave it out"
    )


def _path(config: pytest.Config, name: str) -> Path | None:
    """A path option: from the invocation directory (option) or the ini file's (ini)."""
    option = config.getoption(name, default=None)
    ini = _ini_str(config, name)
    if option is not None and not str(option).strip():
        raise _empty_path(name)
    if option:
        return Path(config.invocation_params.dir, option)
    if ini:
        base = config.inipath.parent if config.inipath is not None else config.rootpath
        return base / ini
    return None


def _paths(config: pytest.Config, name: str) -> tuple[Path, ...] | None:
    """A comma-separated list of paths, each taken as ``_path`` takes one; None when not set."""
    option = config.getoption(name, default=None)
    if option is not None and not any(part.strip() for part in str(option).split(",")):
        raise _empty_path(name)
    text = option if option else _ini_str(config, name)
    if not text:
        return None
    base = (
        config.invocation_params.dir
        if option
        else config.inipath.parent
        if config.inipath is not None
        else config.rootpath
    )
    return tuple(base / part.strip() for part in str(text).split(",") if part.strip()) or None


def check_report_path(path: Path, source: str) -> None:
    """UsageError naming ``source`` unless ``path`` can be written at the session's end.

    Tried, not guessed from permission bits (root passes ``os.access`` where
    the file system still refuses, as in ``/proc``): the folders are made (the
    report would make them anyway), a scratch file is created and removed
    beside the report, and an existing report is opened for appending, which
    leaves it as it is.
    """
    import tempfile

    try:
        check_output_path(path)
    except UsageError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise pytest.UsageError(
            f"{source}: cannot create {path}: {parent} is a file, not a folder; give a path you can write"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".cudagraph-check-"):
            pass
        if path.exists():
            with path.open("a"):
                pass
    except OSError as exc:
        raise pytest.UsageError(
            f"{source}: cannot write {path} ({exc.strerror or exc}); give a path you can write"
        ) from None


def check_environment() -> None:
    """Every environment variable the package reads (``pytest_cudagraph.environment``), read once
    when pytest starts: one it cannot read stops the run (exit 4) before anything is collected."""
    try:
        environment.check_all()
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None


def check_session(run: Settings, config: pytest.Config) -> None:
    """Usage errors a run's settings can only show once it starts (before any test runs).

    Report paths must be writable, and ``--cudagraph-backend=cuda`` (or the
    ini value) needs CUDA here: asking for real graphs where there are none is
    a mistake to tell once, not in every test. (A marker's ``backend='cuda'``
    concerns one test: that test fails, or skips under ``@pytest.mark.cuda``.)
    """
    if run.report is not None:
        check_report_path(run.report, _source(config, "cudagraph_report"))
    if run.bench_report is not None:
        source = _source(config, "cudagraph_bench_report")
        check_report_path(run.bench_report, source)
        try:  # its plot beside it, PATH.png: written only where nothing else is
            check_output_path(run.bench_report.with_suffix(".png"))
        except UsageError as exc:
            raise pytest.UsageError(f"{source}: its plot {exc}") from None
    if run.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(
                f"{_source(config, 'cudagraph_backend')}: cuda asks for real CUDA graphs, but "
                "torch.cuda.is_available() is False here (no GPU, or a CPU build of torch); use "
                "--cudagraph-backend=auto (CUDA where available, the CPU emulator elsewhere) or emulate"
            )


def compare_baseline(run: Settings, config: pytest.Config) -> list[dict[str, Any]] | None:
    """The reports --cudagraph-compare (or its ini) names, read once when the session starts;
    UsageError when one cannot be read as a finished run's report."""
    if run.compare is None:
        return None
    from .compare_report import load_baseline

    source = _source(config, "cudagraph_compare")
    return [load_baseline(path, source) for path in run.compare]


def _source(config: pytest.Config, name: str) -> str:
    """``--cudagraph-x`` or ``ini option cudagraph_x``: where a setting came from."""
    if config.getoption(name, default=None) is not None:
        return "--" + name.replace("_", "-")
    return f"ini option {name}"


# -- the marker ------------------------------------------------------------
def _check_marker(mark: pytest.Mark, nodeid: str) -> None:
    """The marker's keywords checked as ``verify()`` checks its own: the plan by ``CaptureConfig``,
    the rest by ``VerifyOptions``, in one place each; ``pytest.UsageError`` naming the marker."""
    where = f"@pytest.mark.cudagraph on {nodeid}"
    if mark.args:
        raise pytest.UsageError(
            f"{where}: takes keywords only, got positional argument(s) {mark.args!r}; "
            f"the signature is {MARKER_SIGNATURE}"
        )
    for name in mark.kwargs:
        if name not in MARKER_KEYWORDS:
            raise pytest.UsageError(f"{where}: {unknown_keyword(name, MARKER_KEYWORDS, 'the marker')}")
    given = {name: value for name, value in mark.kwargs.items() if value is not None}
    plan = {name: value for name, value in given.items() if name in CONFIG_KEYWORDS}
    if "capture_sizes" in plan:
        plan["capture_sizes"] = parse_sizes(plan["capture_sizes"], f"{where}: capture_sizes")
    else:
        # The sizes come from the run (--cudagraph-sizes) or the call: the rest of the plan is checked
        # with a stand-in, and the bound that depends on the sizes is left to the call.
        plan["capture_sizes"] = (1,)
        plan.pop("max_capture_size", None)
    plan.setdefault("max_num_reqs", max(plan["capture_sizes"]))
    try:
        CaptureConfig(**plan)
        VerifyOptions(**{name: value for name, value in given.items() if name in _VERIFY_FIELDS})
    except UsageError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None


def marker_keywords(item: pytest.Item) -> dict[str, Any]:
    """The ``cudagraph`` markers' keywords on ``item``, the closest marker winning per keyword.

    Raises ``pytest.UsageError`` on positional arguments, an unknown keyword, a
    malformed ``capture_sizes`` or a value ``VerifyOptions`` refuses.
    """
    merged: dict[str, Any] = {}
    for mark in reversed(list(item.iter_markers("cudagraph"))):  # farthest first
        _check_marker(mark, item.nodeid)
        merged.update(mark.kwargs)
    return merged


# -- per-test resolution ---------------------------------------------------
def _given(keywords: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (keywords or {}).items() if v is not None}


def _for_test(parse: Callable[[object, str], _T], value: object, source: str) -> _T:
    """``parse(value, source)``, its ``pytest.UsageError`` (a session's) raised as the package's
    ``UsageError``: the test's, which the fixtures fail it with in one line."""
    try:
        return parse(value, source)
    except pytest.UsageError as exc:
        raise UsageError(str(exc)) from None


def resolve(
    run: Settings, marker: Mapping[str, Any] | None = None, call: Mapping[str, Any] | None = None
) -> Settings:
    """One test's settings: ``call`` keywords > ``marker`` keywords > ``run`` (option > ini > default).

    ``capture_sizes`` sets ``sizes``; each ``VerifyOptions`` field a run sets (``backend``,
    ``checks``, ``nonfinite_padding``, and, from a call only, ``exhaustive``) sets its own, checked
    by ``VerifyOptions``. A bad value is the test's error (``UsageError``), not the session's.
    """
    chosen = {**_given(marker), **_given(call)}
    options = dict(run.options)
    for name, _option, _default in VerifyOptions.run_options():
        if name in chosen:
            options[name] = _for_test(partial(verify_option, name), chosen[name], name)
    sizes = run.sizes
    if "capture_sizes" in chosen:
        # A list, a tuple or a string "1,2,4" alike (never character by character).
        sizes = _for_test(parse_sizes, chosen["capture_sizes"], "capture_sizes")
    return replace(run, options=options, sizes=sizes)


def verify_keywords(
    run: Settings, marker: Mapping[str, Any] | None = None, call: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``verify()``'s keywords for one call, by the precedence of ``resolve``.

    Keywords given as None are dropped (``verify``'s defaults apply);
    ``capture_sizes`` is absent when no level gives it.
    """
    test = resolve(run, marker, call)
    keywords = {**_given(marker), **_given(call)}
    keywords.update({name: value for name, value in test.options.items() if value is not None})
    if run.trace_shapes is not None and "batches" not in keywords:
        keywords["batches"] = run.trace_shapes
    if test.sizes is not None:
        keywords["capture_sizes"] = test.sizes
    return keywords


# -- splitting a verification by descriptor ---------------------------------


def split_labels(run: Settings, marker: Mapping[str, Any]) -> list[str] | None:
    """The descriptor labels a test is split into under ``--cudagraph-split=descriptor``.

    Known at collection only when the marker (or ``--cudagraph-sizes``) sets
    the plan; None otherwise, and the test stays one item. Plan errors are
    left for the test to report.
    """
    from ..plan import CaptureConfig, CapturePlan
    from ..plan.selection import select_descriptors

    keywords = verify_keywords(run, marker, None)
    if "capture_sizes" not in keywords:
        return None
    config = {k: v for k, v in keywords.items() if k in CONFIG_KEYWORDS}
    config.setdefault("max_num_reqs", max(config["capture_sizes"]))
    try:
        plan = CapturePlan(CaptureConfig(**config))
    except (TypeError, ValueError):
        return None
    wanted = marker.get("descriptors")
    if wanted is not None:
        # Named descriptors are verified whatever the quick selection says.
        wanted = {wanted} if isinstance(wanted, str) else set(wanted)
        labels = [d.label() for d in plan.capture_order if d.label() in wanted]
    else:
        labels = [
            d.label() for d in select_descriptors(plan.capture_order, exhaustive=bool(keywords["exhaustive"]))
        ]
    return labels or None
