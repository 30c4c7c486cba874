"""A training step graphed against eager (step time, peak memory), then verified, and a planted bug caught.

    python benchmarks/training_step.py [--model gpt2] [--layers 4] [--hidden 512] [--tokens 1024] [--steps 50]
    python benchmarks/training_step.py --model llama-1b [--layers 16] [--tokens 1024] [--out figures.json]
    python benchmarks/training_step.py --cpu-smoke [--model llama-1b]

Models, random weights (``torch.manual_seed(0)``), fp32 master weights, ``.train()``, SDPA
attention, bf16 autocast, ``AdamW(lr=1e-4, capturable=True)``; one sequence of ``--tokens`` ids a
step, the loss a per-token cross entropy masked by a ``weight`` input (0 on padded rows):

- ``gpt2`` (the default): transformers' ``GPT2LMHeadModel``, vocabulary 8192, ``--layers`` (4)
  and ``--hidden`` (512). (Its eager attention builds its mask with ``torch.tensor(0.0,
  device=...)``, a host-to-device copy no capture holds, on transformers 5.17.)
- ``llama-1b``: ``LlamaForCausalLM`` of Llama-3.2-1B's shape (hidden 2048, MLP 8192, 16 layers,
  32 heads, 8 key-value heads, vocabulary 128256, tied embeddings; its default rope settings, not
  Llama 3's scaled ones), about 1.24 B parameters. ``--layers N`` keeps the shape with N layers;
  the parameter count used is printed. ``--hidden`` is gpt2's only.

Each phase starts from freed memory (its copies deleted, ``gc.collect``,
``torch.cuda.empty_cache``) with the peak reset, so peaks never stack; the caller's model (fp32
weights) stays on the device throughout and is in every absolute peak.

1. Eager: a copy of the model and its optimizer, warmed up; peak above what it holds after the
   warm-up (weights, gradients, optimizer state) and the phase's absolute peak
   (``torch.cuda.max_memory_allocated``).
2. Graphed by hand, as PyTorch's docs capture a whole network: a copy, its optimizer, three
   warm-up steps on a side stream, and one CUDA graph of the whole step (forward, backward, the
   optimizer's step). The wall time of that (build, warm-up, capture) is the hand-written captured
   step's cost; peaks as for eager. Then eager and graph step times, the median of 5 alternating
   rounds of ``--steps`` steps in one process (eager on a fresh copy, built after the graph's
   peak was read).
3. ``verify_training`` of the same step at one capture size (``--tokens``, ``steps=3``): its wall
   time and absolute peak, and their ratios to the hand-captured phase's. Every outcome that passed
   with a message (notes: a tolerance, a skip's reason) is printed; on a failure, the report.
4. The planted bug (``--bug``, the default; ``--no-bug`` skips it): ``verify_training`` of the same
   model with a loss averaged over every row, padded ones too (``per_token.mean()``); it must fail,
   and the checks that failed are printed.

Exit status 0 only when the correct step passed and the bug was caught (or skipped by ``--no-bug``).
``--out PATH`` writes every figure as JSON. CUDA only, except ``--cpu-smoke``: a tiny config (2
layers, hidden 64, vocabulary 512, 16 tokens) on the CPU, where the hand-captured graph is skipped
(eager is timed, peaks are not measured) and ``verify_training`` runs on the emulator, so the
verdicts are exercised end to end.

``verify_training`` holds three trained copies of the model beside the caller's and one snapshot of
their start, and compares each step where the copies hold it: the 16-layer llama-1b (4.6 GiB of
fp32 weights) verified at a peak of 94.9 GiB on an H200 (2026-12-03, docs/training.md), 3.27x the
hand-captured phase's. A verification that runs out of memory is reported as such (exit status
1), not as a verdict, and the figures before it are kept.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph import VerifyReport, verify_training

MODELS = ("gpt2", "llama-1b")
#: Llama-3.2-1B's shape (what --model llama-1b builds; --layers overrides the layer count).
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
#: --cpu-smoke's tiny stand-in for it (the same ratios of MLP to hidden and of heads to key-value heads).
LLAMA_TINY = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "vocab_size": 512,
}
GPT2_VOCAB, SMOKE_VOCAB = 8192, 512
Inputs = Mapping[str, torch.Tensor]


def _model(name: str, layers: int, hidden: int, tokens: int, smoke: bool, device: torch.device) -> Any:
    """The model on ``device`` in train mode, from seed 0, and the shape it was built with."""
    import transformers

    shape: dict[str, Any]
    config: Any
    cls: Any
    if name == "gpt2":
        shape = {
            "vocab_size": SMOKE_VOCAB if smoke else GPT2_VOCAB,
            "n_positions": max(4096, tokens),
            "n_embd": hidden,
            "n_layer": layers,
            "n_head": max(1, hidden // 64),
        }
        config, cls = transformers.GPT2Config, transformers.GPT2LMHeadModel
        # Within the vocabulary (its default, 50256, is GPT-2's own, and transformers warns).
        extra = {"bos_token_id": shape["vocab_size"] - 1, "eos_token_id": shape["vocab_size"] - 1}
    else:
        shape = {
            **(LLAMA_TINY if smoke else LLAMA_1B),
            "num_hidden_layers": layers,
            "max_position_embeddings": max(2048, tokens),
            "tie_word_embeddings": True,
        }
        config, cls, extra = transformers.LlamaConfig, transformers.LlamaForCausalLM, {}
    keywords: dict[str, Any] = {**shape, **extra, "attn_implementation": "sdpa"}
    torch.manual_seed(0)
    model: Any = cls(config(**keywords))
    return model.to(device).train(), shape


def _per_token(out: Any, inputs: Inputs) -> torch.Tensor:
    """Next-token cross entropy at every row of the one sequence."""
    logits = out.logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, inputs["input_ids"][0, 1:], reduction="none")


def _loss(out: Any, inputs: Inputs) -> torch.Tensor:
    """The correct loss: the mean over the real rows (``weight`` is 0 on padded ones)."""
    weight = inputs["weight"][0, 1:]
    return (_per_token(out, inputs) * weight).sum() / weight.sum().clamp(min=1)


def _loss_over_padded(out: Any, inputs: Inputs) -> torch.Tensor:
    """The planted bug: the mean over every row, padded ones too."""
    return _per_token(out, inputs).mean()


def _make_inputs(vocab: int, device: torch.device) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """``make_inputs(num_tokens, num_reqs)``: one sequence of ids from the model's vocabulary."""

    def make_inputs(tokens: int, reqs: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, vocab, (1, tokens), device=device),
            "weight": torch.ones(1, tokens, device=device),
        }

    return make_inputs


def _optimizer(params: Any, capturable: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, capturable=capturable)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: Inputs) -> torch.Tensor:
    opt.zero_grad(set_to_none=False)
    with torch.autocast(inputs["input_ids"].device.type, dtype=torch.bfloat16):
        loss = _loss(model(input_ids=inputs["input_ids"]), inputs)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return loss.detach()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], steps: int, cuda: bool) -> float:
    _sync(cuda)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(cuda)
    return (time.perf_counter() - t0) / steps


def _free(cuda: bool) -> None:
    """What the last phase left goes back (its copies were deleted by the caller), and the peak is reset."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "n/a on the CPU"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _hand(base: torch.nn.Module, batch: Inputs, steps: int, cuda: bool) -> dict[str, Any]:
    """Phases 1 and 2: eager and the hand-captured graph (on the CPU, eager's time only)."""
    figures: dict[str, Any] = {}

    # 1. Eager: its peaks, on a copy that is then freed. (Torch refuses capturable=True on the CPU.)
    _free(cuda)
    eager = copy.deepcopy(base)
    eager_opt = _optimizer(eager.parameters(), capturable=cuda)
    for _ in range(3):
        _step(eager, eager_opt, batch)
    if not cuda:
        # No graph to alternate with: eager's rounds alone, on this copy; no peaks.
        alone = [_timed(functools.partial(_step, eager, eager_opt, batch), steps, cuda) for _ in range(5)]
        figures["eager_step_ms"] = statistics.median(alone) * 1e3
        del eager, eager_opt
        _free(cuda)
        return figures
    so_far = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _timed(functools.partial(_step, eager, eager_opt, batch), 3, cuda)
    figures["eager_peak_above_weights_bytes"] = torch.cuda.max_memory_allocated() - before
    figures["eager_peak_allocated_bytes"] = max(so_far, torch.cuda.max_memory_allocated())
    del eager, eager_opt

    # 2. Graphed by hand: build, warm up on a side stream, capture the whole step (timed), replay.
    _free(cuda)
    t0 = time.perf_counter()
    graphed = copy.deepcopy(base)
    opt = _optimizer(graphed.parameters())
    static = {k: v.clone() for k, v in batch.items()}
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _step(graphed, opt, static)
    torch.cuda.current_stream().wait_stream(side)
    so_far = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(graphed, opt, static)
    torch.cuda.synchronize()
    figures["hand_capture_seconds"] = time.perf_counter() - t0
    graph.replay()
    torch.cuda.synchronize()
    figures["graph_peak_above_weights_bytes"] = torch.cuda.max_memory_allocated() - before
    figures["graph_peak_allocated_bytes"] = max(so_far, torch.cuda.max_memory_allocated())

    # Step times: a fresh eager copy beside the graph, alternating rounds (both see the same machine).
    eager = copy.deepcopy(base)
    eager_opt = _optimizer(eager.parameters())
    for _ in range(3):
        _step(eager, eager_opt, batch)
    rounds: dict[str, list[float]] = {"eager": [], "graph": []}
    for _ in range(5):
        rounds["eager"].append(_timed(functools.partial(_step, eager, eager_opt, batch), steps, cuda))
        rounds["graph"].append(_timed(graph.replay, steps, cuda))
    figures["eager_step_ms"] = statistics.median(rounds["eager"]) * 1e3
    figures["graph_step_ms"] = statistics.median(rounds["graph"]) * 1e3
    del graph, graphed, opt, static, eager, eager_opt
    _free(cuda)
    return figures


def _out_of_memory(exc: BaseException) -> BaseException | None:
    """The device's out-of-memory error in ``exc``'s chain (verify_training may wrap what the step
    raised, EagerFailure for one), or None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _verify(
    base: torch.nn.Module,
    make_inputs: Callable[[int, int], dict[str, torch.Tensor]],
    loss_fn: Callable[[Any, Inputs], torch.Tensor],
    tokens: int,
    device: torch.device,
) -> tuple[VerifyReport | None, float, int | None, str]:
    """``verify_training`` at one capture size: its report (None where it ran out of memory), wall
    time, absolute peak allocated (None on the CPU) and the error that stopped it ("" if none)."""
    cuda = device.type == "cuda"
    _free(cuda)
    t0 = time.perf_counter()
    report: VerifyReport | None = None
    error = ""
    try:
        report = verify_training(
            base,
            make_inputs,
            loss_fn,
            optimizer=_optimizer,
            capture_sizes=[tokens],
            max_num_reqs=1,
            autocast=torch.bfloat16,
            steps=3,
            device=device,
        )
    except Exception as exc:
        oom = _out_of_memory(exc)
        if oom is None:
            raise
        error = f"out of memory: {str(oom).splitlines()[0]}"
        del exc, oom
    _sync(cuda)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else None
    _free(cuda)
    return report, seconds, peak, error


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="gpt2")
    parser.add_argument("--layers", type=int, default=None, help="gpt2: 4, llama-1b: 16, --cpu-smoke: 2")
    parser.add_argument("--hidden", type=int, default=None, help="gpt2 only: 512 (--cpu-smoke: 64)")
    parser.add_argument("--tokens", type=int, default=None, help="1024 (--cpu-smoke: 16)")
    parser.add_argument("--steps", type=int, default=None, help="steps a timed round: 50 (--cpu-smoke: 3)")
    parser.add_argument(
        "--bug",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also verify the planted bug, a loss over padded rows (default: on)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="a tiny config on the CPU: no graph timing, the emulator"
    )
    args = parser.parse_args()
    smoke = args.cpu_smoke
    if args.model != "gpt2" and args.hidden is not None:
        parser.error("--hidden applies to --model gpt2 only (llama-1b's is 2048)")
    for name, least in (("layers", 1), ("hidden", 1), ("tokens", 2), ("steps", 1)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            parser.error(f"--{name} must be at least {least}")
    if not smoke and not torch.cuda.is_available():
        print(
            "training_step.py needs CUDA (torch.cuda.is_available() is False here); "
            "--cpu-smoke runs a tiny config on the CPU",
            file=sys.stderr,
        )
        return 2
    cuda = not smoke
    device = torch.device("cuda" if cuda else "cpu")
    default_layers = 2 if smoke else {"gpt2": 4, "llama-1b": 16}[args.model]
    layers = args.layers if args.layers is not None else default_layers
    hidden = args.hidden if args.hidden is not None else (64 if smoke else 512)
    tokens = args.tokens if args.tokens is not None else (16 if smoke else 1024)
    steps = args.steps if args.steps is not None else (3 if smoke else 50)

    base, shape = _model(args.model, layers, hidden, tokens, smoke, device)
    vocab = int(shape["vocab_size"])
    params = sum(p.numel() for p in base.parameters())
    device_name = (
        torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})"
    )
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.model == "gpt2":
        described = f"GPT-2 shape: {layers} layers, hidden {shape['n_embd']}, vocabulary {vocab}"
    else:
        described = (
            f"Llama shape{' (tiny, --cpu-smoke)' if smoke else ' (Llama-3.2-1B)'}: {layers} layers, hidden "
            f"{shape['hidden_size']}, MLP {shape['intermediate_size']}, {shape['num_attention_heads']} heads, "
            f"{shape['num_key_value_heads']} key-value heads, vocabulary {vocab}, tied embeddings"
        )
    print(
        f"{date}, {device_name}, torch {torch.__version__}; {described}; {params / 1e6:.1f} M parameters "
        f"(fp32 weights {_size(params * 4)}), {tokens} tokens "
        "a step, bf16 autocast, AdamW(capturable=True)"
    )
    figures: dict[str, Any] = {
        "date_utc": date,
        "device": device_name,
        "torch": torch.__version__,
        "model": args.model,
        "cpu_smoke": smoke,
        "shape": shape,
        "parameters": params,
        "tokens": tokens,
        "layers": layers,
        "steps_a_round": steps,
    }
    make_inputs = _make_inputs(vocab, device)
    torch.manual_seed(0)
    batch = make_inputs(tokens, 1)

    figures.update(_hand(base, batch, steps, cuda))
    del batch
    e, g = figures.get("eager_step_ms"), figures.get("graph_step_ms")
    if cuda:
        print(
            f"eager step  {e:8.3f} ms   peak above the weights {_size(figures['eager_peak_above_weights_bytes']):>10}"
            f"   peak allocated {_size(figures['eager_peak_allocated_bytes']):>10}"
        )
        print(
            f"graph step  {g:8.3f} ms   peak above the weights {_size(figures['graph_peak_above_weights_bytes']):>10}"
            f"   peak allocated {_size(figures['graph_peak_allocated_bytes']):>10}   (x{_ratio(e, g):.2f} faster, "
            f"x{_ratio(figures['graph_peak_above_weights_bytes'], max(figures['eager_peak_above_weights_bytes'], 1)):.2f} "
            "the eager peak above the weights)"
        )
        print(
            f"hand-captured step: built, warmed up (3 steps) and captured in {figures['hand_capture_seconds']:.2f} s"
        )
    else:
        print(f"eager step  {e:8.3f} ms   (AdamW(capturable=False): torch refuses True on the CPU; no peaks)")
        print("graph step: skipped on CPU (the hand-captured CUDA graph needs CUDA)")

    # 3. verify_training of the correct step.
    report, seconds, peak, error = _verify(base, make_inputs, _loss, tokens, device)
    passed = report is not None and report.ok
    hand_s, hand_peak = figures.get("hand_capture_seconds"), figures.get("graph_peak_allocated_bytes")
    vs_time, vs_peak = _ratio(seconds, hand_s), _ratio(peak, hand_peak)
    against = (
        f" = x{vs_time:.1f} the hand-captured step's build+warm-up+capture ({hand_s:.2f} s); peak allocated "
        f"{_size(peak)} = x{vs_peak:.2f} the hand-captured phase's ({_size(hand_peak)})"
        if vs_time is not None and vs_peak is not None
        else f"; peak allocated {_size(peak)}"
    )
    eager_steps = f" ({seconds / (e / 1e3):.0f} eager steps)" if e else ""
    print(f"verify_training at {tokens} tokens, steps=3: {seconds:.2f} s{eager_steps}{against}")
    notes = []
    if report is not None:
        for o in report.outcomes:
            if o.passed and o.message:
                where = o.descriptor.label() if o.descriptor is not None else "module"
                note = f"{'skipped' if o.skipped else 'passed'} {o.check} at {where}: {o.message}"
                notes.append(note)
                print(f"  note: {note}")
    print(f"correct step: {'passed' if passed else 'FAILED'}{f' ({error})' if error else ''}")
    if report is not None and not report.ok:
        print(report.format())
    figures.update(
        {
            "verify_seconds": seconds,
            "verify_peak_allocated_bytes": peak,
            "verify_over_hand_capture_time": vs_time,
            "verify_over_hand_peak": vs_peak,
            "correct_passed": passed,
            "correct_error": error or None,
            "correct_notes": notes,
            "correct_failed_checks": sorted({o.check for o in report.outcomes if not o.passed})
            if report is not None
            else None,
        }
    )
    del report

    # 4. The planted bug: a loss over padded rows too.
    caught: bool | None = None
    if args.bug:
        bug, bug_seconds, bug_peak, bug_error = _verify(base, make_inputs, _loss_over_padded, tokens, device)
        failed = sorted({o.check for o in bug.outcomes if not o.passed}) if bug is not None else []
        caught = None if bug is None else not bug.ok
        verdict = "NOT VERIFIED" if caught is None else f"caught by {failed}" if caught else "MISSED"
        print(
            f"bug (loss over padded rows): {verdict}{f' ({bug_error})' if bug_error else ''}   "
            f"({bug_seconds:.2f} s, peak allocated {_size(bug_peak)})"
        )
        figures.update(
            {
                "bug_caught": caught,
                "bug_failed_checks": failed,
                "bug_error": bug_error or None,
                "bug_seconds": bug_seconds,
                "bug_peak_allocated_bytes": bug_peak,
            }
        )
    else:
        print("bug (loss over padded rows): skipped (--no-bug)")
        figures["bug_caught"] = None
    ok = passed and (caught is True or not args.bug)
    figures["ok"] = ok
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
