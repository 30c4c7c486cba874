"""The mutants of issue #57's causes: a Python input held per graph, host numbers that seed a kernel,
attributes changed outside forward, where two runs first differ, the reference's precision in words."""

from __future__ import annotations

from ..common import CX, MS, PH, PR, PS, RP, Mutant, S, pair, twin

CAUSE_TESTS = "tests/test_causes.py"
OUTSIDE_TESTS = "tests/test_outside_state.py"
OUT = "pytest_cudagraph/checks/outside.py"

CAUSES: list[Mutant] = [
    # -- issue #57: every failure names its true cause ----------------------------------------------------
    Mutant(
        "causes-python-value-not-held-per-graph",
        "pytest_cudagraph/manager/capture.py",
        "self.state.values_at[desc.num_tokens, reqs] = {n: sample[n] for n in self.state.value_names}",
        "pass",
        (
            f"{CAUSE_TESTS}::test_the_manager_replays_a_python_number_as_captured_and_runs_eagerly_with_the_one_given",
        ),
        "every graph holds the largest shape's Python value, not its own capture's",
    ),
    Mutant(
        "causes-held-values-never-differ",
        PH,
        "and not same_value(padded[name], inputs[name])",
        "and same_value(padded[name], inputs[name])",
        (pair("ScalesByMaxSeqLen"),),
        "a Python input the graph holds at another value than the batch's is never named",
    ),
    Mutant(
        "causes-held-value-padded-size-unasked",
        PS,
        "if _worst(leaf_differences(with_batch_values, got), limits, roundoff) is not None:",
        "if False:",
        (pair("ScalesByMaxSeqLen"),),
        "padded_size blames the padded size for a Python input's value",
    ),
    Mutant(
        "causes-held-value-real-batches-unasked",
        S,
        "first_difference(runs[0], runs[2]) is None:",
        "first_difference(runs[0], runs[2]) is not None:",
        (
            f"{CAUSE_TESTS}::test_a_python_number_that_decides_the_result_is_named_with_both_values_where_no_float64_runs",
        ),
        "real_batches (no float64 reference) blames the padded size for a Python input's value",
    ),
    Mutant(
        "causes-host-numbers-unmoved-taken-as-moved",
        "pytest_cudagraph/guard/host_numbers.py",
        "if na == nb and va != vb",
        "if na == nb and va == vb",
        (twin("DeviceOffsetSampler"),),
        "a seed that never moves is taken for a moving counter",
    ),
    Mutant(
        "causes-host-numbers-in-aten-ops",
        CX,
        "                if not call.kernel:\n                    continue",
        "                if False:\n                    continue",
        (pair("PythonCounter"),),
        "Python state a plain ATen op reads (x * self.calls) is told as a kernel's seed",
    ),
    Mutant(
        "causes-rng-host-draws-unnamed",
        S,
        "    host = ctx.host_draws()\n    if host:",
        "    host = ctx.host_draws()\n    if False:",
        (pair("HostOffsetSampler"),),
        "rng says the module draws nothing where a kernel repeats the capture's draw",
    ),
    Mutant(
        "causes-attributes-never-confirmed-alone",
        S,
        "        return first_difference(graph, held) is None\n",
        "        return True\n",
        (
            f"{CAUSE_TESTS}::test_a_python_attribute_a_refit_changes_is_named_with_its_values_at_capture_and_now",
        ),
        "every changed attribute is named, the one forward reads among any others",
    ),
    Mutant(
        "causes-first-call-not-differing",
        "pytest_cudagraph/checks/divergence.py",
        "or not differs(cut, b):",
        "or differs(cut, b):",
        (f"{CAUSE_TESTS}::test_a_bug_in_the_users_wrapper_around_a_hugging_face_model_is_named_at_its_line",),
        "the first call whose results agree is named as where they differ",
    ),
    Mutant(
        "causes-launch-internals-taken-for-the-forward",
        "pytest_cudagraph/checks/divergence.py",
        "return bool(self._stack) and self._stack[-1] in self.chain and not self._launching",
        "return bool(self._stack) and self._stack[-1] in self.chain",
        (f"{CAUSE_TESTS}::test_a_kernel_bug_is_named_at_the_kernels_caller_not_at_the_submodule_after_it",),
        "what a Triton launch runs on the way is named in place of the kernel",
    ),
    Mutant(
        "causes-quick-sizes-cut-alone",
        "pytest_cudagraph/manager/output_rows.py",
        "            own[i] = _apply(own[i], lead, later)",
        "            pass",
        (f"{CAUSE_TESTS}::test_a_bug_in_the_users_wrapper_around_a_hugging_face_model_is_named_at_its_line",),
        "quick mode cuts an uncaptured size's (1, T, V) output by requests alone: a correct model refused",
    ),
    Mutant(
        "causes-precision-kept-said-less",
        PR,
        """if held != f"{self.tier}'s precision\"""",
        "if held != self.tier",
        (f"{CAUSE_TESTS}::test_a_kernel_that_keeps_the_references_precision_is_not_said_to_hold_less",),
        "a kernel that keeps float64's precision is said to hold less",
    ),
    Mutant(
        "causes-held-value-always-per-shape",
        PH,
        "return all(same_value(made.get(name), at) for name, (at, _) in held.items())",
        "return True",
        ("examples/buggy/test_gallery.py::test_python_scalar_drawn_per_batch_is_held_per_graph_and_named",),
        "a temperature drawn per batch is told to take one value for every size",
    ),
    # -- issue #69: state forward reads from outside the module ---------------------------------------------
    Mutant(
        "outside-not-held-at-capture",
        PH,
        "self.at_capture[desc] = {**self.now(), **self.outside_now()}",
        "self.at_capture[desc] = self.now()",
        (pair("ReadsTokenCount"), pair("ReadsReplacedTemperature")),
        "what forward reads from a forward context is not kept at capture: its change goes unnamed",
    ),
    Mutant(
        "outside-tensor-by-shape",
        OUT,
        "    if isinstance(a, HeldTensor) or isinstance(b, HeldTensor):\n        return bool(a == b)",
        "    if isinstance(a, HeldTensor) or isinstance(b, HeldTensor):\n        return True",
        (pair("ReadsReplacedTemperature"),),
        "a tensor put in place of the captured one counts as the same: a replaced tensor goes unnamed",
    ),
    Mutant(
        "outside-written-not-learned",
        MS,
        "            self.python_written += moved",
        "            self.python_written += []",
        (pair("CountsStepsInDict"),),
        "a counter forward moves in a module-level dict is not put back: eager is called nondeterministic",
    ),
    Mutant(
        "outside-batch-context-not-put-back",
        PH,
        "                undo.append(outside.set(name, value))",
        "                pass",
        (
            f"{OUTSIDE_TESTS}::test_each_batch_runs_with_its_own_forward_context_and_padding_names_the_held_value",
        ),
        "padded_size's float64 runs read the last batch's forward context: eager blamed for the padded size",
    ),
    Mutant(
        "outside-site-of-a-local-is-its-use",
        OUT,
        "                locals_[ins.argval] = (current, at)",
        '                locals_[ins.argval] = (current, "")',
        (pair("ReadsTokenCount"),),
        "a value read into a local is named without the line that read it",
    ),
    Mutant(
        "outside-read-anything",
        OUT,
        "p == place.name and (steps[: len(s)] == s or s[: len(steps)] == steps)",
        "p == place.name",
        (f"{OUTSIDE_TESTS}::test_only_what_forward_takes_from_a_place_counts_as_read",),
        "every field of a forward context is taken as read where forward reads one",
    ),
    Mutant(
        "outside-floor-printed-for-draws",
        RP,
        "        if anew:\n",
        "        if False:\n",
        (
            f"{OUTSIDE_TESTS}::test_a_host_counter_in_plain_arithmetic_is_named_with_its_values_and_no_floor_is_printed",
        ),
        "the summary prints a float64 floor for a module that draws anew on every call",
    ),
    Mutant(
        "outside-padding-hint-unsaid",
        S,
        "    moving = ctx.python.outside_moving(desc)\n    if not moving:",
        "    moving = ctx.python.outside_moving(desc)\n    if True:",
        (
            f"{OUTSIDE_TESTS}::test_each_batch_runs_with_its_own_forward_context_and_padding_names_the_held_value",
        ),
        "padding_isolation blames the padding alone where a graph holds a forward context's count",
    ),
]
