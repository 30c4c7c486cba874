"""The mutants of the plan: dispatch and its property checks, capture sizes from a trace, the uniform
decode graph (issue #28)."""

from __future__ import annotations

from ..common import CP, DISPATCH, PP, TR, TRACE_TESTS, L, Mutant, S

PLAN: list[Mutant] = [
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
]

TRACE: list[Mutant] = [
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
]

UNIFORM_DECODE: list[Mutant] = [
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
        "or _capture_path(\n                ctx, inputs, batch, state0, got, expected, None if ctx.batch_invariant else padded, rows\n            )",
        'or ""',
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
