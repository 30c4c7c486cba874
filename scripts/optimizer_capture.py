"""Which optimizer settings a CUDA graph captures on this torch, measured (issue #47, point 3).

For SGD, Adam and AdamW, each with its flags (none, ``capturable``, ``fused``, ``foreach``, and
``capturable`` with ``foreach``), with and without ``torch.amp.GradScaler``: a small model's whole
training step (gradients zeroed in place, forward, loss, backward, the optimizer's step, the
scaler's update) is warmed up on a side stream and captured with ``torch.cuda.graph``; then two
replays are held to two eager steps from the same state (parameters, optimizer state, the scaler's
scale), bit for bit where they agree, else the largest difference is recorded.

    python scripts/optimizer_capture.py --out docs/data/optimizer_capture_h200.json

CUDA only (``--help`` answers without a GPU). The table it prints is what
``docs/training.md`` shows beside the capturability table, with the date and the device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

OPTIMIZERS = ("SGD", "Adam", "AdamW")
FLAGS: dict[str, dict[str, bool]] = {
    "none": {},
    "capturable": {"capturable": True},
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "capturable+foreach": {"capturable": True, "foreach": True},
}
STEPS = 2


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _case(torch: Any, name: str, flags: dict[str, bool], scaled: bool) -> dict[str, Any]:
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).cuda()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randn(32, 1, device="cuda")
    kwargs: dict[str, Any] = {"lr": 1e-2, **flags}
    if name == "SGD":
        kwargs["momentum"] = 0.9
    label = next(k for k, v in FLAGS.items() if v == flags)
    row: dict[str, Any] = {"optimizer": name, "flags": label, "grad_scaler": scaled}
    try:
        opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    except Exception as exc:  # a flag this optimizer does not take
        row.update(result="not built", error=_first_line(exc))
        return row
    scaler = torch.amp.GradScaler("cuda") if scaled else None

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaled):
            loss = torch.nn.functional.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except Exception as exc:
        row.update(result="eager step fails", error=_first_line(exc))
        return row
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as exc:
        row.update(result="capture fails", error=_first_line(exc))
        torch.cuda.synchronize()
        return row

    def state() -> list[Any]:
        tensors = [p.data for p in model.parameters()] + [
            p.grad for p in model.parameters() if p.grad is not None
        ]
        for per_param in opt.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        if scaler is not None and scaler._scale is not None:
            tensors += [scaler._scale, scaler._growth_tracker]
        return tensors

    start = [t.clone() for t in state()]
    for _ in range(STEPS):
        graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in state()]
    with torch.no_grad():
        for t, s in zip(state(), start, strict=True):
            t.copy_(s)
    try:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    except Exception as exc:
        row.update(result="eager after capture fails", error=_first_line(exc))
        return row
    eager = state()
    diff = max(
        ((a.float() - b.float()).abs().max().item() for a, b in zip(replayed, eager, strict=True)),
        default=0.0,
    )
    moved = max(
        ((a.float() - b.float()).abs().max().item() for a, b in zip(replayed, start, strict=True)),
        default=0.0,
    )
    row.update(
        result="captured; replay equals eager" if diff == 0 else "captured; replay differs from eager",
        max_difference=diff,
        moved=moved,
    )
    return row


def _in_child(name: str, flags: str, scaled: bool) -> dict[str, Any]:
    """One case in a process of its own: a failed capture leaves the CUDA context (its generator's
    state, the capture's error) unfit for the next."""
    cmd = [sys.executable, __file__, "--case", name, flags, "1" if scaled else "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {
            "optimizer": name,
            "flags": flags,
            "grad_scaler": scaled,
            "result": "process fails",
            "error": tail,
        }
    row: dict[str, Any] = json.loads(lines[-1])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--jobs", type=int, default=4, help="cases run side by side, each in a process of its own"
    )
    parser.add_argument("--case", nargs=3, metavar=("OPTIMIZER", "FLAGS", "SCALED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("optimizer_capture: needs a CUDA device", file=sys.stderr)
        return 2
    if args.case:
        name, flags, scaled = args.case
        print(json.dumps(_case(torch, name, FLAGS[flags], scaled == "1")))
        return 0
    cases = [(name, flags, scaled) for name in OPTIMIZERS for flags in FLAGS for scaled in (False, True)]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda c: _in_child(*c), cases))
    print("| optimizer | flags | GradScaler | result | detail |")
    print("|---|---|---|---|---|")
    for row in rows:
        extra = row.get("error") or f"max difference {row.get('max_difference', 0):.3g}"
        print(
            f"| {row['optimizer']} | {row['flags']} | {'yes' if row['grad_scaler'] else 'no'} | {row['result']} | {extra} |"
        )
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['date']}, {result['device']}, torch {result['torch']}: {len(rows)} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
