"""A synthetic serving trace: decode-heavy traffic with bursts of prefill, one batch a line.

    python -m examples.traces.make_trace OUT.jsonl[.gz] [--batches 50000] [--seed 0]

A continuous-batching scheduler, step by step, the way vLLM's runs:

- Requests arrive in a two-state process: quiet (0.3 arrivals a step on
  average) and bursts (8 a step), switching with probability 0.01 (into a
  burst) and 0.05 (out of one) each step.
- A request has a prompt of log-normal length (median 400 tokens, sigma 1.0,
  16..8192) and an output of log-normal length (median 200, sigma 0.8,
  1..2048).
- Each step runs at most ``MAX_NUM_REQS`` (128) requests and
  ``MAX_BATCHED_TOKENS`` (2048) tokens: every running request in decode
  adds one token; prompts fill what is left of the budget in arrival order,
  chunked (a long prompt takes several steps).
- A step of decodes only is a uniform decode batch (``uniform_token_count``
  1, ``max_query_len`` 1); a step with prefill is a mixed batch whose
  ``max_query_len`` is its longest chunk. Steps with nothing to run are not
  batches.

The shipped trace, ``decode_heavy.jsonl.gz``, is this with the defaults.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
from collections import deque
from collections.abc import Iterator
from pathlib import Path

MAX_NUM_REQS = 128
MAX_BATCHED_TOKENS = 2048


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(math.exp(rng.gauss(math.log(median), sigma)))))


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method: small rates only.
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def batches(count: int, seed: int = 0) -> Iterator[dict[str, int | None]]:
    """``count`` batches of the simulated scheduler, as trace lines."""
    rng = random.Random(seed)
    waiting: deque[list[int]] = deque()  # [prompt tokens left, output tokens]
    running: list[list[int]] = []  # [prompt tokens left, output tokens left]
    burst = False
    made = 0
    while made < count:
        burst = rng.random() < (0.95 if burst else 0.01)
        for _ in range(_poisson(rng, 8.0 if burst else 0.3)):
            waiting.append([_lognormal(rng, 400, 1.0, 16, 8192), _lognormal(rng, 200, 0.8, 1, 2048)])
        while waiting and len(running) < MAX_NUM_REQS:
            running.append(waiting.popleft())
        decodes = [r for r in running if r[0] == 0]
        budget = MAX_BATCHED_TOKENS - len(decodes)
        chunks = []
        for r in running:
            if r[0] and budget > 0:
                chunk = min(r[0], budget)
                budget -= chunk
                chunks.append((r, chunk))
        if not decodes and not chunks:
            continue
        num_tokens = len(decodes) + sum(c for _, c in chunks)
        num_reqs = len(decodes) + len(chunks)
        if chunks:
            yield {
                "num_tokens": num_tokens,
                "num_reqs": num_reqs,
                "uniform_token_count": None,
                "max_query_len": max([c for _, c in chunks] + ([1] if decodes else [])),
            }
        else:
            yield {
                "num_tokens": num_tokens,
                "num_reqs": num_reqs,
                "uniform_token_count": 1,
                "max_query_len": 1,
            }
        made += 1
        for r in decodes:
            r[1] -= 1
        for r, chunk in chunks:
            r[0] -= chunk  # a prompt that finishes samples its first token in this step
            if r[0] == 0:
                r[1] -= 1
        running = [r for r in running if r[1] > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    opener = gzip.open if args.out.suffix == ".gz" else open
    with opener(args.out, "wt", encoding="utf-8") as f:  # type: ignore[operator]
        for line in batches(args.batches, args.seed):
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
