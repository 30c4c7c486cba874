"""What tracking the state forward reads from outside the module costs (issue #69): quick verification
(``exhaustive=False``) of ``scale.py``'s Llama shapes with the tracking on and off, in one process.

For each shape (``tiny``; ``1B`` on a GPU), in bf16 with vLLM's 67 capture sizes on CUDA (the CPU
sizes of ``scale.py`` on the emulator), ``--runs`` quick verifications alternate between tracking on
(``checks/outside.py``: one forward watched by ``sys.setprofile``, the places' leaves read at each
capture and on failures) and off (``outside.TRACKED = False``); it prints the median wall time and
graph-stage peak memory of each and their ratio, and, apart, one eager forward watched against one
not, the places found and the leaves read at a capture (their time)::

    python benchmarks/outside_cost.py --shapes tiny,1B --runs 3 --out outside.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _forward_cost(model: Any, vocab: int, device: str) -> dict[str, Any]:
    """One eager forward watched against one not, and the leaves read at a capture."""
    import torch

    from pytest_cudagraph.checks.outside import Outside

    ids = torch.randint(0, vocab, (1, 8), device=device)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        if device == "cuda":
            torch.cuda.synchronize()

    forward()
    started = time.perf_counter()
    forward()
    plain = time.perf_counter() - started
    outside = Outside(model)
    started = time.perf_counter()
    with outside.watching():
        forward()
    watched = time.perf_counter() - started
    started = time.perf_counter()
    places = outside.places()
    found = time.perf_counter() - started
    started = time.perf_counter()
    leaves = outside.leaves()
    read = time.perf_counter() - started
    return {
        "forward_ms": plain * 1e3,
        "watched_forward_ms": watched * 1e3,
        "find_places_ms": found * 1e3,
        "places": sorted(places),
        "leaves": len(leaves),
        "read_leaves_ms": read * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,1B", help="comma-separated: tiny, 1B, 8B")
    parser.add_argument("--runs", type=int, default=3, help="quick verifications per setting")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    import torch

    from benchmarks import scale
    from pytest_cudagraph.checks import outside
    from pytest_cudagraph.units import format_bytes

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sizes = scale.VLLM_SIZES if cuda else scale.CPU_SIZES
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shapes": {}}
    for shape in args.shapes.split(","):
        if shape != "tiny" and not cuda:
            print(f"{shape}: skipped (no CUDA)")
            continue
        model = scale.build(shape, device)
        vocab = scale.SHAPES[shape]["vocab_size"]
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        scale.verified(model, sizes, vocab, device, exhaustive=False)  # warm: kernels loaded, caches filled
        for _ in range(args.runs):
            for tracked in (True, False):
                outside.TRACKED = tracked
                runs[tracked].append(scale.verified(model, sizes, vocab, device, exhaustive=False))
        outside.TRACKED = True
        figures = {
            "on": {
                "seconds": statistics.median(r["seconds"] for r in runs[True]),
                "peak": max(r["peak"] for r in runs[True]),
                "ok": all(r["ok"] for r in runs[True]),
            },
            "off": {
                "seconds": statistics.median(r["seconds"] for r in runs[False]),
                "peak": max(r["peak"] for r in runs[False]),
                "ok": all(r["ok"] for r in runs[False]),
            },
            "forward": _forward_cost(model, vocab, device),
        }
        figures["time_ratio"] = figures["on"]["seconds"] / figures["off"]["seconds"]
        results["shapes"][shape] = figures
        on, off, fwd = figures["on"], figures["off"], figures["forward"]
        print(
            f"{shape} on {results['device']}, quick, {len(sizes)} sizes, median of {args.runs}: tracked "
            f"{on['seconds']:.2f} s (peak {format_bytes(on['peak'])}, ok={on['ok']}), untracked {off['seconds']:.2f} s "
            f"(peak {format_bytes(off['peak'])}, ok={off['ok']}), x{figures['time_ratio']:.3f}; one forward "
            f"{fwd['forward_ms']:.1f} ms, watched {fwd['watched_forward_ms']:.1f} ms; places found in "
            f"{fwd['find_places_ms']:.1f} ms: {len(fwd['places'])} ({', '.join(fwd['places'][:8])}), "
            f"{fwd['leaves']} leaves read in {fwd['read_leaves_ms']:.2f} ms"
        )
        del model
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
