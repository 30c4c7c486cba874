"""Does eager at a padded size, cut to the real rows, equal eager on the real batch bit for bit?

For each shape (``tiny``, ``1B``, ``8B``: ``benchmarks/scale.py``'s Llamas in bf16) and each of
vLLM's 67 capture sizes N, the most padded real batch n (N - 7 past 8; 1 for 2, 3 for 4) of
random ids, run two ways:

- **plain**: the module as it is (cuBLAS picks a tiling per row count);
- **invariant**: under ``pytest_cudagraph.invariant`` (products and row-wise reductions on rows
  padded to a multiple of 8).

It prints how many sizes agree bit for bit, the time of the 134 forwards of each way, and, for
each planted error of ``scale.Planted`` (on the padded sizes only), how many sizes differ under
``invariant``, which must be every padded one. ``--out`` writes the figures as JSON.

    python benchmarks/invariance.py --shapes 1B,8B --out invariance.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import CPU_SIZES, VLLM_SIZES, Planted, build

from pytest_cudagraph.invariant import Invariance, invariant


def _real(n: int) -> int:
    return {1: 1, 2: 1, 4: 3}.get(n, n - 7)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def agreement(module: Any, sizes: list[int], vocab: int, device: str, *, mode: bool) -> dict[str, Any]:
    """Per size: eager at N cut to n against eager on n, bit for bit; and the wall time."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    state = Invariance()
    same, differs = [], []
    _sync(device)
    started = time.perf_counter()
    flags = []
    traces: list[int] = []
    with torch.no_grad():
        for n_pad in sizes:
            n = _real(n_pad)
            ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
            padded = torch.zeros(1, n_pad, dtype=ids.dtype, device=device)
            padded[:, :n] = ids
            state.trace = []
            with invariant(state) if mode else _nothing():
                real = module(input_ids=ids, use_cache=False)
                real = real.logits if hasattr(real, "logits") else real
            real_trace, state.trace = state.trace, []
            with invariant(state) if mode else _nothing():
                pad = module(input_ids=padded, use_cache=False)
                pad = pad.logits if hasattr(pad, "logits") else pad
            if mode and real_trace != state.trace:
                traces.append(n_pad)
            flags.append(
                (n_pad, torch.equal(pad[:, :n], real), (pad[:, :n].float() - real.float()).abs().max())
            )
    _sync(device)
    seconds = time.perf_counter() - started
    for n_pad, eq, diff in flags:
        (same if eq else differs).append((n_pad, float(diff)))
    return {
        "seconds": seconds,
        "same": [s for s, _ in same],
        "differs": differs,
        "padded_ops": sorted(state.padded),
        "traces_differ": traces,
        "not_row_local": state.not_row_local,
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="tiny")
    parser.add_argument("--errors", default="logit_scale,mlp_scale,rope_base,position_table,vocab_pattern")
    parser.add_argument("--e", type=float, default=1e-3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = VLLM_SIZES if device == "cuda" else CPU_SIZES
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    for shape in args.shapes.split(","):
        model = build(shape, device)
        vocab = model.config.vocab_size
        row: dict[str, Any] = {}
        for name, mode in (("plain", False), ("invariant", True), ("invariant_again", True)):
            row[name] = agreement(model, sizes, vocab, device, mode=mode)
            print(
                f"{shape} {name:16s} {row[name]['seconds']:7.2f} s  same at {len(row[name]['same'])}/{len(sizes)}  "
                f"differs at {[s for s, _ in row[name]['differs']][:12]}  traces differ at {row[name]['traces_differ'][:12]}  "
                f"not row-local: {row[name]['not_row_local'][:3]}",
                flush=True,
            )
        for kind in [k for k in args.errors.split(",") if k]:
            planted = Planted(model, kind, args.e)
            try:
                found = agreement(planted, sizes, vocab, device, mode=True)
            finally:
                planted.remove()
            padded = [s for s in sizes if s >= 8]
            caught = [s for s, _ in found["differs"] if s >= 8]
            row[f"{kind}_{args.e:g}"] = found
            traced = [s for s in found["traces_differ"] if s >= 8]
            print(
                f"{shape} {kind} x(1+{args.e:g}): differs at {len(caught)}/{len(padded)} padded sizes, "
                f"traces differ at {len(traced)}/{len(padded)}, "
                f"{found['seconds']:.2f} s; smallest max diff {min((d for _, d in found['differs']), default=0):.3g}",
                flush=True,
            )
        results[shape] = row
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
