"""``padded_size``: the cross-shape question asked of eager in float64, on bf16 stacks the CPU runs.

A bf16 Llama stack rounds several percent differently at two batch shapes, so
errors that act on the padded sizes alone (a 0.1 % scale inside the stack, a
rotary table of another base, a per-position table added to the embeddings)
hide under bf16's own blur: ``real_batches`` held to the floor of the module's
own precision passes them. In float64 the same two forwards differ by about
1e-15, and each is caught, named as a computation that depends on the padded
size, with the submodule where it first shows. The limit is 64 times the
reference's own floor: an error just above it is caught, one well below passes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.scale import ERROR_KINDS, Planted
from pytest_cudagraph import verify
from tests.models import bf16_llama

transformers = pytest.importorskip("transformers")

SIZES = (4, 8, 16)
VOCAB = 512
BOTH = ["real_batches", "padded_size"]


class Logits(nn.Module):
    """A Llama's logits from ``(1, T)`` ids."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=input_ids, use_cache=False).logits


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return bf16_llama(
        vocab=VOCAB, hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, max_positions=64
    )


def _inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, VOCAB, (1, num_tokens))}


def _verify(module: nn.Module, checks: list[str]) -> Any:
    torch.manual_seed(0)
    return verify(
        module, _inputs, capture_sizes=SIZES, max_num_reqs=4, backend="emulate", checks=checks, progress=False
    )


def _planted(llama: nn.Module, kind: str, e: float, checks: list[str]) -> Any:
    module = Planted(llama, kind, e)
    try:
        return _verify(module, checks)
    finally:
        module.remove()


def _reference(report: Any) -> dict[str, Any]:
    (figures,) = {
        (o.figures["reference"], o.figures["floor"], o.figures["limit"])
        for o in report.outcomes
        if o.check == "padded_size" and "limit" in o.figures
    }
    return {"precision": figures[0], "floor": figures[1], "limit": figures[2]}


def test_the_correct_stack_passes_in_float64_with_its_floor_and_limit_reported(llama) -> None:
    report = _verify(Logits(llama), BOTH)
    assert report.ok, report.format()
    ref = _reference(report)
    assert ref["precision"] == "float64"
    assert 0 < ref["floor"] < 1e-12 and ref["limit"] == pytest.approx(64 * ref["floor"])
    assert report.reference_peak_memory > 0
    assert "float64 reference: floor " in report.summary() and ", limit " in report.summary()
    # The graph stage compared real rows with eager at the padded shape, bit for bit, and measured no floor.
    real = [o for o in report.outcomes if o.check == "real_batches" and not o.skipped]
    assert real and all(o.figures.get("reference") == "padded_size" for o in real)
    assert all(o.figures["floor_measured"] == 0 for o in real)


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_an_error_of_a_tenth_of_a_percent_on_the_padded_sizes_is_caught_and_named(llama, kind) -> None:
    report = _planted(llama, kind, 1e-3, BOTH)
    failed = [o for o in report.failures if o.check == "padded_size"]
    assert failed, report.format()
    assert {o.check for o in report.failures} == {"padded_size"}, report.format()
    message = failed[0].message
    assert "a computation depends on the padded batch size" in message, message
    assert "in float64" in message and "64x that" in message
    where = {
        "logit_scale": "",
        "vocab_pattern": "",
        "mlp_scale": "inner.model.layers.3.mlp",
        "rope_base": "inner.model.rotary_emb",
        "position_table": "inner.model.embed_tokens",
    }[kind]
    assert failed[0].finding is not None and failed[0].finding.submodule == where, report.format()
    assert "eager at the padded shape gave" in report.format()
    # Every such descriptor is one whose graph is padded from a real batch that is not a multiple of 8.
    assert {o.descriptor.num_tokens for o in failed} == {8, 16}


def test_the_floor_of_the_modules_own_precision_misses_what_float64_catches(llama) -> None:
    # The same 0.1 % error inside the stack, held by real_batches to bf16's floor across shapes.
    report = _planted(llama, "mlp_scale", 1e-3, ["real_batches"])
    assert report.ok, report.format()


def _verify_identity_memo(checks: list[str]) -> Any:
    from tests.bugs import IdentityMemo, token_inputs

    torch.manual_seed(0)
    return verify(
        IdentityMemo(),
        token_inputs(),
        capture_sizes=(1, 2, 4, 8),
        max_num_reqs=4,
        backend="emulate",
        checks=checks,
    )


def test_real_batches_holds_the_graph_to_eager_at_its_padded_shape_bit_for_bit() -> None:
    report = _verify_identity_memo(BOTH)
    failed = [o for o in report.failures if o.check == "real_batches"]
    assert failed, report.format()
    assert "the graph's real rows differ from eager at its padded shape on the inputs the graph read" in (
        failed[0].message
    )


def test_real_batches_takes_fresh_inputs_eager_run_at_the_padded_shape_and_still_holds_the_graph(
    llama,
) -> None:
    # fresh_inputs ran eager at the padded shape of each descriptor's most padded batch, the very
    # forward real_batches would run next (issue #48): taken, not run again, for a module that
    # writes nothing and draws nothing. The graph still runs the batch through run().
    report = _verify(Logits(llama), ["fresh_inputs", *BOTH])
    assert report.ok, report.format()
    assert report.costs["real_batches"].forwards == 0
    assert report.costs["real_batches"].replays == len(SIZES)
    # A graph that serves the batch otherwise than eager does is still caught there: IdentityMemo
    # returns what it computed at warm-up whatever the inputs, which fresh_inputs names first.
    report = _verify_identity_memo(["fresh_inputs", *BOTH])
    assert {"fresh_inputs", "real_batches"} <= {o.check for o in report.failures}, report.format()


def test_an_error_just_above_the_limit_is_caught_and_one_well_below_passes(llama) -> None:
    limit = _reference(_verify(Logits(llama), BOTH))["limit"]
    above = _planted(llama, "logit_scale", 4 * limit, BOTH)
    assert [o.check for o in above.failures] and {o.check for o in above.failures} == {"padded_size"}, (
        above.format()
    )
    below = _planted(llama, "logit_scale", limit / 16, BOTH)
    assert below.ok, below.format()


def test_leaf_differences_read_later_name_the_place_and_values_of_what_differs() -> None:
    """The reference's comparison is queued on the device and read once every forward is queued
    (``pending_differences``): what it reads then names the same place and values as before, with
    the leaves themselves gone."""
    from pytest_cudagraph.checks.reference import leaf_differences, pending_differences

    expected = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    got = expected.clone()
    got[2, 1] += 0.5
    got[0, 3] -= 0.25
    pending = pending_differences({"logits": got}, {"logits": expected})
    del got
    (diff,) = pending.read()
    assert diff.path == "['logits']" and not diff.why
    assert diff.index == (2, 1) and diff.got == 9.5 and diff.expected == 9.0
    assert diff.relative == pytest.approx(((0.5**2 + 0.25**2) / float((expected**2).sum())) ** 0.5)

    nan_where_finite = expected.clone()
    nan_where_finite[1, 2] = float("nan")
    nan_where_finite[2, 3] += 100.0  # a larger finite difference elsewhere: the non-finite one is named
    (diff,) = leaf_differences(nan_where_finite, expected)
    assert diff.why == "non-finite where the other is finite" and diff.relative == float("inf")
    assert diff.index == (1, 2) and diff.expected == 6.0 and diff.got != diff.got  # NaN

    both = expected.clone()
    both[0, 0] = float("inf")
    other = expected.clone()
    other[0, 0] = float("-inf")
    (diff,) = leaf_differences(both, other)
    assert diff.why == "another non-finite value" and diff.index == (0, 0)
    assert (diff.got, diff.expected) == (float("inf"), float("-inf"))

    (same,) = leaf_differences(expected, expected.clone())
    assert same.relative == 0.0 and not same.why
