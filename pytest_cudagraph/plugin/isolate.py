"""``--cudagraph-isolate``: each test that uses the plugin runs in a child process of its own.

A fault that takes the process's CUDA context down (a device-side assert, an
illegal address, a crash in a kernel) costs the test that caused it only. The
parent runs ``python -m pytest <the test>`` with its own command-line options
(less those that select other tests, distribute them, or write reports: the
parent does that), with ``CHILD_ENV`` in the child's environment naming a file.
In the child, the plugin registers ``ChildReporter``, which appends each phase's
report, serialised by pytest, to that file, one JSON line a report, flushed as
it goes. The parent logs the child's reports as its own, so the terminal, the
exit status, the JSON report (the records travel on the reports), junitxml and
pytest-xdist see the test as if it had run in the parent. A child that ended
without reporting every phase (killed by a signal, ``os._exit``, a crash in C)
makes a failed report naming its exit code or signal, with the end of its
output; the test is never left unreported.

How the child finds the same configuration: its working directory is the
parent's invocation directory, it gets ``--rootdir`` and ``-c`` with the
parent's rootdir and ini file, and the ini ``addopts`` and ``PYTEST_ADDOPTS``
are filtered like the command line and passed on it (the child's own reading
of them is turned off). The plugin reaches the child the way it reached the
parent (entry point, ``-p``, ``PYTEST_PLUGINS``, a conftest's
``pytest_plugins``); it is not added with ``-p``, which would register it twice
where its entry point is installed.

Pure Python: importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from . import report as pytest_report

__all__ = [
    "CHILD_ENV",
    "DROPPED_FLAGS",
    "DROPPED_OPTIONS",
    "ChildReporter",
    "child_args",
    "filter_args",
    "in_child",
    "option_arities",
    "run_in_child",
]

#: Set in a child's environment to the file where it writes its reports (JSON Lines).
CHILD_ENV = "PYTEST_CUDAGRAPH_ISOLATED"

#: Options that do not reach the child, with their values: pytest-xdist's, report writers
#: (the parent writes the reports), the isolation itself, test selection from the cache,
#: stopping early (the parent counts the failures), and what the parent sets itself.
DROPPED_OPTIONS = frozenset(
    {
        # pytest-xdist
        "-n",
        "--numprocesses",
        "--dist",
        "--maxprocesses",
        "--max-worker-restart",
        "--tx",
        "-d",
        "--rsyncdir",
        "--rsyncignore",
        "--looponfail",
        "-f",
        "--px",
        # report writers
        "--cudagraph-report",
        "--cudagraph-bench-report",
        "--junitxml",
        "--junit-xml",
        "--junit-prefix",
        "--resultlog",
        "--result-log",
        "--report-log",
        "--reportlog",
        "--json-report-file",
        "--html",
        "--benchmark-json",
        "--benchmark-autosave",
        "--benchmark-save",
        "--benchmark-save-data",
        "--cov",
        "--cov-report",
        "--cov-config",
        "--cov-append",
        "--cov-fail-under",
        "--cov-context",
        # the isolation itself
        "--cudagraph-isolate",
        # cache / rerun selection, stopping early
        "--lf",
        "--last-failed",
        "--ff",
        "--failed-first",
        "--nf",
        "--new-first",
        "--sw",
        "--stepwise",
        "--sw-skip",
        "--stepwise-skip",
        "--sw-reset",
        "--stepwise-reset",
        "--lfnf",
        "--last-failed-no-failures",
        "--cache-clear",
        "--cache-show",
        "-x",
        "--exitfirst",
        "--maxfail",
        # set by the parent for the child
        "--rootdir",
        "-c",
        "--config-file",
        "--inifile",
        "--basetemp",
        # a debugger in a child whose stdin is closed quits at once
        "--pdb",
        "--trace",
        "--pdbcls",
    }
)
#: Flags (no value) among the dropped options, for when the parser cannot say.
DROPPED_FLAGS = frozenset(
    {
        "--cudagraph-isolate",
        "--lf",
        "--last-failed",
        "--ff",
        "--failed-first",
        "--nf",
        "--new-first",
        "--sw",
        "--stepwise",
        "--sw-skip",
        "--stepwise-skip",
        "--sw-reset",
        "--stepwise-reset",
        "--cache-clear",
        "-x",
        "--exitfirst",
        "-d",
        "--looponfail",
        "-f",
        "--benchmark-autosave",
        "--cov-append",
        "--json-report",
        "--no-cov",
        "--pdb",
        "--trace",
    }
)
#: Options whose value is optional (argparse ``nargs="?"``), for when the parser cannot say.
_OPTIONAL_VALUE = frozenset(
    {
        "--cov",
        "--lfnf",
        "--last-failed-no-failures",
        "--cache-show",
        "--benchmark-save-data",
        "--benchmark-json",
    }
)
#: Plugins named by ``-p`` that do not reach the child (xdist would distribute the child's one test).
_DROPPED_PLUGINS = frozenset({"xdist", "xdist.plugin", "xdist.looponfail"})
#: Lines of the child's output quoted in the report of a child that ended without reporting.
_TAIL_LINES = 20


# -- the child --------------------------------------------------------------
def in_child() -> bool:
    """Whether this process is a child started by ``--cudagraph-isolate``."""
    return bool(os.environ.get(CHILD_ENV))


class ChildReporter:
    """Registered in the child: appends each phase's report, serialised, to ``$CHILD_ENV``."""

    def __init__(self, config: pytest.Config, path: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.path = Path(path if path is not None else os.environ[CHILD_ENV])

    @pytest.hookimpl(trylast=True)  # after the plugin's own hooks have put their attributes on it
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        line = json.dumps(data, default=repr)
        with self.path.open("a", encoding="utf-8") as out:  # one line a report, flushed: survives a crash
            out.write(line + "\n")
            out.flush()


# -- the arguments the child gets -------------------------------------------
def option_arities(config: pytest.Config) -> dict[str, Any]:
    """``nargs`` of every option string pytest knows (``0`` for flags), from its argparse parser."""
    parser = getattr(getattr(config, "_parser", None), "optparser", None)
    actions = getattr(parser, "_option_string_actions", None)
    if not isinstance(actions, Mapping):
        return {}
    arities: dict[str, Any] = {}
    for name, action in actions.items():
        arities[str(name)] = action.nargs
    return arities


def _takes(name: str, arities: Mapping[str, Any]) -> Any:
    """``nargs`` of ``name``: 0 (a flag), None (one value), '?', '*', '+' or a count."""
    if name in arities:
        return arities[name]
    if name in DROPPED_FLAGS:
        return 0
    if name in _OPTIONAL_VALUE:
        return "?"
    if name in DROPPED_OPTIONS:
        return None
    return 0  # an option nobody registered: a flag (pytest would have refused it anyway)


def _is_option(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # a negative number is a value
    except ValueError:
        return True
    return False


def _units(args: Sequence[str], arities: Mapping[str, Any]) -> list[tuple[str | None, list[str]]]:
    """Split ``args`` as argparse would: (option string, its tokens) or (None, [positional])."""
    units: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            units.extend((None, [t]) for t in args[i:])
            break
        if not _is_option(token):
            units.append((None, [token]))
            continue
        if token.startswith("--"):
            name, sep, _ = token.partition("=")
            if sep:
                units.append((name, [token]))
                continue
            tokens = [token]
            nargs = _takes(name, arities)
            if nargs is None:
                tokens.extend(args[i : i + 1])
                i += len(tokens) - 1
            elif isinstance(nargs, int):
                tokens.extend(args[i : i + nargs])
                i += len(tokens) - 1
            elif nargs == "?":
                if i < len(args) and not _is_option(args[i]):
                    tokens.append(args[i])
                    i += 1
            else:  # '*' or '+'
                while i < len(args) and not _is_option(args[i]):
                    tokens.append(args[i])
                    i += 1
            units.append((name, tokens))
            continue
        # short options: "-x", "-n2", "-n 2", "-vx" (clustered flags), "-rA", "-p no:x"
        chars = token[1:]
        while chars:
            name = "-" + chars[0]
            rest = chars[1:]
            nargs = _takes(name, arities)
            if nargs == 0:
                units.append((name, [name]))
                chars = rest
                continue
            if rest:
                units.append((name, [name + rest]))
            elif nargs == "?":
                if i < len(args) and not _is_option(args[i]):
                    units.append((name, [name, args[i]]))
                    i += 1
                else:
                    units.append((name, [name]))
            else:
                units.append((name, [name, *args[i : i + 1]]))
                i += 1
            break
    return units


def _plugin_arg(tokens: Sequence[str]) -> str:
    return tokens[-1][2:] if len(tokens) == 1 else tokens[-1]


def filter_args(args: Sequence[str], arities: Mapping[str, Any] | None = None) -> list[str]:
    """``args`` without positional arguments (test paths, node ids) and without ``DROPPED_OPTIONS``."""
    arities = arities if arities is not None else {}
    kept: list[str] = []
    for name, tokens in _units(args, arities):
        if name is None or name in DROPPED_OPTIONS:
            continue
        if name == "-p" and _plugin_arg(tokens) in _DROPPED_PLUGINS:
            continue
        if name in ("-o", "--override-ini") and _override_name(tokens) in ("addopts", "cudagraph_isolate"):
            continue
        kept.extend(tokens)
    return kept


def _override_name(tokens: Sequence[str]) -> str:
    value = tokens[-1]
    if len(tokens) == 1:  # "-oname=value" or "--override-ini=name=value"
        value = value.split("=", 1)[1] if value.startswith("--") else value[2:]
    return value.split("=", 1)[0].strip()


def _target(item: pytest.Item) -> str:
    """The item's node id, with its file as an absolute path (the child resolves it from its cwd)."""
    _, sep, rest = item.nodeid.partition("::")
    return f"{item.path}{sep}{rest}" if sep else str(item.path)


def child_args(item: pytest.Item, basetemp: str | os.PathLike[str] | None = None) -> list[str]:
    """The child's command line after ``python -m pytest``: the parent's options, then the test."""
    config = item.config
    arities = option_arities(config)
    addopts = [str(a) for a in config.getini("addopts")]
    env_addopts = shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))
    given = [*addopts, *env_addopts, *(str(a) for a in config.invocation_params.args)]
    args = filter_args(given, arities)
    args += ["--rootdir", str(config.rootpath)]
    if config.inipath is not None:
        args += ["-c", str(config.inipath)]
    args += [
        "-o",
        "addopts=",
        "-o",
        "cudagraph_report=",
        "-o",
        "cudagraph_bench_report=",
        "-o",
        "cudagraph_isolate=false",
    ]
    if basetemp is not None:
        args += ["--basetemp", str(basetemp)]
    args += ["--", _target(item)]
    return args


# -- the parent -----------------------------------------------------------
def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by signal {-returncode} ({name})"
    return f"ended with exit code {returncode}"


def _tail(text: str, lines: int = _TAIL_LINES) -> list[str]:
    return text.rstrip("\n").splitlines()[-lines:] if text.strip() else []


def _failed_report(item: pytest.Item, when: str, message: str) -> pytest.TestReport:
    report = pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords=dict.fromkeys(item.keywords, 1),
        outcome="failed",
        longrepr=message,
        when=when,  # type: ignore[arg-type]
    )
    setattr(report, pytest_report.USED_ATTR, True)
    return report


def _passed_teardown(item: pytest.Item) -> pytest.TestReport:
    report = pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords=dict.fromkeys(item.keywords, 1),
        outcome="passed",
        longrepr=None,
        when="teardown",
    )
    setattr(report, pytest_report.USED_ATTR, True)
    return report


def _read_reports(config: pytest.Config, path: Path) -> list[pytest.TestReport]:
    reports: list[pytest.TestReport] = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return reports
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError:  # the last line, cut short by a crash
            continue
        if isinstance(data, dict) and isinstance(data.get("longrepr"), list):
            data["longrepr"] = tuple(data["longrepr"])  # a skip's (path, line, reason): JSON made it a list
        report = config.hook.pytest_report_from_serializable(config=config, data=data)
        if isinstance(report, pytest.TestReport):
            reports.append(report)
    return reports


def _missing_phase(reports: Iterable[pytest.TestReport]) -> str | None:
    """The phase the child did not report, or None when it reported through teardown."""
    by_phase = {r.when: r for r in reports}
    if "teardown" in by_phase:
        return None
    setup = by_phase.get("setup")
    if setup is None:
        return "setup"
    if setup.passed and "call" not in by_phase:
        return "call"
    return "teardown"


def _basetemp(config: pytest.Config) -> Path | None:
    """A fresh folder under the parent's basetemp for the child's (a child removes its basetemp first)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return None
    try:
        return Path(factory.mktemp("isolated", numbered=True))
    except OSError:
        return None


#: Beyond pytest-timeout's own limit, the time its handler in the child gets to report first.
_TIMEOUT_GRACE_S = 30.0


def child_timeout(item: pytest.Item) -> float | None:
    """Seconds the child of ``item`` may run: ``--cudagraph-isolate-timeout`` (or its ini), else
    pytest-timeout's timeout for the test (its marker, ``--timeout``, ini ``timeout``) plus
    ``_TIMEOUT_GRACE_S``, else None (no limit)."""
    own = pytest_report.run_state(item.config).settings.isolate_timeout
    if own is not None:
        return own
    seconds: Any = None
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        seconds = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    if seconds is None and item.config.pluginmanager.hasplugin("timeout"):
        seconds = item.config.getoption("timeout", default=None)
        if seconds is None:
            try:
                seconds = item.config.getini("timeout")
            except ValueError:
                seconds = None
    try:
        value = float(seconds) if seconds not in (None, "") else 0.0
    except (TypeError, ValueError):
        return None
    return value + _TIMEOUT_GRACE_S if value > 0 else None


def _run_child(
    command: list[str], cwd: Any, env: Mapping[str, str], limit: float | None
) -> tuple[int, str, str, bool]:
    """Run the child in a session of its own; past ``limit`` seconds kill its whole process group
    (a distributed test's ranks too). Returns the exit code, its output and whether it hung."""
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=limit)
            return child.returncode, stdout, stderr, False
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                child.kill()
            stdout, stderr = child.communicate()
            return child.returncode, stdout, stderr, True


def run_in_child(item: pytest.Item) -> None:
    """Run ``item`` in a child process and log its reports as this process's."""
    config = item.config
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    fd, name = tempfile.mkstemp(prefix="cudagraph-isolate-", suffix=".jsonl")
    os.close(fd)
    path = Path(name)
    try:
        env = {**os.environ, CHILD_ENV: str(path), "PYTEST_ADDOPTS": ""}
        command = [sys.executable, "-m", "pytest", *child_args(item, _basetemp(config))]
        limit = child_timeout(item)
        returncode, stdout, stderr, hung = _run_child(command, config.invocation_params.dir, env, limit)
        reports = [r for r in _read_reports(config, path) if r.when in ("setup", "call", "teardown")]
    finally:
        path.unlink(missing_ok=True)
    missing = _missing_phase(reports)
    for report in reports:
        report.nodeid = item.nodeid  # the same test, whatever the child called it
        ihook.pytest_runtest_logreport(report=report)
    if missing is not None:
        ended = (
            f"was still running after {limit:g} s (--cudagraph-isolate-timeout, or pytest-timeout's "
            f"timeout plus {_TIMEOUT_GRACE_S:g} s) and was killed, with its process group, hung in"
            if hung
            else f"{_exit_text(returncode)} without a report of"
        )
        lines = [
            f"the child process running the test {ended} its {missing} phase",
            f"command: {shlex.join(command)}",
        ]
        for stream, text in (("stdout", stdout), ("stderr", stderr)):
            tail = _tail(text)
            if tail:
                lines += ["", f"last lines of the child's {stream}:", *tail]
        ihook.pytest_runtest_logreport(report=_failed_report(item, missing, "\n".join(lines)))
        if missing != "teardown":
            ihook.pytest_runtest_logreport(report=_passed_teardown(item))
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
