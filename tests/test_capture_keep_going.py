"""capture(keep_going=True): one descriptor's failed capture is that descriptor's failure alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pytest_cudagraph import BatchDescriptor, CaptureConfig, CaptureError, GraphManager, GraphMode

D = 16
SIZES = (1, 2, 4, 8, 16)
BAD = 8  # the one token count whose forward cannot be captured


class SyncsAtOneSize(nn.Module):
    """Capturable at every size but one: at ``BAD`` tokens it reads a device value on the host."""

    def __init__(self, bad_op: str = "item") -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.bad_op = bad_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if x.shape[0] == BAD:
            if self.bad_op == "item":
                y = y + y.sum().item() * 0.0  # host sync
            else:
                y = y + torch.nonzero(y > 0).shape[0] * 0.0  # data-dependent shape
        return y


def make_inputs(device: torch.device):
    def make(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, D, device=device)}

    return make


def manager(backend: str, device: torch.device, *, mode: str = "FULL", **keywords) -> GraphManager:
    config = CaptureConfig(capture_sizes=SIZES, max_num_reqs=4, mode=mode)
    return GraphManager(
        SyncsAtOneSize(keywords.pop("bad_op", "item")).to(device).eval(),
        make_inputs(device),
        config,
        backend=backend,
        device=device,
        **keywords,
    )


def assert_replay_matches_eager(mgr: GraphManager, device: torch.device, num_tokens: int) -> None:
    x = torch.randn(num_tokens, D, device=device)
    torch.testing.assert_close(mgr.run(x=x), mgr.eager(x=x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_the_other_descriptors_are_captured_and_replay_equals_eager(backend, device, mode):
    mgr = manager(backend, device, mode=mode)
    mgr.capture(keep_going=True)
    failed = [d for d in mgr.plan.capture_order if d.num_tokens == BAD]
    assert failed and set(mgr.capture_failures) == set(failed)
    assert mgr.captured_descriptors == tuple(d for d in mgr.plan.capture_order if d.num_tokens != BAD)
    assert set(mgr.graph_memory) == set(mgr.captured_descriptors)
    for num_tokens in SIZES:
        if num_tokens != BAD:
            assert (
                mgr.dispatch(num_reqs=min(num_tokens, 4), num_tokens=num_tokens) in mgr.captured_descriptors
            )
            assert_replay_matches_eager(mgr, device, num_tokens)


def test_the_failure_is_recorded_with_its_descriptor(backend, device):
    mgr = manager(backend, device)
    mgr.capture(keep_going=True)
    ((desc, error),) = mgr.capture_failures.items()
    assert desc == BatchDescriptor(mode=GraphMode.FULL, num_tokens=BAD, num_reqs=4)
    assert isinstance(error, CaptureError)
    assert error.descriptor == desc and error.backend == backend
    assert error.op == "Tensor.item()" and "host sync" in str(error)
    with pytest.raises(KeyError):
        mgr.graph(desc)


@pytest.mark.parametrize("num_tokens", [5, BAD])  # both dispatch to the failed descriptor
def test_a_batch_for_the_failed_descriptor_runs_eagerly(backend, device, num_tokens):
    mgr = manager(backend, device)
    mgr.capture(keep_going=True)
    desc = mgr.dispatch(num_reqs=4, num_tokens=num_tokens)
    assert desc.mode is GraphMode.NONE and desc.num_tokens == num_tokens
    x = torch.randn(num_tokens, D, device=device)
    for _ in range(2):  # not remembered as a graph on the hot path either
        torch.testing.assert_close(mgr.run(x=x), mgr.eager(x=x), rtol=0, atol=0)
    # The batches around it still replay their graphs.
    assert_replay_matches_eager(mgr, device, 4)
    assert_replay_matches_eager(mgr, device, 16)


def test_the_default_still_releases_every_graph_and_raises(backend, device):
    mgr = manager(backend, device)
    with pytest.raises(CaptureError) as info:
        mgr.capture()
    assert info.value.descriptor is not None and info.value.descriptor.num_tokens == BAD
    assert mgr.captured_descriptors == () and mgr.capture_failures == {}
    x = torch.randn(4, D, device=device)
    torch.testing.assert_close(mgr.run(x=x), mgr.eager(x=x), rtol=0, atol=0)  # eagerly, as before


def test_the_manager_stays_usable(backend, device):
    mgr = manager(backend, device)
    mgr.capture(keep_going=True)
    first = mgr.captured_descriptors
    mgr.capture(keep_going=True)  # the whole plan again: the same answer
    assert mgr.captured_descriptors == first and len(mgr.capture_failures) == 1
    assert_replay_matches_eager(mgr, device, 16)
    good = [d for d in mgr.plan.capture_order if d.num_tokens != BAD]
    mgr.capture(good)  # without the bad one, the default capture succeeds and forgets the failure
    assert mgr.captured_descriptors == tuple(good) and mgr.capture_failures == {}
    assert_replay_matches_eager(mgr, device, 2)
    mgr.release()
    assert mgr.captured_descriptors == ()


def test_a_kept_failure_does_not_hold_the_failed_capture(backend, device):
    mgr = manager(backend, device)
    mgr.capture(keep_going=True)
    (error,) = mgr.capture_failures.values()
    tb = error.__traceback__
    while tb is not None:  # its frames' locals (the capture's tensors) are dropped
        assert not any(isinstance(v, torch.Tensor) for v in tb.tb_frame.f_locals.values())
        tb = tb.tb_next


def _keeps_going_after_nonzero(checked: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    mgr = manager("cuda", device, bad_op="nonzero", checked_capture=checked)
    mgr.capture(keep_going=True)
    ((desc, error),) = mgr.capture_failures.items()
    assert desc.num_tokens == BAD and error.op is not None and "nonzero" in error.op
    assert mgr.captured_descriptors == tuple(d for d in mgr.plan.capture_order if d.num_tokens != BAD)
    for num_tokens in (1, 3, 5, BAD, 16):
        x = torch.randn(num_tokens, D, device=device)
        torch.testing.assert_close(mgr.run(x=x), mgr.eager(x=x))


@pytest.mark.cuda
def test_cuda_checked_capture_stops_the_op_before_the_device_and_keeps_going():
    # torch.nonzero is seen only by the checked capture's dispatch mode: it
    # is named before the device sees it, the capture ends cleanly and the
    # later graphs share the pool.
    _keeps_going_after_nonzero(checked=True)


_FAST = """
from tests.test_capture_keep_going import _keeps_going_after_nonzero
_keeps_going_after_nonzero(checked=False)
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.xfail(
    strict=False,
    reason=(
        "seen on an H200 (torch 2.11): after a fast capture invalidated on the device, the CUDA generator stays "
        "in capture mode (the next torch.randn raises 'Offset increment outside graph capture encountered "
        "unexpectedly'): CudaBackend._recover does not restore it in this case"
    ),
)
def test_cuda_fast_capture_keeps_going_after_an_op_that_invalidates_the_capture():
    # The fast capture meets torch.nonzero on the device, which invalidates
    # the capture; the backend must leave the device (and the generator) fit
    # for the next graph. In a process of its own: a generator left in
    # capture mode would fail every later test's random op.
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "CUDA_VISIBLE_DEVICES": str(torch.cuda.current_device())
        if "CUDA_VISIBLE_DEVICES" not in os.environ
        else os.environ["CUDA_VISIBLE_DEVICES"].split(",")[torch.cuda.current_device()],
    }
    done = subprocess.run([sys.executable, "-c", _FAST], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.splitlines()[-1:] == ["ok"], done.stderr[-3000:]
