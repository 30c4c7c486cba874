"""CapturePlan against tables derived by hand from vLLM's CUDA-graph manager.

Every expected value below was worked out on paper from the reference
(``/work/shared/reference/vllm_cudagraph_utils.txt``), not by running our code:

* capture descriptors and their order: ``_init_candidates`` (lines 248-369)
  and ``_maybe_ubatch_twin`` (lines 221-246); capture order PIECEWISE before
  FULL: ``capture`` (lines 435-442);
* candidate lists: ``_init_candidates`` (lines 371-385);
* LoRA count mapping: ``_build_lora_dispatch_map`` / ``_resolve_effective_loras``
  (lines 195-219);
* dispatch and the eager fallback: ``dispatch`` (lines 515-545) with
  ``_is_compatible`` (lines 103-130).

Shorthand in the comments: ``F`` FULL, ``PW`` PIECEWISE, ``R`` num_reqs,
``U`` uniform_token_count, ``Q`` max_query_len, ``L`` num_active_loras,
``B`` num_ubatches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_cudagraph.plan import BatchDescriptor, CaptureConfig, CapturePlan, GraphMode

REPO_ROOT = Path(__file__).resolve().parent.parent

NONE = GraphMode.NONE
PW = GraphMode.PIECEWISE
FULL = GraphMode.FULL
FDO = GraphMode.FULL_DECODE_ONLY
FAP = GraphMode.FULL_AND_PIECEWISE

BD = BatchDescriptor

Batch = dict[str, Any]


def plan_for(**kwargs: Any) -> CapturePlan:
    return CapturePlan(CaptureConfig(**kwargs))


def as_dict(
    descs: Mapping[GraphMode, tuple[BatchDescriptor, ...]],
) -> dict[GraphMode, tuple[BatchDescriptor, ...]]:
    return {mode: tuple(d) for mode, d in descs.items()}


# ---------------------------------------------------------------------------
# Configuration A: sizes {1, 2, 4, 8} (given unsorted: the reference sorts
# them, line 254), max_num_reqs=4, decode_query_len=1, no LoRA.
# max_decode_tokens = 4 * 1 = 4 (line 255).
# ---------------------------------------------------------------------------
CONFIG_A: dict[str, Any] = {"capture_sizes": (4, 1, 8, 2), "max_num_reqs": 4}

# Mixed FULL graphs pad requests to min(num_tokens, max_num_reqs) (line 354).
A_FULL_MIXED = (
    BD(FULL, 8, num_reqs=4),
    BD(FULL, 4, num_reqs=4),
    BD(FULL, 2, num_reqs=2),
    BD(FULL, 1, num_reqs=1),
)
# Uniform decode graphs: round_up(n, 1) = n, R = n; 8 > max_decode_tokens (4)
# is skipped (lines 314-322).
A_FULL_DECODE = (
    BD(FULL, 4, num_reqs=4, uniform_token_count=1),
    BD(FULL, 2, num_reqs=2, uniform_token_count=1),
    BD(FULL, 1, num_reqs=1, uniform_token_count=1),
)
# PIECEWISE graphs leave num_reqs None (line 352).
A_PW = (BD(PW, 8), BD(PW, 4), BD(PW, 2), BD(PW, 1))

CAPTURE_TABLE: list[
    tuple[str, dict[str, Any], dict[GraphMode, tuple[BatchDescriptor, ...]], tuple[BatchDescriptor, ...]]
] = [
    # NONE: nothing is captured (line 251: bool(NONE) is False).
    ("A-NONE", {**CONFIG_A, "mode": NONE}, {}, ()),
    # PIECEWISE: not a separate routine, mixed mode PIECEWISE only.
    ("A-PIECEWISE", {**CONFIG_A, "mode": PW}, {PW: A_PW}, A_PW),
    # FULL: not a separate routine; every size is a mixed FULL graph.
    ("A-FULL", {**CONFIG_A, "mode": FULL}, {FULL: A_FULL_MIXED}, A_FULL_MIXED),
    # FULL_DECODE_ONLY: decode FULL (uniform), mixed NONE (nothing).
    ("A-FULL_DECODE_ONLY", {**CONFIG_A, "mode": FDO}, {FULL: A_FULL_DECODE}, A_FULL_DECODE),
    # FULL_AND_PIECEWISE: decode FULL (uniform) + mixed PIECEWISE; the
    # manager captures PIECEWISE first (line 438).
    (
        "A-FULL_AND_PIECEWISE",
        {**CONFIG_A, "mode": FAP},
        {FULL: A_FULL_DECODE, PW: A_PW},
        A_PW + A_FULL_DECODE,
    ),
    # Configuration B: decode_query_len=4, sizes 1..32, max_num_reqs=4, so
    # max_decode_tokens=16. Rounding: 1,2,4 -> 4 (R1, deduped), 8 -> 8 (R2),
    # 16 -> 16 (R4), 32 -> 32 > 16 skipped. Mixed PIECEWISE keeps every size.
    (
        "B-FULL_AND_PIECEWISE-dql4",
        {"capture_sizes": (1, 2, 4, 8, 16, 32), "max_num_reqs": 4, "mode": FAP, "decode_query_len": 4},
        {
            FULL: (
                BD(FULL, 16, num_reqs=4, uniform_token_count=4),
                BD(FULL, 8, num_reqs=2, uniform_token_count=4),
                BD(FULL, 4, num_reqs=1, uniform_token_count=4),
            ),
            PW: (BD(PW, 32), BD(PW, 16), BD(PW, 8), BD(PW, 4), BD(PW, 2), BD(PW, 1)),
        },
        (
            BD(PW, 32),
            BD(PW, 16),
            BD(PW, 8),
            BD(PW, 4),
            BD(PW, 2),
            BD(PW, 1),
            BD(FULL, 16, num_reqs=4, uniform_token_count=4),
            BD(FULL, 8, num_reqs=2, uniform_token_count=4),
            BD(FULL, 4, num_reqs=1, uniform_token_count=4),
        ),
    ),
    # Uniform decode with decode_query_len=1 is not rounded at all; the
    # decode bound is max_num_reqs (3): sizes 4 and 8 get no decode graph.
    (
        "dql1-bound-by-max-num-reqs",
        {"capture_sizes": (1, 2, 3, 4, 8), "max_num_reqs": 3, "mode": FDO},
        {
            FULL: (
                BD(FULL, 3, num_reqs=3, uniform_token_count=1),
                BD(FULL, 2, num_reqs=2, uniform_token_count=1),
                BD(FULL, 1, num_reqs=1, uniform_token_count=1),
            )
        },
        (
            BD(FULL, 3, num_reqs=3, uniform_token_count=1),
            BD(FULL, 2, num_reqs=2, uniform_token_count=1),
            BD(FULL, 1, num_reqs=1, uniform_token_count=1),
        ),
    ),
    # decode_query_len=3: 1,2,3 -> 3 (R1); 4,6 -> 6 (R2). Dedup (line 333).
    (
        "dql3-dedup",
        {"capture_sizes": (1, 2, 3, 4, 6), "max_num_reqs": 8, "mode": FDO, "decode_query_len": 3},
        {
            FULL: (
                BD(FULL, 6, num_reqs=2, uniform_token_count=3),
                BD(FULL, 3, num_reqs=1, uniform_token_count=3),
            )
        },
        (
            BD(FULL, 6, num_reqs=2, uniform_token_count=3),
            BD(FULL, 3, num_reqs=1, uniform_token_count=3),
        ),
    ),
    # decode_query_len=4, max_num_reqs=8 (max_decode_tokens 32), sizes up to
    # 10: 10 rounds to 12 > max_capture_size (defaults to 10): skipped (line 319).
    (
        "dql4-bound-by-max-capture-size",
        {"capture_sizes": (1, 2, 4, 8, 10), "max_num_reqs": 8, "mode": FDO, "decode_query_len": 4},
        {
            FULL: (
                BD(FULL, 8, num_reqs=2, uniform_token_count=4),
                BD(FULL, 4, num_reqs=1, uniform_token_count=4),
            )
        },
        (
            BD(FULL, 8, num_reqs=2, uniform_token_count=4),
            BD(FULL, 4, num_reqs=1, uniform_token_count=4),
        ),
    ),
    # Same with max_capture_size=12: the rounded 12 (R3) is now captured.
    (
        "dql4-raised-max-capture-size",
        {
            "capture_sizes": (1, 2, 4, 8, 10),
            "max_num_reqs": 8,
            "mode": FDO,
            "decode_query_len": 4,
            "max_capture_size": 12,
        },
        {
            FULL: (
                BD(FULL, 12, num_reqs=3, uniform_token_count=4),
                BD(FULL, 8, num_reqs=2, uniform_token_count=4),
                BD(FULL, 4, num_reqs=1, uniform_token_count=4),
            )
        },
        (
            BD(FULL, 12, num_reqs=3, uniform_token_count=4),
            BD(FULL, 8, num_reqs=2, uniform_token_count=4),
            BD(FULL, 4, num_reqs=1, uniform_token_count=4),
        ),
    ),
    # ... but max_num_reqs * decode_query_len (2 * 4 = 8) still bounds it.
    (
        "dql4-bound-by-max-decode-tokens",
        {
            "capture_sizes": (1, 2, 4, 8, 10),
            "max_num_reqs": 2,
            "mode": FDO,
            "decode_query_len": 4,
            "max_capture_size": 12,
        },
        {
            FULL: (
                BD(FULL, 8, num_reqs=2, uniform_token_count=4),
                BD(FULL, 4, num_reqs=1, uniform_token_count=4),
            )
        },
        (
            BD(FULL, 8, num_reqs=2, uniform_token_count=4),
            BD(FULL, 4, num_reqs=1, uniform_token_count=4),
        ),
    ),
    # Dedup is per LoRA case: 1, 2, 4 all round to 4 for L0 and for L1.
    (
        "dql4-dedup-per-lora-case",
        {
            "capture_sizes": (1, 2, 4),
            "max_num_reqs": 4,
            "mode": FDO,
            "decode_query_len": 4,
            "lora_cases": (0, 1),
        },
        {
            FULL: (
                BD(FULL, 4, num_reqs=1, uniform_token_count=4),
                BD(FULL, 4, num_reqs=1, uniform_token_count=4, num_active_loras=1),
            )
        },
        (
            BD(FULL, 4, num_reqs=1, uniform_token_count=4),
            BD(FULL, 4, num_reqs=1, uniform_token_count=4, num_active_loras=1),
        ),
    ),
    # Varlen decode (lines 293-309): decode_query_len=2, max_num_reqs=4,
    # max_decode_tokens 8. Sizes <= 8 get a FULL graph with R=min(n, 4),
    # Q=2 and no uniform count; 16 gets none (the elif on line 312 is off when
    # varlen_decode is set). Mixed PIECEWISE keeps every size.
    (
        "varlen-FULL_AND_PIECEWISE",
        {
            "capture_sizes": (1, 2, 4, 8, 16),
            "max_num_reqs": 4,
            "mode": FAP,
            "decode_query_len": 2,
            "varlen_decode": True,
        },
        {
            FULL: (
                BD(FULL, 8, num_reqs=4, max_query_len=2),
                BD(FULL, 4, num_reqs=4, max_query_len=2),
                BD(FULL, 2, num_reqs=2, max_query_len=2),
                BD(FULL, 1, num_reqs=1, max_query_len=2),
            ),
            PW: (BD(PW, 16), BD(PW, 8), BD(PW, 4), BD(PW, 2), BD(PW, 1)),
        },
        (
            BD(PW, 16),
            BD(PW, 8),
            BD(PW, 4),
            BD(PW, 2),
            BD(PW, 1),
            BD(FULL, 8, num_reqs=4, max_query_len=2),
            BD(FULL, 4, num_reqs=4, max_query_len=2),
            BD(FULL, 2, num_reqs=2, max_query_len=2),
            BD(FULL, 1, num_reqs=1, max_query_len=2),
        ),
    ),
    (
        "varlen-FULL_DECODE_ONLY",
        {
            "capture_sizes": (1, 2, 4, 8, 16),
            "max_num_reqs": 4,
            "mode": FDO,
            "decode_query_len": 2,
            "varlen_decode": True,
        },
        {
            FULL: (
                BD(FULL, 8, num_reqs=4, max_query_len=2),
                BD(FULL, 4, num_reqs=4, max_query_len=2),
                BD(FULL, 2, num_reqs=2, max_query_len=2),
                BD(FULL, 1, num_reqs=1, max_query_len=2),
            ),
        },
        (
            BD(FULL, 8, num_reqs=4, max_query_len=2),
            BD(FULL, 4, num_reqs=4, max_query_len=2),
            BD(FULL, 2, num_reqs=2, max_query_len=2),
            BD(FULL, 1, num_reqs=1, max_query_len=2),
        ),
    ),
    # LoRA cases: product(sizes, cases) in the order the cases are given
    # (line 296), then a stable sort largest first (line 368).
    (
        "lora-FULL",
        {"capture_sizes": (1, 2), "max_num_reqs": 2, "mode": FULL, "lora_cases": (0, 1, 2, 4)},
        {
            FULL: (
                BD(FULL, 2, num_reqs=2),
                BD(FULL, 2, num_reqs=2, num_active_loras=1),
                BD(FULL, 2, num_reqs=2, num_active_loras=2),
                BD(FULL, 2, num_reqs=2, num_active_loras=4),
                BD(FULL, 1, num_reqs=1),
                BD(FULL, 1, num_reqs=1, num_active_loras=1),
                BD(FULL, 1, num_reqs=1, num_active_loras=2),
                BD(FULL, 1, num_reqs=1, num_active_loras=4),
            )
        },
        (
            BD(FULL, 2, num_reqs=2),
            BD(FULL, 2, num_reqs=2, num_active_loras=1),
            BD(FULL, 2, num_reqs=2, num_active_loras=2),
            BD(FULL, 2, num_reqs=2, num_active_loras=4),
            BD(FULL, 1, num_reqs=1),
            BD(FULL, 1, num_reqs=1, num_active_loras=1),
            BD(FULL, 1, num_reqs=1, num_active_loras=2),
            BD(FULL, 1, num_reqs=1, num_active_loras=4),
        ),
    ),
    (
        "lora-case-order-follows-config",
        {"capture_sizes": (1, 2), "max_num_reqs": 2, "mode": FULL, "lora_cases": (4, 0)},
        {
            FULL: (
                BD(FULL, 2, num_reqs=2, num_active_loras=4),
                BD(FULL, 2, num_reqs=2),
                BD(FULL, 1, num_reqs=1, num_active_loras=4),
                BD(FULL, 1, num_reqs=1),
            )
        },
        (
            BD(FULL, 2, num_reqs=2, num_active_loras=4),
            BD(FULL, 2, num_reqs=2),
            BD(FULL, 1, num_reqs=1, num_active_loras=4),
            BD(FULL, 1, num_reqs=1),
        ),
    ),
    (
        "lora-FULL_AND_PIECEWISE",
        {"capture_sizes": (1, 2), "max_num_reqs": 2, "mode": FAP, "lora_cases": (0, 2)},
        {
            FULL: (
                BD(FULL, 2, num_reqs=2, uniform_token_count=1),
                BD(FULL, 2, num_reqs=2, uniform_token_count=1, num_active_loras=2),
                BD(FULL, 1, num_reqs=1, uniform_token_count=1),
                BD(FULL, 1, num_reqs=1, uniform_token_count=1, num_active_loras=2),
            ),
            PW: (BD(PW, 2), BD(PW, 2, num_active_loras=2), BD(PW, 1), BD(PW, 1, num_active_loras=2)),
        },
        (
            BD(PW, 2),
            BD(PW, 2, num_active_loras=2),
            BD(PW, 1),
            BD(PW, 1, num_active_loras=2),
            BD(FULL, 2, num_reqs=2, uniform_token_count=1),
            BD(FULL, 2, num_reqs=2, uniform_token_count=1, num_active_loras=2),
            BD(FULL, 1, num_reqs=1, uniform_token_count=1),
            BD(FULL, 1, num_reqs=1, uniform_token_count=1, num_active_loras=2),
        ),
    ),
    # Microbatch twins (lines 221-246) on mixed FULL graphs: num_ubatches=2,
    # ubatch_min_tokens=4, max_num_reqs=8.
    #   1 (R1): 1 < 2 ubatches -> none;   2 (R2): 2 < 4 min tokens -> none;
    #   4 (R4): 4/4 = 1 -> twin U1;        8 (R8): 8/8 = 1 -> twin U1;
    #  12 (R8): 12 % 8 != 0 -> none;      16 (R8): 16/8 = 2 -> twin U2.
    # Each twin is appended right after its graph; the stable sort keeps it there.
    (
        "ubatch-FULL",
        {
            "capture_sizes": (1, 2, 4, 8, 12, 16),
            "max_num_reqs": 8,
            "mode": FULL,
            "num_ubatches": 2,
            "ubatch_min_tokens": 4,
        },
        {
            FULL: (
                BD(FULL, 16, num_reqs=8),
                BD(FULL, 16, num_reqs=8, uniform_token_count=2, num_ubatches=2),
                BD(FULL, 12, num_reqs=8),
                BD(FULL, 8, num_reqs=8),
                BD(FULL, 8, num_reqs=8, uniform_token_count=1, num_ubatches=2),
                BD(FULL, 4, num_reqs=4),
                BD(FULL, 4, num_reqs=4, uniform_token_count=1, num_ubatches=2),
                BD(FULL, 2, num_reqs=2),
                BD(FULL, 1, num_reqs=1),
            )
        },
        (
            BD(FULL, 16, num_reqs=8),
            BD(FULL, 16, num_reqs=8, uniform_token_count=2, num_ubatches=2),
            BD(FULL, 12, num_reqs=8),
            BD(FULL, 8, num_reqs=8),
            BD(FULL, 8, num_reqs=8, uniform_token_count=1, num_ubatches=2),
            BD(FULL, 4, num_reqs=4),
            BD(FULL, 4, num_reqs=4, uniform_token_count=1, num_ubatches=2),
            BD(FULL, 2, num_reqs=2),
            BD(FULL, 1, num_reqs=1),
        ),
    ),
    # num_ubatches=3: a graph needs at least 3 tokens (line 238).
    (
        "ubatch-3-FULL",
        {"capture_sizes": (1, 2, 3, 6), "max_num_reqs": 8, "mode": FULL, "num_ubatches": 3},
        {
            FULL: (
                BD(FULL, 6, num_reqs=6),
                BD(FULL, 6, num_reqs=6, uniform_token_count=1, num_ubatches=3),
                BD(FULL, 3, num_reqs=3),
                BD(FULL, 3, num_reqs=3, uniform_token_count=1, num_ubatches=3),
                BD(FULL, 2, num_reqs=2),
                BD(FULL, 1, num_reqs=1),
            )
        },
        (
            BD(FULL, 6, num_reqs=6),
            BD(FULL, 6, num_reqs=6, uniform_token_count=1, num_ubatches=3),
            BD(FULL, 3, num_reqs=3),
            BD(FULL, 3, num_reqs=3, uniform_token_count=1, num_ubatches=3),
            BD(FULL, 2, num_reqs=2),
            BD(FULL, 1, num_reqs=1),
        ),
    ),
    # Twins of uniform decode graphs (line 336), none for PIECEWISE ones
    # (line 229). decode_query_len=2, max_num_reqs=4: 1,2 -> 2 (R1; 2 < 4 min
    # tokens: no twin), 4 -> 4 (R2, twin), 8 -> 8 (R4, twin).
    (
        "ubatch-FULL_AND_PIECEWISE",
        {
            "capture_sizes": (1, 2, 4, 8),
            "max_num_reqs": 4,
            "mode": FAP,
            "decode_query_len": 2,
            "num_ubatches": 2,
            "ubatch_min_tokens": 4,
        },
        {
            FULL: (
                BD(FULL, 8, num_reqs=4, uniform_token_count=2),
                BD(FULL, 8, num_reqs=4, uniform_token_count=2, num_ubatches=2),
                BD(FULL, 4, num_reqs=2, uniform_token_count=2),
                BD(FULL, 4, num_reqs=2, uniform_token_count=2, num_ubatches=2),
                BD(FULL, 2, num_reqs=1, uniform_token_count=2),
            ),
            PW: (BD(PW, 8), BD(PW, 4), BD(PW, 2), BD(PW, 1)),
        },
        (
            BD(PW, 8),
            BD(PW, 4),
            BD(PW, 2),
            BD(PW, 1),
            BD(FULL, 8, num_reqs=4, uniform_token_count=2),
            BD(FULL, 8, num_reqs=4, uniform_token_count=2, num_ubatches=2),
            BD(FULL, 4, num_reqs=2, uniform_token_count=2),
            BD(FULL, 4, num_reqs=2, uniform_token_count=2, num_ubatches=2),
            BD(FULL, 2, num_reqs=1, uniform_token_count=2),
        ),
    ),
    (
        "ubatch-PIECEWISE-has-no-twins",
        {"capture_sizes": (4, 8), "max_num_reqs": 8, "mode": PW, "num_ubatches": 2},
        {PW: (BD(PW, 8), BD(PW, 4))},
        (BD(PW, 8), BD(PW, 4)),
    ),
    # Varlen decode graphs get no twin (only the uniform branch asks, line 336).
    (
        "ubatch-varlen-has-no-twins",
        {
            "capture_sizes": (4, 8),
            "max_num_reqs": 8,
            "mode": FDO,
            "decode_query_len": 1,
            "varlen_decode": True,
            "num_ubatches": 2,
        },
        {FULL: (BD(FULL, 8, num_reqs=8, max_query_len=1), BD(FULL, 4, num_reqs=4, max_query_len=1))},
        (BD(FULL, 8, num_reqs=8, max_query_len=1), BD(FULL, 4, num_reqs=4, max_query_len=1)),
    ),
]


@pytest.mark.parametrize(
    ("config", "expected", "order"),
    [pytest.param(c, e, o, id=i) for i, c, e, o in CAPTURE_TABLE],
)
def test_capture_descriptors(
    config: dict[str, Any],
    expected: dict[GraphMode, tuple[BatchDescriptor, ...]],
    order: tuple[BatchDescriptor, ...],
) -> None:
    plan = plan_for(**config)
    assert as_dict(plan.capture_descriptors) == expected
    assert plan.capture_order == order
    assert plan.descriptors == order


@pytest.mark.parametrize("mode", [NONE, PW, FULL, FDO, FAP], ids=lambda m: m.name)
def test_capture_order_piecewise_before_full_largest_first(mode: GraphMode) -> None:
    plan = plan_for(capture_sizes=(1, 2, 4, 8, 16, 24), max_num_reqs=8, mode=mode, lora_cases=(0, 1))
    order = plan.capture_order
    modes = [d.mode for d in order]
    # Every PIECEWISE graph before every FULL graph (reference line 438).
    assert modes == sorted(modes, key=lambda m: 0 if m is PW else 1)
    for runtime_mode in (PW, FULL):
        sizes = [d.num_tokens for d in order if d.mode is runtime_mode]
        assert sizes == sorted(sizes, reverse=True)
    assert NONE not in modes


@pytest.mark.parametrize("mode", [FULL, PW], ids=lambda m: m.name)
def test_varlen_decode_ignored_without_separate_routine(mode: GraphMode) -> None:
    # capture_varlen_decode needs separate_routine() (line 294): FULL and
    # PIECEWISE plans do not change with varlen_decode.
    base = {"capture_sizes": (1, 2, 4, 8, 16), "max_num_reqs": 4, "mode": mode, "decode_query_len": 2}
    assert as_dict(plan_for(**base).capture_descriptors) == as_dict(
        plan_for(**base, varlen_decode=True).capture_descriptors
    )


def test_decode_query_len_ignored_without_separate_routine() -> None:
    # FULL mode never builds uniform decode graphs, so decode_query_len only
    # matters through varlen/uniform branches it never takes.
    base = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "mode": FULL}
    assert as_dict(plan_for(**base).capture_descriptors) == as_dict(
        plan_for(**base, decode_query_len=4).capture_descriptors
    )


def test_full_mixed_graph_pads_requests_to_max_num_reqs() -> None:
    # num_reqs = min(num_tokens, max_num_reqs) (line 354).
    plan = plan_for(capture_sizes=(2, 64, 512), max_num_reqs=256, mode=FULL)
    assert plan.capture_descriptors[FULL] == (
        BD(FULL, 512, num_reqs=256),
        BD(FULL, 64, num_reqs=64),
        BD(FULL, 2, num_reqs=2),
    )


def test_ubatch_twin_of_full_mixed_graph_above_max_num_reqs() -> None:
    # 512 tokens over 256 requests split evenly (2 per request): twin U2.
    plan = plan_for(capture_sizes=(512,), max_num_reqs=256, mode=FULL, num_ubatches=2, ubatch_min_tokens=256)
    assert plan.capture_descriptors[FULL] == (
        BD(FULL, 512, num_reqs=256),
        BD(FULL, 512, num_reqs=256, uniform_token_count=2, num_ubatches=2),
    )


def test_ubatch_min_tokens_is_inclusive() -> None:
    # check_ubatch_thresholds passes when num_tokens >= ubatch_min_tokens.
    at = plan_for(capture_sizes=(8,), max_num_reqs=8, mode=FULL, num_ubatches=2, ubatch_min_tokens=8)
    above = plan_for(capture_sizes=(8,), max_num_reqs=8, mode=FULL, num_ubatches=2, ubatch_min_tokens=9)
    assert at.capture_descriptors[FULL] == (
        BD(FULL, 8, num_reqs=8),
        BD(FULL, 8, num_reqs=8, uniform_token_count=1, num_ubatches=2),
    )
    assert above.capture_descriptors[FULL] == (BD(FULL, 8, num_reqs=8),)


# ---------------------------------------------------------------------------
# LoRA mapping (lines 195-219)
# ---------------------------------------------------------------------------
LORA_MAP_TABLE: list[tuple[tuple[int, ...], dict[int, int]]] = [
    # Each count maps to the smallest captured case >= it; counts above the
    # largest case clamp to it; 0 stays 0.
    ((0, 1, 2, 4), {0: 0, 1: 1, 2: 2, 3: 4, 4: 4, 5: 4, 6: 4, 100: 4}),
    ((0, 2), {0: 0, 1: 2, 2: 2, 3: 2, 6: 2}),
    ((4, 0, 1), {0: 0, 1: 1, 2: 4, 3: 4, 4: 4, 5: 4}),
    ((1, 8), {0: 0, 1: 1, 2: 8, 7: 8, 8: 8, 9: 8}),
    # No LoRA case above 0: counts pass through unchanged (line 216).
    ((0,), {0: 0, 1: 1, 3: 3, 6: 6}),
]


@pytest.mark.parametrize(("cases", "expected"), LORA_MAP_TABLE, ids=lambda v: str(v))
def test_effective_loras(cases: tuple[int, ...], expected: dict[int, int]) -> None:
    plan = plan_for(capture_sizes=(1, 2), max_num_reqs=2, mode=FULL, lora_cases=cases)
    assert {n: plan.effective_loras(n) for n in expected} == expected
    assert plan.max_lora_case == max(cases)


def test_effective_loras_applies_in_none_mode() -> None:
    # The map is built independently of the mode (line 170), so even an eager
    # plan reports the captured case it would have used.
    plan = plan_for(capture_sizes=(1, 2), max_num_reqs=2, mode=NONE, lora_cases=(0, 1, 2, 4))
    assert plan.effective_loras(3) == 4
    assert plan.dispatch(num_reqs=1, num_tokens=1, num_active_loras=3) == BD(
        NONE, 1, num_reqs=1, num_active_loras=4
    )


# ---------------------------------------------------------------------------
# Candidates (lines 371-385)
# ---------------------------------------------------------------------------
def test_candidates_priority_full_then_piecewise() -> None:
    plan = plan_for(**CONFIG_A, mode=FAP)
    f1, f2, f4 = (
        BD(FULL, 1, num_reqs=1, uniform_token_count=1),
        BD(FULL, 2, num_reqs=2, uniform_token_count=1),
        BD(FULL, 4, num_reqs=4, uniform_token_count=1),
    )
    # Ranges start at 0 (line 377); dispatch never asks for 0 (line 527).
    assert plan.candidates(0) == (f1, BD(PW, 1))
    assert plan.candidates(1) == (f1, BD(PW, 1))
    assert plan.candidates(2) == (f2, BD(PW, 2))
    assert plan.candidates(3) == (f4, BD(PW, 4))
    assert plan.candidates(4) == (f4, BD(PW, 4))
    for n in range(5, 9):
        assert plan.candidates(n) == (BD(PW, 8),)
    assert plan.candidates(9) == ()
    # No LoRA graphs at all.
    assert plan.candidates(2, 1) == ()


def test_candidates_group_twins_before_their_graph() -> None:
    # The candidate lists walk each mode's descriptors reversed (line 372),
    # so within one size a twin (appended after its graph) comes first.
    plan = plan_for(
        capture_sizes=(1, 2, 4, 8, 12, 16), max_num_reqs=8, mode=FULL, num_ubatches=2, ubatch_min_tokens=4
    )
    t4 = BD(FULL, 4, num_reqs=4, uniform_token_count=1, num_ubatches=2)
    d4 = BD(FULL, 4, num_reqs=4)
    t16 = BD(FULL, 16, num_reqs=8, uniform_token_count=2, num_ubatches=2)
    d16 = BD(FULL, 16, num_reqs=8)
    assert plan.candidates(3) == (t4, d4)
    assert plan.candidates(4) == (t4, d4)
    assert plan.candidates(10) == (BD(FULL, 12, num_reqs=8),)
    assert plan.candidates(13) == (t16, d16)
    assert plan.candidates(17) == ()


def test_candidates_use_effective_loras() -> None:
    plan = plan_for(capture_sizes=(1, 2), max_num_reqs=2, mode=FULL, lora_cases=(0, 1, 2, 4))
    assert plan.candidates(2, 3) == (BD(FULL, 2, num_reqs=2, num_active_loras=4),)
    assert plan.candidates(2, 9) == (BD(FULL, 2, num_reqs=2, num_active_loras=4),)
    assert plan.candidates(1, 0) == (BD(FULL, 1, num_reqs=1),)
    assert plan.candidates(3, 1) == ()


def test_candidates_uniform_decode_and_piecewise_groups_differ() -> None:
    # Configuration B: FULL groups are 4, 8, 16; PIECEWISE groups 1..32.
    plan = plan_for(capture_sizes=(1, 2, 4, 8, 16, 32), max_num_reqs=4, mode=FAP, decode_query_len=4)
    f4 = BD(FULL, 4, num_reqs=1, uniform_token_count=4)
    f16 = BD(FULL, 16, num_reqs=4, uniform_token_count=4)
    assert plan.candidates(1) == (f4, BD(PW, 1))
    assert plan.candidates(3) == (f4, BD(PW, 4))
    assert plan.candidates(9) == (f16, BD(PW, 16))
    assert plan.candidates(17) == (BD(PW, 32),)


CANDIDATE_RANGE_TABLE: list[tuple[BatchDescriptor, range]] = [
    (BD(FULL, 1, num_reqs=1, uniform_token_count=1), range(1, 2)),
    (BD(FULL, 2, num_reqs=2, uniform_token_count=1), range(2, 3)),
    (BD(FULL, 4, num_reqs=4, uniform_token_count=1), range(3, 5)),
    (BD(PW, 1), range(1, 2)),
    (BD(PW, 2), range(2, 3)),
    (BD(PW, 4), range(3, 5)),
    (BD(PW, 8), range(5, 9)),
    # Not in the plan: an empty range.
    (BD(FULL, 8, num_reqs=4, uniform_token_count=1), range(0)),
    (BD(PW, 4, num_active_loras=1), range(0)),
    (BD(NONE, 4, num_reqs=4), range(0)),
]


@pytest.mark.parametrize(("desc", "expected"), CANDIDATE_RANGE_TABLE, ids=lambda v: str(v))
def test_candidate_range(desc: BatchDescriptor, expected: range) -> None:
    plan = plan_for(**CONFIG_A, mode=FAP)
    assert plan.candidate_range(desc) == expected


def test_candidate_range_lora_and_twins() -> None:
    plan = plan_for(
        capture_sizes=(1, 2, 4, 8, 12, 16),
        max_num_reqs=8,
        mode=FULL,
        lora_cases=(0, 4),
        num_ubatches=2,
        ubatch_min_tokens=4,
    )
    assert plan.candidate_range(BD(FULL, 4, num_reqs=4, uniform_token_count=1, num_ubatches=2)) == range(3, 5)
    assert plan.candidate_range(
        BD(FULL, 16, num_reqs=8, uniform_token_count=2, num_active_loras=4, num_ubatches=2)
    ) == range(13, 17)
    assert plan.candidate_range(BD(FULL, 12, num_reqs=8, num_active_loras=4)) == range(9, 13)


# ---------------------------------------------------------------------------
# Dispatch tables (lines 515-545 with _is_compatible, lines 103-130)
# ---------------------------------------------------------------------------
def b(
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None = None,
    num_active_loras: int = 0,
    max_query_len: int | None = None,
    num_ubatches: int = 1,
) -> Batch:
    return {
        "num_reqs": num_reqs,
        "num_tokens": num_tokens,
        "uniform_token_count": uniform_token_count,
        "num_active_loras": num_active_loras,
        "max_query_len": max_query_len,
        "num_ubatches": num_ubatches,
    }


CONFIG_B: dict[str, Any] = {"capture_sizes": (1, 2, 4, 8, 16, 32), "max_num_reqs": 4, "decode_query_len": 4}
CONFIG_V: dict[str, Any] = {
    "capture_sizes": (1, 2, 4, 8, 16),
    "max_num_reqs": 4,
    "decode_query_len": 2,
    "varlen_decode": True,
}
CONFIG_L: dict[str, Any] = {"capture_sizes": (1, 2), "max_num_reqs": 2, "lora_cases": (0, 1, 2, 4)}
CONFIG_U: dict[str, Any] = {
    "capture_sizes": (1, 2, 4, 8, 12, 16),
    "max_num_reqs": 8,
    "num_ubatches": 2,
    "ubatch_min_tokens": 4,
}
CONFIG_U2: dict[str, Any] = {
    "capture_sizes": (1, 2, 4, 8),
    "max_num_reqs": 4,
    "decode_query_len": 2,
    "num_ubatches": 2,
    "ubatch_min_tokens": 4,
}

# (id, config, batch, expected descriptor)
DISPATCH_TABLE: list[tuple[str, dict[str, Any], Batch, BatchDescriptor]] = [
    # --- NONE: every batch runs eagerly; the NONE descriptor carries tokens,
    # reqs, the *effective* LoRA case and num_ubatches, never the uniform count
    # or max_query_len (lines 539-545).
    ("NONE-decode", {**CONFIG_A, "mode": NONE}, b(1, 1, 1, max_query_len=1), BD(NONE, 1, num_reqs=1)),
    ("NONE-mixed", {**CONFIG_A, "mode": NONE}, b(2, 4, 2, max_query_len=2), BD(NONE, 4, num_reqs=2)),
    (
        "NONE-ubatch",
        {**CONFIG_A, "mode": NONE},
        b(2, 4, num_ubatches=2),
        BD(NONE, 4, num_reqs=2, num_ubatches=2),
    ),
    ("NONE-zero", {**CONFIG_A, "mode": NONE}, b(0, 0), BD(NONE, 0, num_reqs=0)),
    (
        "NONE-lora-mapped",
        {**CONFIG_L, "mode": NONE},
        b(1, 2, num_active_loras=3),
        BD(NONE, 2, num_reqs=1, num_active_loras=4),
    ),
    # --- PIECEWISE (configuration A): token padding only.
    ("PW-1", {**CONFIG_A, "mode": PW}, b(1, 1, 1), BD(PW, 1)),
    ("PW-pad-3-to-4", {**CONFIG_A, "mode": PW}, b(3, 3, 1), BD(PW, 4)),
    ("PW-prefill", {**CONFIG_A, "mode": PW}, b(1, 3), BD(PW, 4)),
    ("PW-pad-5-to-8", {**CONFIG_A, "mode": PW}, b(4, 7), BD(PW, 8)),
    # A PIECEWISE graph has num_reqs None: any request count fits.
    ("PW-reqs-above-max", {**CONFIG_A, "mode": PW}, b(8, 8, 1), BD(PW, 8)),
    ("PW-max-query-len-irrelevant", {**CONFIG_A, "mode": PW}, b(2, 6, max_query_len=5), BD(PW, 8)),
    ("PW-oversize", {**CONFIG_A, "mode": PW}, b(2, 9), BD(NONE, 9, num_reqs=2)),
    ("PW-zero", {**CONFIG_A, "mode": PW}, b(0, 0), BD(NONE, 0, num_reqs=0)),
    (
        "PW-ubatch-mismatch",
        {**CONFIG_A, "mode": PW},
        b(2, 2, num_ubatches=2),
        BD(NONE, 2, num_reqs=2, num_ubatches=2),
    ),
    (
        "PW-lora-without-cases",
        {**CONFIG_A, "mode": PW},
        b(1, 2, num_active_loras=1),
        BD(NONE, 2, num_reqs=1, num_active_loras=1),
    ),
    # --- FULL (configuration A): mixed FULL graphs, request bound min(n, 4).
    ("FULL-1", {**CONFIG_A, "mode": FULL}, b(1, 1), BD(FULL, 1, num_reqs=1)),
    # No uniform count on a mixed FULL graph: any uniform count is fine.
    ("FULL-uniform-any", {**CONFIG_A, "mode": FULL}, b(1, 2, 2), BD(FULL, 2, num_reqs=2)),
    ("FULL-pad-3-to-4", {**CONFIG_A, "mode": FULL}, b(3, 3, 1), BD(FULL, 4, num_reqs=4)),
    ("FULL-4", {**CONFIG_A, "mode": FULL}, b(4, 4), BD(FULL, 4, num_reqs=4)),
    ("FULL-pad-5-to-8", {**CONFIG_A, "mode": FULL}, b(4, 5), BD(FULL, 8, num_reqs=4)),
    # 5 requests > R4 of the 8-token graph; FULL mode has no PIECEWISE to
    # fall back on.
    ("FULL-reqs-over-bound", {**CONFIG_A, "mode": FULL}, b(5, 6), BD(NONE, 6, num_reqs=5)),
    (
        "FULL-max-query-len-irrelevant",
        {**CONFIG_A, "mode": FULL},
        b(4, 8, max_query_len=2),
        BD(FULL, 8, num_reqs=4),
    ),
    ("FULL-oversize", {**CONFIG_A, "mode": FULL}, b(4, 9), BD(NONE, 9, num_reqs=4)),
    ("FULL-zero", {**CONFIG_A, "mode": FULL}, b(0, 0), BD(NONE, 0, num_reqs=0)),
    # --- FULL_DECODE_ONLY (configuration A): uniform decode FULL graphs 1, 2, 4.
    ("FDO-1", {**CONFIG_A, "mode": FDO}, b(1, 1, 1), BD(FULL, 1, num_reqs=1, uniform_token_count=1)),
    ("FDO-2", {**CONFIG_A, "mode": FDO}, b(2, 2, 1), BD(FULL, 2, num_reqs=2, uniform_token_count=1)),
    ("FDO-pad-3-to-4", {**CONFIG_A, "mode": FDO}, b(3, 3, 1), BD(FULL, 4, num_reqs=4, uniform_token_count=1)),
    ("FDO-mixed-is-eager", {**CONFIG_A, "mode": FDO}, b(2, 3), BD(NONE, 3, num_reqs=2)),
    ("FDO-uniform-mismatch", {**CONFIG_A, "mode": FDO}, b(1, 2, 2), BD(NONE, 2, num_reqs=1)),
    ("FDO-above-decode-bound", {**CONFIG_A, "mode": FDO}, b(5, 5, 1), BD(NONE, 5, num_reqs=5)),
    ("FDO-zero", {**CONFIG_A, "mode": FDO}, b(0, 0), BD(NONE, 0, num_reqs=0)),
    # --- FULL_AND_PIECEWISE (configuration A): FULL decode 1, 2, 4; PW 1..8.
    ("FAP-decode-1", {**CONFIG_A, "mode": FAP}, b(1, 1, 1), BD(FULL, 1, num_reqs=1, uniform_token_count=1)),
    # The FULL graph demands uniform_token_count == 1; None does not match.
    ("FAP-uniform-none", {**CONFIG_A, "mode": FAP}, b(1, 1), BD(PW, 1)),
    (
        "FAP-decode-pad-3-to-4",
        {**CONFIG_A, "mode": FAP},
        b(3, 3, 1),
        BD(FULL, 4, num_reqs=4, uniform_token_count=1),
    ),
    (
        "FAP-decode-4-mql",
        {**CONFIG_A, "mode": FAP},
        b(4, 4, 1, max_query_len=1),
        BD(FULL, 4, num_reqs=4, uniform_token_count=1),
    ),
    ("FAP-mixed-3", {**CONFIG_A, "mode": FAP}, b(2, 3), BD(PW, 4)),
    ("FAP-uniform-mismatch", {**CONFIG_A, "mode": FAP}, b(1, 2, 2), BD(PW, 2)),
    # Decode batch above the FULL decode bound: PIECEWISE serves it.
    ("FAP-decode-above-bound", {**CONFIG_A, "mode": FAP}, b(5, 5, 1), BD(PW, 8)),
    ("FAP-mixed-8", {**CONFIG_A, "mode": FAP}, b(2, 8), BD(PW, 8)),
    ("FAP-oversize", {**CONFIG_A, "mode": FAP}, b(9, 9, 1), BD(NONE, 9, num_reqs=9)),
    ("FAP-zero", {**CONFIG_A, "mode": FAP}, b(0, 0), BD(NONE, 0, num_reqs=0)),
    (
        "FAP-lora-without-cases",
        {**CONFIG_A, "mode": FAP},
        b(4, 4, 1, num_active_loras=1),
        BD(NONE, 4, num_reqs=4, num_active_loras=1),
    ),
    (
        "FAP-ubatch-without-twins",
        {**CONFIG_A, "mode": FAP},
        b(4, 4, 1, num_ubatches=2),
        BD(NONE, 4, num_reqs=4, num_ubatches=2),
    ),
    # --- Configuration B (decode_query_len=4): FULL groups 4, 8, 16.
    ("B-FAP-decode-4", {**CONFIG_B, "mode": FAP}, b(1, 4, 4), BD(FULL, 4, num_reqs=1, uniform_token_count=4)),
    ("B-FAP-decode-8", {**CONFIG_B, "mode": FAP}, b(2, 8, 4), BD(FULL, 8, num_reqs=2, uniform_token_count=4)),
    (
        "B-FAP-decode-pad-12-to-16",
        {**CONFIG_B, "mode": FAP},
        b(3, 12, 4),
        BD(FULL, 16, num_reqs=4, uniform_token_count=4),
    ),
    (
        "B-FAP-decode-16",
        {**CONFIG_B, "mode": FAP},
        b(4, 16, 4, max_query_len=4),
        BD(FULL, 16, num_reqs=4, uniform_token_count=4),
    ),
    # 1 token: the smallest FULL group (4, U4) does not match U1, so the
    # smallest PIECEWISE group (1) serves it.
    ("B-FAP-one-token", {**CONFIG_B, "mode": FAP}, b(1, 1, 1), BD(PW, 1)),
    ("B-FAP-uniform-3", {**CONFIG_B, "mode": FAP}, b(1, 3, 3), BD(PW, 4)),
    ("B-FAP-uniform-1-two-reqs", {**CONFIG_B, "mode": FAP}, b(2, 2, 1), BD(PW, 2)),
    ("B-FAP-mixed-5", {**CONFIG_B, "mode": FAP}, b(2, 5), BD(PW, 8)),
    ("B-FAP-decode-above-bound", {**CONFIG_B, "mode": FAP}, b(5, 20, 4), BD(PW, 32)),
    ("B-FAP-oversize", {**CONFIG_B, "mode": FAP}, b(3, 33), BD(NONE, 33, num_reqs=3)),
    ("B-FDO-one-token", {**CONFIG_B, "mode": FDO}, b(1, 1, 1), BD(NONE, 1, num_reqs=1)),
    (
        "B-FDO-decode-pad-12-to-16",
        {**CONFIG_B, "mode": FDO},
        b(3, 12, 4),
        BD(FULL, 16, num_reqs=4, uniform_token_count=4),
    ),
    ("B-FDO-decode-above-bound", {**CONFIG_B, "mode": FDO}, b(5, 20, 4), BD(NONE, 20, num_reqs=5)),
    # --- Varlen decode (configuration V): FULL 1, 2, 4, 8 with Q2; PW 1..16.
    (
        "V-FAP-varlen-3",
        {**CONFIG_V, "mode": FAP},
        b(2, 3, max_query_len=2),
        BD(FULL, 4, num_reqs=4, max_query_len=2),
    ),
    # max_query_len None (the batch may hold a prefill) never meets a graph
    # that bounds query length (line 124).
    ("V-FAP-mql-none", {**CONFIG_V, "mode": FAP}, b(2, 3), BD(PW, 4)),
    ("V-FAP-mql-over-bound", {**CONFIG_V, "mode": FAP}, b(1, 3, 3, max_query_len=3), BD(PW, 4)),
    (
        "V-FAP-mql-under-bound",
        {**CONFIG_V, "mode": FAP},
        b(2, 2, 1, max_query_len=1),
        BD(FULL, 2, num_reqs=2, max_query_len=2),
    ),
    (
        "V-FAP-one",
        {**CONFIG_V, "mode": FAP},
        b(1, 1, 1, max_query_len=1),
        BD(FULL, 1, num_reqs=1, max_query_len=2),
    ),
    (
        "V-FAP-varlen-6",
        {**CONFIG_V, "mode": FAP},
        b(4, 6, max_query_len=2),
        BD(FULL, 8, num_reqs=4, max_query_len=2),
    ),
    # 5 requests exceed the 8-token graph's R4: PIECEWISE.
    ("V-FAP-reqs-over-bound", {**CONFIG_V, "mode": FAP}, b(5, 6, max_query_len=2), BD(PW, 8)),
    ("V-FAP-above-decode-bound", {**CONFIG_V, "mode": FAP}, b(6, 12, 2, max_query_len=2), BD(PW, 16)),
    ("V-FAP-oversize", {**CONFIG_V, "mode": FAP}, b(9, 17, max_query_len=2), BD(NONE, 17, num_reqs=9)),
    ("V-FDO-mql-none", {**CONFIG_V, "mode": FDO}, b(2, 3), BD(NONE, 3, num_reqs=2)),
    (
        "V-FDO-varlen-3",
        {**CONFIG_V, "mode": FDO},
        b(2, 3, max_query_len=2),
        BD(FULL, 4, num_reqs=4, max_query_len=2),
    ),
    (
        "V-FDO-above-decode-bound",
        {**CONFIG_V, "mode": FDO},
        b(6, 12, 2, max_query_len=2),
        BD(NONE, 12, num_reqs=6),
    ),
    # --- LoRA (configuration L, cases 0, 1, 2, 4), FULL mode.
    ("L-FULL-no-lora", {**CONFIG_L, "mode": FULL}, b(2, 2), BD(FULL, 2, num_reqs=2)),
    (
        "L-FULL-lora-1",
        {**CONFIG_L, "mode": FULL},
        b(2, 2, num_active_loras=1),
        BD(FULL, 2, num_reqs=2, num_active_loras=1),
    ),
    (
        "L-FULL-lora-3-to-4",
        {**CONFIG_L, "mode": FULL},
        b(2, 2, num_active_loras=3),
        BD(FULL, 2, num_reqs=2, num_active_loras=4),
    ),
    (
        "L-FULL-lora-5-clamps",
        {**CONFIG_L, "mode": FULL},
        b(1, 1, num_active_loras=5),
        BD(FULL, 1, num_reqs=1, num_active_loras=4),
    ),
    (
        "L-FULL-lora-2",
        {**CONFIG_L, "mode": FULL},
        b(1, 1, num_active_loras=2),
        BD(FULL, 1, num_reqs=1, num_active_loras=2),
    ),
    (
        "L-FULL-oversize-lora",
        {**CONFIG_L, "mode": FULL},
        b(1, 3, num_active_loras=3),
        BD(NONE, 3, num_reqs=1, num_active_loras=4),
    ),
    (
        "L-FULL-zero-lora",
        {**CONFIG_L, "mode": FULL},
        b(0, 0, num_active_loras=3),
        BD(NONE, 0, num_reqs=0, num_active_loras=4),
    ),
    # Cases (0, 2) with FULL_AND_PIECEWISE.
    (
        "L02-FAP-lora-1-to-2",
        {"capture_sizes": (1, 2, 4), "max_num_reqs": 4, "lora_cases": (0, 2), "mode": FAP},
        b(2, 2, 1, num_active_loras=1),
        BD(FULL, 2, num_reqs=2, uniform_token_count=1, num_active_loras=2),
    ),
    (
        "L02-FAP-mixed-lora-3-clamps",
        {"capture_sizes": (1, 2, 4), "max_num_reqs": 4, "lora_cases": (0, 2), "mode": FAP},
        b(2, 3, num_active_loras=3),
        BD(PW, 4, num_active_loras=2),
    ),
    # No case 0: a batch without adapters has no graph (0 never meets a LoRA graph).
    (
        "L12-FULL-no-lora-eager",
        {"capture_sizes": (1, 2), "max_num_reqs": 2, "lora_cases": (1, 2), "mode": FULL},
        b(2, 2),
        BD(NONE, 2, num_reqs=2),
    ),
    (
        "L12-FULL-lora-1",
        {"capture_sizes": (1, 2), "max_num_reqs": 2, "lora_cases": (1, 2), "mode": FULL},
        b(2, 2, num_active_loras=1),
        BD(FULL, 2, num_reqs=2, num_active_loras=1),
    ),
    # Adapters active but no LoRA graphs: eager, count passed through.
    (
        "L0-FULL-lora-3-eager",
        {"capture_sizes": (1, 2), "max_num_reqs": 2, "mode": FULL},
        b(2, 2, num_active_loras=3),
        BD(NONE, 2, num_reqs=2, num_active_loras=3),
    ),
    # --- Microbatches (configuration U, FULL mode).
    (
        "U-FULL-twin",
        {**CONFIG_U, "mode": FULL},
        b(4, 4, 1, num_ubatches=2),
        BD(FULL, 4, num_reqs=4, uniform_token_count=1, num_ubatches=2),
    ),
    (
        "U-FULL-twin-padded",
        {**CONFIG_U, "mode": FULL},
        b(3, 3, 1, num_ubatches=2),
        BD(FULL, 4, num_reqs=4, uniform_token_count=1, num_ubatches=2),
    ),
    ("U-FULL-no-split", {**CONFIG_U, "mode": FULL}, b(4, 4, 1), BD(FULL, 4, num_reqs=4)),
    # Only the smallest group of a mode is tried: the 4-token group holds
    # U1/B2 and B1, neither serves a U2/B2 batch, and the 16-token U2/B2 twin
    # that would is never looked at.
    (
        "U-FULL-smallest-group-only",
        {**CONFIG_U, "mode": FULL},
        b(2, 4, 2, num_ubatches=2),
        BD(NONE, 4, num_reqs=2, num_ubatches=2),
    ),
    (
        "U-FULL-no-twin-at-12",
        {**CONFIG_U, "mode": FULL},
        b(8, 10, num_ubatches=2),
        BD(NONE, 10, num_reqs=8, num_ubatches=2),
    ),
    (
        "U-FULL-twin-16",
        {**CONFIG_U, "mode": FULL},
        b(7, 14, 2, num_ubatches=2),
        BD(FULL, 16, num_reqs=8, uniform_token_count=2, num_ubatches=2),
    ),
    ("U-FULL-16-no-split", {**CONFIG_U, "mode": FULL}, b(8, 16, 2), BD(FULL, 16, num_reqs=8)),
    (
        "U-FULL-twin-needs-uniform",
        {**CONFIG_U, "mode": FULL},
        b(4, 4, num_ubatches=2),
        BD(NONE, 4, num_reqs=4, num_ubatches=2),
    ),
    # Configuration U2 (FULL_AND_PIECEWISE, decode_query_len=2).
    (
        "U2-FAP-twin",
        {**CONFIG_U2, "mode": FAP},
        b(2, 4, 2, num_ubatches=2),
        BD(FULL, 4, num_reqs=2, uniform_token_count=2, num_ubatches=2),
    ),
    (
        "U2-FAP-no-split",
        {**CONFIG_U2, "mode": FAP},
        b(2, 4, 2),
        BD(FULL, 4, num_reqs=2, uniform_token_count=2),
    ),
    (
        "U2-FAP-twin-padded",
        {**CONFIG_U2, "mode": FAP},
        b(3, 6, 2, num_ubatches=2),
        BD(FULL, 8, num_reqs=4, uniform_token_count=2, num_ubatches=2),
    ),
    # 2 tokens: the 2-token FULL graph has no twin and PIECEWISE graphs are
    # never split, so a 2-way batch runs eagerly.
    (
        "U2-FAP-small-split-eager",
        {**CONFIG_U2, "mode": FAP},
        b(1, 2, 2, num_ubatches=2),
        BD(NONE, 2, num_reqs=1, num_ubatches=2),
    ),
    (
        "U2-FAP-mixed-split-eager",
        {**CONFIG_U2, "mode": FAP},
        b(2, 4, num_ubatches=2),
        BD(NONE, 4, num_reqs=2, num_ubatches=2),
    ),
]


@pytest.mark.parametrize(
    ("config", "batch", "expected"),
    [pytest.param(c, bt, e, id=i) for i, c, bt, e in DISPATCH_TABLE],
)
def test_dispatch_table(config: dict[str, Any], batch: Batch, expected: BatchDescriptor) -> None:
    plan = plan_for(**config)
    assert plan.dispatch(**batch) == expected
    # Asked again, the memoised answer is the same.
    assert plan.dispatch(**batch) == expected


def test_dispatch_table_covers_every_mode() -> None:
    modes = {GraphMode.parse(c["mode"]) for _, c, _, _ in DISPATCH_TABLE}
    assert modes == {NONE, PW, FULL, FDO, FAP}


def test_dispatch_defaults() -> None:
    # uniform_token_count=None, num_active_loras=0, max_query_len=None,
    # num_ubatches=1 when not given.
    plan = plan_for(**CONFIG_A, mode=FAP)
    assert plan.dispatch(num_reqs=2, num_tokens=3) == BD(PW, 4)
    assert plan.dispatch(num_reqs=9, num_tokens=9) == BD(NONE, 9, num_reqs=9)


def test_dispatch_does_not_mix_batches_in_memo() -> None:
    # Interleave two batches that differ only in one field many times.
    plan = plan_for(**CONFIG_V, mode=FAP)
    for _ in range(3):
        assert plan.dispatch(**b(2, 3, max_query_len=2)) == BD(FULL, 4, num_reqs=4, max_query_len=2)
        assert plan.dispatch(**b(2, 3)) == BD(PW, 4)
        assert plan.dispatch(**b(2, 3, num_active_loras=1, max_query_len=2)) == BD(
            NONE, 3, num_reqs=2, num_active_loras=1
        )


# ---------------------------------------------------------------------------
# Properties: dispatch follows the reference's rule on random configurations.
# The rule, restated from lines 371-385 and 515-545: look at FULL graphs, then
# PIECEWISE; within a mode only the graphs of the smallest captured size that
# holds the batch (same effective LoRA case) are tried; the first compatible
# one wins; else the eager NONE descriptor.
# ---------------------------------------------------------------------------
configs: st.SearchStrategy[dict[str, Any]] = st.builds(
    dict,
    capture_sizes=st.lists(st.integers(1, 48), min_size=1, max_size=6, unique=True),
    max_num_reqs=st.integers(1, 16),
    mode=st.sampled_from([NONE, PW, FULL, FDO, FAP]),
    decode_query_len=st.integers(1, 4),
    lora_cases=st.lists(st.sampled_from([0, 1, 2, 4]), min_size=1, max_size=4, unique=True),
    varlen_decode=st.booleans(),
    num_ubatches=st.integers(1, 3),
    ubatch_min_tokens=st.integers(1, 8),
)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    n = draw(st.integers(0, 60))
    r = 0 if n == 0 else draw(st.integers(1, n))
    return b(
        r,
        n,
        draw(st.none() | st.integers(1, 4)),
        draw(st.integers(0, 6)),
        draw(st.none() | st.integers(1, 5)),
        draw(st.integers(1, 3)),
    )


def _smallest_group(plan: CapturePlan, mode: GraphMode, n: int, loras: int) -> list[BatchDescriptor]:
    descs = [
        d for d in plan.capture_descriptors.get(mode, ()) if d.num_active_loras == loras and d.num_tokens >= n
    ]
    if not descs:
        return []
    smallest = min(d.num_tokens for d in descs)
    return [d for d in descs if d.num_tokens == smallest]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, batch=batches())
def test_dispatch_follows_reference_rule(config: dict[str, Any], batch: Batch) -> None:
    plan = plan_for(**config)
    got = plan.dispatch(**batch)
    n = batch["num_tokens"]
    loras = plan.effective_loras(batch["num_active_loras"])
    check = dict(batch, num_active_loras=loras)
    eager = BD(
        NONE, n, num_reqs=batch["num_reqs"], num_active_loras=loras, num_ubatches=batch["num_ubatches"]
    )
    if n == 0:
        assert got == eager
        return
    full = _smallest_group(plan, FULL, n, loras)
    pw = _smallest_group(plan, PW, n, loras)
    full_ok = [d for d in full if d.is_compatible(**check)]
    pw_ok = [d for d in pw if d.is_compatible(**check)]
    if full_ok:
        assert got in full_ok
    elif pw_ok:
        assert got in pw_ok
    else:
        assert got == eager
    # And the candidate list is exactly those two groups, FULL first.
    assert set(plan.candidates(n, batch["num_active_loras"])) == set(full) | set(pw)
    cands = plan.candidates(n, batch["num_active_loras"])
    assert [d.mode for d in cands] == sorted((d.mode for d in cands), key=lambda m: 0 if m is FULL else 1)


@settings(max_examples=200, deadline=None, database=None)
@given(config=configs)
def test_capture_descriptor_invariants(config: dict[str, Any]) -> None:
    plan = plan_for(**config)
    cfg = plan.config
    max_decode = cfg.max_num_reqs * cfg.decode_query_len
    sizes = set(cfg.capture_sizes)
    seen: set[BatchDescriptor] = set()
    for d in plan.capture_order:
        assert d.mode in (FULL, PW)
        assert d.num_active_loras in cfg.lora_cases
        if d.num_ubatches != 1:
            # Twins: FULL, even split, at least ubatch_min_tokens tokens.
            assert d.mode is FULL and d.num_ubatches == cfg.num_ubatches
            assert d.num_reqs is not None and d.uniform_token_count is not None
            assert d.uniform_token_count * d.num_reqs == d.num_tokens
            assert d.num_tokens >= max(cfg.ubatch_min_tokens, cfg.num_ubatches)
            base = BD(FULL, d.num_tokens, num_reqs=d.num_reqs, num_active_loras=d.num_active_loras)
            uniform_base = BD(
                FULL,
                d.num_tokens,
                num_reqs=d.num_reqs,
                uniform_token_count=d.uniform_token_count,
                num_active_loras=d.num_active_loras,
            )
            assert base in plan.capture_order or uniform_base in plan.capture_order
        elif d.mode is PW:
            assert d.num_reqs is None and d.num_tokens in sizes
        elif d.uniform_token_count is not None:
            assert cfg.mode.separate_routine() and not cfg.varlen_decode
            assert d.uniform_token_count == cfg.decode_query_len
            assert d.num_tokens % cfg.decode_query_len == 0
            assert d.num_tokens <= min(max_decode, cfg.max_capture_size or 0)
        elif d.max_query_len is not None:
            assert cfg.varlen_decode and cfg.mode.separate_routine()
            assert d.num_tokens in sizes and d.num_tokens <= max_decode
        else:
            assert d.num_tokens in sizes and d.num_reqs == min(d.num_tokens, cfg.max_num_reqs)
        if d.mode is FULL and d.uniform_token_count is not None and d.num_ubatches == 1:
            # Uniform decode graphs are deduplicated (line 333).
            assert d not in seen
        seen.add(d)


# ---------------------------------------------------------------------------
# The plan package must not need torch.
# ---------------------------------------------------------------------------
def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_plan_imports_with_torch_blocked() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"
        "from pytest_cudagraph.plan import CaptureConfig, CapturePlan\n"
        "import pytest_cudagraph.plan.capture_plan, pytest_cudagraph.plan.config\n"
        "import pytest_cudagraph.plan.descriptor, pytest_cudagraph.plan.modes\n"
        "p = CapturePlan(CaptureConfig(capture_sizes=(1, 2), max_num_reqs=2, mode='FULL_AND_PIECEWISE'))\n"
        "print(p.dispatch(num_reqs=1, num_tokens=1, uniform_token_count=1).mode.name)\n"
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "FULL"


def test_plan_import_does_not_load_torch() -> None:
    code = (
        "import sys\n"
        "import pytest_cudagraph.plan\n"
        "from pytest_cudagraph.plan import capture_plan, config, descriptor, modes\n"
        "print('torch' in sys.modules)\n"
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# ---------------------------------------------------------------------------
# Dynamic speculative decoding: a uniform decode graph per query length the
# scheduler may use (lines 265-291 and 312-340), graphs of one token count
# grouped over one candidate range (lines 377-385). Worked by hand.
# ---------------------------------------------------------------------------
def test_speculative_plan_captures_a_decode_graph_per_query_length() -> None:
    # Sizes 1, 2, 4, 8; 4 requests; q up to 4, lengths 1..4. Bounds: 4 * 4 = 16 decode tokens, 8 per
    # graph (the largest size), 4 requests. Per size, per length (rounded up to a multiple of it):
    #   1: U1 1R1, U2 2R1, U3 3R1, U4 4R1;   2: U1 2R2 (the others repeat);
    #   4: U1 4R4, U2 4R2, U3 6R2 (U4 repeats);   8: U1 8R8 (> 4 requests: no), U2 8R4, U3 9 (> 8: no), U4 8R2.
    plan = plan_for(
        capture_sizes=(8, 4, 2, 1),
        max_num_reqs=4,
        mode=FAP,
        decode_query_len=4,
        decode_query_lens=(4, 2, 3, 1),
    )

    def u(tokens: int, reqs: int, q: int) -> BatchDescriptor:
        return BD(FULL, tokens, num_reqs=reqs, uniform_token_count=q)

    # Largest first, ties in the order they were made.
    assert plan.capture_descriptors[FULL] == (
        u(8, 4, 2),
        u(8, 2, 4),
        u(6, 2, 3),
        u(4, 1, 4),
        u(4, 4, 1),
        u(4, 2, 2),
        u(3, 1, 3),
        u(2, 1, 2),
        u(2, 2, 1),
        u(1, 1, 1),
    )
    assert plan.capture_descriptors[PW] == (BD(PW, 8), BD(PW, 4), BD(PW, 2), BD(PW, 1))
    # One token count's graphs share its range, in the reverse of their order above.
    assert plan.candidates(4) == (u(4, 2, 2), u(4, 4, 1), u(4, 1, 4), BD(PW, 4))
    assert plan.candidates(5) == (u(6, 2, 3), BD(PW, 8))
    assert plan.candidates(7) == (u(8, 2, 4), u(8, 4, 2), BD(PW, 8))
    assert plan.candidate_range(u(4, 1, 4)) == plan.candidate_range(u(4, 4, 1)) == range(4, 5)
    assert plan.candidate_range(u(6, 2, 3)) == range(5, 7)
    # Each decode batch is served by the graph of its own length.
    assert plan.dispatch(num_reqs=2, num_tokens=4, uniform_token_count=2, max_query_len=2) == u(4, 2, 2)
    assert plan.dispatch(num_reqs=1, num_tokens=4, uniform_token_count=4, max_query_len=4) == u(4, 1, 4)
    assert plan.dispatch(num_reqs=4, num_tokens=4, uniform_token_count=1, max_query_len=1) == u(4, 4, 1)
    assert plan.dispatch(num_reqs=2, num_tokens=6, uniform_token_count=3, max_query_len=3) == u(6, 2, 3)
    assert plan.dispatch(num_reqs=1, num_tokens=3, uniform_token_count=3, max_query_len=3) == u(3, 1, 3)
    # Three requests of one token: the 3-token group holds only U3; PIECEWISE 4 serves it.
    assert plan.dispatch(num_reqs=3, num_tokens=3, uniform_token_count=1, max_query_len=1) == BD(PW, 4)
    # Two requests of four tokens: 8 tokens, served by U4 8R2 (the group's U2 graph does not match).
    assert plan.dispatch(num_reqs=2, num_tokens=8, uniform_token_count=4, max_query_len=4) == u(8, 2, 4)


def test_speculative_plan_with_lora_cases_and_microbatch_twins() -> None:
    # Sizes 2, 4; 2 requests; q up to 2, lengths 1, 2; LoRA cases 0, 1; twins of 2 microbatches.
    # Bounds: 4 decode tokens, 4 per graph, 2 requests.
    #   (2, L0): U1 2R2 + twin, U2 2R1 + twin;  (2, L1): the same with L1;
    #   (4, L0): U1 4R4 (> 2 requests: no), U2 4R2 + twin;  (4, L1): the same.
    plan = plan_for(
        capture_sizes=(2, 4),
        max_num_reqs=2,
        mode=FDO,
        decode_query_len=2,
        decode_query_lens=(1, 2),
        lora_cases=(0, 1),
        num_ubatches=2,
    )

    def u(tokens: int, reqs: int, q: int, loras: int = 0, ub: int = 1) -> BatchDescriptor:
        return BD(FULL, tokens, num_reqs=reqs, uniform_token_count=q, num_active_loras=loras, num_ubatches=ub)

    assert plan.capture_order == (
        u(4, 2, 2),
        u(4, 2, 2, ub=2),
        u(4, 2, 2, 1),
        u(4, 2, 2, 1, 2),
        u(2, 2, 1),
        u(2, 2, 1, ub=2),
        u(2, 1, 2),
        u(2, 1, 2, ub=2),
        u(2, 2, 1, 1),
        u(2, 2, 1, 1, 2),
        u(2, 1, 2, 1),
        u(2, 1, 2, 1, 2),
    )
    assert plan.candidates(1) == (u(2, 1, 2, ub=2), u(2, 1, 2), u(2, 2, 1, ub=2), u(2, 2, 1))
    assert plan.candidates(3, 1) == (u(4, 2, 2, 1, 2), u(4, 2, 2, 1))
    assert plan.dispatch(num_reqs=1, num_tokens=2, uniform_token_count=2, max_query_len=2) == u(2, 1, 2)
    assert plan.dispatch(
        num_reqs=2, num_tokens=2, uniform_token_count=1, max_query_len=1, num_ubatches=2
    ) == u(2, 2, 1, ub=2)
    assert plan.dispatch(
        num_reqs=2, num_tokens=4, uniform_token_count=2, max_query_len=2, num_active_loras=1
    ) == u(4, 2, 2, 1)
    # Three one-token requests: no 4-token U1 graph (4 requests > 2), and no mixed graphs: eager.
    assert plan.dispatch(num_reqs=3, num_tokens=3, uniform_token_count=1, max_query_len=1).mode is NONE


def test_query_lengths_leave_varlen_decode_and_a_single_length_unchanged() -> None:
    base = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "mode": FAP, "decode_query_len": 3}
    assert plan_for(**base, decode_query_lens=(3,)).capture_order == plan_for(**base).capture_order
    # Varlen decode graphs already take 1..q tokens a request: the lengths add nothing (line 301).
    assert (
        plan_for(**base, varlen_decode=True, decode_query_lens=(1, 2, 3)).capture_order
        == plan_for(**base, varlen_decode=True).capture_order
    )
    # Without a separate decode routine there are no uniform decode graphs to multiply.
    assert (
        plan_for(**{**base, "mode": PW}, decode_query_lens=(1, 2, 3)).capture_order
        == plan_for(**{**base, "mode": PW}).capture_order
    )
