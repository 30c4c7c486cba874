"""GPU faults on a real device (#19): failure paths give their memory back; a lost context costs one test.

CUDA-marked: skipped without a GPU. docs/reliability.md shows the H200 run.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from pytest_cudagraph import CaptureError, GraphManager, verify

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parent.parent
D = 256
SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
CYCLES, WARM = 30, 5
#: Device memory a path may take over cycles 6..30: the allocator's rounding, nothing a cycle keeps.
SLACK = 2 << 20


class Clean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 4 * D)
        self.b = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu() * 2)


class HostSync(Clean):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        return self.b(h * (2 if h.sum().item() > 0 else 1))


class HugeInCapture(Clean):
    """Asks for 256 GiB only while a capture records: out of memory in the capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if torch.cuda.is_current_stream_capturing():
            y = y + torch.empty(1 << 38, dtype=torch.uint8, device=x.device)[: y.numel()].view_as(y).float()
        return y


class SyncInCapture(Clean):
    """Synchronizes its stream inside the capture: the driver invalidates the capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()
        return y


def make_x(t: int, r: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(t, D, device="cuda")}


def _device_used() -> int:
    """Device memory in use, as the driver sees it; under pytest-xdist other workers share the
    device, so there it is this process's allocator's reserved memory (where every leak seen
    so far showed: a pool never freed, a cuBLAS workspace kept in it)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return int(torch.cuda.memory_reserved())
    free, total = torch.cuda.mem_get_info()
    return total - free


def _capture_once(cls: type[nn.Module], fails: bool) -> Callable[[], None]:
    def once() -> None:
        manager = GraphManager(
            cls().cuda(),
            make_x,
            {"capture_sizes": SIZES, "max_num_reqs": 128},
            backend="cuda",
            progress=False,
        )
        try:
            if fails:
                with pytest.raises(CaptureError):
                    manager.capture()
            else:
                manager.capture()
        finally:
            manager.release()

    return once


def _verify_once() -> None:
    report = verify(
        HostSync().cuda(),
        make_x,
        capture_sizes=SIZES,
        backend="cuda",
        progress=False,
        checks=["capture_safety", "replay_matches_eager"],
    )
    assert not report.ok


PATHS = {
    "clean twin": _capture_once(Clean, fails=False),
    "host sync": _capture_once(HostSync, fails=True),
    "out of memory in capture": _capture_once(HugeInCapture, fails=True),
    "invalidated capture": _capture_once(SyncInCapture, fails=True),
    "host sync through verify": _verify_once,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_failure_path_gives_back_what_it_took(path: str) -> None:
    once = PATHS[path]
    used = []
    for _ in range(CYCLES):
        once()
        used.append(_device_used())
    growth = used[-1] - used[WARM - 1]
    assert growth <= SLACK, (
        f"{path}: device memory grew by {growth / 2**20:.1f} MiB over cycles "
        f"{WARM + 1}..{CYCLES} (per cycle: {[u - used[WARM - 1] for u in used[WARM:]]})"
    )


SCRIPT = """
import torch
from torch import nn
from pytest_cudagraph import verify
from pytest_cudagraph.faults import ContextLost


class OutOfRange(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids):
        return self.emb(ids + (100 if ids.shape[0] >= 8 else 0))


try:
    verify(OutOfRange().cuda(), lambda t, r: {"ids": torch.randint(0, 16, (t,), device="cuda")},
           capture_sizes=[2, 8], backend="cuda", progress=False)
except ContextLost as lost:
    print("LOST", lost.code, lost.where.module, lost.where.descriptor, lost.where.phase)
"""


def test_a_device_assert_is_told_as_a_lost_context_with_where_it_showed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert "LOST 710 OutOfRange FULL-T8-R8 eager" in done.stdout, done.stdout + done.stderr[-2000:]


def test_a_suite_with_faults_runs_on(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """One device assert, one host sync and one out-of-memory capture among correct tests, under xdist."""
    from .conftest import isolate_plugins

    isolate_plugins(monkeypatch)  # this plugin whether installed or on PYTHONPATH; xdist by -p
    pytester.makepyfile(
        test_faults_demo=(ROOT / "scripts" / "fault_suite" / "test_faults_demo.py").read_text()
    )
    result = pytester.runpytest_subprocess("-p", "xdist", "-n", "2", "-rA")
    result.assert_outcomes(passed=3, failed=3)
    out = result.stdout.str()
    for name in ("test_a_correct", "test_c_correct", "test_f_correct"):
        assert f"PASSED test_faults_demo.py::{name}" in out
    assert "CUDA context lost: a device-side assert (cudaErrorAssert) in OutOfRange" in out
    assert "crashed while running" not in out
