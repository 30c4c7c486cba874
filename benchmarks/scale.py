"""Verification at the size users work at: Llama-shaped models with random weights, against a hand loop.

For each shape (``tiny``, ``1B``: Llama-3.2-1B's, ``8B``: Llama-3-8B's), in bf16
with ``(1, T)`` input ids and vLLM's 67 capture sizes (1, 2, 4, then 8 to 512
by 8), in one process:

- **hand**: a hand-written ``torch.cuda.CUDAGraph`` loop, every size warmed up
  on a side stream and captured into one pool, largest first, run twice: the
  first loop of the process pays for lazy kernel loading, so the median of
  the next three (``--hand-runs``) is the baseline of the ratios;
- **verify**: ``verify(mode="FULL")`` of every descriptor (``exhaustive=True``);
- **quick**: ``verify(exhaustive=False)``;
- **bug**: quick verification of the same model with a small systematic bug
  (logits scaled by 3 % for batches of the largest capture size: a Python
  branch on the token count, which the graph padded to 512 takes for 505
  real tokens and eager on 505 tokens does not), which must be caught;
- **errors**: quick verification with a 0.1 % error inside the stack (the last
  layer's MLP output times 1.001) and a 0.1 % logit scale, each on the padded
  sizes only (``Planted``: a token count that is a multiple of 8);
- **limits**: the detection-limit table: for each kind of error of
  ``ERROR_KINDS`` (on the padded sizes only), the smallest caught when the
  graph is held to the floor of bf16 (``real_batches`` alone) and to the
  float64 reference (``padded_size``), verifying the largest descriptor; and
  the correct model's verdict in both.

Each prints its verdict, wall time, the graph stages' peak reserved memory
(the allocator's, reset before each), the float64 reference's floor, limit
and stage peak, and the ratios against the hand loop; ``--out`` writes them
as JSON, with where each verification's time went. On the CPU (no CUDA) only
the emulator's verification of ``tiny`` runs, with small sizes.

    python benchmarks/scale.py --shapes tiny,1B,8B --out scale.json
    python benchmarks/scale.py --shapes tiny --resnet      # also torchvision's resnet18 in fp32 (TF32 on)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
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


#: The references ``verified`` hands to ``verify`` (``--attention op``: the bf16-only op's).
REFERENCES: dict[Any, Any] = {}


def _bf16_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention as a kernel for bf16 alone: every layer's causal attention through the
    custom op ``cgref::attention`` (``examples/references``: it refuses any dtype but half precision,
    as FlashAttention does), its keys and values repeated per query head."""
    from examples.references.kernels import attention

    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    out = torch.stack([attention(query[b], k[b], v[b]) for b in range(query.shape[0])])
    return out.transpose(1, 2).contiguous(), None


def use_bf16_attention() -> None:
    """Every Llama built after this runs its attention through ``cgref::attention``, and every
    verification hands in its plain-torch reference (``references=``)."""
    from transformers import AttentionInterface

    from examples.references.kernels import attention, attention_reference

    AttentionInterface.register("cg_bf16_only", _bf16_attention)
    REFERENCES[attention] = attention_reference


def build(shape: str, device: str) -> nn.Module:
    """A ``LlamaForCausalLM`` of ``shape`` with seeded random bf16 weights, made on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    extra = {"attn_implementation": "cg_bf16_only"} if REFERENCES else {}
    config = LlamaConfig(max_position_embeddings=4096, **SHAPES[shape], **extra)
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


#: Errors that act only on the padded sizes: a token count that is a multiple of 8 (every captured
#: size past 4; the real batches between them are not), each of relative size ``e``.
ERROR_KINDS = ("logit_scale", "vocab_pattern", "mlp_scale", "rope_base", "position_table")


def _padded(tokens: int) -> bool:
    return tokens >= 8 and tokens % 8 == 0


class Planted(nn.Module):
    """``inner`` (a ``LlamaForCausalLM``) with an error of kind ``kind`` and size ``e`` on the padded sizes:

    - ``logit_scale``: the logits times 1 + e;
    - ``vocab_pattern``: a fixed pattern over the vocabulary added, e times the logits' rms;
    - ``mlp_scale``: the last decoder layer's MLP output times 1 + e (an error inside the stack);
    - ``rope_base``: the rotary table from frequencies times 1 + e (a table made for another length);
    - ``position_table``: a fixed table per position added to the embeddings, e times their rms.

    The hooks live on ``inner`` until ``remove()``."""

    def __init__(self, inner: nn.Module, kind: str, e: float) -> None:
        super().__init__()
        if kind not in ERROR_KINDS:
            raise ValueError(f"kind must be one of {ERROR_KINDS}; got {kind!r}")
        self.inner, self.kind, self.e = inner, kind, e
        gen = torch.Generator().manual_seed(1234)
        device = next(inner.parameters()).device
        hidden, vocab = inner.config.hidden_size, inner.config.vocab_size
        self.register_buffer("pattern", torch.randn(vocab, generator=gen).to(device), persistent=False)
        self.register_buffer("table", torch.randn(4096, hidden, generator=gen).to(device), persistent=False)
        model = inner.model
        hooks = {
            "mlp_scale": (model.layers[-1].mlp, self._scaled),
            "rope_base": (model.rotary_emb, self._rope),
            "position_table": (model.embed_tokens, self._positions),
        }
        self._handles = (
            [hooks[kind][0].register_forward_hook(hooks[kind][1], with_kwargs=True)] if kind in hooks else []
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _scaled(self, module: nn.Module, args: Any, kwargs: Any, out: torch.Tensor) -> Any:
        return out * (1 + self.e) if _padded(out.shape[1]) else None

    def _rope(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        x = args[0] if args else kwargs["x"]
        position_ids = args[1] if len(args) > 1 else kwargs["position_ids"]
        if not _padded(position_ids.shape[-1]):
            return None
        freqs = position_ids[..., None].float() * (module.inv_freq.float() * (1 + self.e))[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = getattr(module, "attention_scaling", 1.0)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    def _positions(self, module: nn.Module, args: Any, kwargs: Any, out: torch.Tensor) -> Any:
        tokens = out.shape[1]
        if not _padded(tokens):
            return None
        rms = out.float().pow(2).mean().sqrt()
        return out + (self.e * rms * self.table[:tokens]).to(out.dtype)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        logits = self.inner(input_ids=input_ids, use_cache=use_cache).logits
        if not _padded(input_ids.shape[1]):
            return logits
        if self.kind == "logit_scale":
            return logits * (1 + self.e)
        if self.kind == "vocab_pattern":
            rms = logits.float().pow(2).mean().sqrt()
            return logits + (self.e * rms * self.pattern).to(logits.dtype)
        return logits


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


def hand_median(model: nn.Module, sizes: list[int], vocab: int, *, runs: int = 3) -> dict[str, Any]:
    """The hand loop's figure: the median of ``runs`` warm loops, after a first one that pays for lazy
    kernel loading and cuBLAS's set-up at every shape (kept as ``cold_seconds``). One loop is no
    figure: on the H200 a single warm loop moved between 1.6 and 4.5 s from run to run."""
    cold = hand_loop(model, sizes, vocab)
    loops = [hand_loop(model, sizes, vocab) for _ in range(runs)]
    median = sorted(loops, key=lambda r: r["seconds"])[len(loops) // 2]
    return {
        **median,
        "runs": [r["seconds"] for r in loops],
        "peak": max(r["peak"] for r in loops),
        "cold_seconds": cold["seconds"],
    }


def verified(
    module: nn.Module,
    sizes: list[int],
    vocab: int,
    device: str,
    *,
    exhaustive: bool,
    checks: Any = None,
    descriptors: Any = None,
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
        checks=checks,
        descriptors=descriptors,
        references=dict(REFERENCES) or None,
    )
    seconds = time.perf_counter() - started
    peak = report.peak_memory  # the graph stages' (the reference stage's is apart)
    failed = sorted({o.check for o in report.failures})
    first = report.failures[0] if report.failures else None
    reference = [o.figures for o in report.outcomes if o.check == "padded_size" and "limit" in o.figures]
    skipped_reference = next(
        (o.message for o in report.outcomes if o.check == "padded_size" and o.skipped), ""
    )
    return {
        "ok": report.ok,
        "seconds": seconds,
        "peak": peak,
        "before": before,
        "reference_peak": report.reference_peak_memory,
        "reference_before": report.reference_memory_at_start,
        "reference": {
            "precision": reference[0]["reference"] if reference else None,
            "floor": max((f["floor"] for f in reference), default=None),
            "limit": max((f["limit"] for f in reference), default=None),
            "largest_difference": max((f["relative_rms"] for f in reference), default=None),
            "skipped": skipped_reference,
            "bit_for_bit": sum(
                int(o.figures.get("bit_for_bit", 0)) for o in report.outcomes if o.check == "padded_size"
            ),
            "float64": sum(
                int(o.figures.get("float64", 0)) for o in report.outcomes if o.check == "padded_size"
            ),
            "why_float64": sorted(
                {str(o.figures["why_float64"]) for o in report.outcomes if "why_float64" in o.figures}
            ),
        },
        "failed": failed,
        "first_failure": f"{first.headline()}: {first.message}" if first is not None else "",
        "first_submodule": first.finding.submodule if first is not None and first.finding else None,
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


def median_of(runs: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall time among ``runs`` of ``run``, with every run's seconds, peak and
    verdict (``runs``): one run is no figure, as one hand loop is none, and the first run of a shape
    pays set-up the hand loop's first (untimed) loop pays for it (kernels loaded, cuDNN's and
    cuBLAS's choices made at each new shape and layout)."""
    results = [run() for _ in range(max(1, runs))]
    median = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]
    return {
        **median,
        "runs": [{"seconds": r["seconds"], "peak": r["peak"], "ok": r["ok"]} for r in results],
        "peak": max(r["peak"] for r in results),
        "reference_peak": max(r["reference_peak"] for r in results),
        # A verdict that changes from run to run is no verdict: the median's stands only if all agree.
        "ok": median["ok"] if len({r["ok"] for r in results}) == 1 else None,
    }


def verified_planted(model: nn.Module, kind: str, e: float, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``verified`` of ``model`` with the error ``kind`` of size ``e`` planted, the hooks removed after
    (nothing here outlives the call: a wrapper left in a caller's variable keeps the model alive)."""
    planted = Planted(model, kind, e)
    try:
        return verified(planted, *args, **kwargs)
    finally:
        planted.remove()


#: The two ways of holding a graph across shapes: the module's own precision (real_batches' floor,
#: padded_size deselected) and the float64 reference; and the errors each is tried with, largest
#: first (the sweep stops at the first one missed).
MODES = {"bf16 statistics": ["real_batches"], "float64 reference": ["real_batches", "padded_size"]}
SWEEP = {
    "bf16 statistics": (0.3, 0.1, 0.03, 0.01, 0.003, 0.001),
    "float64 reference": (0.001, 1e-4, 1e-5, 1e-6),
}


def detection_limits(model: nn.Module, sizes: list[int], vocab: int, device: str) -> dict[str, Any]:
    """Per error kind and mode, the smallest error of its SWEEP caught (verification of the largest
    descriptor alone, whose real batches are not multiples of 8), and the correct model's verdict."""
    largest = [f"FULL-T{max(sizes)}-R{max(sizes)}"]
    table: dict[str, Any] = {"correct": {}, "kinds": {}}
    for mode, checks in MODES.items():
        r = verified(model, sizes, vocab, device, exhaustive=False, checks=checks, descriptors=largest)
        table["correct"][mode] = {"ok": r["ok"], "failed": r["failed"], "reference": r["reference"]}
    for kind in ERROR_KINDS:
        row: dict[str, Any] = {}
        for mode, checks in MODES.items():
            caught, missed, message = None, None, ""
            for e in SWEEP[mode]:
                r = verified_planted(
                    model, kind, e, sizes, vocab, device, exhaustive=False, checks=checks, descriptors=largest
                )
                if r["ok"]:
                    missed = e
                    break
                caught, message = e, message or r["first_failure"]
            row[mode] = {"smallest_caught": caught, "first_missed": missed, "message": message}
        table["kinds"][kind] = row
        print(
            f"    {kind:15} " + "  ".join(f"{m}: {_limit(row[m])}" for m in MODES),
            flush=True,
        )
    return table


def _limit(cell: dict[str, Any]) -> str:
    if cell["smallest_caught"] is None:
        return f"none caught (missed {cell['first_missed']:g})"
    below = (
        f", {cell['first_missed']:g} missed" if cell["first_missed"] is not None else " (the smallest tried)"
    )
    return f"{cell['smallest_caught']:g} caught{below}"


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
        "--parts",
        default="hand,verify,quick,bug,errors,limits",
        help="comma-separated: hand, verify, quick, bug, errors (a 0.1 %% error inside the stack and a 0.1 %% "
        "logit scale on the padded sizes), limits (the detection-limit table)",
    )
    parser.add_argument(
        "--hand-runs", type=int, default=3, help="warm hand loops whose median the ratios use (default 3)"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=3,
        help="runs of each verification part; the median's figures are reported, every run's seconds kept "
        "(default 3; the first of a shape pays per-shape set-up, as the hand loop's first loop does)",
    )
    parser.add_argument(
        "--errors",
        default="mlp_scale,logit_scale",
        help="comma-separated: the kinds of 0.1 %% error the errors part plants (default mlp_scale,logit_scale)",
    )
    parser.add_argument("--resnet", action="store_true", help="also torchvision's resnet18 (fp32, TF32 on)")
    parser.add_argument(
        "--attention",
        choices=("sdpa", "op"),
        default="sdpa",
        help="op: every attention layer through a custom op for bf16 alone (examples/references' "
        "cgref::attention), its plain-torch reference handed in (default sdpa: transformers' own)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    parts = set(args.parts.split(","))
    if args.attention == "op":
        use_bf16_attention()
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "attention": args.attention,
        "shapes": {},
    }
    print(f"{results['date']}, {results['device']}, torch {torch.__version__}", flush=True)
    if cuda and parts & {"verify", "quick", "bug", "errors", "limits"}:
        # What a process pays once, at its first verification (importing hypothesis and
        # torch._dynamo, loading the kernels of float64 and of the checks), paid here by a verification
        # of the tiny shape, as the hand loop's first loop pays for lazy kernel loading: under pytest
        # the plugins have imported hypothesis before any test runs.
        warm = build("tiny", device)
        started = time.perf_counter()
        verify(
            warm,
            _inputs(warm.config.vocab_size, device),
            capture_sizes=CPU_SIZES,
            mode="FULL",
            progress=False,
        )
        results["warm_up_seconds"] = time.perf_counter() - started
        print(f"warm-up: a verification of tiny, {results['warm_up_seconds']:.2f} s (untimed)", flush=True)
        del warm
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
            row["hand"] = hand_median(model, sizes, vocab, runs=args.hand_runs)
            print(
                f"  hand   {row['hand']['seconds']:7.2f} s  peak {format_bytes(row['hand']['peak'])} (the median "
                f"of {len(row['hand']['runs'])} warm loops: {', '.join(f'{s:.2f}' for s in row['hand']['runs'])} s; "
                f"the first loop of the process: {row['hand']['cold_seconds']:.2f} s)",
                flush=True,
            )
        for part, exhaustive in (("verify", True), ("quick", False)):
            if part in parts:
                row[part] = median_of(
                    args.runs, functools.partial(verified, model, sizes, vocab, device, exhaustive=exhaustive)
                )
                _print(part, row[part], row.get("hand"))
        if "bug" in parts:
            row["bug"] = median_of(
                args.runs,
                functools.partial(
                    verified, ScaledFromTokenCount(model, max(sizes)), sizes, vocab, device, exhaustive=False
                ),
            )
            _print("bug", row["bug"], row.get("hand"))
        if "errors" in parts:
            # Two errors of a tenth of a percent, each on the padded sizes only, in quick verification:
            # inside the stack (the last layer's MLP output) and on the logits (issues #38 and #48).
            for kind, e in ((k, 0.001) for k in args.errors.split(",")):
                row[f"{kind} {e:g}"] = median_of(
                    args.runs,
                    functools.partial(
                        verified_planted, model, kind, e, sizes, vocab, device, exhaustive=False
                    ),
                )
                _print(f"{kind} {e:g}", row[f"{kind} {e:g}"], row.get("hand"))
        if "limits" in parts:
            print("  detection limits (the largest descriptor; smallest error caught):", flush=True)
            row["limits"] = detection_limits(model, sizes, vocab, device)
            for mode, cell in row["limits"]["correct"].items():
                print(
                    f"    correct model, {mode}: {'passed' if cell['ok'] else 'FAILED ' + str(cell['failed'])}"
                )
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
    verdict = (
        "VERDICT CHANGED between runs"
        if r["ok"] is None
        else "passed"
        if r["ok"]
        else f"FAILED {','.join(r['failed'])}"
    )
    runs = ""
    if len(r.get("runs", ())) > 1:
        each = ", ".join(f"{x['seconds']:.2f}" for x in r["runs"])
        runs = f"; the median of {len(r['runs'])} runs: {each} s"
    ratio = ""
    if hand:
        ratio = f"  x{r['seconds'] / hand['seconds']:.2f} time, x{r['peak'] / hand['peak']:.3f} peak"
    peak = f"  peak {format_bytes(r['peak'])}" if r["peak"] else ""
    print(
        f"  {part:6} {r['seconds']:7.2f} s{peak}{ratio}  {verdict}; {r['descriptors']} descriptors, "
        f"{r['real_batches']} real batches, floor measured for {r['floor_measured']} (max {r['floor_max']:.3g})"
        f"{runs}",
        flush=True,
    )
    ref = r["reference"]
    if ref["precision"]:
        print(
            f"         cross-shape: {ref['bit_for_bit']} batches bit for bit, {ref['float64']} in "
            f"{ref['precision']}; floor {ref['floor']:.2g}, limit {ref['limit']:.2g}, largest "
            f"difference across shapes {ref['largest_difference']:.2g}; stage peak "
            f"{format_bytes(r['reference_peak'])} ({format_bytes(r['reference_before'])} before)"
            + (
                f", x{r['reference_peak'] / hand['peak']:.3f} the hand loop's"
                if hand and r["reference_peak"]
                else ""
            ),
            flush=True,
        )
        for why in ref["why_float64"][:3]:
            print(f"         asked in float64 where {why[:300]}", flush=True)
    elif ref["skipped"]:
        print(f"         reference: {ref['skipped'][:200]}", flush=True)
    if r["first_failure"]:
        print(f"         {r['first_failure'][:600]}", flush=True)
        print(f"         first divergent submodule: {r['first_submodule']!r}", flush=True)
    top = sorted(r["costs"].items(), key=lambda kv: -kv[1]["seconds"])[:6]
    print("         " + ", ".join(f"{k} {v['seconds']:.2f}s/{v['forwards']}f" for k, v in top), flush=True)


if __name__ == "__main__":
    sys.exit(main())
