"""The mutants of issue #56's references: keys, standing in, each reference held against its kernel,
and what the report says of them."""

from __future__ import annotations

from ..common import PR, PS, Mutant

REF_TESTS = "tests/test_references.py"
KR = "pytest_cudagraph/checks/kernel_references.py"
RK = "pytest_cudagraph/references.py"


def _t(name: str) -> str:
    return f"{REF_TESTS}::{name}"


REFERENCES: list[Mutant] = [
    Mutant(
        "references-op-never-stands-in",
        PR,
        "            if entry is not None:\n                return self.stand_in(entry, args, kwargs)",
        "            if False:\n                return self.stand_in(entry, args, kwargs)",
        (_t("test_a_reference_stands_in_for_the_op_in_float64"),),
        "a custom op's reference never stands in: padded_size stays off for bf16-only attention",
    ),
    Mutant(
        "references-stand-in-outside-the-mode",
        PR,
        "            torch._C._ForceDispatchKeyGuard(*self.dispatch_keys)\n",
        "            contextlib.nullcontext()\n",
        (_t("test_a_references_own_casts_are_raised_like_the_modules"),),
        "the reference's ops run unraised: its float32 casts stay, and the float64 question is float32's",
    ),
    Mutant(
        "references-function-not-redirected",
        RK,
        "                fn.__code__ = _trampoline(fn, name)",
        "                pass",
        (_t("test_a_python_function_is_redirected_wherever_the_module_reaches_it"),),
        "a Python-function key (a Triton wrapper) is never replaced in the reference run",
    ),
    Mutant(
        "references-redirect-left-in-place",
        RK,
        "                    fn.__code__ = saved\n",
        "                    pass\n",
        (_t("test_a_redirect_is_put_back_when_the_block_raises"),),
        "a redirected function keeps the trampoline after the reference run",
    ),
    Mutant(
        "references-overload-key-not-found",
        RK,
        "        return ops.get(name)\n",
        "        return None\n",
        (_t("test_every_form_of_an_op_key_names_the_op"),),
        "an op keyed by name is never found where the dispatcher hands over its overload",
    ),
    Mutant(
        "references-unknown-op-accepted",
        RK,
        "        except (AttributeError, RuntimeError):\n            raise UsageError(",
        "        except (AttributeError, RuntimeError):\n            return text\n            raise UsageError(",
        (_t("test_a_wrong_reference_is_one_usage_line_before_anything_runs"),),
        "a key that names no registered op is taken, and the reference never runs",
    ),
    Mutant(
        "references-agreement-never-fails",
        KR,
        "        return not self.why and self.relative <= self.limit",
        "        return True",
        (_t("test_a_reference_that_disagrees_with_its_kernel_fails_saying_where_and_by_how_much"),),
        "a reference that computes something else stands in and holds the module to it",
    ),
    Mutant(
        "references-agreement-limit-unscaled",
        KR,
        "                limit = AGREEMENT_CAP * floor",
        "                limit = 8 * AGREEMENT_CAP * floor",
        (_t("test_the_agreement_limit_has_a_wrong_reference_just_above_it"),),
        "the agreement's limit is loose enough for a reference off by several floors",
    ),
    Mutant(
        "references-agreement-on-the-smallest-size",
        PS,
        "    desc = max(ctx.manager.plan.capture_order, key=lambda d: d.num_tokens)\n    batch = ctx.exact_batch(desc)\n    inputs = ctx.make(batch)",
        "    desc = min(ctx.manager.plan.capture_order, key=lambda d: d.num_tokens)\n    batch = ctx.exact_batch(desc)\n    inputs = ctx.make(batch)",
        (_t("test_a_reference_that_disagrees_with_its_kernel_fails_saying_where_and_by_how_much"),),
        "the reference is held at one token, where attention's result is its value row whatever the scale",
    ),
    Mutant(
        "references-written-arguments-unheld",
        KR,
        "        if a.shape == b.shape and a.dtype == b.dtype and not torch.equal(a.detach(), b):",
        "        if False:",
        (_t("test_what_a_kernel_writes_into_its_arguments_is_held_too"),),
        "what a kernel writes into its output argument is never held against the reference",
    ),
    Mutant(
        "references-disagreement-still-stands-in",
        PS,
        "        if wrong:\n",
        "        if False:\n",
        (_t("test_a_reference_that_disagrees_with_its_kernel_fails_saying_where_and_by_how_much"),),
        "padded_size runs through a reference that disagrees with its kernel",
    ),
    Mutant(
        "references-missing-kernel-unnamed",
        PS,
        "                missing.append(exc.op)",
        "                pass",
        (_t("test_without_a_reference_padded_size_says_which_kernel_needs_one"),),
        "a kernel left without a reference is not named with the sentence that adds one",
    ),
    Mutant(
        "references-registry-ignored",
        PS,
        "    refs = ref.references = normalized(ctx.options.references).merged_over(registered())",
        "    refs = ref.references = normalized(ctx.options.references)",
        (_t("test_a_registered_reference_serves_every_verification_and_a_calls_own_wins"),),
        "register_reference in a conftest serves no verification",
    ),
    Mutant(
        "references-not-called-passes",
        KR,
        "    if not agreement.calls:\n        return Outcome(",
        "    if False:\n        return Outcome(",
        (_t("test_a_kernel_the_module_never_calls_is_said_so"),),
        "a kernel the module never calls is reported as held",
    ),
    Mutant(
        "references-raising-wrapper-unnamed",
        PS,
        "                if raiser:\n",
        "                if False:\n",
        ("examples/references/test_references.py::test_without_a_reference_the_report_says_how_to_add_one",),
        "a Triton wrapper that refuses float64 is not named with the key that adds its reference",
    ),
]
