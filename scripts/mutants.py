"""Mutation testing: does the suite notice when the code that says "equal" (or any check) lies?

Each mutant is one small, hand-written change to the package: an exact snippet
of today's code and what replaces it. For every mutant the script copies the
working tree (tracked files and untracked files git does not ignore, as
``git ls-files -co --exclude-standard`` lists them) into a fresh temporary
folder, applies the mutant there (the tree it reads is never written), and
runs pytest on the copy with ``PYTHONPATH`` pointing at it, after checking in a
subprocess that ``pytest_cudagraph`` really imports from the copy:

1. the mutant's targeted tests, ``python -m pytest -x -q -p no:cacheprovider <tests>``;
2. only if they all pass (and without ``--fast``): the whole suite, ``tests``
   and then ``examples``, each with ``-x``.

A mutant is **killed** when a run fails (or times out), **survived** when every
run passes, and **invalid** when the mutated package does not even import (a
mutant that breaks the import proves nothing about the tests). A snippet that
is not found exactly once is a **stale** mutant, an error: the code moved or
changed and the mutant must be rewritten. Only for code that is moved between
files is a snippet not found in the file named looked for in every file of the
package, so those mutants (``manager/*``, ``checks/builtin/*``, ``checks/engine.py``:
marked ``*`` in the table) follow it.

Before the mutants, the unmutated copy must import and pass every selected
mutant's targeted tests (the baseline), or nothing is run.

Run it (CPU work: one thread per pytest process)::

    OMP_NUM_THREADS=1 python scripts/mutants.py              # every mutant, whole suite for survivors
    OMP_NUM_THREADS=1 python scripts/mutants.py --fast       # targeted tests only
    python scripts/mutants.py --list                         # the mutants
    python scripts/mutants.py --only compare-all-any --only suite-address-identity
    python scripts/mutants.py --jobs 4                       # mutants in parallel
    python scripts/mutants.py --tree /path/to/a/clean/copy  # mutate another copy of the repo

It prints a table (id, file, result, the test that killed it or why not,
seconds) and the kill rate, killed / (killed + survived); invalid mutants are
counted apart. The exit status is 1 if a mutant survived, 2 on a stale mutant
or a failing baseline, 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "pytest_cudagraph"
# Code that moves between files as the package is reorganised (the manager's parts, the
# checks): a mutant's snippet there is looked for in the whole package (the table marks it).
MOVING = (
    "pytest_cudagraph/manager/",
    "pytest_cudagraph/checks/builtin/",
    "pytest_cudagraph/checks/engine.py",
)
PYTEST = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE")
WHOLE_SUITE = ("tests", "examples")

COMPARE_TESTS = ("tests/test_compare.py",)
SENSITIVITY = "tests/test_check_sensitivity.py"
DISPATCH = ("tests/test_dispatch_rules.py",)
ROWS = ("tests/test_manager_rows.py",)


def pair(buggy: str) -> str:
    """The gallery test that ``buggy`` fails its check (tests/test_checks.py)."""
    return f"tests/test_checks.py::test_buggy_module_fails_its_check[emulate-{buggy}]"


def twin(correct: str) -> str:
    """The gallery test that the correct twin ``correct`` passes every check."""
    return f"tests/test_checks.py::test_correct_twin_passes_every_check[emulate-{correct}]"


def sensitivity(*names: str) -> tuple[str, ...]:
    return tuple(f"{SENSITIVITY}::{name}" for name in names)


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # where the snippet is today (relative to the repository root)
    original: str  # exact text, found exactly once
    replacement: str
    tests: tuple[str, ...]  # pytest arguments run first (node ids or paths)
    about: str = ""
    # (original, replacement) of the same mutant in code being rewritten: tried in order when
    # ``original`` is not found (today's code and the restructured one, say).
    alternatives: tuple[tuple[str, str], ...] = ()

    @property
    def moving(self) -> bool:
        return self.file.startswith(MOVING)

    @property
    def variants(self) -> list[tuple[str, str]]:
        return [(self.original, self.replacement), *self.alternatives]


C = "pytest_cudagraph/checks/compare.py"
S = "pytest_cudagraph/checks/builtin/"  # the built-in checks: each snippet found in its family's module
X = "pytest_cudagraph/checks/verify_context.py"
GM = "pytest_cudagraph/manager/runtime.py"
L = "pytest_cudagraph/manager/layout.py"
PP = "pytest_cudagraph/plan/properties.py"
CP = "pytest_cudagraph/plan/capture_plan.py"
E = "pytest_cudagraph/checks/engine.py"
RG = "pytest_cudagraph/checks/registry.py"
RP = "pytest_cudagraph/checks/report.py"
RC = "pytest_cudagraph/runner/checks.py"
RX = "pytest_cudagraph/runner/runner_context.py"
RV = "pytest_cudagraph/runner/verify.py"
RUNNER_TESTS = ("tests/test_runner.py",)
DV = "pytest_cudagraph/distributed/verify.py"
EM = "pytest_cudagraph/backends/emulate.py"
FA = "pytest_cudagraph/faults.py"
PL = "pytest_cudagraph/plugin/__init__.py"
FAULT_TESTS = ("tests/test_faults.py",)
TR = "pytest_cudagraph/plan/trace.py"
CX = "pytest_cudagraph/checks/verify_context.py"
TRACE_TESTS = ("tests/test_trace.py",)
DIST_TESTS = ("tests/test_distributed.py",)
REGISTRY = ("tests/test_registry.py",)
ONE_EACH = ("tests/test_one_outcome_each.py",)
FL = "pytest_cudagraph/checks/floor.py"
OB = "pytest_cudagraph/observe.py"
CO = "pytest_cudagraph/checks/cost.py"
FLOOR_TESTS = ("tests/test_floor.py",)
PS = "pytest_cudagraph/checks/builtin/padded_size.py"
RF = "pytest_cudagraph/checks/reference.py"
PR = "pytest_cudagraph/precision.py"
LA = "pytest_cudagraph/launches.py"
KERNEL_EXAMPLES = ("examples/kernels/test_kernels.py",)
LAUNCH_TESTS = ("tests/test_launches.py", f"{KERNEL_EXAMPLES[0]}::test_correct_model_passes")
FN = S
REFERENCE_TESTS = ("tests/test_reference.py",)
PRECISION_TESTS = ("tests/test_precision.py",)
SCALE_TESTS = "tests/test_scale.py"
OBSERVE_TESTS = ("tests/test_observe.py",)
DIAGNOSES = ("tests/test_diagnoses.py",)
PRT = "pytest_cudagraph/plugin/report.py"
GD = "pytest_cudagraph/guard/__init__.py"
GDV = "pytest_cudagraph/guard/host_values.py"
MT = "pytest_cudagraph/manager/types.py"
CB = "pytest_cudagraph/capturability.py"
CAPTURABILITY = ("tests/test_capturability.py",)
TRC = "pytest_cudagraph/training/checks.py"
TRR = "pytest_cudagraph/training/replicas.py"
TRM = "pytest_cudagraph/training/compare.py"
TRV = "pytest_cudagraph/training/verify.py"
TRAINING_TESTS = ("tests/test_training.py", "examples/training/test_training_gallery.py")

EXACT = "return ((g == e) & _same_sign(g, e)) | both_nan"

MUTANTS: list[Mutant] = [
    # -- checks/compare.py: the code that says "equal" --------------------------------------------------
    Mutant(
        "compare-all-any",
        C,
        "if not bool(same.all()):",
        "if not bool(same.any()):",
        COMPARE_TESTS,
        "equal when any element is: a bug in one column passes",
    ),
    Mutant(
        "compare-nan-exact",
        C,
        EXACT,
        "return (g == e) & _same_sign(g, e)",
        COMPARE_TESTS,
        "NaN differs from NaN bit for bit",
    ),
    Mutant(
        "compare-nan-tolerance",
        C,
        "equal_nan=True",
        "equal_nan=False",
        COMPARE_TESTS,
        "NaN differs from NaN within tolerance",
    ),
    Mutant(
        "compare-signed-zero",
        C,
        EXACT,
        "return (g == e) | both_nan",
        COMPARE_TESTS,
        "+0.0 equals -0.0 bit for bit (the bug this change fixed)",
    ),
    Mutant(
        "compare-tolerance-per-dtype",
        C,
        "r, a = default_tolerance(g.dtype, compute)",
        "r, a = default_tolerance(torch.float32, compute)",
        COMPARE_TESTS,
        "fp32's tolerance for every dtype",
    ),
    Mutant(
        "compare-no-tolerance-table",
        C,
        "rtol, atol = _TOLERANCES.get(dtype, (0.0, 0.0))",
        "rtol, atol = (0.0, 0.0)",
        COMPARE_TESTS,
        "no default tolerance: rtol=None means bit for bit",
    ),
    Mutant(
        "compare-strides-dropped",
        C,
        "if check_strides and got.numel() > 1",
        "if False and check_strides and got.numel() > 1",
        COMPARE_TESTS,
        "strides never compared",
    ),
    Mutant(
        "compare-size1-strides",
        C,
        "stride if size > 1 else None",
        "stride",
        COMPARE_TESTS,
        "strides of size-1 dimensions compared",
    ),
    Mutant(
        "compare-plain-leaves-dropped",
        C,
        "elif g != e and not (g != g and e != e):",
        "elif False:",
        COMPARE_TESTS,
        "non-tensor leaves never compared",
    ),
    Mutant(
        "compare-plain-nan",
        C,
        "elif g != e and not (g != g and e != e):",
        "elif g != e:",
        COMPARE_TESTS,
        "a NaN Python float differs from itself",
    ),
    Mutant(
        "compare-index-off-by-one",
        C,
        "flat_index = start + int((~same).nonzero()[0, 0])",
        "flat_index = start + int((~same).nonzero()[0, 0]) + 1",
        COMPARE_TESTS,
        "the reported index one past the first difference",
    ),
    Mutant(
        "compare-index-last",
        C,
        "flat_index = start + int((~same).nonzero()[0, 0])",
        "flat_index = start + int((~same).nonzero()[-1, 0])",
        COMPARE_TESTS,
        "the last difference reported, not the first",
    ),
    Mutant(
        "compare-dtype-dropped",
        C,
        "if got.dtype != expected.dtype:",
        "if False:",
        COMPARE_TESTS,
        "dtype never compared",
    ),
    Mutant(
        "compare-shape-dropped",
        C,
        "if got.shape != expected.shape:",
        "if got.numel() != expected.numel():",
        COMPARE_TESTS,
        "shapes compared by element count only",
    ),
    Mutant(
        "compare-structure-dropped",
        C,
        "if [p for p, _ in got_leaves] != [p for p, _ in exp_leaves]:",
        "if len(got_leaves) != len(exp_leaves):",
        COMPARE_TESTS,
        "structure compared by leaf count only",
    ),
    Mutant(
        "compare-opaque-dropped",
        C,
        "if g is not e:",
        "if False:",
        COMPARE_TESTS,
        "an object forward made compares equal to any other",
    ),
    Mutant(
        "compare-float8-widen",
        C,
        "gp, ep = gp.float(), ep.float()",
        "pass",
        COMPARE_TESTS,
        "float8 compared without widening: no kernels for signbit, isfinite, isclose",
    ),
    Mutant(
        "compare-max-ulp",
        C,
        "max_ulp = max(max_ulp or 0, int(ulps.max()))",
        "max_ulp = max(max_ulp or 0, int(ulps.min()))",
        COMPARE_TESTS,
        "the smallest ULP difference reported",
    ),
    # -- checks/builtin/: the checks ----------------------------------------------------------------------
    Mutant(
        "suite-replay-compare",
        S,
        "diff = first_difference(graph, eager, check_strides=True)",
        "diff = first_difference(graph, graph, check_strides=True)",
        (
            *sensitivity("test_a_bug_in_one_column_or_one_element_fails_replay_and_fresh_inputs"),
            pair("PythonCounter"),
        ),
        "replay compared with itself",
    ),
    Mutant(
        "suite-capture-path-unexplained",
        S,
        '    if not explained:\n        return ""\n',
        "",
        (
            "tests/test_verdicts.py::test_a_capture_path_that_does_not_explain_the_failure_is_not_named[emulate]",
            pair("PlannedPerRequestCount"),
        ),
        "the capture path named as the cause where the graph disagrees with it too (an 8B false diagnosis)",
    ),
    Mutant(
        "suite-rng-over-unwritten-memory",
        S,
        "    if ctx.uninitialized():\n        # What a replay and an eager run read",
        "    if False:\n        # What a replay and an eager run read",
        ("tests/test_diagnoses.py::test_rng_of_a_module_reading_unwritten_memory_is_skipped_every_time",),
        "rng judged over memory nobody wrote: a verdict that changes run to run (a CI drift)",
    ),
    Mutant(
        "suite-padding-first-row",
        S,
        "fill(view)",
        "fill(view[1:])",
        (*sensitivity("test_padding_isolation_fills_the_first_padded_row"), pair("PoolsPaddedRows")),
        "the first padded row left unfilled (issue #15)",
    ),
    Mutant(
        "suite-padding-compare",
        S,
        "diff = first_difference(out, base_out)",
        "diff = None",
        (*sensitivity("test_padding_isolation_fills_the_first_padded_row"), pair("PoolsPaddedRows")),
        "real rows under different fills never compared",
    ),
    Mutant(
        "suite-padding-state",
        S,
        "diff = ctx.state_difference(state, base_state, use_scratch=True)",
        "diff = None",
        sensitivity("test_padding_isolation_catches_padded_rows_written_into_state"),
        "state written by padded rows never compared",
    ),
    Mutant(
        "suite-lifetime-no-later-runs",
        S,
        "        ctx.run(later, batch)  # a later batch",
        "        pass  # a later batch",
        (*sensitivity("test_output_lifetime_runs_later_batches"), pair("ReturnsStatsBuffer")),
        "output_lifetime runs no later batch (issue #15)",
    ),
    Mutant(
        "suite-lifetime-eager-path",
        S,
        "if eager_desc.mode is GraphMode.NONE:",
        "if False:",
        (*sensitivity("test_output_lifetime_runs_later_batches"), pair("ReturnsStatsBuffer")),
        "the eager path's outputs never checked",
    ),
    Mutant(
        "suite-address-identity",
        S,
        "if now is None or now[0] is not tensor or now[1] != ptr:",
        "if now is None or now[1] != ptr:",
        sensitivity("test_address_stability_checks_identity_not_only_the_address"),
        "address_stability ignores identity (issue #15)",
    ),
    Mutant(
        "suite-state-inputs",
        S,
        "diff = first_difference(graph_inputs, eager_inputs)",
        "diff = None",
        (*sensitivity("test_state_catches_an_input_mutated_in_one_element"), pair("MutatesInput")),
        "inputs mutated by eager never compared",
    ),
    Mutant(
        "suite-state-buffers",
        S,
        "diff = ctx.state_difference(graph_state, eager_state, use_scratch=False)",
        "diff = None",
        sensitivity("test_state_catches_a_buffer_that_ends_differently_in_one_element"),
        "module state after run() never compared",
    ),
    Mutant(
        "suite-determinism",
        S,
        "outs = ctx.from_one_state(poisoned, len(poisons))\n    diff = first_difference(outs[1], outs[0])",
        "outs = ctx.from_one_state(poisoned, len(poisons))\n    diff = None",
        (*sensitivity("test_determinism_catches_a_difference_in_one_column"), pair("UnregisteredState")),
        "two replays never compared",
    ),
    Mutant(
        "suite-rng",
        S,
        'diff = first_difference(draws["graph", s0], draws["eager", s0])',
        "diff = None",
        (pair("ReseedsInForward"),),
        "seeded draws of replay and eager never compared",
    ),
    Mutant(
        "suite-real-batches",
        S,
        "verdict = across_shapes(\n                    got, expected, padded,",
        "verdict = across_shapes(\n                    expected, expected, padded,",
        (pair("BatchStatisticsInBf16Kernel"), SCALE_TESTS),
        "real batches never compared with unpadded eager",
    ),
    Mutant(
        "suite-side-outputs",
        S,
        "diff = first_difference(got[name], expected[name], rtol=ctx.rtol, atol=ctx.atol)",
        "diff = None",
        (pair("StoresHidden"),),
        "side outputs never compared",
    ),
    Mutant(
        "suite-capture-safety",
        S,
        "if violations:\n            first = violations[0]",
        "if False:\n            first = violations[0]",
        sensitivity("test_capture_safety_lists_every_op_at_every_descriptor_before_capture"),
        "ops a graph cannot hold never reported",
    ),
    # -- checks/verify_context.py: state put back between comparisons -----------------------------------------------
    Mutant(
        "context-restore-noop",
        X,
        "t.copy_(snap[name])",
        "pass",
        (*sensitivity("test_a_counter_buffer_passes_every_check_and_is_put_back"), twin("BufferCounter")),
        "restore() puts nothing back",
    ),
    Mutant(
        "context-preserved-state",
        X,
        "finally:\n            self.restore(snap)",
        "finally:\n            pass",
        (*sensitivity("test_a_counter_buffer_passes_every_check_and_is_put_back"), twin("BufferCounter")),
        "preserved_state() does not restore",
    ),
    Mutant(
        "context-seed",
        X,
        "def seed_all(self, seed: int) -> None:\n        torch.manual_seed(seed)",
        "def seed_all(self, seed: int) -> None:\n        pass",
        (twin("DrawsNoise"),),
        "checks never seed the generator",
    ),
    # -- manager: copy-in, padding, cut (snippets kept small, so they follow the code between files) ------------
    Mutant(
        "manager-padding-views-first-row",
        GM,
        ".narrow(spec.dim, real, rows - real)))",
        ".narrow(spec.dim, real + 1, rows - real - 1)))",
        (*ROWS, *sensitivity("test_padding_isolation_fills_the_first_padded_row")),
        "padding_views leaves out the first padded row (issue #15)",
    ),
    Mutant(
        "manager-tail-first-row",
        GM,
        "tail = window.narrow(spec.dim, real, rows - real) if rows > real else None",
        "tail = window.narrow(spec.dim, real + 1, rows - real - 1) if rows > real + 1 else None",
        ROWS,
        "the first padded row keeps a stale value",
    ),
    Mutant("manager-no-pad-fill", MT, "tail.fill_(pad)", "pass", ROWS, "padded rows keep stale values"),
    Mutant(
        "manager-edge-first-row",
        MT,
        "tail.copy_(value[-1:].expand_as(tail))",
        "tail.copy_(value[:1].expand_as(tail))",
        ("tests/test_manager.py::test_edge_padding_repeats_the_last_real_row[emulate]",),
        "'edge' padding repeats the first real row",
    ),
    Mutant(
        "manager-mask",
        GM,
        "masks.append((self.state.is_padding[batch.num_tokens : tokens], True))",
        "masks.append((self.state.is_padding[batch.num_tokens : tokens], False))",
        (*ROWS, twin("MaskBySelect0")),
        "padded rows not marked in is_padding",
    ),
    Mutant(
        "manager-cut-rows",
        MT,
        "leaf = leaf.narrow(d, 0, min(count, leaf.shape[d]))",
        "leaf = leaf.narrow(d, 0, leaf.shape[d])",
        ROWS,
        "outputs not cut to the real rows",
    ),
    Mutant(
        "manager-cut-reqs",
        MT,
        'count = batch.num_tokens if kind == "tokens" else batch.num_reqs',
        "count = batch.num_tokens",
        ROWS,
        "per-request outputs cut by the token count",
    ),
    Mutant(
        "layout-full-shape",
        L,
        "if full != _count(kind, offset, max_tokens, max_reqs):",
        "if False:",
        ("tests/test_manager_rows.py::test_probes_must_agree_with_the_largest_batch",),
        "the largest batch's shape not checked against the probes (issue #15)",
    ),
    # -- plan: dispatch and its property checks -----------------------------------------------------------------------
    Mutant(
        "properties-check-rejects-any-exception",
        PP,
        "except ValueError:\n        return",
        "except Exception:\n        return",
        DISPATCH,
        "check_rejects accepts any exception (issue #15)",
    ),
    Mutant(
        "properties-completeness-one-token",
        PP,
        "if serving and batch.num_tokens > 0:",
        "if serving and batch.num_tokens > 1:",
        DISPATCH,
        "completeness skipped at one token (issue #15)",
    ),
    Mutant(
        "properties-group-bound",
        PP,
        "d.num_tokens >= num_tokens\n    ]",
        "d.num_tokens > num_tokens\n    ]",
        DISPATCH,
        "a graph of exactly the batch's size not a candidate for the checks",
    ),
    Mutant(
        "plan-full-before-piecewise",
        CP,
        "for mode in (GraphMode.FULL, GraphMode.PIECEWISE):\n            ascending",
        "for mode in (GraphMode.PIECEWISE, GraphMode.FULL):\n            ascending",
        DISPATCH,
        "PIECEWISE graphs tried before FULL ones",
    ),
    Mutant(
        "plan-exact-size",
        CP,
        "at = bisect_left(sizes, num_tokens)",
        "at = bisect_left(sizes, num_tokens + 1)",
        DISPATCH,
        "a batch of a captured size gets the next larger graph",
    ),
    Mutant(
        "plan-reqs-bound",
        CP,
        "and (desc.num_reqs is None or num_reqs <= desc.num_reqs)",
        "and (desc.num_reqs is None or num_reqs < desc.num_reqs)",
        DISPATCH,
        "a FULL graph refuses a batch of exactly its request count",
    ),
    Mutant(
        "plan-varlen-bound",
        CP,
        "max_query_len <= desc.max_query_len",
        "max_query_len < desc.max_query_len",
        DISPATCH,
        "a varlen decode graph refuses its own query length",
    ),
    Mutant(
        "plan-uniform",
        CP,
        "(desc.uniform_token_count is None or desc.uniform_token_count ==",
        "(desc.uniform_token_count is None or True or desc.uniform_token_count ==",
        DISPATCH,
        "uniform decode graphs serve mixed batches",
    ),
    Mutant(
        "plan-lora-case",
        CP,
        "return cases[bisect_left(cases, num_active_loras)]",
        "return cases[bisect_left(cases, num_active_loras) - 1]",
        DISPATCH,
        "active adapters mapped to a case too small to hold them",
    ),
    Mutant(
        "plan-fast-validation",
        CP,
        "and 0 <= num_reqs <= num_tokens",
        "and 0 <= num_reqs",
        DISPATCH,
        "more requests than tokens answered instead of rejected",
    ),
    Mutant(
        "plan-candidate-range",
        CP,
        "low = sizes[at - 1] + 1 if at else 1",
        "low = sizes[at - 1] if at else 1",
        DISPATCH,
        "candidate ranges overlap",
    ),
    # -- the engine, the registry and the report: every check runs, fails loudly, is told ----------------------
    Mutant(
        "engine-crash-passes",
        E,
        'return Outcome(check.name, desc, False, f"the check could not run: {step}{faults.described(exc)}")',
        'return Outcome(check.name, desc, True, f"the check could not run: {step}{faults.described(exc)}")',
        REGISTRY,
        "a check that raises passes",
    ),
    Mutant(
        "faults-oom-not-described",
        FA,
        "    oom = oom_detail(exc, device)\n",
        "    oom = None\n",
        FAULT_TESTS,
        "an out-of-memory failure does not say what was asked and free",
    ),
    Mutant(
        "engine-capture-failure-twice",
        E,
        "                    for d in to_capture\n                    if d not in manager.capture_failures\n",
        "                    for d in to_capture\n",
        ONE_EACH,
        "a failed capture is reported beside capture_safety's pass",
    ),
    Mutant(
        "engine-uncaptured-checked",
        E,
        'blocked.setdefault(\n                    outcome.descriptor, f"not captured: {check.name} failed for this descriptor"\n                )',
        "pass",
        ONE_EACH,
        "checks run on a descriptor that was never captured",
    ),
    Mutant(
        "registry-select-all",
        RG,
        "return tuple(c for c in known if c in chosen)",
        "return known",
        REGISTRY,
        "checks= selects nothing: every check runs",
    ),
    Mutant(
        "report-skips-hidden",
        RP,
        "        if not verbose:\n            for check, reason, where in",
        "        if False:\n            for check, reason, where in",
        ONE_EACH,
        "the report does not list skipped checks",
    ),
    Mutant(
        "fresh-no-harness-inputs",
        S,
        "second, made = drawn_inputs(ctx, second)",
        'made = ""',
        ONE_EACH,
        "with a deterministic make_inputs, fresh_inputs cannot run",
    ),
    Mutant(
        "fresh-harness-same-values",
        S,
        "drawn[name] = drawn_value(tensors[name], gen)",
        "drawn[name] = tensors[name]",
        ONE_EACH,
        "the harness's fresh values are the old ones",
    ),
    Mutant(
        "fresh-harness-ints-unchanged",
        S,
        "permuted = value.index_select(dim, perm.to(value.device))",
        "permuted = value",
        ONE_EACH,
        "integer rows are not permuted",
    ),
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
        X,
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
    # -- capture sizes from a trace (plan/trace.py, --cudagraph-trace) -------------------------------------
    Mutant(
        "trace-hull-keeps-useless-lines",
        TR,
        "if (b - b1) * (a1 - a2) <= (b2 - b1) * (a1 - a):",
        "if (b - b1) * (a1 - a2) < (b2 - b1) * (a1 - a) and False:",
        TRACE_TESTS,
        "the lower envelope keeps lines it should drop (the walk then stops on a worse one)",
    ),
    Mutant(
        "trace-walk-stops-early",
        TR,
        "slopes[head + 1] * x + inter[head + 1] <= slopes[head] * x + inter[head]",
        "slopes[head + 1] * x + inter[head + 1] < slopes[head] * x + inter[head] - 1",
        TRACE_TESTS,
        "the query walk stops before the best line",
    ),
    Mutant(
        "trace-cost-forgets-tokens",
        TR,
        "cur[j] = x * counts[j] - tokens[j] + slopes[head] * x + inter[head]",
        "cur[j] = x * counts[j] + slopes[head] * x + inter[head]",
        TRACE_TESTS,
        "the padding of a layer ignores the real tokens",
    ),
    Mutant(
        "trace-largest-not-forced",
        TR,
        "        if cur[m] is not None and (best_cost is None or cur[m] < best_cost):",
        "        if cur[m] is not None and (best_cost is None or cur[m] > best_cost):",
        TRACE_TESTS,
        "the worst number of sizes is kept instead of the best",
    ),
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
    # -- checks/floor.py: results of different shapes against the measured floor (issue #25) ----------
    Mutant(
        "floor-no-multiple",
        FL,
        "atol=a + FLOOR_MAX * s.max_f, figures=False)",
        "atol=a + 1e9, figures=False)",
        FLOOR_TESTS,
        "any difference from unpadded eager passes the floor's largest-difference test",
    ),
    Mutant(
        "floor-is-the-graph",
        FL,
        "f = torch.where(ok, pd - ed, 0.0)",
        "f = torch.where(ok, gd - ed, 0.0)",
        FLOOR_TESTS,
        "the floor is measured on the graph itself: no difference is ever beyond it",
    ),
    Mutant(
        "floor-systematic-off",
        FL,
        "if fit.share > max(SYSTEMATIC, CHANCE * chance) and _material(",
        "if False and _material(",
        (*FLOOR_TESTS, SCALE_TESTS),
        "a systematic difference (a few-percent scale from a branch on the token count) passes",
    ),
    Mutant(
        "floor-never-material",
        FL,
        "if bool(((part.abs() > atol + rtol * ed.abs()) & ok).any()):",
        "if False:",
        FLOOR_TESTS,
        "no systematic part is ever large enough to matter",
    ),
    Mutant(
        "floor-no-cap",
        FL,
        "if rms_e > 0 and rms_d > CAP * u * rms_e + tol_rms:",
        "if False:",
        (*FLOOR_TESTS, pair("BatchStatistics")),
        "a difference beyond what rounding can do passes on the floor",
    ),
    Mutant(
        "floor-nonfinite-dropped",
        FL,
        "if not torch.equal(finite_g, finite_e):",
        "if False:",
        FLOOR_TESTS,
        "NaN where eager is finite is measured as rounding",
    ),
    Mutant(
        "floor-integers-explained",
        FL,
        "unexplained = off & (g != p)",
        "unexplained = off & False",
        FLOOR_TESTS,
        "a token id no eager run gives passes as a flip",
    ),
    Mutant(
        "floor-always-measured",
        FL,
        "    if diff is None:\n        return Verdict(True, figures=_largest(got, expected))",
        "    if False:\n        return Verdict(True, figures=_largest(got, expected))",
        FLOOR_TESTS,
        "the floor is measured even where the tolerance settles it (a forward more per batch)",
    ),
    Mutant(
        "suite-smallest-batch-dropped",
        CX,
        "return batches if len(batches) <= 2 else [batches[0], batches[-1]]",
        "return batches[-1:]",
        (pair("BatchStatistics"), SCALE_TESTS),
        "real_batches runs only the batch without padding",
    ),
    # -- issue #38: the cross-shape question asked of eager in float64 (padded_size) --------------------
    Mutant(
        "reference-limit-never-exceeded",
        PS,
        "if d.why or d.relative > limits.get(d.path, REFERENCE_CAP * roundoff)]",
        "if d.why]",
        (*REFERENCE_TESTS, pair("DynamicNTKRotary")),
        "a difference across shapes of any size passes the float64 reference",
    ),
    Mutant(
        "reference-cap-loosened",
        RF,
        "REFERENCE_CAP = 64.0",
        "REFERENCE_CAP = 1e6",
        REFERENCE_TESTS,
        "the limit is a million times the reference's floor, not 64",
    ),
    Mutant(
        "reference-floor-without-noise",
        PS,
        "        noisy = runs.real(floor_at, noise=roundoff)",
        "        noisy = runs.real(floor_at, noise=1e-3)",
        REFERENCE_TESTS,
        "the floor is measured with noise far above rounding: an error just above the limit passes",
    ),
    Mutant(
        "reference-floor-holds-the-bug",
        PS,
        "        floors = {d.path: d.relative for d in leaf_differences(noisy, exact)}",
        "        floors = {d.path: d.relative for d in leaf_differences(runs.padded(floor_at), exact)}",
        REFERENCE_TESTS,
        "the floor is measured across shapes with the module itself: it grows with the bug",
    ),
    Mutant(
        "reference-capture-path-unnamed",
        PS,
        "    if path_differs and path_explains:",
        "    if False:",
        (pair("PlannedPerRequestCount"), "tests/test_verdicts.py"),
        "a module that computes otherwise under capture is named as a padded-size computation",
    ),
    Mutant(
        "reference-submodule-unnamed",
        PS,
        "            if diffs and (diffs[0].why or diffs[0].relative > limit):\n                return name_p",
        "            if False:\n                return name_p",
        REFERENCE_TESTS,
        "the first divergent submodule of a padded-size computation is never named",
    ),
    Mutant(
        "reference-never-queued",
        FN,
        "                reference.queue(\n",
        "                (lambda *a, **k: None)(\n",
        (*REFERENCE_TESTS, pair("BatchStatistics")),
        "real_batches leaves nothing to the reference: padded_size compares no batch",
    ),
    Mutant(
        "real-batches-program-uncompared",
        FN,
        "                diff = first_difference(got, at_padded)",
        "                diff = None",
        REFERENCE_TESTS,
        "with the reference, the graph's real rows are never held to eager at its padded shape",
    ),
    Mutant(
        "precision-views-copied",
        PR,
        "        if kind == _VIEW:\n            # On the tensor itself, so that a write through the view still lands there.\n            return func(*args, **kwargs)",
        "        if kind == _VIEW:\n            return _raised(func(*[_raised(a, _RAISE) for a in args], **kwargs), _RAISE)",
        PRECISION_TESTS,
        "a view of the module's state is a float64 copy: writes through it are lost",
    ),
    Mutant(
        "precision-fallback-silent",
        PR,
        "        self.record.fell_back.setdefault(what, _first_line(exc))",
        "        pass",
        PRECISION_TESTS,
        "an op run in float32 for want of a float64 kernel is not said",
    ),
    Mutant(
        "precision-noise-off",
        PR,
        "        return out * self._factor(out, noise)",
        "        return out",
        (*PRECISION_TESTS, *REFERENCE_TESTS),
        "the floor's noise is never added: the floor is zero",
    ),
    Mutant(
        "make-inputs-writes-taken-for-forwards",
        CX,
        "        self.observer.on_outside_writes.append(self._written_outside)",
        "        pass",
        (
            "examples/buggy/test_gallery.py::test_weights_synced_in_place_by_make_inputs_pass_and_rebound_ones_are_caught",
        ),
        "a weight sync in place by make_inputs fails state as if a forward wrote it",
    ),
    Mutant(
        "make-inputs-rebinds-unseen",
        FN,
        "    if ctx.rebound_outside:",
        "    if False:",
        (
            "tests/test_verdicts.py::test_a_weight_rebound_by_make_inputs_is_named_though_the_allocator_hands_its_address_back",
        ),
        "a weight make_inputs rebinds is missed when the allocator hands its old address back",
    ),
    # -- kernels outside the dispatcher (launches.py, the reference's and the emulator's use) -------------
    Mutant(
        "launches-hook-skipped",
        LA,
        "        return _HOOKS[-1](Launch(self, run, args, kwargs))",
        "        return run(self, *args, **kwargs)",
        LAUNCH_TESTS,
        "no Triton launch reaches a hook: the emulator replays a stale output, the reference misses the kernel",
    ),
    Mutant(
        "unwritten-outside-never-found",
        LA,
        "        return None if _marked(entry.tensor) else entry",
        "        return None",
        LAUNCH_TESTS,
        "memory an extension wrote where no op shows it is never found",
    ),
    Mutant(
        "precision-outside-roundoff-dropped",
        PR,
        "        self.record.roundoff = max(self.record.roundoff, roundoff)\n        if self.noise:",
        "        if self.noise:",
        LAUNCH_TESTS,
        "a kernel that holds float32's precision leaves the reference's limit at float64's",
    ),
    Mutant(
        "precision-outside-noise-off",
        PR,
        "            factor = self._factor(t, max(self.noise, roundoff))",
        "            factor = torch.ones_like(t)",
        LAUNCH_TESTS,
        "the floor's run puts no rounding on what a kernel outside the dispatcher wrote",
    ),
    Mutant(
        "precision-float32-tier-skipped",
        S,
        "    for tier in (torch.float64, torch.float32):",
        "    for tier in (torch.float64,):",
        (pair("BatchStatisticsInFloat32Kernel"),),
        "a forward that refuses float64 gets no reference at all, where float32's would run",
    ),
    Mutant(
        "emulator-launch-unrecorded",
        EM,
        "        self.steps.append(\n            _Step(\n                functools.partial(relaunch,",
        "        (\n            (\n                functools.partial(relaunch,",
        KERNEL_EXAMPLES,
        "the emulator runs a Triton launch at capture and never again: replay returns its stale output",
    ),
    Mutant(
        "emulator-unrecordable-silent",
        EM,
        '                raise Unrecordable(_unrecordable(entry.op, f"before {func} read it", call_site()))',
        "                pass",
        (f"{KERNEL_EXAMPLES[0]}::test_an_extension_is_held_to_the_float32_reference",),
        "an extension's write the emulator cannot replay is reported as stale graph memory",
    ),
    # -- observe.py and what verification copies --------------------------------------------------------
    Mutant(
        "observe-writes-unmarked",
        OB,
        "if arg.alias_info is not None and arg.alias_info.is_write:",
        "if False:",
        OBSERVE_TESTS,
        "no write is seen: what forwards write is found by fingerprint only, or not at all",
    ),
    Mutant(
        "observe-batch-norm",
        OB,
        'p: (3, 4, "running_mean", "running_var")',
        "p: ()",
        OBSERVE_TESTS,
        "batch norm's running statistics are not writes",
    ),
    Mutant(
        "observe-not-put-back",
        OB,
        "                        live[name].copy_(saved)",
        "                        pass",
        OBSERVE_TESTS,
        "restoring leaves what the forwards wrote",
    ),
    Mutant(
        "observe-tf32-ignored",
        OB,
        'return TF32 if device.type == "cuda" and _tf32_convolutions() else 2.0**-24',
        "return 2.0**-24",
        OBSERVE_TESTS,
        "TF32 convolutions taken for fp32 (resnet18 fails real_batches)",
    ),
    Mutant(
        "observe-fingerprint-unweighted",
        OB,
        "total[1] += weights.mul_(chunk).sum()",
        "total[1] += chunk.sum()",
        OBSERVE_TESTS,
        "two elements swapped keep the fingerprint",
    ),
    Mutant(
        "context-snapshot-everything",
        X,
        "snap = Snapshot({name: t.detach().clone() for name, t in self.observer.written_items()})",
        "snap = Snapshot({name: t.detach().clone() for name, t in self.observer.tensors()})",
        OBSERVE_TESTS,
        "every snapshot copies the weights (four copies of an 8B model at once)",
    ),
    Mutant(
        "engine-no-learning",
        E,
        "                _learn_writes(ctx, selected)",
        "                pass",
        OBSERVE_TESTS,
        "verification leaves what its forwards wrote in the module",
    ),
    Mutant(
        "engine-unseen-write-silent",
        E,
        '            f"forward writes {names} where no op shows it',
        '            f"" if True else f"forward writes {names} where no op shows it',
        OBSERVE_TESTS,
        "a write found by fingerprint is not said",
    ),
    Mutant(
        "engine-safety-not-listed",
        E,
        "            if capture_check is not None and error.op:",
        "            if False:",
        (*sensitivity("test_capture_safety_lists_every_op_at_every_descriptor_before_capture"),),
        "a descriptor the capture's guard stopped names its first op only",
    ),
    Mutant(
        "suite-state-eager-inputs",
        S,
        "eager_inputs = {name: padded[name] for name in graph_inputs}",
        "eager_inputs = graph_inputs",
        (pair("MutatesInput"),),
        "state compares the graph's inputs with themselves: a mutated input passes",
    ),
    Mutant(
        "cost-forwards-uncounted",
        CO,
        "cost.forwards += self.forwards - forwards",
        "cost.forwards += 0",
        OBSERVE_TESTS,
        "the report says no check ran a forward",
    ),
    # -- issue #26: integer padding, state on padded batches, the true cause named ----------------------
    Mutant(
        "observe-randomness-unseen",
        OB,
        "        elif draws_random(func):",
        "        elif False:",
        (*DIAGNOSES, pair("ReseedsInForward")),
        "no module draws random numbers: real_batches runs on noise",
    ),
    Mutant(
        "context-python-not-restored",
        X,
        "            _set_python_value(self.module, dotted, value)",
        "            pass",
        DIAGNOSES,
        "a Python counter is not put back between runs, nor after verification",
    ),
    Mutant(
        "observe-unwritten-read-unseen",
        OB,
        "                elif self.unwritten_read is None:",
        "                elif False:",
        (*OBSERVE_TESTS, pair("SplitKIntoEmpty")),
        "a read of memory nobody wrote is not seen",
    ),
    Mutant(
        "observe-writes-taken-for-reads",
        OB,
        "if place in written and not (place == 0 and in_place):",
        "if False:",
        OBSERVE_TESTS,
        "an op's out= (or a copy_) counts as a read of what it writes",
    ),
    Mutant(
        "context-uninitialized-unconfirmed",
        X,
        "if first_difference(outs[0], outs[1]) is not None:\n                    self._uninitialized = (",
        "if True:\n                    self._uninitialized = (",
        DIAGNOSES,
        "a read no poison changes the results of is a finding",
    ),
    Mutant(
        "engine-cause-not-named",
        E,
        "    if uninitialized and uninitialized not in outcome.message:",
        "    if False:",
        DIAGNOSES,
        "other failures of a module reading unwritten memory blame their own check",
    ),
    Mutant(
        "suite-integers-not-filled",
        S,
        "    for label, int_fill in _INT_FILLS:",
        "    for label, int_fill in []:",
        (pair("HashRoutedLoad"),),
        "padded integer rows keep their pad value",
    ),
    Mutant(
        "suite-declared-pads-filled",
        S,
        "        and name not in declared\n",
        "",
        ("examples/real_models/test_hf_bugs.py::test_fix_passes",),
        "a pad value the caller declared (padded positions are 0) is overwritten",
    ),
    Mutant(
        "suite-state-padded-skipped",
        S,
        '    return _state_padded(ctx, desc) or Outcome("state", desc, True)',
        '    return Outcome("state", desc, True)',
        DIAGNOSES,
        "state never compared after a padded batch",
    ),
    Mutant(
        "engine-eager-failure-per-descriptor",
        E,
        "    if len(failures) == len(shapes):",
        "    if False:",
        DIAGNOSES,
        "a module whose eager forward fails everywhere gets a capture failure per descriptor",
    ),
    Mutant(
        "engine-eager-failure-hides-capture-bug",
        E,
        "        if told is not None and told.ops:",
        "        if False:",
        DIAGNOSES,
        "a forward that fails everywhere at an op a graph cannot hold is told as eager's own failure",
    ),
    Mutant(
        "suite-op-before-failure-unnamed",
        S,
        "                if met:\n",
        "                if False:\n",
        DIAGNOSES,
        "a forward that fails eagerly names no op a graph cannot hold met on its way",
    ),
    Mutant(
        "report-quick-reads-as-failed",
        PRT,
        'f"{captured} of {planned} descriptors verified (quick mode)"\n        if quick and calls',
        'f"{captured}/{planned} descriptors captured"\n        if quick and calls',
        ("tests/test_plugin.py::test_terminal_summary_section",),
        'a passing quick run reads "2/3 captured"',
    ),
    Mutant(
        "compare-ulps-across-signs",
        C,
        "signed = finite & _same_sign(gp, ep)",
        "signed = finite",
        COMPARE_TESTS,
        "ULPs counted across a sign change (two billion for 0.3 against -0.2)",
    ),
    Mutant(
        "suite-snapshot-before-make",
        S,
        "        inputs = ctx.make(batch)\n        with ctx.preserved_state() as state0:\n"
        "            ctx.seed_all(ctx.seed)\n            got = ctx.run(",
        "        with ctx.preserved_state() as state0:\n            inputs = ctx.make(batch)\n"
        "            ctx.seed_all(ctx.seed)\n            got = ctx.run(",
        DIAGNOSES,
        "real_batches snapshots before make_inputs, the other checks after it",
    ),
    Mutant(
        "emulate-one-poison",
        EM,
        "data[offset : offset + size].fill_(POISON_BYTES[which])",
        "data[offset : offset + size].fill_(POISON_BYTES[0])",
        DIAGNOSES,
        "the graph's free memory is poisoned one way only: a replay reading it is never told",
    ),
    Mutant(
        "suite-graph-poison-unread",
        S,
        "        graph_diff = first_difference(outs[2], outs[0])",
        "        graph_diff = None",
        DIAGNOSES,
        "replays that read graph memory nobody wrote, below the dispatcher, pass determinism",
    ),
    # -- issue #27: the capturability table learned on a GPU -----------------------------------------
    Mutant(
        "guard-table-unasked",
        GD,
        "            found is None\n            and self.by_provenance\n            and not self.suspended\n            and table is not None\n            and not _is_view(func)",
        "            False\n            and self.by_provenance\n            and not self.suspended\n            and table is not None\n            and not _is_view(func)",
        (*CAPTURABILITY, pair("InvertsInForward")),
        "the emulator passes an op the table says CUDA refuses",
    ),
    Mutant(
        "guard-learned-outranked",
        GD,
        "            learned = self._learned(table, func, args, kwargs, exact=True)",
        "            learned = None",
        CAPTURABILITY,
        "a write through a host boolean mask, which CUDA captures, is refused by the general rule",
    ),
    Mutant(
        "guard-not-known-silent",
        GD,
        "                self.tracker.not_known.setdefault(str(func), self.tracker.path)",
        "                pass",
        CAPTURABILITY,
        "an op the table does not cover passes in silence",
    ),
    # -- issue #27: value rules, where shapes and values decide (held to the H200) ------------------
    Mutant(
        "rule-equal-shapes",
        CB,
        "    if a.shape != b.shape:",
        "    if False:",
        CAPTURABILITY,
        "torch.equal of two shapes, which returns early and CUDA captures, is refused",
    ),
    Mutant(
        "rule-isin-boundary",
        CB,
        "    if tests.numel() < few:",
        "    if tests.numel() <= few:",
        CAPTURABILITY,
        "isin at the heuristic's boundary, which sorts and syncs on CUDA, is held",
    ),
    Mutant(
        "rule-lu-batch",
        CB,
        "(m <= 128 and batch <= 16)",
        "m <= 128",
        CAPTURABILITY,
        "a batch of 17 LUs of 17 x 17, which takes MAGMA and syncs, is held",
    ),
    Mutant(
        "rule-segment-unsafe",
        CB,
        '    if _arg(args, kwargs, 6, "unsafe"):',
        "    if False:",
        CAPTURABILITY,
        "segment_reduce(unsafe=True), which checks nothing on the host, is refused",
    ),
    Mutant(
        "guard-value-rule-unasked",
        GD,
        "            ruled = value_rule(str(func), args, kwargs)",
        "            ruled = None",
        CAPTURABILITY,
        "the table's majority answer decides where sizes do (isin of many elements in few)",
    ),
    Mutant(
        "guard-one-hot-count-missed",
        GDV,
        "    elif num_classes == -1 and isinstance(labels, torch.Tensor) and labels.numel() > 0:",
        "    elif False:",
        (*CAPTURABILITY, pair("CountsClasses")),
        "one_hot without num_classes, which reads the labels back on CUDA, is held",
    ),
    Mutant(
        "guard-one-hot-cpu-check",
        GDV,
        "    torch.nn.functional.one_hot: _one_hot,\n",
        "",
        (*CAPTURABILITY, twin("CountsClassesGiven")),
        "one_hot with num_classes is refused for the CPU's own range check, which CUDA does not run",
    ),
    # -- issue #31: training graphs ---------------------------------------------------------------
    Mutant(
        "training-capturable-unread",
        TRC,
        '    if not all(held) and all("capturable" in g for g in opt.param_groups):',
        "    if False:",
        TRAINING_TESTS,
        "an optimizer with its step count on the host passes",
    ),
    Mutant(
        "training-replay-unheld",
        TRC,
        "        if diff is not None:\n            return _fail(\n                check,",
        "        if False:\n            return _fail(\n                check,",
        TRAINING_TESTS,
        "replays that train differently from eager pass",
    ),
    Mutant(
        "training-tolerance-for-all",
        TRC,
        "            if loose is None:\n                notes.append",
        "            if True:\n                notes.append",
        TRAINING_TESTS,
        "a gradient beyond the dtype's tolerance passes as another kernel's rounding",
    ),
    Mutant(
        "training-grads-unread",
        TRR,
        '            out[f"grad of {name}"] = p.grad',
        "            pass",
        TRAINING_TESTS,
        "a gradient that differs passes where the loss agrees",
    ),
    Mutant(
        "training-padding-unfilled",
        TRC,
        "                if full > rows:",
        "                if False:",
        TRAINING_TESTS,
        "padded rows that reach the loss or a BatchNorm's statistics pass",
    ),
    # -- issue #39: inputs that mark rows keep their pad value in training_padding ---------------------
    Mutant(
        "training-padding-marker-unseen",
        TRC,
        "        if extent is not None and _looks_like_a_marker(*extent, floating=value.is_floating_point()):",
        "        if False:",
        ("tests/test_training.py",),
        "a per-token weight forward receives is stressed as data: a correct masked step fails",
    ),
    Mutant(
        "training-padding-gate-unasked",
        TRC,
        "                changes(gates | {data}, gates) is not None",
        "                True",
        ("tests/test_training.py",),
        "an input that looks like a weight is taken as a marker without letting any data in",
    ),
    Mutant(
        "training-padding-gate-unneeded",
        TRC,
        "                and changes((gates - {name}) | {data}, gates - {name}) is None",
        "                and True",
        ("tests/test_training.py",),
        "an input is taken as a marker where another marker lets the data in without it",
    ),
    Mutant(
        "training-padding-ambiguity-unsaid",
        TRC,
        "    if name in marker_like:",
        "    if False:",
        ("tests/test_training.py",),
        "an input that may mark rows is named without how to declare one",
    ),
    Mutant(
        "training-padding-marker-unsaid",
        TRC,
        "        return Outcome(check, desc, passed=True, message=note)",
        "        return Outcome(check, desc, passed=True)",
        ("tests/test_training.py",),
        "an input taken as a marker is kept at its pad value in silence",
    ),
    Mutant(
        "training-floor-always",
        TRM,
        "    if _difference(again, want) is None:\n        return _difference(got, want)",
        "    if False:\n        return _difference(got, want)",
        TRAINING_TESTS,
        "a step eager reproduces bit for bit is held only within a tolerance",
    ),
    Mutant(
        "training-fused-not-capturable",
        TRC,
        'held = [bool(g.get("capturable")) or bool(g.get("fused")) for g in opt.param_groups]',
        'held = [bool(g.get("capturable")) for g in opt.param_groups]',
        TRAINING_TESTS,
        "a fused optimizer, which keeps its step count on the device, refused as host-counted",
    ),
    Mutant(
        "training-grads-let-go-unseen",
        TRC,
        "        if held is None or p.grad is held:\n            continue",
        "        if True:\n            continue",
        TRAINING_TESTS,
        "gradients set to None between replays go unnamed (the optimizer outside the graph skips them)",
    ),
    Mutant(
        "training-between-skipped",
        TRC,
        "        loss = graph.output.detach().clone()\n        sides.graphed.between()",
        "        loss = graph.output.detach().clone()",
        TRAINING_TESTS,
        "the loop's code between replays never runs on the graph's side",
    ),
    Mutant(
        "training-host-draw-unnamed",
        TRC,
        "    if first_difference(again, once, rtol=0.0, atol=0.0) is not None:",
        "    if False:",
        TRAINING_TESTS,
        "a value drawn on the host and frozen at capture (a dropout seed) passes within eager's own drift",
    ),
    Mutant(
        "training-scaler-unnamed",
        TRV,
        '        if frame.f_code.co_name == "step" and os.path.basename(frame.f_code.co_filename) == "grad_scaler.py":',
        "        if False:",
        TRAINING_TESTS,
        "GradScaler's host sync named without its cause and fix",
    ),
    Mutant(
        "training-real-batches-self",
        TRC,
        "            {key: got.get(key)},\n            {key: want},",
        "            {key: want},\n            {key: want},",
        TRAINING_TESTS,
        "the padded step compared with eager's unpadded step with itself: a loss divided by the padded count passes",
    ),
    Mutant(
        "training-real-batches-random",
        TRC,
        "    if observer.random_ops:",
        "    if False:",
        TRAINING_TESTS,
        "a step that draws random numbers held to eager on the unpadded batch, whose draws are others",
    ),
    Mutant(
        "training-runner-held-to-itself",
        TRV,
        "made = _made_step(step, copy_, opt, loss_fn) if graphed or not own else None",
        "made = _made_step(step, copy_, opt, loss_fn)",
        TRAINING_TESTS,
        "a step graphed by torch held to itself run eagerly, not to the default step",
    ),
    Mutant(
        "training-runner-skips-unread",
        TRV,
        '    skipped = graphed.not_graphed() if error is None else ""',
        '    skipped = ""',
        TRAINING_TESTS,
        "a step torch ran without its CUDA graphs passes its capture",
    ),
    Mutant(
        "training-start-unrestored",
        TRV,
        "    graphed.restore(start)  # the emulator's capture ran the step; CUDA's did not",
        "    pass",
        TRAINING_TESTS,
        "the emulator's capture, which ran the step, leaves the replays a step ahead of eager",
    ),
    Mutant(
        "compare-new-failure-missed",
        "pytest_cudagraph/plugin/compare_report.py",
        'if status == "failed" and was != "failed":',
        "if False:",
        (
            "tests/test_compare_report.py",
            "tests/test_plugin.py::test_compare_names_new_failures_and_new_passes_and_can_fail_the_run",
        ),
        "--cudagraph-compare misses a check that newly fails",
    ),
    Mutant(
        "compare-fail-ignored",
        "pytest_cudagraph/plugin/__init__.py",
        "                run.compare_fail\n                and state.comparison.new_failures",
        "                False\n                and state.comparison.new_failures",
        ("tests/test_plugin.py::test_compare_names_new_failures_and_new_passes_and_can_fail_the_run",),
        "--cudagraph-compare-fail passes a run with a new failure",
    ),
    Mutant(
        "report-skipped-passes",
        "pytest_cudagraph/checks/report.py",
        '"passed": None if self.skipped else self.passed,',
        '"passed": self.passed,',
        ("tests/test_plugin.py::test_json_report_content",),
        "a skipped check reported as passed (issue #29)",
    ),
    Mutant(
        "junit-failed-uncounted",
        "pytest_cudagraph/plugin/report.py",
        'failed += status == "failed"',
        "failed += 0",
        ("tests/test_plugin.py::test_the_schema_holds_the_reports_fields_and_fails_a_report_without_them",),
        "junit XML says no check failed",
    ),
    Mutant(
        "registry-deselect-ignored",
        "pytest_cudagraph/checks/registry.py",
        "chosen = [c for c in chosen if c not in dropped]",
        "chosen = list(chosen)",
        (
            "tests/test_registry.py::test_a_leading_minus_deselects_a_check",
            "tests/test_plugin.py::test_checks_option_and_ini_select_and_deselect_and_the_marker_wins",
        ),
        "--cudagraph-checks=-determinism runs determinism all the same",
    ),
    Mutant(
        "isolate-timeout-ignored",
        "pytest_cudagraph/plugin/isolate.py",
        "stdout, stderr = child.communicate(timeout=limit)",
        "stdout, stderr = child.communicate(timeout=None)",
        ("tests/test_isolate.py::test_a_hung_child_is_killed_with_its_group_and_named_with_its_phase",),
        "a hung isolated child hangs the run",
    ),
    Mutant(
        "capturability-empty-unseen",
        CB,
        "elif value.numel() == 0:",
        "elif False:",
        CAPTURABILITY,
        "an empty tensor lettered as a full one (an empty matrix refused where CUDA holds it)",
    ),
    Mutant(
        "capturability-empty-takes-refusal",
        CB,
        "if full is not None and full.kind == HELD:",
        "if full is not None:",
        CAPTURABILITY,
        "an empty tensor refused because a full one is",
    ),
    Mutant(
        "capturability-numbers-matter",
        CB,
        'tensors = letters.replace("s", "")',
        "tensors = letters",
        CAPTURABILITY,
        "an op learned with a dim argument is not known without it",
    ),
    Mutant(
        "capturability-any-kind-carries",
        CB,
        "            if all(letter in seen for letter in tensors):",
        "            if True:",
        CAPTURABILITY,
        "a verdict learned for integer indices carries over to a boolean mask",
    ),
    Mutant(
        "emulate-shape-change-replayed",
        EM,
        '            getattr(func, "overloadpacket", None) in _METADATA_IN_PLACE\n            and args',
        "            False\n            and args",
        CAPTURABILITY,
        "an in-place transpose_ is replayed as a step: replay fails on shapes",
    ),
    Mutant(
        "emulate-steps-not-frozen",
        EM,
        "            step.swap(lambda value: frozen if value is t else value)",
        "            pass",
        CAPTURABILITY,
        "steps before an in-place shape change read the tensor as it ends",
    ),
    # -- issue #28: a uniform decode graph for every query length -------------------------------------
    Mutant(
        "plan-one-query-length",
        CP,
        "                for q in cfg.query_lens:",
        "                for q in (cfg.decode_query_len,):",
        ("tests/test_plan_reference.py",),
        "decode_query_lens are ignored: shorter decode batches get no graph of their own",
    ),
    Mutant(
        "config-lengths-unbounded",
        "pytest_cudagraph/plan/config.py",
        "            above = [q for q in lens if q > decode_query_len]",
        "            above = []",
        ("tests/test_plan_validation.py",),
        "a query length above decode_query_len is accepted",
    ),
    Mutant(
        "suite-capture-path-unnamed",
        S,
        "        cause = _capture_path(\n            ctx, inputs, batch, state0, got, expected, None if ctx.batch_invariant else padded, rows\n        )",
        '        cause = ""',
        ("tests/test_verdicts.py",),
        "a module that computes something else under capture is blamed on the padded batch size (the floor of "
        "the module's own precision, where no float64 reference runs)",
    ),
    Mutant(
        "layout-probe-beyond-requests",
        L,
        "if t <= max_tokens and r <= max_reqs and t > r]",
        "if t <= max_tokens and t > r]",
        ("tests/test_manager_rows.py",),
        "the output probe runs the module with more requests than the plan holds (a device assert on a GPU)",
    ),
    Mutant(
        "settings-ini-bool-keyless",
        "pytest_cudagraph/plugin/settings.py",
        "    except (ValueError, pytest.UsageError) as exc:  # pytest 9 raises UsageError, without the key",
        "    except ValueError as exc:",
        ("tests/test_usage_errors.py",),
        "a bad ini boolean does not name its key",
    ),
]


# -- running -------------------------------------------------------------------------------------------------
@dataclass
class Result:
    mutant: Mutant
    status: str  # killed | survived | invalid | stale | error
    by: str = ""
    seconds: float = 0.0
    located: str = ""  # the file the snippet was found in
    log: list[str] = field(default_factory=list)


class Stale(Exception):
    pass


_NOT_SOURCE = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".hypothesis"}


def tree_files(tree: Path) -> list[str]:
    """What git would commit: tracked files and untracked ones it does not ignore (files only:
    a tracked file deleted in the working tree is left out). Outside git: every file but caches."""
    proc = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=tree, capture_output=True
    )
    if proc.returncode == 0:
        names = proc.stdout.decode().split("\0")
    else:
        names = [
            str(p.relative_to(tree))
            for p in tree.rglob("*")
            if not _NOT_SOURCE & set(p.relative_to(tree).parts) and not p.name.endswith(".egg-info")
        ]
    return sorted({name for name in names if name and (tree / name).is_file()})


def copy_tree(tree: Path, files: Iterable[str], dest: Path) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / name, target)


def locate(copy: Path, mutant: Mutant) -> tuple[Path, str, str]:
    """(file, original, replacement) of the first variant whose snippet is found exactly once: in
    the file named, else (a mutant of code that moves, ``MOVING``) in exactly one file of the
    package. Elsewhere a snippet outside its file is stale: the table would name the wrong file."""
    named = copy / mutant.file
    sources = {p: p.read_text() for p in sorted((copy / PACKAGE).rglob("*.py"))}
    seen = []
    for original, replacement in mutant.variants:
        if named.is_file() and named.read_text().count(original) == 1:
            return named, original, replacement
        hits = [(p, text.count(original)) for p, text in sources.items() if original in text]
        if mutant.moving and len(hits) == 1 and hits[0][1] == 1:
            return hits[0][0], original, replacement
        where = ", ".join(f"{p.relative_to(copy)} x{n}" for p, n in hits) or "nowhere"
        seen.append(f"{original!r} found {where}")
    raise Stale(
        f"stale mutant {mutant.id}: snippet {'; '.join(seen)} (wanted once, in {mutant.file}"
        + (" or in one file of the package)" if mutant.moving else ")")
    )


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def import_error(copy: Path, module: str) -> str | None:
    """None when the package imports from ``copy`` (checked by its ``__file__``) with ``module`` in it."""
    code = f"import {PACKAGE}, importlib; importlib.import_module({module!r}); print({PACKAGE}.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit status {proc.returncode}"
    where = Path(proc.stdout.strip().splitlines()[-1]).resolve()
    if not where.is_relative_to(copy.resolve()):
        raise RuntimeError(
            f"{PACKAGE} imports from {where}, not from the copy {copy}: PYTHONPATH does not win"
        )
    return None


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (.+?)(?: - |$)", line)  # a test id may hold spaces in its brackets
        if m:
            return m.group(2)
    return ""


def pytest_run(copy: Path, args: Sequence[str], timeout: float) -> tuple[int | None, str]:
    """(exit status or None on timeout, the first failing test or the output's tail)."""
    try:
        proc = subprocess.run(
            [sys.executable, *PYTEST, *args],
            cwd=copy,
            env=_env(copy),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s"
    output = proc.stdout + proc.stderr
    first = _first_failure(output)
    if not first:
        tail = [line for line in output.strip().splitlines() if line.strip()]
        first = tail[-1] if tail else ""
    return proc.returncode, first


def module_name(path: Path, copy: Path) -> str:
    return ".".join(path.relative_to(copy).with_suffix("").parts)


def run_mutant(
    mutant: Mutant, tree: Path, files: list[str], *, fast: bool, timeout: float, keep: bool, scratch: Path
) -> Result:
    start = time.monotonic()
    copy = Path(tempfile.mkdtemp(prefix=f"{mutant.id}-", dir=scratch))
    try:
        copy_tree(tree, files, copy)
        try:
            target, original, replacement = locate(copy, mutant)
        except Stale as exc:
            return Result(mutant, "stale", str(exc), time.monotonic() - start)
        located = str(target.relative_to(copy))
        target.write_text(target.read_text().replace(original, replacement, 1))
        broken = import_error(copy, module_name(target, copy))
        if broken is not None:
            return Result(mutant, "invalid", f"does not import: {broken}", time.monotonic() - start, located)
        runs = [list(mutant.tests)] + ([] if fast else [[path] for path in WHOLE_SUITE])
        for args in runs:
            code, first = pytest_run(copy, args, timeout)
            if code is None:
                return Result(
                    mutant, "killed", f"{' '.join(args)}: {first}", time.monotonic() - start, located
                )
            if code in (1, 2, 3):  # tests failed, interrupted (collection), internal error
                return Result(mutant, "killed", first, time.monotonic() - start, located)
            if code != 0:  # usage error (a test id that does not exist), no tests collected
                return Result(
                    mutant,
                    "error",
                    f"pytest {' '.join(args)} exited {code}: {first}",
                    time.monotonic() - start,
                    located,
                )
        what = "targeted tests" if fast else "targeted tests, tests/ and examples/"
        return Result(mutant, "survived", f"{what} passed", time.monotonic() - start, located)
    finally:
        if keep:
            print(f"  kept {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def baseline(
    tree: Path, files: list[str], mutants: Sequence[Mutant], timeout: float, scratch: Path
) -> str | None:
    """None when the unmutated copy imports and passes every selected mutant's targeted tests."""
    copy = Path(tempfile.mkdtemp(prefix="baseline-", dir=scratch))
    try:
        copy_tree(tree, files, copy)
        for mutant in mutants:
            locate(copy, mutant)  # raises Stale
        broken = import_error(copy, f"{PACKAGE}.checks")
        if broken is not None:
            return f"the unmutated tree does not import: {broken}"
        tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
        code, first = pytest_run(copy, tests, timeout)
        if code != 0:
            return f"the unmutated tree fails the targeted tests (exit {code}): {first}"
        return None
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def table(results: Sequence[Result]) -> str:
    rows = [("id", "file", "result", "by", "s")]
    for r in results:
        name = r.located or r.mutant.file
        name = name.removeprefix(f"{PACKAGE}/") + (" *" if r.mutant.moving else "")
        rows.append((r.mutant.id, name, r.status, r.by, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        lines.append(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
            + "  "
            + row[4].rjust(6)
        )
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> str:
    count = {
        s: sum(r.status == s for r in results) for s in ("killed", "survived", "invalid", "stale", "error")
    }
    valid = count["killed"] + count["survived"]
    rate = f"{100 * count['killed'] / valid:.1f}%" if valid else "n/a"
    parts = [f"kill rate {count['killed']}/{valid} = {rate}"]
    parts += [f"{n} {s}" for s, n in count.items() if n and s not in ("killed",)]
    text = "; ".join(parts)
    survivors = [r.mutant.id for r in results if r.status == "survived"]
    if survivors:
        text += "\nsurvived: " + ", ".join(survivors)
    return (
        text
        + "\n(* = snippet looked for in the whole package if it moved: manager/*, checks/builtin/*, checks/engine.py)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--only", action="append", default=[], metavar="ID", help="run this mutant (repeatable)"
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default 1)")
    parser.add_argument("--fast", action="store_true", help="targeted tests only, not the whole suite")
    parser.add_argument("--tree", type=Path, default=REPO, help="the repository to copy (default: this one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run (default 1800)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated baseline run")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies (paths on stderr)")
    args = parser.parse_args(argv)

    ids = [m.id for m in MUTANTS]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        parser.error(f"duplicate mutant ids {sorted(duplicates)}")
    unknown = [i for i in args.only if i not in ids]
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; see --list")
    selected = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.list:
        for m in selected:
            print(
                f"{m.id}{' *' if m.moving else ''}\n    {m.file}: {m.about}\n    tests: {' '.join(m.tests)}"
            )
        print(f"{len(selected)} mutants")
        return 0

    # Every copy lives under one folder, removed at the end, on Ctrl-C and on SIGTERM too.
    scratch = Path(tempfile.mkdtemp(prefix="mutants-"))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args, selected, scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, selected: Sequence[Mutant], scratch: Path) -> int:
    tree = args.tree.resolve()
    files = tree_files(tree)
    started = time.monotonic()
    if not args.no_baseline:
        try:
            problem = baseline(tree, files, selected, args.timeout, scratch)
        except Stale as exc:
            problem = str(exc)
        if problem is not None:
            print(f"baseline: {problem}", file=sys.stderr)
            return 2
        print(
            f"baseline: the unmutated copy of {tree} passes the targeted tests "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )

    def one(mutant: Mutant) -> Result:
        result = run_mutant(
            mutant, tree, files, fast=args.fast, timeout=args.timeout, keep=args.keep, scratch=scratch
        )
        print(f"  {result.status:8} {mutant.id} ({result.seconds:.1f} s) {result.by}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, selected))
    print()
    print(table(results))
    print()
    mode = (
        "targeted tests only (--fast)"
        if args.fast
        else "targeted tests, then tests/ and examples/ for survivors"
    )
    print(f"{len(results)} mutants of {tree}, {mode}, {time.monotonic() - started:.0f} s")
    print(summary(results))
    if any(r.status in ("stale", "error") for r in results):
        return 2
    return 1 if any(r.status == "survived" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
