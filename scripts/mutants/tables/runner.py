"""The mutants of verify_runner (the runner checks and their sweep) and of verify_distributed
with the emulator's collectives."""

from __future__ import annotations

from ..common import (
    DIST_TESTS,
    DL,
    DM,
    DP,
    DP_TESTS,
    EM,
    LAUNCHER_TESTS,
    LE,
    MS,
    PRK,
    RC,
    RUNNER_TESTS,
    RV,
    RX,
    Mutant,
)

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

_AGREE = "pytest_cudagraph/distributed/agree.py"
_TD = "tests/test_distributed.py"

DISTRIBUTED: list[Mutant] = [
    Mutant(
        "rank-alone-answer-seen",
        "pytest_cudagraph/distributed/rank.py",
        "                with _unseen():\n                    return _alone(name, args, kwargs)\n",
        "                return _alone(name, args, kwargs)\n",
        (f"{_TD}::test_a_branch_after_a_collective_is_placed_by_the_users_calls_as_in_one_process[bug]",),
        "a collective answered alone reads its tensors where the diagnosis records the forward's calls: a "
        "branch after an all-reduce is placed by a shape read said to be at the all-reduce's line",
    ),
    # -- each collective held to the other ranks' before any enters it (issue #68) -------------
    Mutant(
        "agree-shapes-not-compared",
        _AGREE,
        "    def key(self) -> tuple[str, int, int]:\n        return (self.what, self.forward, self.place)",
        "    def key(self) -> tuple[str, int, int]:\n        return (self.what.split(' of ')[0], self.forward, self.place)",
        (f"{_TD}::test_ranks_that_pad_differently_are_named_before_the_collective",),
        "collectives of another shape pass the agreement: gloo then ends a rank's process on the sizes",
    ),
    Mutant(
        "agree-forward-not-compared",
        _AGREE,
        "    def key(self) -> tuple[str, int, int]:\n        return (self.what, self.forward, self.place)",
        "    def key(self) -> tuple[str, int, int]:\n        return (self.what, 0, 0)",
        (f"{_TD}::test_a_collective_skipped_once_is_named_there_not_paired_with_the_next_forwards",),
        "a skipped collective pairs with the next forward's: named late, if at all, not at the one skipped",
    ),
    Mutant(
        "agree-raise-not-told",
        _AGREE,
        '        """``peer`` ran this forward to its end (and ended the step) without issuing the collective."""\n'
        "        raised = self._raised(peer, mine.forward)\n",
        '        """``peer`` ran this forward to its end (and ended the step) without issuing the collective."""\n'
        "        raised = ''\n",
        (f"{_TD}::test_a_rank_that_raises_in_forward_is_named_and_no_rank_hangs",),
        "a rank that raised before its collective is told as one that skipped it: the cause is lost",
    ),
    Mutant(
        "agree-order-said-as-shape",
        _AGREE,
        '        elif mine.what.split(" of ")[0] != theirs.what.split(" of ")[0]:',
        "        elif False:",
        (f"{_TD}::test_collectives_in_another_order_are_named",),
        "collectives in another order are told as another shape",
    ),
    # -- the harness's own forwards in step across ranks; every way a rank leaves, named (issue #68) --
    Mutant(
        "agree-step-left-never",
        _AGREE,
        "                if ran < self.forwards:",
        "                if False:",
        (f"{_TD}::test_a_bug_on_one_rank_is_named_by_the_check_that_sees_it_there",),
        "a peer whose check stopped early is taken for one that skipped a collective: a bug on one rank is "
        "told as collectives that differ",
    ),
    Mutant(
        "peers-any-rank-local",
        "pytest_cudagraph/peers.py",
        "    if _PEERS and not _ALONE[0]:\n        return _PEERS[-1].any_rank(",
        "    if False:\n        return _PEERS[-1].any_rank(",
        (f"{_TD}::test_a_bug_on_one_rank_is_named_by_the_check_that_sees_it_there",),
        "each rank decides alone where forwards follow: a batch one rank sends to float64 parts the ranks",
    ),
    Mutant(
        "peers-diagnosis-issued",
        "pytest_cudagraph/peers.py",
        "    return _ALONE[0] > 0",
        "    return False",
        (f"{_TD}::test_a_bug_on_one_rank_is_named_by_the_check_that_sees_it_there",),
        "a failure's diagnosis issues its collectives to a group whose other ranks do not run it",
    ),
    Mutant(
        "spawn-ended-rank-not-told",
        "pytest_cudagraph/distributed/spawn.py",
        '                ended.write_text(f"ended ({_how(p.exitcode)}): its process is gone")',
        "                pass",
        (f"{_TD}::test_a_rank_whose_process_ends_is_named_at_once_and_the_session_goes_on",),
        "a spawned rank whose process ended is named only when the timeout runs out",
    ),
    Mutant(
        "launcher-skip-kept-a-skip",
        "pytest_cudagraph/plugin/ranks.py",
        '            if ran:\n                report.outcome = "failed"',
        '            if False:\n                report.outcome = "failed"',
        ("tests/test_launcher.py::test_torchrun_runs_the_suite_once_a_rank_with_one_verdict_and_one_report",),
        "a test rank 0 skips where its peers ran it stays a skip in the reports rank 0 writes",
    ),
    # -- verify_distributed and the emulator's collectives ------------------------------------
    Mutant(
        "distributed-rank-peaks-dropped",
        DM,
        "        report.rank_peak_memory[rank] = result.report.peak_memory\n",
        "",
        ("examples/tensor_parallel/test_tensor_parallel.py::test_tp_module_passes_on_every_rank[llama]",),
        "a rank's peak memory lost in the merged report (issue #32: each rank against its hand capture)",
    ),
    Mutant(
        "dist-outputs-not-compared",
        DM,
        "diff = first_difference(b.output, a.output)",
        "diff = first_difference(a.output, a.output)",
        DIST_TESTS,
        "rank_agreement compares rank 0 with itself",
    ),
    Mutant(
        "dist-descriptor-not-compared",
        DM,
        "if a.descriptor != b.descriptor:",
        "if False:",
        DIST_TESTS,
        "ranks that serve a batch with different graphs agree",
    ),
    # -- ranks a launcher started (#59) ----------------------------------------------------------
    Mutant(
        "launcher-verdict-not-agreed",
        DL,
        'agreed = self.store.compare_set(f"{label}/verdict", "", proposal)',
        "agreed = proposal",
        (f"{LAUNCHER_TESTS}::test_the_ranks_agree_on_the_first_verdict_proposed",),
        "each rank takes its own verdict: ranks end one verification with different outcomes",
    ),
    Mutant(
        "launcher-srun-ignored",
        LE,
        "    if tasks is None or proc is None or tasks < 2:",
        "    if True:",
        (f"{LAUNCHER_TESTS}::test_the_environment_says_which_rank_this_is",),
        "srun's SLURM_PROCID / SLURM_NTASKS not read: its ranks would each spawn ranks of their own",
    ),
    Mutant(
        "launcher-rank1-writes-reports",
        PRK,
        "    return env is None or env.rank == 0",
        "    return True",
        (f"{LAUNCHER_TESTS}::test_only_rank_0_writes_the_reports",),
        "every rank writes --cudagraph-report over the same path",
    ),
    Mutant(
        "launcher-rank1-writes-junit",
        PRK,
        "        config.option.xmlpath = None  # rank 0 writes it",
        "        pass  # rank 0 writes it",
        (f"{LAUNCHER_TESTS}::test_only_rank_0_writes_the_reports",),
        "every rank writes --junitxml over the same path",
    ),
    Mutant(
        "ddp-sync-unchecked",
        DP,
        "if sync != held), None)",
        "if False), None)",
        (f"{DP_TESTS}::test_the_sync_the_graph_holds_is_held_to_each_eager_step",),
        "a graph captured with gradient sync on, replayed where eager runs under no_sync(), passes",
    ),
    Mutant(
        "ddp-weights-not-held-across-ranks",
        DP,
        "                    copy.after.append(_held_equal(module, bool(copy.captured)))",
        "                    pass",
        (f"{DP_TESTS}::test_its_twin_all_reducing_outside_the_graph_passes",),
        "the ranks' weights after each replayed step never compared",
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
