"""The comparison core (``checks/compare.py``): what "equal" means for every check.

Bit for bit by default (NaN equals NaN, +0.0 and -0.0 differ, shape, dtype
and, when asked, strides too); within a per-dtype tolerance when ``rtol`` /
``atol`` are None; leaves walked through tuples, lists, dicts, namedtuples and
dataclasses; the first difference reported by its path, its row-major index
and both values. Assertions are on this project's ``Difference`` fields and
messages only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import pytest
import torch

from pytest_cudagraph.checks.compare import Difference, default_tolerance, first_difference, leaves

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _next_up(value: float, dtype: torch.dtype) -> torch.Tensor:
    """The next representable value of ``dtype`` above ``value`` (one ULP up), as a 1-element tensor."""
    t = torch.tensor([value], dtype=dtype)
    return torch.nextafter(t, torch.tensor([math.inf], dtype=dtype))


def _differs(got: Any, expected: Any, **kwargs: Any) -> Difference:
    diff = first_difference(got, expected, **kwargs)
    assert diff is not None, f"{got!r} and {expected!r} compared equal"
    return diff


# -- bit for bit ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_identical_floats_are_equal_and_every_single_element_change_is_found(dtype: torch.dtype) -> None:
    base = torch.randn(3, 5).to(dtype)
    assert first_difference(base, base.clone()) is None
    for flat in range(base.numel()):
        changed = base.clone()
        changed.view(-1)[flat] += 1
        diff = _differs(changed, base)
        assert diff.index == (flat // 5, flat % 5)
        assert diff.reason == "values differ"
        assert diff.got == changed.view(-1)[flat].item()
        assert diff.expected == base.view(-1)[flat].item()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_one_ulp_is_a_difference_bit_for_bit(dtype: torch.dtype) -> None:
    one = torch.tensor([1.0], dtype=dtype)
    up = _next_up(1.0, dtype)
    diff = _differs(up, one)
    assert diff.index == (0,)
    assert diff.max_ulp == 1
    assert diff.max_abs == pytest.approx((up.double() - 1.0).item())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nan_equals_nan_but_not_a_number(dtype: torch.dtype) -> None:
    nan = torch.tensor([1.0, math.nan, 3.0], dtype=dtype)
    assert first_difference(nan, nan.clone()) is None
    # Another NaN bit pattern (the sign bit flipped) is still NaN.
    assert first_difference(nan, -nan) is not None  # 1.0 vs -1.0 first
    assert first_difference(nan[1:2], -nan[1:2]) is None
    number = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    for got, expected in ((nan, number), (number, nan)):
        diff = _differs(got, expected)
        assert diff.index == (1,)
        assert math.isnan(diff.got) != math.isnan(diff.expected)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nan_equals_nan_within_tolerance_too(dtype: torch.dtype) -> None:
    nan = torch.tensor([math.nan, 1.0], dtype=dtype)
    assert first_difference(nan, nan.clone(), rtol=None, atol=None) is None
    assert first_difference(nan, nan.clone(), rtol=0.5, atol=0.5) is None
    diff = _differs(nan, torch.tensor([0.0, 1.0], dtype=dtype), rtol=0.5, atol=0.5)
    assert diff.index == (0,)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_infinities_equal_themselves_and_differ_from_each_other(dtype: torch.dtype) -> None:
    inf = torch.tensor([math.inf, -math.inf], dtype=dtype)
    assert first_difference(inf, inf.clone()) is None
    diff = _differs(inf, inf.flip(0))
    assert diff.index == (0,)
    assert diff.got == math.inf and diff.expected == -math.inf


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_signed_zeros_differ_bit_for_bit(dtype: torch.dtype) -> None:
    pos = torch.tensor([1.0, 0.0, 2.0], dtype=dtype)
    neg = torch.tensor([1.0, -0.0, 2.0], dtype=dtype)
    assert first_difference(neg, neg.clone()) is None
    diff = _differs(pos, neg)
    assert diff.index == (1,)
    assert math.copysign(1.0, diff.got) == 1.0
    assert math.copysign(1.0, diff.expected) == -1.0


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_signed_zeros_are_equal_within_tolerance(dtype: torch.dtype) -> None:
    assert (
        first_difference(
            torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype), rtol=None, atol=None
        )
        is None
    )


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_float8_bit_for_bit(dtype: torch.dtype) -> None:
    got = torch.tensor([1.0, 0.0, math.nan, -2.0]).to(dtype)
    assert first_difference(got, got.clone()) is None
    assert _differs(got, torch.tensor([1.0, -0.0, math.nan, -2.0]).to(dtype)).index == (1,)
    assert _differs(got, torch.tensor([1.0, 0.0, math.nan, 2.0]).to(dtype)).index == (3,)
    assert _differs(got, torch.tensor([1.0, 0.0, 1.0, -2.0]).to(dtype)).index == (2,)
    diff = _differs(got, torch.tensor([1.0, 0.0, math.nan, 2.0]).to(dtype))
    assert diff.max_abs == 4.0 and (diff.got, diff.expected) == (-2.0, 2.0)
    near = torch.tensor([1.25, 0.0, math.nan, -2.0]).to(dtype)
    assert first_difference(got, near, rtol=0.0, atol=0.5) is None
    assert _differs(got, near, rtol=0.0, atol=0.125).index == (0,)


def test_signed_zeros_of_complex_parts_differ() -> None:
    got = torch.tensor([complex(1.0, 0.0)])
    assert first_difference(got, got.clone()) is None
    assert _differs(got, torch.tensor([complex(1.0, -0.0)])).index == (0,)


def test_ulps_are_counted_where_signs_agree_and_for_negative_values() -> None:
    tiny = torch.tensor([0.0], dtype=torch.float32)
    up = torch.nextafter(tiny, torch.tensor([1.0]))  # the smallest subnormal
    assert _differs(up, tiny).max_ulp == 1
    # Across a sign change a ULP count measures the whole range between the values (0.3 against
    # -0.2 is two billion ULPs): no figure, where no element of one sign differs.
    assert _differs(up, -up).max_ulp is None
    across = _differs(
        torch.tensor([0.3, 1.0]), torch.tensor([-0.2, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))])
    )
    assert across.max_ulp == 1
    minus_one = torch.tensor([-1.0])
    below = torch.nextafter(minus_one, torch.tensor([-2.0]))
    assert _differs(below, minus_one).max_ulp == 1


def test_max_abs_and_max_ulp_are_the_largest_over_the_tensor() -> None:
    expected = torch.tensor([1.0, 2.0, 4.0, 8.0])
    got = expected.clone()
    got[1] = 2.5
    got[3] = 8.0 + 2**-20  # a few ULPs at 8
    diff = _differs(got, expected)
    assert diff.index == (1,)  # the first, not the largest
    assert diff.max_abs == pytest.approx(0.5)
    ulp_at_2 = (_next_up(2.0, torch.float32) - 2.0).item()
    assert diff.max_ulp == round(0.5 / ulp_at_2)


def test_max_abs_ignores_non_finite_elements() -> None:
    expected = torch.tensor([1.0, 2.0, 3.0])
    got = torch.tensor([1.25, math.inf, math.nan])
    diff = _differs(got, expected)
    assert diff.index == (0,)
    assert diff.max_abs == pytest.approx(0.25)


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_integers_are_compared_exactly(dtype: torch.dtype) -> None:
    base = torch.arange(12, dtype=dtype).reshape(3, 4)
    assert first_difference(base, base.clone()) is None
    assert first_difference(base, base.clone(), rtol=None, atol=None) is None
    changed = base.clone()
    changed[2, 1] += 3
    diff = _differs(changed, base)
    assert diff.index == (2, 1)
    assert (diff.got, diff.expected) == (int(base[2, 1]) + 3, int(base[2, 1]))
    assert diff.max_abs == 3.0
    assert diff.max_ulp is None
    # Integers have no tolerance of their own: the per-dtype default is exact.
    assert default_tolerance(dtype) == (0.0, 0.0)
    assert _differs(changed, base, rtol=None, atol=None).index == (2, 1)


def test_bools_are_compared_exactly() -> None:
    base = torch.tensor([[True, False], [False, True]])
    assert first_difference(base, base.clone()) is None
    changed = base.clone()
    changed[1, 0] = True
    diff = _differs(changed, base)
    assert diff.index == (1, 0)
    assert (diff.got, diff.expected) == (True, False)
    assert diff.max_abs is None


# -- shape, dtype, strides ------------------------------------------------------------------------------
def test_shape_mismatch_is_reported_with_both_shapes() -> None:
    diff = _differs(torch.zeros(2, 3), torch.zeros(3, 2))
    assert diff.reason == "shape (2, 3) but eager gives (3, 2)"
    assert diff.index is None
    # Same number of elements, one more dimension.
    assert _differs(torch.zeros(6), torch.zeros(1, 6)).reason == "shape (6,) but eager gives (1, 6)"


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        (torch.float32, torch.float16),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.float64),
        (torch.int32, torch.int64),
        (torch.int64, torch.float32),
        (torch.bool, torch.uint8),
    ],
    ids=str,
)
def test_dtype_mismatch_is_reported_even_for_equal_values(got: torch.dtype, expected: torch.dtype) -> None:
    diff = _differs(torch.ones(3, dtype=got), torch.ones(3, dtype=expected))
    assert diff.reason == f"dtype {got} but eager gives {expected}"
    assert (
        _differs(torch.ones(3, dtype=got), torch.ones(3, dtype=expected), rtol=None, atol=None).reason
        == diff.reason
    )


def test_strides_are_compared_only_when_asked() -> None:
    expected = torch.arange(12.0).reshape(3, 4)
    transposed = expected.t().contiguous().t()  # same values and shape, column-major
    assert transposed.stride() != expected.stride()
    assert first_difference(transposed, expected) is None
    diff = _differs(transposed, expected, check_strides=True)
    assert diff.reason == f"strides {transposed.stride()} but eager gives {expected.stride()}"
    assert first_difference(expected.clone(), expected, check_strides=True) is None


def test_strides_of_size_one_dimensions_say_nothing() -> None:
    a = torch.zeros(1, 4)
    b = torch.zeros(4, 1).t()  # shape (1, 4), stride (1, 1) instead of (4, 1)
    assert a.stride() != b.stride()
    assert first_difference(b, a, check_strides=True) is None
    # One element: no stride addresses anything.
    assert first_difference(torch.zeros(1, 1).t(), torch.zeros(1, 1), check_strides=True) is None


def test_non_contiguous_views_are_compared_by_value_in_row_major_order() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, ::2]  # sliced: (3, 3), strides (6, 2)
    assert not view.is_contiguous()
    assert first_difference(view, view.contiguous()) is None
    changed = view.contiguous()
    changed[2, 1] = -1.0
    diff = _differs(view, changed)
    assert diff.index == (2, 1)
    assert (diff.got, diff.expected) == (view[2, 1].item(), -1.0)
    transposed = base.t()
    other = transposed.contiguous()
    other[5, 0] = 100.0
    other[0, 3] = 100.0  # the first in row-major order of the (6, 4) view, not of base's memory
    diff = _differs(transposed, other)
    assert diff.index == (0, 3)


def test_the_first_difference_is_the_first_in_row_major_order() -> None:
    expected = torch.zeros(3, 4, 5)
    got = expected.clone()
    got[2, 0, 0] = 1.0
    got[0, 3, 4] = 2.0
    got[1, 1, 1] = 3.0
    diff = _differs(got, expected)
    assert diff.index == (0, 3, 4)
    assert diff.got == 2.0
    got[0, 3, 3] = 5.0
    assert _differs(got, expected).index == (0, 3, 3)


def test_only_the_last_element_differs() -> None:
    expected = torch.randn(4, 7)
    got = expected.clone()
    got[-1, -1] += 1
    assert _differs(got, expected).index == (3, 6)


def test_a_bug_in_one_column_is_found() -> None:
    expected = torch.randn(8, 16)
    got = expected.clone()
    got[:, 5] = got[:, 5] * 2 + 1
    diff = _differs(got, expected)
    assert diff.index == (0, 5)


def test_zero_element_tensors_compare_by_shape() -> None:
    assert first_difference(torch.zeros(0, 3), torch.zeros(0, 3)) is None
    assert _differs(torch.zeros(0, 3), torch.zeros(0, 4)).reason == "shape (0, 3) but eager gives (0, 4)"


def test_zero_dim_tensors() -> None:
    assert first_difference(torch.tensor(1.5), torch.tensor(1.5)) is None
    diff = _differs(torch.tensor(1.5), torch.tensor(2.5))
    assert diff.index == ()
    assert (diff.got, diff.expected) == (1.5, 2.5)


def test_grad_tracking_tensors_are_compared_by_value() -> None:
    weight = torch.ones(3, requires_grad=True)
    assert first_difference(weight * 2, torch.full((3,), 2.0)) is None
    assert _differs(weight * 2, torch.full((3,), 3.0)).index == (0,)


# -- tolerance per dtype ---------------------------------------------------------------------------------
def test_default_tolerances_grow_as_precision_shrinks() -> None:
    rtols = [default_tolerance(d)[0] for d in FLOATS]
    atols = [default_tolerance(d)[1] for d in FLOATS]
    assert rtols == sorted(rtols) and atols == sorted(atols)
    assert all(r > 0 and a > 0 for r, a in zip(rtols, atols, strict=True))


# (dtype, a value within its default tolerance of 1.0, one outside it): each
# "within" value is also one that the next more precise dtype rejects.
TOLERANCE_CASES = [
    (torch.float64, 1.0 + 1e-8, 1.0 + 1e-6),
    (torch.float32, 1.0 + 2**-20, 1.0 + 2**-12),
    (torch.float16, 1.0 + 2**-10, 1.0 + 2**-6),
    (torch.bfloat16, 1.0 + 2**-7, 1.0 + 2**-4),
]


@pytest.mark.parametrize(("dtype", "within", "outside"), TOLERANCE_CASES, ids=lambda v: str(v))
def test_default_tolerance_is_the_dtypes_own(dtype: torch.dtype, within: float, outside: float) -> None:
    expected = torch.ones(2, 3, dtype=dtype)
    close = expected.clone()
    close[1, 2] = within
    far = expected.clone()
    far[1, 1] = outside
    assert close[1, 2].item() == within and far[1, 1].item() == outside  # representable in the dtype
    # Bit for bit both differ; within the dtype's tolerance only the far one does.
    assert _differs(close, expected).index == (1, 2)
    assert first_difference(close, expected, rtol=None, atol=None) is None
    diff = _differs(far, expected, rtol=None, atol=None)
    assert diff.index == (1, 1)
    assert diff.max_abs == pytest.approx(outside - 1.0)
    # rtol or atol alone None: that one from the dtype, the other as given.
    rtol, atol = default_tolerance(dtype)
    assert first_difference(close, expected, rtol=None, atol=atol) is None
    assert first_difference(close, expected, rtol=rtol, atol=None) is None


def test_the_same_difference_is_within_fp16_tolerance_but_not_fp32() -> None:
    delta = 2**-10
    for dtype, close in ((torch.float16, True), (torch.float32, False), (torch.float64, False)):
        diff = first_difference(
            torch.tensor([1.0 + delta], dtype=dtype), torch.tensor([1.0], dtype=dtype), rtol=None, atol=None
        )
        assert (diff is None) == close, dtype


def test_tolerance_is_chosen_per_leaf() -> None:
    delta = 2**-10  # within fp16's tolerance, not fp32's
    got = {"half": torch.tensor([1.0 + delta], dtype=torch.float16), "single": torch.tensor([1.0 + delta])}
    expected = {"half": torch.tensor([1.0], dtype=torch.float16), "single": torch.tensor([1.0])}
    diff = _differs(got, expected, rtol=None, atol=None)
    assert diff.path == "['single']"


def test_explicit_tolerance_wins_over_the_default() -> None:
    got, expected = torch.tensor([1.1]), torch.tensor([1.0])
    assert first_difference(got, expected, rtol=None, atol=None) is not None
    assert first_difference(got, expected, rtol=0.0, atol=0.2) is None
    assert first_difference(got, expected, rtol=0.2, atol=0.0) is None
    assert _differs(got, expected, rtol=0.0, atol=0.05).index == (0,)


# -- structures and leaves -----------------------------------------------------------------------------------
class Pair(NamedTuple):
    logits: torch.Tensor
    extra: Any


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    aux: dict[str, Any]
    note: str = "ok"


def test_leaves_name_paths_of_nested_structures() -> None:
    t = torch.zeros(1)
    value = {"a": [t, (1, None)], "b": Pair(t, "x"), "c": Output(t, {"k": 2.5})}
    assert leaves(value) == [
        ("['a'][0]", t),
        ("['a'][1][0]", 1),
        ("['a'][1][1]", None),
        ("['b'].logits", t),
        ("['b'].extra", "x"),
        ("['c'].hidden", t),
        ("['c'].aux['k']", 2.5),
        ("['c'].note", "ok"),
    ]
    assert leaves(t) == [("", t)]


def _nested(changed: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    value: dict[str, Any] = {
        "outs": [torch.randn(4, 3), torch.randn(4, 3), (torch.randn(2), torch.arange(5))],
        "pair": Pair(torch.randn(3, 3), 7),
        "data": Output(torch.randn(2, 2), {"k": torch.randn(3), "n": 1.5, "s": "text", "none": None}),
    }
    if changed == "middle":
        value["outs"][1][2, 1] += 1
    elif changed == "int":
        value["outs"][2][1][4] = 99
    elif changed == "field":
        value["data"].hidden[1, 0] = -5.0
    elif changed == "deep":
        value["data"].aux["k"][2] = 0.5
    elif changed == "namedtuple":
        value["pair"].logits[0, 2] = 9.0
    return value


@pytest.mark.parametrize(
    ("changed", "path", "index"),
    [
        ("middle", "['outs'][1]", (2, 1)),
        ("int", "['outs'][2][1]", (4,)),
        ("namedtuple", "['pair'].logits", (0, 2)),
        ("field", "['data'].hidden", (1, 0)),
        ("deep", "['data'].aux['k']", (2,)),
    ],
)
def test_one_element_of_one_output_among_many(changed: str, path: str, index: tuple[int, ...]) -> None:
    expected = _nested()
    assert first_difference(_nested(), expected) is None
    diff = _differs(_nested(changed), expected)
    assert (diff.path, diff.index, diff.reason) == (path, index, "values differ")
    assert diff.got != diff.expected


def test_the_first_differing_output_is_reported() -> None:
    expected = [torch.zeros(2), torch.zeros(2), torch.zeros(2)]
    got = [torch.zeros(2), torch.ones(2), torch.ones(2)]
    assert _differs(got, expected).path == "[1]"


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        (1, 2),
        (1.5, 2.5),
        ("a", "b"),
        (None, 0),
        (0, None),
        (True, False),
        (torch.float32, torch.float16),
        (torch.device("cpu"), torch.device("meta")),
        (b"x", b"y"),
    ],
)
def test_plain_leaves_that_differ(got: Any, expected: Any) -> None:
    diff = _differs((torch.zeros(1), got), (torch.zeros(1), expected))
    assert diff.path == "[1]"
    assert diff.reason == "values differ"
    assert (diff.got, diff.expected) == (got, expected)
    assert diff.index is None and not diff.opaque


@pytest.mark.parametrize(
    "value", [1, 1.5, "text", None, True, math.nan, torch.float16, torch.Size([1, 2]), b"x"]
)
def test_plain_leaves_that_are_equal(value: Any) -> None:
    assert first_difference({"v": value, "t": torch.ones(2)}, {"v": value, "t": torch.ones(2)}) is None


def test_plain_leaf_in_a_dataclass_field() -> None:
    diff = _differs(Output(torch.zeros(1), {}, note="a"), Output(torch.zeros(1), {}, note="b"))
    assert (diff.path, diff.got, diff.expected) == (".note", "a", "b")


def test_tensor_against_a_plain_value() -> None:
    diff = _differs([torch.ones(1)], [1.0])
    assert diff.path == "[0]"
    assert diff.reason == "Tensor but eager gives float"
    assert _differs([None], [torch.ones(1)]).reason == "NoneType but eager gives Tensor"


def test_structures_that_differ() -> None:
    diff = _differs((torch.ones(1), torch.ones(1)), (torch.ones(1),))
    assert diff.path == ""
    assert diff.reason.startswith("output structure ")
    assert _differs({"a": torch.ones(1)}, {"b": torch.ones(1)}).reason.startswith("output structure ")
    assert _differs(torch.ones(1), [torch.ones(1)]).reason.startswith("output structure ")


class _Cache:
    """An object forward made: neither a tensor nor a plain value."""


def test_opaque_objects_are_equal_only_when_identical() -> None:
    cache = _Cache()
    assert first_difference((torch.ones(1), cache), (torch.ones(1), cache)) is None
    diff = _differs((torch.ones(1), _Cache()), (torch.ones(1), cache))
    assert diff.opaque
    assert diff.path == "[1]"
    assert diff.expected is cache
    assert diff.index is None


def test_a_difference_is_reported_only_by_values_not_by_identity_of_tensors() -> None:
    t = torch.randn(3)
    assert first_difference([t], [t]) is None
    assert first_difference([t], [t.clone()]) is None
