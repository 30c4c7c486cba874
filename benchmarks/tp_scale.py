"""The Llama shape sharded tensor-parallel, verified on every rank at real size, against a hand capture.

    python benchmarks/tp_scale.py --shape 8B --world-size 2 --out tp.json        # NCCL, one GPU a rank
    python benchmarks/tp_scale.py --shape small --backend emulate --sizes 1,2,4  # gloo on the CPU

``examples/tensor_parallel/llama.py``'s ``TPLlama`` (random weights, each rank
making only its own shards), verified by ``verify_distributed`` with every
descriptor and every check on every rank, ``rank_agreement`` over the ranks,
vLLM's 67 capture sizes on CUDA. Beside it, on CUDA, a hand capture of the
same shards in processes of their own: each rank warms every size up on a
side stream and captures each into one pool, largest first, with its
collectives inside the graphs, as an engine does. Reported: the verdict, each
rank's peak memory against its hand capture's, the seconds per descriptor;
then the rank bugs of ``llama.py`` at the same shape (``--bugs``), each of
which the verification must catch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scale import VLLM_SIZES  # noqa: E402  (vLLM's 67 capture sizes)
from examples.tensor_parallel import llama  # noqa: E402
from pytest_cudagraph import verify_distributed  # noqa: E402


def _hand_rank(
    rank: int, world_size: int, shape: str, dtype: str, sizes: list[int], init: str, out: str
) -> None:
    """One rank of the hand capture: its shard, every size warmed up, then captured into one pool."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        module = llama.build(rank, world_size, shape=shape, dtype=dtype)
        vocab = llama.SHAPES[shape].vocab
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
        started = time.perf_counter()
        static = torch.randint(1, vocab, (max(sizes),), device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graphs, outputs = [], []
        with torch.no_grad():
            with torch.cuda.stream(stream):
                for n in sorted(sizes, reverse=True):
                    module(static[:n])
            torch.cuda.current_stream().wait_stream(stream)
            pool = None
            for n in sorted(sizes, reverse=True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs.append(module(static[:n]))
                pool = graph.pool()
                graphs.append(graph)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        result = {
            "rank": rank,
            "seconds": seconds,
            "peak": torch.cuda.max_memory_reserved(),
            "before": before,
        }
        Path(out, f"hand{rank}.json").write_text(json.dumps(result))
        del graphs, outputs
    finally:
        dist.destroy_process_group()


def hand_capture(world_size: int, shape: str, dtype: str, sizes: list[int]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(
            _hand_rank,
            args=(world_size, shape, dtype, sizes, os.path.join(folder, "init"), folder),
            nprocs=world_size,
        )
        return [json.loads(Path(folder, f"hand{r}.json").read_text()) for r in range(world_size)]


def verified(
    world_size: int, shape: str, dtype: str, sizes: list[int], backend: str, bug: str, timeout: float
) -> dict[str, Any]:
    started = time.perf_counter()
    report = verify_distributed(
        functools.partial(llama.build, shape=shape, dtype=dtype, bug=bug),
        functools.partial(llama.make_inputs, vocab=llama.SHAPES[shape].vocab),
        world_size=world_size,
        capture_sizes=sizes,
        backend=backend,
        timeout=timeout,
    )
    seconds = time.perf_counter() - started
    agreement = [o for o in report.outcomes if o.check == "rank_agreement"]
    return {
        "bug": bug,
        "ok": report.ok,
        "seconds": seconds,
        "descriptors": len(report.descriptors),
        "seconds_per_descriptor": seconds / max(1, len(report.descriptors)),
        "ranks_verified": sorted({o.rank for o in report.outcomes if o.check != "rank_agreement"}),
        "rank_agreement": "passed" if agreement and all(o.passed for o in agreement) else "failed",
        "failed": sorted({o.check for o in report.failures}),
        "first_failure": f"{report.failures[0].headline()}: {report.failures[0].message}"
        if report.failures
        else "",
        "rank_peak": {str(r): n for r, n in report.rank_peak_memory.items()},
        "memory_kind": report.memory_kind,
        "summary": report.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(llama.SHAPES), default="8B")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", choices=("cuda", "emulate"), default="cuda")
    parser.add_argument(
        "--sizes", help="capture sizes, comma-separated (default: vLLM's 67 on CUDA, 1,2,4 else)"
    )
    parser.add_argument(
        "--bugs", default="rank_branch", help="llama.py bugs to catch at this shape ('' for none)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a rank counts as hung")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    cuda = args.backend == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (VLLM_SIZES if cuda else [1, 2, 4])
    result: dict[str, Any] = {
        "shape": args.shape,
        "world_size": args.world_size,
        "backend": args.backend,
        "dtype": dtype,
        "sizes": len(sizes),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    result["verify"] = verified(args.world_size, args.shape, dtype, sizes, args.backend, "", args.timeout)
    print(f"verify: {result['verify']['summary']}")
    if cuda:
        hand = hand_capture(args.world_size, args.shape, dtype, sizes)
        result["hand"] = hand
        for h in hand:
            peak = result["verify"]["rank_peak"].get(str(h["rank"]), 0)
            h["verify_over_hand"] = peak / h["peak"] if h["peak"] else None
            print(
                f"rank {h['rank']}: verify peak {peak / 2**30:.2f} GiB, hand capture {h['peak'] / 2**30:.2f} GiB "
                f"(x{h['verify_over_hand']:.3f}), hand capture {h['seconds']:.2f} s"
            )
    result["bugs"] = [
        verified(args.world_size, args.shape, dtype, sizes, args.backend, bug, args.timeout)
        for bug in filter(None, args.bugs.split(","))
    ]
    for b in result["bugs"]:
        print(f"bug {b['bug']}: {'caught' if not b['ok'] else 'MISSED'} ({', '.join(b['failed'])})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    caught = all(not b["ok"] for b in result["bugs"])
    return 0 if result["verify"]["ok"] and caught else 1


if __name__ == "__main__":
    raise SystemExit(main())
