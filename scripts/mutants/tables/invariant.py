"""The mutants of issue #67: ``invariant`` (rows padded to one count at both sizes) and
``padded_size``'s fast route (bit for bit and op for op, float64 at the largest batch always and
wherever the fast route leaves a batch open)."""

from __future__ import annotations

from ..common import Mutant

TESTS = "tests/test_invariant.py"
MODE = "pytest_cudagraph/invariant/mode.py"
FAST = "pytest_cudagraph/checks/builtin/padded_fast.py"
SIZE = "pytest_cudagraph/checks/builtin/padded_size.py"


def _t(name: str) -> str:
    return f"{TESTS}::{name}"


INVARIANT: list[Mutant] = [
    Mutant(
        "invariant-products-unpadded",
        MODE,
        "    if target != rows:\n        new = list(args)",
        "    if False:\n        new = list(args)",
        (_t("test_products_and_reductions_reach_the_kernel_at_the_padded_row_count"),),
        "products reach the kernel at the real row count: another tiling at each size",
    ),
    Mutant(
        "invariant-mask-padded-open",
        MODE,
        "        out = lowest.expand(shape).clone()",
        "        out = mask.new_zeros(shape)",
        (_t("test_invariant_computes_what_each_op_computes"),),
        "an additive mask's padded keys are left open: real rows attend the padding",
    ),
    Mutant(
        "invariant-row-check-always-holds",
        MODE,
        "        if not torch.equal(a.narrow(out_dim, 0, half), b.narrow(out_dim, 0, half)):\n            return False",
        "        if False:\n            return False",
        (_t("test_an_op_whose_rows_depend_on_each_other_is_not_row_local"),),
        "the row independence the invariance rests on is never found broken",
    ),
    Mutant(
        "fast-route-trace-ignored",
        FAST,
        "        if self.parted:\n",
        "        if False:\n",
        (_t("test_an_error_that_rounds_away_in_bf16_is_caught_through_the_trace"),),
        "two forwards that ran other ops are settled when their bf16 bits agree: a 0.1 % branch passes",
    ),
    Mutant(
        "fast-route-bits-ignored",
        FAST,
        "        if self.flag is not None and bool(self.flag.item()):",
        "        if False:",
        (_t("test_an_error_that_moves_bits_at_one_size_goes_to_float64"),),
        "two forwards whose outputs differ are settled: a branch on one size passes",
    ),
    Mutant(
        "fast-route-no-float64-anchor",
        SIZE,
        "        wanted = peers.any_rank([bool(unsettled[id(q)]) or q is anchor for q in work])",
        "        wanted = peers.any_rank([bool(unsettled[id(q)]) for q in work])",
        (_t("test_an_error_that_neither_bits_nor_ops_show_is_caught_at_the_largest_batch"),),
        "float64 is asked only where the fast route leaves a batch open: an error bf16 rounds away passes",
    ),
    Mutant(
        "fast-route-every-failure-diagnosed-never-told",
        SIZE,
        "                        failed = _undiagnosed(ctx, q, bad, limits, floors, roundoff, diagnosed)",
        "                        failed = Outcome(CHECK, q.desc, False, 'differs')",
        (_t("test_a_failure_past_the_first_two_names_where_the_cause_was_diagnosed"),),
        "a failure past the first two gives no figures and does not say where the cause was diagnosed",
    ),
    Mutant(
        "fast-route-kernel-per-size-settled",
        FAST,
        "    flag = bits_differ(got, expected)\n",
        "    flag = torch.zeros((), dtype=torch.bool)\n",
        (_t("test_a_kernel_that_rounds_per_size_goes_to_float64_and_passes"),),
        "the fast route never sees a difference: nothing goes to float64 but the largest batch",
    ),
    Mutant(
        "invariant-pad-layout-contiguous",
        MODE,
        "    if x.is_contiguous() or x.dim() < 2:",
        "    if True:",
        (_t("test_a_padded_operand_keeps_its_layout"),),
        "a transposed operand is padded into a contiguous one: another kernel (and set-up) at the real batch",
    ),
    Mutant(
        "invariant-pad-cache-ignores-writes",
        MODE,
        "        if last and last[0] is x and last[1] == (x._version, dim, target):",
        "        if last and last[0] is x and last[1][1:] == (dim, target):",
        (_t("test_an_operand_written_in_place_is_padded_anew"),),
        "an operand written in place between two products is padded from its old values",
    ),
    Mutant(
        "invariant-trace-empty",
        MODE,
        "            kind = _KINDS[func] = (_name(func) not in _UNTRACED_NAMES, _HANDLERS.get(func))",
        "            kind = _KINDS[func] = (False, _HANDLERS.get(func))",
        (_t("test_a_branch_that_rounds_away_parts_the_traces"),),
        "the trace lists no call: a branch whose effect rounds away in bf16 is settled",
    ),
    Mutant(
        "invariant-trace-lists-indexing",
        MODE,
        '        "__getitem__",\n',
        "",
        (_t("test_a_correct_model_is_settled_bit_for_bit_but_its_largest_batch"),),
        "indexing is traced: transformers slices its mask at one size alone, and a correct Llama asks float64 there",
    ),
    Mutant(
        "fast-route-mixed-rows-settled",
        FAST,
        "    if mixed:  # padding changed what such a call computes",
        "    if False:  # padding changed what such a call computes",
        (_t("test_a_call_whose_rows_depend_on_each_other_settles_nothing"),),
        "a padded call whose rows depend on each other still settles batches bit for bit",
    ),
]
