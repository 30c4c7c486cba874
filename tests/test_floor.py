"""Comparing across batch shapes (``checks/floor.py``): rounding passes, a bug does not.

Synthetic outputs stand for the three runs the check compares: eager on the
unpadded batch (``expected``), eager at the graph's padded shape cut to the
real rows (``padded``, the floor) and the graph (``got``). Noise of the size
the floor shows passes; a few-percent scale, an offset per feature, a scale
per row, a difference beyond the floor or beyond what rounding at the
precision can do, non-finite values and flipped integers each fail, with the
words and both figures. Every case is checked on its own twin too.
"""

from __future__ import annotations

import re

import pytest
import torch

from pytest_cudagraph.checks.floor import CAP, SYSTEMATIC, across_shapes, compute_dtype, cut_to
from pytest_cudagraph.observe import unit_roundoff

BF16 = unit_roundoff(torch.bfloat16)
FP32 = unit_roundoff(torch.float32)


def _data(
    rows: int = 8, cols: int = 1000, noise: float = 0.01, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    expected = torch.randn(rows, cols, generator=gen)
    padded = expected + noise * torch.randn(rows, cols, generator=gen)
    return expected, padded


def _verdict(
    got: torch.Tensor,
    expected: torch.Tensor,
    padded: torch.Tensor | None,
    *,
    roundoff: float = BF16,
    dtype: torch.dtype = torch.bfloat16,
    **kwargs: object,
):
    return across_shapes(
        got.to(dtype),
        expected.to(dtype),
        (lambda: padded.to(dtype)) if padded is not None else None,
        rtol=None,
        atol=None,
        roundoff=roundoff,
        **kwargs,
    )


def test_within_the_tolerance_nothing_more_runs() -> None:
    expected, _ = _data(noise=0.0)
    ran = []
    verdict = across_shapes(
        expected, expected.clone(), lambda: ran.append(1), rtol=None, atol=None, roundoff=FP32
    )
    assert verdict.passed and not verdict.floor_used and not ran
    assert verdict.figures == {"max_abs": 0.0}


def test_rounding_of_the_floors_size_passes_and_says_both_figures() -> None:
    expected, padded = _data()
    verdict = _verdict(padded, expected, padded)
    assert verdict.passed and verdict.floor_used
    leaf = verdict.figures["output"]
    assert leaf["graph_max"] == leaf["floor_max"] > 0 and leaf["roundoff"] == BF16


def test_noise_twice_the_floor_at_the_same_spread_passes_but_far_beyond_it_fails() -> None:
    expected, padded = _data()
    gen = torch.Generator().manual_seed(1)
    other = expected + 0.01 * torch.randn(
        expected.shape, generator=gen
    )  # the graph ran other kernels: same size
    assert _verdict(other, expected, padded).passed
    far = expected + 0.2 * torch.randn(expected.shape, generator=gen)
    verdict = _verdict(far, expected, padded)
    assert not verdict.passed
    assert "by more than eager differs from itself across batch shapes" in verdict.why
    assert "graph vs unpadded eager: max" in verdict.why and "eager vs itself across shapes" in verdict.why
    assert verdict.diff is not None and verdict.diff.index is not None


def test_one_element_far_beyond_the_floor_fails_by_the_largest_difference_alone() -> None:
    # Too few elements to move the rms or to be systematic: only the largest difference shows it.
    expected, padded = _data()
    got = padded.clone()
    got[3, 500] += 0.5
    verdict = _verdict(got, expected, padded)
    assert not verdict.passed and "by more than eager differs from itself" in verdict.why
    assert verdict.diff is not None and verdict.diff.index == (3, 500)


@pytest.mark.parametrize("scale", [1.03, 1.025, 0.97])
def test_a_few_percent_scale_from_the_padded_size_fails_even_when_the_floor_holds_it(scale: float) -> None:
    expected, padded = _data()
    buggy = padded * scale  # eager at the padded shape has the bug too: the floor is as far off as the graph
    verdict = _verdict(buggy, expected, buggy)
    assert not verdict.passed
    assert verdict.why.startswith("real rows are off systematically")
    found = re.search(r"a scale of ([+-]\d+\.\d+)%", verdict.why)
    assert found is not None and abs(float(found.group(1)) - (scale - 1) * 100) < 0.2, verdict.why
    assert "a Python branch on the token count" in verdict.why


def test_an_offset_per_feature_over_the_rows_is_named_as_batch_statistics() -> None:
    expected, padded = _data()
    gen = torch.Generator().manual_seed(2)
    buggy = padded + 0.05 * torch.randn(1, expected.shape[1], generator=gen)
    verdict = _verdict(buggy, expected, buggy)
    assert not verdict.passed and "one offset per feature" in verdict.why


def test_a_scale_of_its_own_in_each_row_is_named() -> None:
    expected, padded = _data()
    gen = torch.Generator().manual_seed(3)
    buggy = padded * (1 + 0.05 * torch.randn(expected.shape[0], 1, generator=gen))
    verdict = _verdict(buggy, expected, buggy)
    assert not verdict.passed and "a scale of each row" in verdict.why


def test_a_systematic_part_too_small_to_exceed_the_tolerance_is_rounding() -> None:
    expected, padded = _data(noise=0.001)
    # 0.5 %: under bf16's 1.6 % relative tolerance everywhere.
    slight = padded * 1.005
    assert _verdict(slight, expected, slight).passed


def test_a_difference_beyond_what_rounding_can_do_fails_even_when_unstructured() -> None:
    # One row: no family can be fitted beyond chance; the floor holds the bug; fp32 rounding cannot.
    expected = torch.randn(1, 6)
    buggy = expected + torch.tensor([[0.3, -0.2, 0.5, -0.4, 0.1, -0.3]])
    verdict = _verdict(buggy, expected, buggy, roundoff=FP32, dtype=torch.float32)
    assert not verdict.passed
    assert "more than rounding at float32 precision" in verdict.why
    # The same difference from a bf16 program is within what its rounding does? No: it is 30 % of the values.
    relative = float((buggy - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())
    assert relative > CAP * FP32


def test_the_floor_is_capped_by_the_precision_but_bf16_rounding_of_real_size_passes() -> None:
    # 5 % relative rms is what a 32-layer bf16 Llama shows across shapes (docs/scale.md): under the cap.
    expected, padded = _data(noise=0.05)
    assert 0.05 < CAP * BF16
    assert _verdict(padded, expected, padded).passed


def test_non_finite_where_eager_is_finite_fails_as_such() -> None:
    expected, padded = _data()
    got = padded.clone()
    got[2, 5] = float("nan")
    verdict = _verdict(got, expected, padded)
    assert not verdict.passed and "non-finite" in verdict.why
    assert verdict.diff is not None and verdict.diff.index == (2, 5)


def test_no_floor_means_the_tolerance_decides() -> None:
    expected, padded = _data()
    verdict = _verdict(padded, expected, None)
    assert not verdict.passed and verdict.why.startswith(
        "real rows differ from eager on the unpadded batch ("
    )
    assert not verdict.floor_used


def test_integers_may_flip_only_where_eager_at_the_padded_shape_flips() -> None:
    expected = torch.arange(20).reshape(4, 5)
    flipped = expected.clone()
    flipped[1, 2] = 99
    ok = across_shapes(flipped, expected, lambda: flipped.clone(), rtol=None, atol=None, roundoff=BF16)
    assert ok.passed
    wrong = across_shapes(flipped, expected, lambda: expected.clone(), rtol=None, atol=None, roundoff=BF16)
    assert (
        not wrong.passed
        and "integer values that eager at the graph's padded shape does not give" in wrong.why
    )
    most = expected + 1
    many = across_shapes(most, expected, lambda: most.clone(), rtol=None, atol=None, roundoff=BF16)
    assert not many.passed and "more than rounding flips" in many.why


def test_structures_that_differ_fail_without_a_floor() -> None:
    expected, _ = _data()
    verdict = across_shapes(expected[:3], expected, lambda: expected, rtol=None, atol=None, roundoff=BF16)
    assert not verdict.passed and "shape" in verdict.why


def test_a_large_output_is_compared_in_pieces_with_the_same_verdict() -> None:
    # 5000 x 1000 elements: more than one piece of rows.
    expected, padded = _data(rows=5000, cols=1000)
    assert _verdict(padded, expected, padded).passed
    buggy = padded * 1.03
    assert not _verdict(buggy, expected, buggy).passed


def test_an_fp32_output_of_bf16_products_gets_bf16_tolerance() -> None:
    expected, padded = _data(noise=0.001)
    assert (
        compute_dtype(BF16) is torch.bfloat16 and compute_dtype(unit_roundoff(torch.float16)) is torch.float16
    )
    verdict = across_shapes(padded, expected, None, rtol=None, atol=None, roundoff=BF16)
    assert verdict.passed and not verdict.floor_used  # within bf16's tolerance: no floor needed
    assert not across_shapes(padded, expected, None, rtol=None, atol=None, roundoff=FP32).passed


def test_the_systematic_threshold_is_what_the_docs_say() -> None:
    assert 0 < SYSTEMATIC < 1


def test_cut_to_takes_the_real_rows_in_every_padded_dimension() -> None:
    padded = {"logits": torch.arange(24.0).reshape(1, 4, 6), "h": torch.arange(8.0).reshape(4, 2)}
    like = {"logits": torch.zeros(1, 3, 6), "h": torch.zeros(3, 2)}
    cut = cut_to(padded, like)
    assert torch.equal(cut["logits"], padded["logits"][:, :3]) and torch.equal(cut["h"], padded["h"][:3])


def test_a_small_relative_difference_keeps_two_figures() -> None:
    # A loss 2.8e-5 off relative is no "0.0%": the message says how far it is.
    from pytest_cudagraph.checks.floor import _percent

    assert _percent(2.8e-5) == "0.0028%"
    assert _percent(0.25) == "25.0%"
