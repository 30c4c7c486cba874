"""Print the reports of the tensor-parallel examples and their gallery, as the docs show them.

    python -m examples.tensor_parallel.show --backend emulate            # gloo ranks on the CPU
    python -m examples.tensor_parallel.show --backend cuda --world-size 2  # NCCL, one GPU a rank

Each correct module, then each bug of ``buggy.py``, is verified with
``verify_distributed``; the script prints how long each took and the first
lines of its report (the summary and the first failures), and exits 1 when a
correct module fails or a bug passes.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import pytest_cudagraph
from examples.tensor_parallel import buggy, tp

CORRECT = {
    "TPMLP": (tp.build_tp_mlp, tp.make_inputs),
    "TPAttention": (tp.build_tp_attention, tp.make_inputs),
    "TPMLPAllGather": (tp.build_tp_mlp_all_gather, tp.make_inputs),
}
BUGS = {
    "RankDependentPadding": (buggy.build_rank_dependent_padding, buggy.make_inputs_rank_dependent),
    "SkippedCollective": (buggy.build_skipped_collective, tp.make_inputs),
    "RankBranch": (buggy.build_rank_branch, tp.make_inputs),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("emulate", "cuda"), default="emulate")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a rank is a hang")
    parser.add_argument("--lines", type=int, default=3, help="report lines shown per module")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, backend {args.backend}, world_size {args.world_size}")
    wrong = []
    for name, (build, make_inputs) in {**CORRECT, **BUGS}.items():
        start = time.perf_counter()
        report = pytest_cudagraph.verify_distributed(
            build,
            make_inputs,
            world_size=args.world_size,
            capture_sizes=[1, 2, 4],
            backend=args.backend,
            timeout=args.timeout,
        )
        seconds = time.perf_counter() - start
        expected = name in CORRECT
        if report.ok != expected:
            wrong.append(name)
        print(f"\n## {name} ({'correct' if expected else 'bug'}; {seconds:.1f} s)")
        print("\n".join(report.format().splitlines()[: args.lines]))
    if wrong:
        print(f"\nunexpected verdicts: {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
