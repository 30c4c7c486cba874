"""The mutants of bad input (#58): each rule that refuses a keyword, an option, an environment value,
an output path or make_inputs' results in one line, or refuses to pass a verification that verified
nothing, taken away; tests/test_bad_input.py must fail each."""

from __future__ import annotations

from ..common import PL, Mutant

T = "tests/test_bad_input.py"


def _t(*names: str) -> tuple[str, ...]:
    return tuple(f"{T}::{name}" for name in names)


KEYWORD = _t("test_a_bad_keyword_is_one_line")

USAGE: list[Mutant] = [
    # -- verify()'s keywords (options.py, plan/, checks/engine.py) ------------------------------------
    Mutant(
        "usage-nan-tolerance",
        "pytest_cudagraph/plan/validate.py",
        "        or not math.isfinite(value)\n",
        "",
        KEYWORD,
        "atol=nan and rtol=inf are accepted: every comparison passes whatever the values",
    ),
    Mutant(
        "usage-seed-unbounded",
        "pytest_cudagraph/options.py",
        "or not low <= self.seed <= high:",
        ":",
        KEYWORD,
        "seed=2**70 reaches torch.manual_seed, which overflows with a traceback",
    ),
    Mutant(
        "usage-empty-batches",
        "pytest_cudagraph/options.py",
        "    if not found:\n",
        "    if False:\n",
        KEYWORD,
        "batches=[] passes, real_batches skipped everywhere",
    ),
    Mutant(
        "usage-bytes-sizes",
        "pytest_cudagraph/plan/config.py",
        "    elif isinstance(given, (bytes, bytearray, Mapping)):",
        "    elif isinstance(given, Mapping):",
        KEYWORD,
        "capture_sizes=b'1,2' verifies sizes 49, 44 and 50",
    ),
    Mutant(
        "usage-no-did-you-mean",
        "pytest_cudagraph/plan/validate.py",
        '    return f" (did you mean {close[0]!r}?)" if close else ""',
        '    return ""',
        KEYWORD,
        "an unknown keyword is named without the nearest known one",
    ),
    Mutant(
        "usage-plan-without-graph",
        "pytest_cudagraph/checks/arguments.py",
        "    if not plan.descriptors:\n",
        "    if False:\n",
        _t("test_a_plan_with_no_graph_is_refused_not_passed"),
        "mode='NONE' reports '0 of 0 descriptors verified ... all checks passed'",
    ),
    Mutant(
        "usage-batches-no-graph-serves",
        "pytest_cudagraph/checks/engine.py",
        "    if opts.batches is not None and all(",
        "    if False and all(",
        _t("test_batches_that_no_graph_serves_are_refused"),
        "batches that every run eagerly pass with real_batches skipped everywhere",
    ),
    Mutant(
        "usage-nan-outputs-compared",
        "pytest_cudagraph/checks/compare.py",
        "        if t.numel() and bool(torch.isfinite(t).any()):",
        "        if t.numel():",
        _t("test_outputs_nan_everywhere_are_not_verified_and_a_leak_is_caught_on_finite_inputs"),
        "all-NaN inputs verify as passing, and hide a padding leak",
    ),
    Mutant(
        "usage-scriptmodule",
        "pytest_cudagraph/manager/layout.py",
        "    if isinstance(module, torch.jit.ScriptModule):",
        "    if False:",
        _t("test_a_torchscript_module_is_told_as_such"),
        "a ScriptModule fails inside torch's hook registration",
    ),
    Mutant(
        "usage-device-unchecked",
        "pytest_cudagraph/backends/factory.py",
        "    dev = as_device(device)",
        "    dev = torch.device(device) if device is not None else None",
        KEYWORD,
        "device='tpu' is torch's own error, with a traceback",
    ),
    Mutant(
        "usage-endless-eager-submodules",
        "pytest_cudagraph/manager/pieces.py",
        "        if len(items) > MAX_ITEMS or isinstance(spec, (bytes, bytearray)):",
        "        if False:",
        KEYWORD,
        "an endless eager_submodules is read as far as MAX_ITEMS and then said to name no submodule",
    ),
    # -- make_inputs' results (manager/inputs.py) ----------------------------------------------------------
    Mutant(
        "usage-unreadable-input",
        "pytest_cudagraph/manager/inputs.py",
        "        if why is not None:",
        "        if False:",
        _t("test_an_input_the_harness_cannot_read_is_one_line"),
        "a numpy array, a sparse tensor or a nested dict crashes inside the manager",
    ),
    Mutant(
        "usage-key-not-a-string",
        "pytest_cudagraph/manager/inputs.py",
        "        if not isinstance(key, str):",
        "        if False:",
        _t("test_a_key_that_is_not_a_string_is_named"),
        "make_inputs returning {0: x} is not named for its key",
    ),
    # -- files the plugin writes (files.py, settings.py) ---------------------------------------------------
    Mutant(
        "usage-replaces-a-fifo",
        "pytest_cudagraph/files.py",
        "    if not stat.S_ISREG(mode):",
        "    if False:",
        _t(
            "test_an_output_path_that_is_not_a_regular_file_is_never_replaced",
            "test_a_report_path_that_is_a_fifo_stops_the_run",
        ),
        "a report path that is a FIFO or a device is opened, or replaced by a plain file",
    ),
    Mutant(
        "usage-empty-path-option",
        "pytest_cudagraph/plugin/settings.py",
        "    if option is not None and not str(option).strip():",
        "    if False:",
        _t("test_an_empty_path_option_is_a_usage_error"),
        "--cudagraph-report= (empty) writes nothing, silently",
    ),
    # -- options and the environment ------------------------------------------------------------------------
    Mutant(
        "usage-sizes-option-unbounded",
        "pytest_cudagraph/plugin/option_table.py",
        "        if item > MAX_CAPTURE_TOKENS:",
        "        if False:",
        _t("test_a_numeric_option_beyond_its_bound_stops_the_run"),
        "--cudagraph-sizes=99999999999999 passes start-up",
    ),
    Mutant(
        "usage-threads-unbounded",
        "pytest_cudagraph/environment.py",
        "    if not 0 <= count <= MAX_THREADS:",
        "    if not 0 <= count:",
        _t("test_the_thread_count_is_bounded_where_torch_would_crash"),
        "PYTEST_CUDAGRAPH_THREADS=100000 reaches torch: a segmentation fault in observe.bit_sums",
    ),
    Mutant(
        "usage-environment-unchecked-at-start",
        PL,
        "    settings.check_environment()  # a value the plugin cannot read stops the run here (exit 4)",
        "    pass",
        _t("test_a_bad_environment_value_stops_the_run_before_collection"),
        "PYTEST_CUDAGRAPH_CAPTURE=bogus fails every test instead of stopping the run",
    ),
    Mutant(
        "usage-environment-false-is-true",
        "pytest_cudagraph/environment.py",
        '_FALSE = ("n", "no", "f", "false", "off", "0")',
        '_FALSE = ("0",)',
        _t("test_booleans_in_the_environment_read_as_the_ini_reads_them"),
        "PYTEST_CUDAGRAPH_MEMORY_CHECK=false leaves the check on",
    ),
    # -- the marker and the fixtures ----------------------------------------------------------------------
    Mutant(
        "usage-marker-plan-unchecked",
        "pytest_cudagraph/plugin/settings.py",
        "        CaptureConfig(**plan)\n",
        "",
        _t("test_a_malformed_marker_or_keyword_fails_its_own_test_in_one_line"),
        "a marker's mode='BOGUS' fails in the fixture with a traceback, not at set-up in one line",
    ),
    Mutant(
        "usage-fixture-traceback",
        "pytest_cudagraph/plugin/harness.py",
        '        return _usage("cudagraph_verify_training", lambda: self._verify(module, make_inputs, loss_fn, **call))',
        "        return self._verify(module, make_inputs, loss_fn, **call)",
        _t("test_a_malformed_marker_or_keyword_fails_its_own_test_in_one_line"),
        "cudagraph_verify_training's bad keyword is a traceback through the package",
    ),
    # -- a module the fixtures cannot run, scratch_state, --help's check names (#66) -----------------------
    Mutant(
        "usage-module-class-as-a-function",
        "pytest_cudagraph/manager/layout.py",
        "    if isinstance(module, type) and issubclass(module, torch.nn.Module):",
        "    if False:",
        _t(
            "test_a_module_class_for_an_instance_is_named",
            "test_a_module_the_fixtures_cannot_run_fails_its_test_in_one_line",
        ),
        "cudagraph_verify(M, ...) says 'got a function (type 'M')' and to wrap the code in a Module, not M()",
    ),
    Mutant(
        "usage-scratch-state-traceback",
        "pytest_cudagraph/checks/module_state.py",
        "            raise UsageError(_not_state(module, unknown, names))",
        "            raise ValueError(_not_state(module, unknown, names))",
        _t(
            "test_a_scratch_state_that_names_no_buffer_is_one_line",
            "test_a_module_the_fixtures_cannot_run_fails_its_test_in_one_line",
        ),
        "scratch_state={'nope': 0} is a ValueError traceback through the package from every fixture",
    ),
    Mutant(
        "usage-scratch-state-no-buffers-named",
        "pytest_cudagraph/checks/module_state.py",
        '        f"its buffers are {listed(held)}"\n        if held\n',
        '        f"its buffers are {listed(names)}"\n        if names\n',
        _t("test_a_scratch_state_that_names_no_buffer_is_one_line"),
        "a scratch_state naming no buffer lists the module's parameters as its buffers",
    ),
    Mutant(
        "usage-runner-forward-raises-traceback",
        "pytest_cudagraph/runner/runner_context.py",
        "                raise self._forward_raises(exc, self.batch(n)) from exc",
        "                raise",
        _t(
            "test_a_forward_that_raises_under_verify_runner_is_one_line_at_the_users_line",
            "test_a_module_the_fixtures_cannot_run_fails_its_test_in_one_line",
        ),
        "cudagraph_verify_runner given a module whose forward raises fails with the exception's traceback",
    ),
    Mutant(
        "usage-bench-forward-raises-traceback",
        "pytest_cudagraph/bench/fixture.py",
        "                _forward_raises(manager, exc)  # the module's own exception, told in one line",
        "                pass",
        (
            "tests/test_bench.py::test_fixture_given_a_module_class_or_a_forward_that_raises_fails_in_one_line",
        ),
        "cudagraph_benchmark given a module whose forward raises fails with a CaptureError traceback",
    ),
    Mutant(
        "usage-bench-capture-failure-told-as-forward",
        "pytest_cudagraph/bench/fixture.py",
        "        manager.eager(**manager.make_inputs(desc.num_tokens, reqs))",
        "        raise failed.__cause__ or failed",
        ("tests/test_bench.py::test_a_capture_that_fails_where_eager_runs_stays_a_capture_error",),
        "a capture that fails where the eager forward runs is told as the forward raising",
    ),
    Mutant(
        "usage-forward-raises-no-user-line",
        "pytest_cudagraph/guard/tracker.py",
        "        if _users(code.co_filename):",
        "        if False:",
        (
            "tests/test_bench.py::test_fixture_given_a_module_class_or_a_forward_that_raises_fails_in_one_line",
            f"{T}::test_a_forward_that_raises_under_verify_runner_is_one_line_at_the_users_line",
        ),
        "a forward that raises is told without the line of the user's code it left",
    ),
    Mutant(
        "usage-help-no-check-names",
        "pytest_cudagraph/options.py",
        """            f"The checks: {', '.join(BUILTIN_CHECKS)}, and those a conftest's pytest_cudagraph_checks hook adds",""",
        '            "",',
        ("tests/test_plugin.py::test_help_lists_the_builtin_checks_under_the_checks_option",),
        "pytest --help does not say which checks --cudagraph-checks can name",
    ),
    Mutant(
        "usage-help-check-table-drifts",
        "pytest_cudagraph/options.py",
        '    "rng",\n    "output_lifetime",\n',
        '    "output_lifetime",\n',
        ("tests/test_registry.py::test_the_registry_is_the_table_help_lists_without_torch",),
        "--help's list of checks leaves out one the registry runs",
    ),
]
