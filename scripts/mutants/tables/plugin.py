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
