"""Verification at the size users work at: Llama-shaped models with random weights, against a hand loop.

For each shape (``tiny``, ``1B``: Llama-3.2-1B's, ``8B``: Llama-3-8B's), in bf16
with ``(1, T)`` input ids and vLLM's 67 capture sizes (1, 2, 4, then 8 to 512
by 8), in one process:

- **hand**: a hand-written ``torch.cuda.CUDAGraph`` loop, every size warmed up
  on a side stream and captured into one pool, largest first, run twice: the
  first loop of the process pays for lazy kernel loading, so the second is
  the baseline of the ratios;
- **verify**: ``verify(mode="FULL")`` of every descriptor (``exhaustive=True``);
- **quick**: ``verify(exhaustive=False)``;
- **bug**: quick verification of the same model with a small systematic bug
  (logits scaled by 3 % for batches of the largest capture size: a Python
  branch on the token count, which the graph padded to 512 takes for 505
  real tokens and eager on 505 tokens does not), which ``real_batches``
  must catch.

Each prints its verdict, wall time, peak reserved memory (the allocator's,
reset before each) and the ratios against the hand loop; ``--out`` writes
them as JSON, with where each verification's time went. On the CPU (no CUDA)
only the emulator's verification of ``tiny`` runs, with small sizes.

    python benchmarks/scale.py --shapes tiny,1B,8B --out scale.json
    python benchmarks/scale.py --shapes tiny --resnet      # also torchvision's resnet18 in fp32 (TF32 on)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph import verify
from pytest_cudagraph.units import format_bytes

#: Llama-3.2-1B and Llama-3-8B's shapes; tiny for CPUs and tests.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=True,
    ),
    "1B": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
}
#: vLLM's classic capture sizes: 1, 2, 4, then every multiple of 8 up to 512 (67 sizes).
VLLM_SIZES = [1, 2, 4, *range(8, 513, 8)]
CPU_SIZES = [1, 2, 4, 8, 16, 24, 32]


def build(shape: str, device: str) -> nn.Module:
    """A ``LlamaForCausalLM`` of ``shape`` with seeded random bf16 weights, made on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=4096, **SHAPES[shape])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


class ScaledFromTokenCount(nn.Module):
    """The bug: logits scaled by 3 % once the batch has ``threshold`` tokens or more."""

    def __init__(self, inner: nn.Module, threshold: int) -> None:
        super().__init__()
        self.inner = inner
        self.threshold = threshold

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        logits = self.inner(input_ids=input_ids, use_cache=use_cache).logits
        return logits * 1.03 if input_ids.shape[1] >= self.threshold else logits


def _inputs(vocab: int, device: str) -> Any:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"input_ids": torch.randint(0, vocab, (1, num_tokens), device=device), "use_cache": False}

    return make_inputs


def _fresh(device: str) -> int:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_reserved())
    return 0


def _peak(device: str) -> int:
    return int(torch.cuda.max_memory_reserved()) if device == "cuda" else 0


def hand_loop(model: nn.Module, sizes: list[int], vocab: int) -> dict[str, Any]:
    """Warm every size up on a side stream, then capture each into one pool, largest first."""
    before = _fresh("cuda")
    started = time.perf_counter()
    static = torch.randint(0, vocab, (1, max(sizes)), device="cuda")
    graphs, outputs = [], []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            for n in sorted(sizes, reverse=True):
                model(input_ids=static[:, :n], use_cache=False)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for n in sorted(sizes, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs.append(model(input_ids=static[:, :n], use_cache=False).logits)
            pool = graph.pool()
            graphs.append(graph)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = _peak("cuda")
    del graphs, outputs
    _fresh("cuda")
    return {"seconds": seconds, "peak": peak, "before": before, "graphs": len(sizes)}


def verified(
    module: nn.Module, sizes: list[int], vocab: int, device: str, *, exhaustive: bool
) -> dict[str, Any]:
    before = _fresh(device)
    started = time.perf_counter()
    report = verify(
        module,
        _inputs(vocab, device),
        capture_sizes=sizes,
        mode="FULL",
        exhaustive=exhaustive,
        progress=False,
    )
    seconds = time.perf_counter() - started
    peak = _peak(device) if device == "cuda" else report.peak_memory
    failed = sorted({o.check for o in report.failures})
    first = report.failures[0] if report.failures else None
    return {
        "ok": report.ok,
        "seconds": seconds,
        "peak": peak,
        "before": before,
        "failed": failed,
        "first_failure": f"{first.headline()}: {first.message}" if first is not None else "",
        "descriptors": len(report.descriptors),
        "real_batches": report.real_batches,
        "floor_measured": sum(
            o.figures.get("floor_measured", 0) for o in report.outcomes if o.check == "real_batches"
        ),
        "floor_max": max(
            [o.figures.get("floor_max", 0.0) for o in report.outcomes if o.check == "real_batches"],
            default=0.0,
        ),
        "costs": {name: cost.to_dict() for name, cost in report.costs.items()},
        "summary": report.summary(),
    }


def resnet(device: str) -> dict[str, Any]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().to(device).eval()

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"x": torch.randn(num_tokens, 3, 224, 224, device=device)}

    before = _fresh(device)
    started = time.perf_counter()
    report = verify(model, make_inputs, capture_sizes=[1, 2, 4, 8], progress=False)
    return {
        "ok": report.ok,
        "seconds": time.perf_counter() - started,
        "peak": _peak(device),
        "before": before,
        "failed": sorted({o.check for o in report.failures}),
        "summary": report.summary(),
        "tf32_convolutions": bool(torch.backends.cudnn.allow_tf32),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,1B,8B", help="comma-separated: tiny, 1B, 8B")
    parser.add_argument(
        "--parts", default="hand,verify,quick,bug", help="comma-separated: hand, verify, quick, bug"
    )
    parser.add_argument("--resnet", action="store_true", help="also torchvision's resnet18 (fp32, TF32 on)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "shapes": {},
    }
    print(f"{results['date']}, {results['device']}, torch {torch.__version__}", flush=True)
    for shape in args.shapes.split(","):
        sizes = VLLM_SIZES if cuda else CPU_SIZES
        if not cuda and shape != "tiny":
            print(f"{shape}: skipped (no CUDA device; the CPU runs tiny only)", flush=True)
            continue
        model = build(shape, device)
        vocab = model.config.vocab_size
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        row: dict[str, Any] = {"weights": weights, "sizes": len(sizes)}
        print(
            f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, weights "
            f"{format_bytes(weights)}, {len(sizes)} capture sizes",
            flush=True,
        )
        if cuda and "hand" in parts:
            # The first loop of a process pays for lazy kernel loading and cuBLAS's set-up at every
            # shape; the second is the hand loop's own cost, and the one the ratios use.
            cold = hand_loop(model, sizes, vocab)
            row["hand"] = hand_loop(model, sizes, vocab)
            row["hand"]["cold_seconds"] = cold["seconds"]
            print(
                f"  hand   {row['hand']['seconds']:7.2f} s  peak {format_bytes(row['hand']['peak'])} "
                f"(the first loop of the process: {cold['seconds']:.2f} s)",
                flush=True,
            )
        for part, exhaustive in (("verify", True), ("quick", False)):
            if part in parts:
                row[part] = verified(model, sizes, vocab, device, exhaustive=exhaustive)
                _print(part, row[part], row.get("hand"))
        if "bug" in parts:
            row["bug"] = verified(
                ScaledFromTokenCount(model, max(sizes)), sizes, vocab, device, exhaustive=False
            )
            _print("bug", row["bug"], row.get("hand"))
        results["shapes"][shape] = row
        del model
        _fresh(device) if cuda else gc.collect()
    if args.resnet:
        results["resnet18"] = resnet(device)
        print(
            f"resnet18: {'passed' if results['resnet18']['ok'] else 'FAILED'} "
            f"{results['resnet18']['failed']} ({results['resnet18']['summary']})",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def _print(part: str, r: dict[str, Any], hand: dict[str, Any] | None) -> None:
    verdict = "passed" if r["ok"] else f"FAILED {','.join(r['failed'])}"
    ratio = ""
    if hand:
        ratio = f"  x{r['seconds'] / hand['seconds']:.2f} time, x{r['peak'] / hand['peak']:.3f} peak"
    peak = f"  peak {format_bytes(r['peak'])}" if r["peak"] else ""
    print(
        f"  {part:6} {r['seconds']:7.2f} s{peak}{ratio}  {verdict}; {r['descriptors']} descriptors, "
        f"{r['real_batches']} real batches, floor measured for {r['floor_measured']} (max {r['floor_max']:.3g})",
        flush=True,
    )
    if r["first_failure"]:
        print(f"         {r['first_failure'][:400]}", flush=True)
    top = sorted(r["costs"].items(), key=lambda kv: -kv[1]["seconds"])[:6]
    print("         " + ", ".join(f"{k} {v['seconds']:.2f}s/{v['forwards']}f" for k, v in top), flush=True)


if __name__ == "__main__":
    sys.exit(main())
