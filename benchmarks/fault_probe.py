"""GPU faults: does a failure path give back what it took, and what does a sticky CUDA error leave?

    PYTHONPATH=$PWD python benchmarks/fault_probe.py leaks [--cycles 30] [--json OUT]
    PYTHONPATH=$PWD python benchmarks/fault_probe.py sticky

``leaks``: for each failure path (a capture that meets a host sync, through
``GraphManager.capture`` and through ``verify``; a capture that runs out of
memory; a capture the driver invalidates) and a successful twin, repeats the
path ``--cycles`` times and reads the device after each (the driver's free
memory, the allocator's reserved and allocated bytes, after a garbage
collection and ``empty_cache``). Growth is counted after the first five
cycles (warm-up: cuBLAS handles, kernels loaded). ``sticky``: a
device-side assert in a verification, then what the process can still do.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pytest_cudagraph import CaptureError, GraphManager, verify

D = 256


class HostSyncAt(nn.Module):
    """Reads a device value on the host in the middle of the forward: a capture fails there."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 4 * D)
        self.b = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        if h.sum().item() > 0:  # the bug
            h = h * 2
        return self.b(h)


class Clean(HostSyncAt):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu() * 2)


class HugeInCapture(Clean):
    """Asks for far more than the device has, only while a capture records."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if torch.cuda.is_current_stream_capturing():
            y = y + torch.empty(1 << 38, dtype=torch.uint8, device=x.device)[: y.numel()].view_as(y).float()
        return y


class SyncInCapture(Clean):
    """Synchronizes the device inside the capture: the driver invalidates it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()
        return y


class OutOfRange(nn.Module):
    """An embedding indexed past its end on the largest batch: a device-side assert."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids + (100 if ids.shape[0] >= 8 else 0))


def make_x(t: int, r: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(t, D, device="cuda")}


def make_ids(t: int, r: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, 16, (t,), device="cuda")}


SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def reading() -> dict[str, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return {
        "free": free,
        "reserved": torch.cuda.memory_reserved(),
        "allocated": torch.cuda.memory_allocated(),
    }


def manager_capture(cls: type[nn.Module]) -> Callable[[], str]:
    def once() -> str:
        module = cls().cuda()
        manager = GraphManager(
            module, make_x, {"capture_sizes": SIZES, "max_num_reqs": 128}, backend="cuda", progress=False
        )
        try:
            manager.capture()
            return "captured"
        except CaptureError as exc:
            return f"CaptureError({str(exc).splitlines()[0][:90]})"
        except Exception as exc:
            return f"{type(exc).__name__}({str(exc).splitlines()[0][:90]})"
        finally:
            manager.release()

    return once


def verify_path(cls: type[nn.Module]) -> Callable[[], str]:
    def once() -> str:
        report = verify(
            cls().cuda(),
            make_x,
            capture_sizes=SIZES,
            backend="cuda",
            progress=False,
            checks=["capture_safety", "replay_matches_eager"],
        )
        return "ok" if report.ok else f"failed: {', '.join(sorted({f.check for f in report.failures}))}"

    return once


PATHS: dict[str, Callable[[], str]] = {
    "clean (manager)": manager_capture(Clean),
    "host sync (manager)": manager_capture(HostSyncAt),
    "host sync (verify)": verify_path(HostSyncAt),
    "out of memory in capture (manager)": manager_capture(HugeInCapture),
    "invalidated capture (manager)": manager_capture(SyncInCapture),
    "clean (verify)": verify_path(Clean),
}


def leaks(cycles: int, out: str | None) -> None:
    results: dict[str, Any] = {}
    for name, once in PATHS.items():
        outcome = once()
        readings = [reading()]
        for _ in range(cycles - 1):
            once()
            readings.append(reading())
        base = readings[min(5, len(readings) - 1)]
        last = readings[-1]
        growth = {k: (base["free"] - last["free"]) if k == "free" else last[k] - base[k] for k in base}
        results[name] = {"outcome": outcome, "growth_after_5": growth, "first": readings[0], "last": last}
        mib = {k: round(v / 2**20, 1) for k, v in growth.items()}
        print(
            f"{name}: {outcome}\n    growth over cycles 6..{cycles} (MiB): device {mib['free']}, reserved "
            f"{mib['reserved']}, allocated {mib['allocated']}",
            flush=True,
        )
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)


def sticky() -> None:
    report = None
    try:
        report = verify(OutOfRange().cuda(), make_ids, capture_sizes=[4, 8], backend="cuda", progress=False)
        print("verify returned:", report.format()[:1500])
    except BaseException as exc:
        chain = []
        e: BaseException | None = exc
        while e is not None and len(chain) < 6:
            chain.append(
                f"{type(e).__module__}.{type(e).__name__} error_code={getattr(e, 'error_code', None)}: "
                f"{str(e).splitlines()[0][:160] if str(e) else ''}"
            )
            e = e.__cause__ or e.__context__
        print("verify raised:\n  " + "\n  ".join(chain))
    for what, op in [
        ("synchronize", torch.cuda.synchronize),
        ("small op", lambda: torch.ones(2, device="cuda").add_(1).sum().item()),
        ("mem_get_info", torch.cuda.mem_get_info),
    ]:
        try:
            print(f"after: {what}: ok {op()}")
        except BaseException as exc:
            print(
                f"after: {what}: {type(exc).__name__} error_code={getattr(exc, 'error_code', None)}: "
                f"{str(exc).splitlines()[0][:120]}"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("leaks", "sticky"))
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    if args.what == "leaks":
        leaks(args.cycles, args.json)
    else:
        sticky()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
