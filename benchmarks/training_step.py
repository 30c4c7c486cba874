"""A training step of a small GPT, graphed against eager: step time and peak memory, side by side.

    python benchmarks/training_step.py [--layers 4] [--hidden 512] [--tokens 1024] [--steps 50]

GPT-2-shaped (transformers' ``GPT2LMHeadModel`` with random weights, its SDPA attention, bf16
autocast), AdamW(capturable=True). (Its eager attention builds its mask with ``torch.tensor(0.0,
device=...)``, a host-to-device copy no capture holds, on transformers 5.17.) The same step runs eagerly and as
one CUDA graph (forward, backward and the optimizer's step, captured by hand as PyTorch's docs
capture a whole network), alternating rounds in one process; then ``verify_training`` verifies
that step at the same size and its time is given against one eager step. CUDA only.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph import verify_training


def _model(layers: int, hidden: int) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=8192,
        n_positions=4096,
        n_embd=hidden,
        n_layer=layers,
        n_head=max(1, hidden // 64),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).cuda().train()


def _loss(out: Any, inputs: Any) -> torch.Tensor:
    logits = out.logits[0, :-1].float()
    per_token = torch.nn.functional.cross_entropy(logits, inputs["input_ids"][0, 1:], reduction="none")
    weight = inputs["weight"][0, 1:]
    return (per_token * weight).sum() / weight.sum().clamp(min=1)


def _inputs(tokens: int, reqs: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 8192, (1, tokens), device="cuda"),
        "weight": torch.ones(1, tokens, device="cuda"),
    }


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, capturable=True)


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = _loss(model(input_ids=inputs["input_ids"]), inputs)
    loss.backward()
    opt.step()
    return loss.detach()


def _timed(fn: Any, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    base = _model(args.layers, args.hidden)
    params = sum(p.numel() for p in base.parameters())
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}; GPT-2 shape: {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f} M "
        f"parameters, {args.tokens} tokens a step, bf16 autocast, AdamW(capturable=True)"
    )

    # Eager.
    eager = copy.deepcopy(base)
    eager_opt = _optimizer(eager.parameters())
    batch = _inputs(args.tokens, 1)
    for _ in range(3):
        _step(eager, eager_opt, batch)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    eager_peak_run = _timed(functools.partial(_step, eager, eager_opt, batch), 3)
    eager_peak = torch.cuda.max_memory_allocated() - before
    del eager_peak_run

    # Graphed by hand: warm up on a side stream, capture the whole step, replay.
    graphed = copy.deepcopy(base)
    opt = _optimizer(graphed.parameters())
    static = {k: v.clone() for k, v in batch.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _step(graphed, opt, static)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(graphed, opt, static)
    graph.replay()
    torch.cuda.synchronize()
    graph_peak = torch.cuda.max_memory_allocated() - before

    rounds: dict[str, list[float]] = {"eager": [], "graph": []}
    for _ in range(5):  # alternating rounds: both see the same machine
        rounds["eager"].append(_timed(functools.partial(_step, eager, eager_opt, batch), args.steps))
        rounds["graph"].append(_timed(graph.replay, args.steps))
    e, g = statistics.median(rounds["eager"]), statistics.median(rounds["graph"])
    print(f"eager step  {e * 1e3:8.3f} ms   peak above the weights {eager_peak / 2**20:8.1f} MiB")
    print(
        f"graph step  {g * 1e3:8.3f} ms   peak above the weights {graph_peak / 2**20:8.1f} MiB   "
        f"(x{e / g:.2f} faster, x{graph_peak / max(eager_peak, 1):.2f} the eager peak)"
    )
    del graph, graphed, opt, eager, eager_opt
    torch.cuda.empty_cache()

    t0 = time.perf_counter()
    report = verify_training(
        base,
        _inputs,
        _loss,
        optimizer=_optimizer,
        capture_sizes=[args.tokens],
        max_num_reqs=1,
        autocast=torch.bfloat16,
        steps=3,
    )
    seconds = time.perf_counter() - t0
    print(
        f"verify_training at {args.tokens} tokens: {seconds:.2f} s ({seconds / e:.0f} eager steps), "
        f"{'passed' if report.ok else 'FAILED'}"
    )
    if not report.ok:
        print(report.format())


if __name__ == "__main__":
    main()
