"""pytest plugin: markers, options, hooks and fixtures of pytest-cudagraph.

Hooks, options and fixtures only; the work lives in ``settings`` (resolving
the settings), ``report`` (run state, header, summary, JSON report),
``harness`` (what the fixtures do), ``workers`` (GPUs of xdist workers, and a
lost CUDA context) and ``isolate`` (a test in a child process). torch is imported lazily, inside fixtures
and hooks that run tests, so that ``pytest --help`` stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from .. import environment
from . import ranks, settings, workers
from . import report as pytest_report

if TYPE_CHECKING:
    import torch

    from ..plan.batch import Batch
    from ..plan.properties import DispatchProperties
    from .harness import (
        Benchmark,
        DistributedVerifier,
        Launched,
        ManagerFactory,
        RunnerVerifier,
        TrainingVerifier,
        Verifier,
    )

_CUDA_MARKER = "cuda: the test needs a CUDA device; it is skipped cleanly where none is available"
_CUDAGRAPH_MARKER = (
    f"{settings.MARKER_SIGNATURE}: settings of the test's cudagraph_verify / cudagraph_manager "
    "calls (keywords given to the call win; capture_sizes and backend beat --cudagraph-sizes / "
    "--cudagraph-backend)"
)


# -- options ---------------------------------------------------------------
def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)
    # A rank's hooks (torchrun, srun): registered now so that they run in pytest's order; idle
    # unless the launcher's environment is there.
    pluginmanager.register(ranks.RankPlugin(), "cudagraph-ranks")


def pytest_addoption(parser: pytest.Parser) -> None:
    environment = "".join(f"\n  {name}: {what}" for name, what in ENVIRONMENT)
    group = parser.getgroup(
        "cudagraph", f"CUDA-graph verification (pytest-cudagraph). Environment:{environment}\nOptions"
    )
    # Every option and its ini twin, from one table (settings.add_options): the verify() keywords a
    # run sets come with VerifyOptions' help and validation, then the plugin's own settings.
    settings.add_options(group, parser)


# -- configuration and run state -------------------------------------------
class _Collector:
    """Takes each phase's records off its report into the run state (xdist: on the controller too),
    and marks the JSON report incomplete when the session starts."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        _state(self.config).collect(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # The previous run's report must not look like this run's while this
        # one runs, nor after it if it is killed (SIGTERM, OOM) before the end.
        if hasattr(self.config, "workerinput") or not ranks.writes_reports(self.config):
            return  # an xdist worker (the controller writes the report), or a rank other than 0
        state = _state(self.config)
        if state.settings.report is not None:
            pytest_report.write_incomplete_report(state, state.settings.report)


#: The plugin's fixtures: a test that requests one (or carries the marker) is listed in the JSON report.
_PLUGIN_FIXTURES = frozenset(
    {
        "cudagraph_verify",
        "cudagraph_verify_runner",
        "cudagraph_verify_distributed",
        "cudagraph_manager",
        "cudagraph_benchmark",
        "cudagraph_dispatch_properties",
        "cudagraph_trace_batches",
        "_cudagraph_slice",
    }
)


def _uses_plugin(item: pytest.Item) -> bool:
    fixtures = getattr(item, "fixturenames", ())
    return item.get_closest_marker("cudagraph") is not None or any(f in _PLUGIN_FIXTURES for f in fixtures)


@pytest.hookimpl(tryfirst=True)  # before hypothesis' own plugin loads the profile it is asked for
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--hypothesis-profile", default=None) in HYPOTHESIS_PROFILES:
        # Only where asked for: importing hypothesis costs half a second, which a suite that never
        # draws an example should not pay. The dispatch-properties fixture registers them too.
        from .profiles import register

        register()
    config.addinivalue_line("markers", _CUDA_MARKER)
    config.addinivalue_line("markers", _CUDAGRAPH_MARKER)
    if config.getoption("help", default=False):
        return  # --help works whatever the settings' values
    settings.check_environment()  # a value the plugin cannot read stops the run here (exit 4)
    ranks.configure(config)  # under torchrun or srun: which rank this is (only rank 0 writes --junitxml)
    run = settings.session_settings(config)
    state = config.stash[pytest_report.STATE_KEY] = pytest_report.RunState(run)
    if not hasattr(config, "workerinput"):  # checked once, before the run starts (and any worker)
        settings.check_session(run, config)  # report paths writable; --cudagraph-backend=cuda has CUDA
        state.baseline = settings.compare_baseline(run, config)
    config.pluginmanager.register(_Collector(config), "cudagraph-collector")
    config.pluginmanager.register(workers.LostContext(config), "cudagraph-lost-context")
    from . import isolate

    if isolate.in_child():  # a test run by --cudagraph-isolate: its reports go back to the parent
        config.pluginmanager.register(isolate.ChildReporter(config), "cudagraph-isolate-child")


_state = pytest_report.run_state


_THREADS_KEY = pytest.StashKey["str | None"]()
#: The hypothesis profiles of ``profiles.py``, by name (kept equal to theirs by a test): named here so
#: that the plugin knows them without importing hypothesis.
HYPOTHESIS_PROFILES = ("cudagraph-ci", "cudagraph-thorough")

#: The environment variables the plugin reads, shown in --help: from their one table
#: (``pytest_cudagraph.environment``, no torch), which also reads them.
ENVIRONMENT = tuple((var.name, var.help) for var in environment.VARIABLES)


def pytest_report_header(config: pytest.Config) -> str:
    run = _state(config).settings
    # The settings as given: "auto" is not resolved here, where torch may not be imported yet (from
    # a wheel it is not; from a checkout a conftest may have imported it), so the header would say
    # one thing or the other by chance. The terminal summary says what "auto" became.
    line = pytest_report.header_line(run)
    threads = config.stash.get(_THREADS_KEY, None)
    return f"{line}, {threads}" if threads else line  # None only before the session starts


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A malformed cudagraph marker fails its own test, at set-up, with the
    # message naming it; every other test runs (with or without xdist).
    for item in items:
        try:
            settings.marker_keywords(item)  # pytest.UsageError on a malformed cudagraph marker
        except pytest.UsageError as exc:
            item.stash[settings.MARKER_ERROR_KEY] = str(exc)
        except Exception as exc:  # never the session's error: the test's own, said in one line
            item.stash[settings.MARKER_ERROR_KEY] = (
                f"@pytest.mark.cudagraph on {item.nodeid}: could not be read ({type(exc).__name__}: {exc})"
            )
    _check_checks_option(config, items)


def _check_checks_option(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--cudagraph-checks (or its ini) names checks that exist: the built-ins, and those the
    pytest_cudagraph_checks hooks of the collected tests' conftests return. Known once every
    conftest is loaded, so checked here, before any test runs; a bad name stops the run (exit 4)."""
    chosen = _state(config).settings.options.get("checks")
    if not chosen or not items:
        return
    from ..checks.arguments import registry_with
    from ..checks.registry import check_list

    extra: dict[str, Any] = {}
    for proxy in {id(i.ihook): i.ihook for i in items}.values():
        for result in proxy.pytest_cudagraph_checks(config=config):
            for check in check_list(result, what="what pytest_cudagraph_checks returns"):
                extra.setdefault(getattr(check, "name", repr(check)), check)
    try:
        registry_with(list(extra.values())).select(chosen)
    except ValueError as exc:
        raise pytest.UsageError(f"--cudagraph-checks (ini cudagraph_checks): {exc}") from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # --cudagraph-split=descriptor: one item per descriptor, so that xdist
    # spreads one model's descriptors over workers.
    if "_cudagraph_slice" not in metafunc.fixturenames:
        return
    run = _state(metafunc.config).settings
    if run.split != "descriptor":
        return
    try:
        marker = settings.marker_keywords(metafunc.definition)
    except pytest.UsageError:
        return  # reported at collection of the item
    labels = settings.split_labels(run, marker)
    if labels:
        metafunc.parametrize("_cudagraph_slice", labels, indirect=True, ids=labels)


def pytest_sessionstart(session: pytest.Session) -> None:
    # torch's intra-op threads: the cores divided among xdist workers, unless
    # the user chose (OMP_NUM_THREADS, MKL_NUM_THREADS, PYTEST_CUDAGRAPH_THREADS).
    # Planned now for the header; applied (with the worker's device) once torch
    # is there: a suite that never imports torch never pays for its import.
    from .threads import thread_plan

    session.config.stash[_THREADS_KEY] = thread_plan(session.config)[1]
    # --cudagraph-devices asks for GPUs: checked here, where a bad one can stop the run.
    if "torch" in sys.modules or _state(session.config).settings.devices is not None:
        workers.torch_ready(session.config)


def pytest_collection_finish(session: pytest.Session) -> None:
    if "torch" in sys.modules:  # the tests' modules imported it: set it up before any test runs
        workers.torch_ready(session.config)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    # --cudagraph-isolate: a test that uses the plugin runs in a child process,
    # whose reports this process logs as its own.
    from . import isolate

    if _state(item.config).settings.isolate and _uses_plugin(item) and not isolate.in_child():
        isolate.run_in_child(item)
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    # --cudagraph-progress: a verification's stage and descriptor on the terminal, past the capture.
    if not _uses_plugin(item):
        return (yield)
    from .terminal_progress import showing

    with showing(item.config):
        return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    # pytest-xdist's controller: its workers show progress as it decided (their stdout is no terminal).
    from .terminal_progress import WORKER_KEY, decided

    node.workerinput[WORKER_KEY] = decided(node.config)


def _needs_cuda(item: pytest.Item) -> bool:
    """A test that runs on the GPU: marked ``cuda``, or using the plugin where the run's backend is CUDA."""
    if item.get_closest_marker("cuda") is not None:
        return True
    return _uses_plugin(item) and settings.concrete_backend(_state(item.config).settings.backend) == "cuda"


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A test that imports torch only in its body, or only through this plugin's fixtures.
    if not workers.is_torch_ready(item.config) and (
        "torch" in sys.modules or any(n.startswith("cudagraph") for n in getattr(item, "fixturenames", ()))
    ):
        workers.torch_ready(item.config)
    marker_error = item.stash.get(settings.MARKER_ERROR_KEY, None)
    if marker_error is not None:
        pytest.fail(marker_error, pytrace=False)
    if item.get_closest_marker("cuda") is not None and not _cuda_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    state = _state(item.config)
    if state.lost_here is not None and _needs_cuda(item):
        # This process's CUDA context is gone: the test would fail for a fault not its own.
        state.not_run.append(item.nodeid)
        # One line that fits the short summary (-rs), the same for every test it stops, so pytest counts
        # them on one line; the cudagraph summary names the test that lost the context.
        pytest.skip(
            "not run: an earlier test lost this process's CUDA context (a sticky CUDA error); -n N "
            "(pytest-xdist) or --cudagraph-isolate confines a fault to one test"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    state = _state(item.config)
    if call.excinfo is not None:
        from ..faults import context_lost_error, note_loss

        lost = context_lost_error(call.excinfo.value)
        if lost is not None and state.lost_here is None:
            # Told in words, without the harness's frames: the context is
            # gone, and no traceback of ours says more than this does.
            first = note_loss(lost)  # the process's first: where the context was lost
            message = str(first if lost.where is None else lost)
            report.longrepr = message
            report.user_properties.append((pytest_report.LOST_PROPERTY, message))
            state.lost.setdefault(item.nodeid, message)
            state.lost_here = item.nodeid
        elif lost is not None and state.lost_here != item.nodeid:
            # A test that still ran (it uses CUDA without the marker or the
            # plugin) meets the context an earlier test lost: its own failure
            # stays as it is, with where the loss began.
            report.sections.append(
                (
                    "cudagraph",
                    f"this process's CUDA context was lost earlier, in "
                    f"{state.lost_here}: every CUDA call fails since",
                )
            )
    records = state.take_pending(item.nodeid)
    if records:
        setattr(report, pytest_report.REPORT_ATTR, records)
        # As record_property does: junit XML writes the item's properties (<properties>) with the
        # test's last report.
        item.user_properties.extend(pytest_report.junit_properties(records))
    rows = state.take_bench_rows()  # they travel like the records: from xdist workers too
    if rows:
        setattr(report, pytest_report.BENCH_ATTR, rows)
    if _uses_plugin(item):
        setattr(report, pytest_report.USED_ATTR, True)
    from .isolate import in_child

    # The packages that took part, from every process of the run (xdist workers, isolated children).
    if state.settings.report is not None or in_child():
        modules = state.take_new_modules()
        if modules:
            setattr(report, pytest_report.MODULES_ATTR, modules)
    return report


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    config = session.config
    if hasattr(config, "workerinput") or not ranks.writes_reports(config):
        return  # an xdist worker (the controller writes the report), or a rank other than 0
    state = _state(config)
    run = state.settings
    if run.report is not None or run.compare is not None:
        complete = (
            int(exitstatus) != pytest.ExitCode.INTERRUPTED
            and not session.shouldstop
            and not session.shouldfail
        )
        document = pytest_report.report_document(
            state, int(exitstatus), complete=complete, root=config.rootpath
        )
        if run.compare is not None:
            from .compare_report import compare

            state.comparison = compare(
                state.baseline or [{}], document, ", ".join(map(str, run.compare)), run.compare_threshold
            )
            if (
                run.compare_fail
                and state.comparison.new_failures
                and session.exitstatus == pytest.ExitCode.OK
            ):
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
                document["exitstatus"] = int(session.exitstatus)
                document["passed"] = False
        if run.report is not None:
            pytest_report.write_report(
                state, run.report, int(session.exitstatus), complete=complete, document=document
            )
    bench_report = state.settings.bench_report
    if bench_report is not None:
        state.bench_results.extend(state.take_bench_rows())  # rows made outside a test's phases
        if state.bench_results:
            from ..bench.markdown import write_bench_report

            state.bench_written = write_bench_report(state.bench_results, bench_report)
        else:
            import warnings

            warnings.warn(
                pytest.PytestWarning(
                    f"cudagraph: the benchmark report {bench_report} was not written: no cudagraph_benchmark "
                    "results reached this process"
                ),
                stacklevel=1,
            )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    state = _state(config)
    if state.results:
        terminalreporter.section("cudagraph")
        resolved = pytest_report.backends_line(state.settings, state.results)
        if resolved:
            terminalreporter.line(resolved)
        for nodeid, records in state.results.items():
            terminalreporter.line(pytest_report.summary_line(nodeid, records, state.outcomes.get(nodeid)))
    unverified = [
        n
        for n in state.listed
        if n not in state.results and state.outcomes.get(n) not in (None, "passed", "skipped")
    ]
    if unverified:  # failed, errored or crashed before any verification finished
        if not state.results:
            terminalreporter.section("cudagraph")
        for nodeid in unverified:
            terminalreporter.line(f"{nodeid}: no verification finished [{state.outcomes[nodeid]}]")
    for line in pytest_report.skipped_lines(state.results, verbose=terminalreporter.verbosity > 0):
        terminalreporter.line(line)
    for nodeid in state.lost:
        if nodeid == state.lost_here:  # here, without xdist or isolation
            after = f"; {len(state.not_run)} GPU test(s) after it were not run in this process"
        elif state.settings.isolate:  # the test's own child process (xdist or not)
            after = " (its own child process: --cudagraph-isolate); the tests after it ran"
        else:  # xdist's controller
            after = "; its worker ended after its report, and a fresh one ran the tests after it"
        terminalreporter.line(f"cudagraph: {nodeid} lost the CUDA context of its process{after}")
    if state.comparison is not None:
        for line in state.comparison.lines():
            terminalreporter.line(line)
        if state.settings.compare_fail and state.comparison.new_failures:
            terminalreporter.line("cudagraph: the run fails on its new failure(s) (--cudagraph-compare-fail)")
    if state.written is not None:
        terminalreporter.line(f"cudagraph: JSON report written to {state.written}")
    for path in state.bench_written:
        terminalreporter.line(f"cudagraph: benchmark report written to {path}")


# -- fixtures --------------------------------------------------------------
@pytest.fixture
def cudagraph_backend(request: pytest.FixtureRequest) -> str:
    """The test's backend, 'cuda' or 'emulate' ('auto' resolved: cuda where available)."""
    test = settings.resolve(_state(request.config).settings, settings.marker_keywords(request.node))
    return settings.concrete_backend(test.backend)


@pytest.fixture
def cudagraph_device(cudagraph_backend: str) -> torch.device:
    """The test's device: the current CUDA device for the cuda backend (under pytest-xdist, the
    worker's own GPU), the CPU for emulate."""
    from .harness import device_for_test

    return device_for_test(cudagraph_backend)


@pytest.fixture
def _cudagraph_slice(request: pytest.FixtureRequest) -> str | None:
    """The descriptor this item verifies under --cudagraph-split=descriptor (None: all)."""
    return getattr(request, "param", None)


@pytest.fixture
def cudagraph_verify(request: pytest.FixtureRequest, _cudagraph_slice: str | None) -> Verifier:
    """``cudagraph_verify(module, make_inputs, **keywords) -> VerifyReport``.

    Runs ``pytest_cudagraph.checks.verify`` with keywords from the call, then
    the ``cudagraph`` marker, then the settings; fails the test with the
    readable report when a check fails.
    """
    from .harness import Verifier

    state = _state(request.config)
    record = functools.partial(state.add_pending, request.node.nodeid)
    return Verifier(
        state.settings,
        settings.marker_keywords(request.node),
        record,
        descriptor=_cudagraph_slice,
        hook_checks=_hook_checks(request),
        launched=_launched(request.config),
    )


@pytest.fixture
def cudagraph_verify_runner(request: pytest.FixtureRequest) -> RunnerVerifier:
    """``cudagraph_verify_runner(runner, module, make_inputs, **keywords) -> VerifyReport``.

    Runs ``pytest_cudagraph.verify_runner`` on a runner someone else wrote
    (an engine's own, torch.compile's, make_graphed_callables'), with
    keywords from the call, then the ``cudagraph`` marker, then the settings
    (``--cudagraph-sizes``); fails the test with the readable report when a
    check fails.
    """
    from .harness import RunnerVerifier

    state = _state(request.config)
    record = functools.partial(state.add_pending, request.node.nodeid)
    return RunnerVerifier(state.settings, settings.marker_keywords(request.node), record)


@pytest.fixture
def cudagraph_verify_training(request: pytest.FixtureRequest) -> TrainingVerifier:
    """``cudagraph_verify_training(module, make_inputs, loss_fn, **keywords) -> VerifyReport``.

    Runs ``pytest_cudagraph.verify_training``: a training step (forward, backward, the optimizer's
    step) captured per capture size and held to eager step by step, with keywords from the call,
    then the ``cudagraph`` marker, then the settings; fails the test with the readable report when
    a check fails.
    """
    from .harness import TrainingVerifier

    state = _state(request.config)
    record = functools.partial(state.add_pending, request.node.nodeid)
    return TrainingVerifier(
        state.settings, settings.marker_keywords(request.node), record, launched=_launched(request.config)
    )


@pytest.fixture
def cudagraph_verify_distributed(request: pytest.FixtureRequest) -> DistributedVerifier:
    """``cudagraph_verify_distributed(build, make_inputs, **keywords) -> VerifyReport``.

    Runs ``pytest_cudagraph.verify_distributed``: ``build(rank, world_size)``
    in a process a rank, verified on every rank and the ranks against each
    other. Keywords from the call, then the ``cudagraph`` marker, then the
    settings (``--cudagraph-sizes``, ``--cudagraph-backend``,
    ``--cudagraph-world-size``); fails the test with the readable report when
    a check fails.
    """
    from .harness import DistributedVerifier

    state = _state(request.config)
    record = functools.partial(state.add_pending, request.node.nodeid)
    worker = request.config.workerinput["workerid"] if hasattr(request.config, "workerinput") else None
    return DistributedVerifier(
        state.settings,
        settings.marker_keywords(request.node),
        record,
        worker=worker,
        launched=_launched(request.config),
        timeout=ranks.timeout(request.config),
    )


def _launched(config: pytest.Config) -> Launched | None:
    """The ranks torchrun or srun started (None: no launcher), for the fixtures to verify across."""
    from .harness import Launched

    world_size = ranks.launched_world_size(config)
    return None if world_size is None else Launched(world_size, ranks.timeout(config))


def _hook_checks(request: pytest.FixtureRequest) -> list[Any]:
    """The checks the ``pytest_cudagraph_checks`` hooks return for this test: plugins', and those of
    the conftest.py files above it (through the item's hook proxy, as pytest scopes conftest hooks)."""
    from ..checks.registry import Check, check_list

    found: list[Any] = []
    for result in request.node.ihook.pytest_cudagraph_checks(config=request.config):
        items = check_list(result, what="what pytest_cudagraph_checks returns")
        bad = [c for c in items if not isinstance(c, Check)]
        if bad:
            raise TypeError(
                f"pytest_cudagraph_checks returned {bad[0]!r}; it returns a list of pytest_cudagraph.checks.Check"
            )
        found.extend(items)
    return found


@pytest.fixture
def cudagraph_benchmark(request: pytest.FixtureRequest) -> Benchmark:
    """``cudagraph_benchmark(module, make_inputs, *, capture_sizes, ..., rounds=30, calls_per_round=20)``.

    Captures every descriptor and times eager, ``run()`` and bare replay for
    each: one pytest-benchmark entry each, grouped per module, with the
    descriptor, padding, speedup over eager and graph memory in
    ``extra_info``. Returns the measurements (None when pytest-benchmark is
    disabled, under xdist say: then each graph runs once, untimed).
    """
    from ..bench.fixture import BenchmarkRunner
    from .harness import Benchmark, default_device

    state = _state(request.config)
    test = settings.resolve(state.settings, settings.marker_keywords(request.node))
    backend = settings.concrete_backend(test.backend)
    return Benchmark(
        BenchmarkRunner(
            request.node,
            getattr(request.config, "_benchmarksession", None),
            backend=backend,
            device=default_device(backend),
            record=state.bench_rows.append,
        )
    )


@pytest.fixture(scope="session")
def cudagraph_dispatch_properties() -> DispatchProperties:
    """``cudagraph_dispatch_properties(plan, batch, *, dispatch=None, captured=None)``.

    Asserts every dispatch property for one batch (and, once per plan, that
    every captured descriptor is reachable); session-scoped so that
    ``@given`` tests can use it.
    """
    from ..plan.properties import DispatchProperties
    from .profiles import register

    register()  # a suite that draws examples can load cudagraph-ci or cudagraph-thorough
    return DispatchProperties()


@pytest.fixture(scope="session")
def cudagraph_trace_batches(request: pytest.FixtureRequest) -> tuple[Batch, ...]:
    """The distinct batch shapes of ``--cudagraph-trace`` (ini ``cudagraph_trace``), smallest first.

    For a suite's own dispatch properties on the shapes its engine sees; the
    test skips when no trace is given.
    """
    shapes = _state(request.config).settings.trace_shapes
    if shapes is None:
        pytest.skip("no trace: give --cudagraph-trace=PATH (or ini cudagraph_trace)")
    return shapes


@pytest.fixture
def cudagraph_manager(request: pytest.FixtureRequest) -> Generator[ManagerFactory, None, None]:
    """``cudagraph_manager(module, make_inputs, config=None, **keywords) -> GraphManager``.

    Backend and device come from the settings unless given; every manager made
    is released at teardown.
    """
    from .harness import ManagerFactory

    factory = ManagerFactory(_state(request.config).settings, settings.marker_keywords(request.node))
    yield factory
    factory.release_all()
