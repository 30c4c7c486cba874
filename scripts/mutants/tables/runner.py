"""The mutants of verify_runner (the runner checks and their sweep) and of verify_distributed
with the emulator's collectives."""

from __future__ import annotations

from ..common import DIST_TESTS, DV, EM, MS, RC, RUNNER_TESTS, RV, RX, Mutant

RUNNER: list[Mutant] = [
    # -- verify_runner: the runner checks and their sweep ------------------------------------
    Mutant(
        "runner-rows-not-compared",
        RC,
        "verdict = across_shapes(\n                call.got,\n                call.expected,",
        "verdict = across_shapes(\n                call.expected,\n                call.expected,",
        RUNNER_TESTS,
        "real_batches compares eager with itself",
    ),
    Mutant(
        "runner-state-not-compared",
        MS,
        "raw, start = got[name], before.get(name)",
        "raw, start = expected[name], before.get(name)",
        RUNNER_TESTS,
        "state compares eager's state with itself",
    ),
    Mutant(
        "runner-state-after-restore",
        RX,
        "            call.got_state = self.snapshot()\n            self.restore(state0)",
        "            self.restore(state0)\n            call.got_state = self.snapshot()",
        RUNNER_TESTS,
        "the runner's state read after it was put back",
    ),
    Mutant(
        "runner-sweep-smallest-first",
        RX,
        "for n in range(self.max_tokens, 0, -1):",
        "for n in range(1, self.max_tokens + 1):",
        RUNNER_TESTS,
        "smaller batches run first: a stale table from a larger step never shows",
    ),
    Mutant(
        "runner-lifetime-kept-is-first",
        RC,
        "            kept = clone_tree(first)",
        "            kept = first",
        RUNNER_TESTS,
        "output_lifetime compares an output with itself",
    ),
    Mutant(
        "runner-fresh-same-inputs",
        RC,
        "        out, _ = ctx.call_runner(second)",
        "        out, _ = ctx.call_runner(first)",
        RUNNER_TESTS,
        "fresh_inputs calls the runner on the first inputs again",
    ),
]

DISTRIBUTED: list[Mutant] = [
    # -- verify_distributed and the emulator's collectives ------------------------------------
    Mutant(
        "distributed-rank-peaks-dropped",
        DV,
        "        report.rank_peak_memory[rank] = result.report.peak_memory\n",
        "",
        ("examples/tensor_parallel/test_tensor_parallel.py::test_tp_module_passes_on_every_rank[llama]",),
        "a rank's peak memory lost in the merged report (issue #32: each rank against its hand capture)",
    ),
    Mutant(
        "dist-outputs-not-compared",
        DV,
        "diff = first_difference(b.output, a.output)",
        "diff = first_difference(a.output, a.output)",
        DIST_TESTS,
        "rank_agreement compares rank 0 with itself",
    ),
    Mutant(
        "dist-descriptor-not-compared",
        DV,
        "if a.descriptor != b.descriptor:",
        "if False:",
        DIST_TESTS,
        "ranks that serve a batch with different graphs agree",
    ),
    Mutant(
        "emulate-collective-not-replayed",
        EM,
        "    if _is_collective(func):\n        return True  # c10d's",
        "    if False:\n        return True  # c10d's",
        DIST_TESTS,
        "replay does not issue the captured all-reduce again",
    ),
    Mutant(
        "runner-capture-state-unchecked",
        RV,
        '        if "state" in selected:',
        "        if False:",
        RUNNER_TESTS,
        "what the runner's capture() wrote into live state is never compared",
    ),
    Mutant(
        "runner-capture-not-called",
        RV,
        "    if callable(capture):",
        "    if False:",
        RUNNER_TESTS,
        "the runner's capture() never called",
    ),
]
