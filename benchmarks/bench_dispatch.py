"""Time ``CapturePlan.dispatch`` on a realistic, seeded stream of batches.

Standalone (no pytest): ``python benchmarks/bench_dispatch.py``; ``--smoke``: the same
measurements on a short stream and few rounds (seconds less; the figures mean little).

Configuration: capture sizes 1, 2, 4, then 8..512 step 8 (67 sizes) times
LoRA cases (0, 1, 2, 4, 8), FULL_AND_PIECEWISE, max_num_reqs=256.

Two measurements:

* warm: one plan, the whole stream dispatched once as warm-up, then timed
  over several passes. This is the steady state of a serving loop, where the
  same batch shapes come back again and again (memo hits).
* cold: a fresh plan per round (built outside the timed region), and every
  timed call is the first time that plan sees that batch, so each call pays
  for validation, the LoRA mapping and the candidate walk (memo misses).

Each call is timed on its own with ``time.perf_counter_ns``; the cost of an
empty timed region (the timer's own overhead, measured the same way) is
subtracted, and the raw figures are printed too so nothing is hidden.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytest_cudagraph.plan import CaptureConfig, CapturePlan, GraphMode

SEED = 20240601
CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))
LORA_CASES = (0, 1, 2, 4, 8)
MAX_NUM_REQS = 256
STREAM_LEN = 20_000
WARM_PASSES = 25
COLD_ROUNDS = 50
COLD_ROUND_LEN = 2_000

Batch = dict[str, Any]


def make_config() -> CaptureConfig:
    return CaptureConfig(
        capture_sizes=CAPTURE_SIZES,
        max_num_reqs=MAX_NUM_REQS,
        mode=GraphMode.FULL_AND_PIECEWISE,
        lora_cases=LORA_CASES,
    )


def _lora_count(rng: random.Random) -> int:
    # Most batches run without adapters; some with a few; a few with more
    # adapters than the largest captured case (clamped by dispatch).
    roll = rng.random()
    if roll < 0.6:
        return 0
    if roll < 0.95:
        return rng.randint(1, 8)
    return rng.randint(9, 16)


def make_batch(rng: random.Random) -> Batch:
    kind = rng.random()
    loras = _lora_count(rng)
    if kind < 0.55:
        # Uniform decode: one token per request.
        reqs = rng.randint(1, MAX_NUM_REQS)
        return {
            "num_reqs": reqs,
            "num_tokens": reqs,
            "uniform_token_count": 1,
            "num_active_loras": loras,
            "max_query_len": 1,
        }
    if kind < 0.90:
        # Mixed prefill + decode within the captured range.
        tokens = rng.randint(1, CAPTURE_SIZES[-1])
        reqs = rng.randint(1, min(tokens, MAX_NUM_REQS))
        return {"num_reqs": reqs, "num_tokens": tokens, "num_active_loras": loras}
    if kind < 0.97:
        # Oversize prefill: no graph, eager.
        tokens = rng.randint(CAPTURE_SIZES[-1] + 1, 8192)
        reqs = rng.randint(1, min(tokens, MAX_NUM_REQS))
        return {"num_reqs": reqs, "num_tokens": tokens, "num_active_loras": loras}
    # Idle step (empty batch).
    return {"num_reqs": 0, "num_tokens": 0}


def make_stream(rng: random.Random, length: int) -> list[Batch]:
    return [make_batch(rng) for _ in range(length)]


def _key(batch: Batch) -> tuple[Any, ...]:
    return tuple(sorted(batch.items()))


def timer_overhead_ns(samples: int = 200_000) -> float:
    """Median cost of an empty timed region."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(samples):
        t0 = clock()
        out.append(clock() - t0)
    return float(statistics.median(out))


def time_calls(plan: CapturePlan, stream: list[Batch], out: list[int]) -> None:
    clock = time.perf_counter_ns
    dispatch = plan.dispatch
    append = out.append
    for batch in stream:
        t0 = clock()
        dispatch(**batch)
        append(clock() - t0)


def percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def summarize(samples: list[int], overhead: float) -> tuple[float, float, float, float]:
    """(median, p99) raw and overhead-corrected, in ns."""
    raw = sorted(float(s) for s in samples)
    med, p99 = statistics.median(raw), percentile(raw, 0.99)
    return med, p99, max(med - overhead, 0.0), max(p99 - overhead, 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="a short stream and few rounds: runs in a second, proves little"
    )
    args = parser.parse_args(argv)
    stream_len, warm_passes, cold_rounds, cold_round_len = (
        (500, 2, 2, 200) if args.smoke else (STREAM_LEN, WARM_PASSES, COLD_ROUNDS, COLD_ROUND_LEN)
    )
    start = time.perf_counter()
    rng = random.Random(SEED)
    stream = make_stream(rng, stream_len)
    n_sizes, n_loras = len(CAPTURE_SIZES), len(LORA_CASES)
    assert n_sizes == 67 and n_loras == 5

    config = make_config()
    build_ns = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        plan = CapturePlan(config)
        build_ns.append(time.perf_counter_ns() - t0)
    graphs = len(plan.capture_order)
    modes = {m.name: len(d) for m, d in plan.capture_descriptors.items()}
    answers = [plan.dispatch(**b) for b in stream]  # warm-up pass
    mix = {
        m.name: sum(1 for a in answers if a.mode is m)
        for m in (GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.NONE)
    }
    distinct = len({_key(b) for b in stream})

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        overhead = timer_overhead_ns(10_000 if args.smoke else 200_000)

        warm: list[int] = []
        for _ in range(warm_passes):
            time_calls(plan, stream, warm)

        # Cold: fresh plan per round, each round's batches all distinct, so
        # every timed call is a memo miss.
        cold: list[int] = []
        cold_rng = random.Random(SEED + 1)
        for _ in range(cold_rounds):
            seen: set[tuple[Any, ...]] = set()
            round_batches: list[Batch] = []
            while len(round_batches) < cold_round_len:
                batch = make_batch(cold_rng)
                key = _key(batch)
                if key not in seen:
                    seen.add(key)
                    round_batches.append(batch)
            fresh = CapturePlan(config)  # built outside the timed region
            time_calls(fresh, round_batches, cold)
    finally:
        if gc_was_enabled:
            gc.enable()

    w_med, w_p99, w_med_c, w_p99_c = summarize(warm, overhead)
    c_med, c_p99, c_med_c, c_p99_c = summarize(cold, overhead)

    print(
        f"config: {n_sizes} capture sizes x {n_loras} LoRA cases {LORA_CASES}, "
        f"FULL_AND_PIECEWISE, max_num_reqs={MAX_NUM_REQS}"
    )
    print(f"plan: {graphs} graphs {modes}; build median {statistics.median(build_ns) / 1e6:.2f} ms")
    print(f"stream: {stream_len} batches (seed {SEED}), {distinct} distinct; answers {mix}")
    print(f"timer overhead (empty perf_counter_ns region, subtracted): {overhead:.0f} ns")
    print(
        f"warm  ({len(warm)} calls, {warm_passes} passes, memo hits): "
        f"median {w_med_c:.0f} ns, p99 {w_p99_c:.0f} ns  [raw {w_med:.0f} / {w_p99:.0f} ns]"
    )
    print(
        f"cold  ({len(cold)} calls, {cold_rounds} fresh plans x {cold_round_len} distinct batches, "
        f"memo misses): median {c_med_c:.0f} ns, p99 {c_p99_c:.0f} ns  [raw {c_med:.0f} / {c_p99:.0f} ns]"
    )
    print(
        f"dispatch median (cold memo): {c_med_c / 1000:.2f} us/call "
        f"({n_sizes} sizes x {n_loras} LoRA cases, {len(cold)} calls)"
    )
    print(
        f"dispatch median: {w_med_c / 1000:.2f} us/call "
        f"({n_sizes} sizes x {n_loras} LoRA cases, {len(warm)} calls)"
    )
    print(f"elapsed: {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
