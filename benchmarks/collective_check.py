"""What holding each collective to the other ranks' costs: a correct verification under torchrun, with
the check and without it, side by side in one process a rank.

    python -m torch.distributed.run --nproc-per-node=2 benchmarks/collective_check.py
    python -m torch.distributed.run --nproc-per-node=2 benchmarks/collective_check.py --model llama --runs 5

Each rank says what it issues before every collective of a verification and waits for its peers to
say the same, through the launcher's store (``pytest_cudagraph/distributed/agree.py``). Here the
same correct verification (``examples/tensor_parallel``'s MLP, or its small Llama) runs ``--runs``
times with the check and as many without (``agree.ENABLED`` off), alternating, on the CPU (gloo, the
emulator); rank 0 prints the median seconds of each, their ratio, and how many collectives a
verification issued.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.tensor_parallel import llama, tp  # noqa: E402
from pytest_cudagraph import verify_distributed  # noqa: E402
from pytest_cudagraph.distributed import agree  # noqa: E402

MODELS = {
    "mlp": (tp.build_tp_mlp, tp.make_inputs, {"capture_sizes": [1, 2, 4, 8], "max_num_reqs": 4}),
    "llama": (llama.build, llama.make_inputs, {"capture_sizes": [1, 2, 4, 8], "max_num_reqs": 4}),
}


def _counting() -> list[int]:
    """How many collectives the agreement held, counted as it holds them."""
    seen = [0]
    before = agree.Agreement.before

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        if agree.ENABLED:
            seen[0] += 1
        before(self, *args, **kwargs)

    agree.Agreement.before = counted  # type: ignore[method-assign]
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--runs", type=int, default=3, help="verifications of each kind (default 3)")
    parser.add_argument("--out", help="rank 0 writes the figures here as JSON")
    args = parser.parse_args(argv)
    build, make_inputs, config = MODELS[args.model]
    import torch.distributed as dist

    from pytest_cudagraph.launch_env import from_environment

    if from_environment() is None:
        # Spawned ranks would import agree afresh: the switch below would not reach them.
        print(
            "collective_check.py: run it under a launcher, such as python -m torch.distributed.run "
            "--nproc-per-node=2 benchmarks/collective_check.py",
            file=sys.stderr,
        )
        return 2

    seen = _counting()
    times: dict[bool, list[float]] = {True: [], False: []}
    issued = 0
    for _ in range(args.runs):
        for enabled in (True, False):
            agree.ENABLED = enabled
            seen[0] = 0
            started = time.perf_counter()
            report = verify_distributed(build, make_inputs, backend="emulate", **config)
            times[enabled].append(time.perf_counter() - started)
            if not report.ok:
                print(report.format(), file=sys.stderr)
                return 1
            if enabled:
                issued = seen[0]
    agree.ENABLED = True
    if dist.get_rank() == 0:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        figures = {
            "model": args.model,
            "world_size": dist.get_world_size(),
            "collectives_held": issued,
            "with_check_s": on,
            "without_check_s": off,
            "ratio": on / off,
            "runs": {"with": times[True], "without": times[False]},
        }
        print(
            f"{args.model}, {figures['world_size']} ranks (gloo, emulator): a correct verification "
            f"{on:.2f} s with the check, {off:.2f} s without (median of {args.runs} each), x{on / off:.3f}; "
            f"{issued} collectives held on each rank"
        )
        if args.out:
            Path(args.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
