"""What verifying a runner costs, per descriptor, next to verifying our own manager's graphs.

    python benchmarks/runner_cost.py [--out results.json]

On CUDA: the example engine runner on the decoder, torch.compile's
reduce-overhead on the decoder, make_graphed_callables on the MLP, each
through ``verify_runner``; and ``verify`` (our GraphManager, checked capture,
every check) on the same modules and capture sizes. Each figure is wall
seconds for the whole verification (capture included) over the number of
descriptors the report holds, the median of ``--rounds`` runs, every
contender's round taken in turn. Every report must pass: a failing one is
printed and the script exits 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.decoder import MAX_REQS, PAD_VALUES, SCRATCH_STATE, TinyDecoder
from examples.decoder import make_inputs as decoder_inputs
from examples.engine_runner.runner import EngineRunner, make_engine_inputs
from examples.mlp import MLPBlock
from examples.mlp import make_inputs as mlp_inputs
from pytest_cudagraph import verify, verify_runner
from pytest_cudagraph.runner.adapters import compiled, graphed_callables

DECODER_SIZES = [1, 2, 4]
MLP_SIZES = [1, 2, 4, 8]


def _decoder(device: torch.device) -> tuple[TinyDecoder, Any]:
    torch.manual_seed(0)
    return TinyDecoder().to(device).eval(), functools.partial(make_engine_inputs, device=device)


def _mlp(device: torch.device) -> tuple[MLPBlock, Any]:
    torch.manual_seed(0)
    return MLPBlock().to(device).eval(), functools.partial(mlp_inputs, device=device)


def contenders(device: torch.device) -> dict[str, Callable[[], Any]]:
    dec_kw: dict[str, Any] = {
        "capture_sizes": DECODER_SIZES,
        "max_num_reqs": MAX_REQS,
        "scratch_state": SCRATCH_STATE,
    }

    def engine_runner() -> Any:
        module, make = _decoder(device)
        return verify_runner(EngineRunner(module, DECODER_SIZES, device=device), module, make, **dec_kw)

    def compiled_decoder() -> Any:
        module, make = _decoder(device)
        # Every token count it will serve warmed up: graph trees record a shape on its second call.
        runner = compiled(
            module,
            clone_outputs=True,
            make_inputs=make,
            warmup_sizes=range(1, DECODER_SIZES[-1] + 1),
            max_num_reqs=MAX_REQS,
        )
        return verify_runner(runner, module, make, **dec_kw)

    def manager_decoder() -> Any:
        module, _ = _decoder(device)  # the manager sets the is_padding mask itself
        return verify(
            module,
            functools.partial(decoder_inputs, device=device),
            capture_sizes=DECODER_SIZES,
            max_num_reqs=MAX_REQS,
            mode="FULL",
            pad_values=PAD_VALUES,
            scratch_state=SCRATCH_STATE,
            device=device,
            progress=False,
        )

    def graphed_mlp() -> Any:
        module, make = _mlp(device)
        return verify_runner(
            graphed_callables(module, make, MLP_SIZES), module, make, capture_sizes=MLP_SIZES
        )

    def manager_mlp() -> Any:
        module, make = _mlp(device)
        return verify(module, make, capture_sizes=MLP_SIZES, mode="FULL", device=device, progress=False)

    return {
        "engine runner, decoder": engine_runner,
        "torch.compile reduce-overhead, decoder": compiled_decoder,
        "GraphManager (verify), decoder": manager_decoder,
        "make_graphed_callables, MLP": graphed_mlp,
        "GraphManager (verify), MLP": manager_mlp,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("runner_cost.py needs a CUDA device")
    device = torch.device("cuda", 0)
    runs = contenders(device)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    reports: dict[str, Any] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            report = run()
            torch.cuda.synchronize()
            seconds[name].append((time.perf_counter() - t0) / max(1, len(report.descriptors)))
            reports[name] = report
    failed = False
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device),
        "rows": [],
    }
    for name, report in reports.items():
        row = {
            "verification": name,
            "descriptors": len(report.descriptors),
            "ok": report.ok,
            "seconds_per_descriptor": statistics.median(seconds[name]),
            "summary": report.summary(),
        }
        results["rows"].append(row)
        print(f"{name:44s} {row['seconds_per_descriptor'] * 1e3:9.1f} ms/descriptor  {report.summary()}")
        if not report.ok:
            failed = True
            print(report.format())
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
