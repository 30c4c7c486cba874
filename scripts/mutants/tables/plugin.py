"""The mutants of a lost CUDA context: faults.py and the plugin's handling of it."""

from __future__ import annotations

from ..common import CX, FA, FAULT_TESTS, PL, TRACE_TESTS, Mutant

FAULTS: list[Mutant] = [
    # -- a lost CUDA context (faults.py, the plugin's handling of it) -----------------------------------
    Mutant(
        "faults-any-code-sticky",
        FA,
        "    if code not in STICKY_CODES:\n        return None",
        "    if code is None:\n        return None",
        FAULT_TESTS,
        "out of memory and an invalidated capture are told as a lost context",
    ),
    Mutant(
        "faults-worker-not-ended",
        "pytest_cudagraph/plugin/workers.py",
        "            os._exit(self.EXIT)",
        "            pass",
        FAULT_TESTS,
        "an xdist worker whose context is lost runs the tests after it",
    ),
    Mutant(
        "faults-crash-counted-twice",
        "pytest_cudagraph/plugin/workers.py",
        '            report.outcome = "passed"',
        "            pass",
        FAULT_TESTS,
        "the replaced worker is also reported as a crash of the test",
    ),
    Mutant(
        "faults-gpu-tests-run-after-loss",
        PL,
        "    if state.lost_here is not None and _needs_cuda(item):",
        "    if False:",
        FAULT_TESTS,
        "serially, the GPU tests after a lost context fail as their own",
    ),
    Mutant(
        "faults-phase-untagged",
        FA,
        "                exc.cudagraph_where = where  # type: ignore[attr-defined]",
        "                pass",
        FAULT_TESTS,
        "a lost context does not say where it showed",
    ),
    Mutant(
        "trace-shapes-ignored",
        CX,
        "        if self.given_batches is not None:",
        "        if False:",
        TRACE_TESTS,
        "--cudagraph-trace shapes are not what the checks run",
    ),
]

CR = "pytest_cudagraph/plugin/compare_report.py"
COMPARE_REPORT_TESTS = ("tests/test_compare_report.py",)
PACKAGES_TESTS = ("tests/test_report_complete.py::test_the_report_names_every_package_a_test_imported",)

REPORTS: list[Mutant] = [
    # -- what a run's report says of its processes, and --cudagraph-compare ----------------------------
    Mutant(
        "report-skip-detail-without-v",
        "pytest_cudagraph/plugin/report.py",
        "        if verbose:\n            if len(named) > _CHECKS_NAMED:",
        "        if True:\n            if len(named) > _CHECKS_NAMED:",
        (
            "tests/test_skip_reasons.py::test_the_terminal_prints_each_reason_on_one_line_and_the_detail_under_v",
        ),
        "the terminal summary prints every skip's detail without -v: a reason is no longer one line (issue #66)",
    ),
    Mutant(
        "report-packages-from-workers-dropped",
        "pytest_cudagraph/plugin/report.py",
        "        self.modules.update(getattr(report, MODULES_ATTR, None) or ())",
        "        pass",
        PACKAGES_TESTS,
        "machine.packages names only what the controller imported (under xdist, not triton)",
    ),
    Mutant(
        "report-packages-fixed-list",
        "pytest_cudagraph/plugin/run_info.py",
        "    for module in imported_modules() | set(modules):",
        "    for module in ():",
        PACKAGES_TESTS,
        "machine.packages is the fixed list again",
    ),
    Mutant(
        "compare-spread-ignored",
        CR,
        "    if change < _FLOORS[figure] or (spread is not None and change <= spread):",
        "    if change < _FLOORS[figure]:",
        COMPARE_REPORT_TESTS,
        "a timing within its run-to-run spread is listed as moved",
    ),
    Mutant(
        "compare-spread-range-not-interval",
        CR,
        "    return T_995[min(n - 1, len(T_995)) - 1] * deviation * math.sqrt(1 + 1 / n)",
        "    return max(kept) - min(kept)",
        COMPARE_REPORT_TESTS,
        "the spread is the kept values' range: two close runs make noise a move",
    ),
    Mutant(
        "compare-one-report-timings-judged",
        CR,
        "        if figure in _TIMINGS:\n            return None",
        "        pass",
        COMPARE_REPORT_TESTS,
        "a timing of one kept report is held to 10 % again",
    ),
    Mutant(
        "compare-threshold-ignored",
        CR,
        "    return bound is None or change >= bound * mean",
        "    return True",
        COMPARE_REPORT_TESTS,
        "a figure under the threshold the user set is listed as moved",
    ),
    Mutant(
        "compare-figures-before-verdicts",
        CR,
        '        out += _listed((("moved", self.moved),), limit)',
        '        out[1:1] = _listed((("moved", self.moved),), limit)',
        COMPARE_REPORT_TESTS,
        "the moved figures are listed before the new failures",
    ),
]

TP = "pytest_cudagraph/plugin/terminal_progress.py"
PROGRESS_TESTS = ("tests/test_progress.py",)

PROGRESS: list[Mutant] = [
    # -- --cudagraph-progress: the terminal, past the capture, from xdist workers ------------------------
    Mutant(
        "progress-auto-in-ci",
        TP,
        "        return terminal and not on_ci(environ) and not quiet",
        "        return terminal and not quiet",
        PROGRESS_TESTS,
        "auto shows progress in a CI job's log",
    ),
    Mutant(
        "progress-captured",
        TP,
        "    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():",
        "    with contextlib.nullcontext():",
        PROGRESS_TESTS,
        "the steps go into pytest's capture (shown only with -s), as before",
    ),
    Mutant(
        "progress-workers-not-told",
        PL,
        "    node.workerinput[WORKER_KEY] = decided(node.config)",
        "    pass",
        PROGRESS_TESTS,
        "xdist workers, whose stdout is no terminal, decide auto for themselves: nothing shows",
    ),
    Mutant(
        "progress-left-on-the-line",
        TP,
        "        if self.shown:\n            with _uncaptured(self.config):",
        "        if False:\n            with _uncaptured(self.config):",
        PROGRESS_TESTS,
        "the last step stays written on pytest's line",
    ),
    Mutant(
        "progress-sink-unused",
        "pytest_cudagraph/progress.py",
        "    elif sink is not None:",
        "    elif False:",
        PROGRESS_TESTS,
        "the walks never reach the plugin's sink",
    ),
]
