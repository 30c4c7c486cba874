"""Where a verification's time goes at real size: issue #67's profile, for the session that gets a GPU.

On one GPU, in one process, for one shape of ``scale.py`` (``1B`` or ``8B``): a warm hand loop, then an
eager forward and one under ``invariant`` at several token counts (each synchronized, and queued back
to back), then each mode of verification (``quick``, ``full``) once warm and once under cProfile,
whose statistics (by own time and by cumulative time) are printed and dumped to ``--out``:

    python benchmarks/scale_profile.py --shape 1B --modes quick,full --out $OUT

Written 2026-12-05 for issue #67 while no GPU was lent; it has not run yet (no figure of it is in the
docs). Without CUDA it only parses its arguments.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _ms(fn: Callable[[], Any], *, sync: bool, n: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(n):
        fn()
        if sync:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / n * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1B", choices=["tiny", "1B", "8B"])
    parser.add_argument("--modes", default="quick,full", help="comma-separated: quick, full")
    parser.add_argument("--out", default=".", help="a folder for the cProfile dumps")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("scale_profile.py needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.scale import VLLM_SIZES, build, hand_loop, verified
    from pytest_cudagraph.invariant import Invariance, invariant

    model = build(args.shape, "cuda")
    vocab = model.config.vocab_size
    hand_loop(model, VLLM_SIZES, vocab)  # the first loop pays for lazy loading
    print(f"hand loop {hand_loop(model, VLLM_SIZES, vocab)['seconds']:.2f} s", flush=True)
    ids = torch.randint(0, vocab, (1, max(VLLM_SIZES)), device="cuda")
    with torch.no_grad():
        for tokens in (512, 505, 256, 249, 8, 1):
            x = ids[:, :tokens]

            def eager(x: torch.Tensor = x) -> None:
                model(input_ids=x, use_cache=False)

            def under(x: torch.Tensor = x) -> None:
                with invariant(Invariance(trace=[])):
                    model(input_ids=x, use_cache=False)

            print(
                f"T={tokens}: eager {_ms(eager, sync=True):.1f} ms ({_ms(eager, sync=False):.1f} queued), "
                f"invariant {_ms(under, sync=True):.1f} ms ({_ms(under, sync=False):.1f} queued)",
                flush=True,
            )
    for mode in args.modes.split(","):
        exhaustive = mode == "full"
        warm = verified(model, VLLM_SIZES, vocab, "cuda", exhaustive=exhaustive)
        steps = {k: round(v["seconds"], 2) for k, v in warm["costs"].items() if v["seconds"] > 0.1}
        print(f"{mode}: {warm['seconds']:.2f} s warm, ok={warm['ok']}, {steps}", flush=True)
        profile = cProfile.Profile()
        profile.enable()
        again = verified(model, VLLM_SIZES, vocab, "cuda", exhaustive=exhaustive)
        profile.disable()
        print(f"{mode}: {again['seconds']:.2f} s under cProfile", flush=True)
        profile.dump_stats(str(Path(args.out) / f"{args.shape}_{mode}.prof"))
        for key, rows in (("tottime", 45), ("cumtime", 90)):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(rows)
            print(text.getvalue()[:20000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
