"""Big plans are told before they cost: bounded plans, memory estimates, progress."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pytest_cudagraph import CaptureConfig, CaptureError, CapturePlan, GraphManager, GraphMode, verify
from pytest_cudagraph.manager import estimate
from pytest_cudagraph.manager.layout import PROBES
from pytest_cudagraph.plan.config import MAX_CAPTURE_TOKENS, MAX_GRAPHS, MAX_LORA_CASE
from tests import models

# -- plan construction is bounded ---------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "config"),
    [
        ("capture_sizes", {"capture_sizes": [1, 2**40], "max_num_reqs": 4}),
        ("capture_sizes", {"capture_sizes": [MAX_CAPTURE_TOKENS + 1], "max_num_reqs": 4}),
        ("max_num_reqs", {"capture_sizes": [8], "max_num_reqs": 2**40}),
        ("max_capture_size", {"capture_sizes": [8], "max_num_reqs": 4, "max_capture_size": 2**40}),
        ("decode_query_len", {"capture_sizes": [8], "max_num_reqs": 4, "decode_query_len": 2**40}),
        ("lora_cases", {"capture_sizes": [8], "max_num_reqs": 4, "lora_cases": [0, 2**40]}),
        ("lora_cases", {"capture_sizes": [8], "max_num_reqs": 4, "lora_cases": [MAX_LORA_CASE + 1]}),
        ("num_ubatches", {"capture_sizes": [8], "max_num_reqs": 4, "num_ubatches": 2**40}),
    ],
)
def test_counts_far_beyond_any_device_are_a_value_error(field, config):
    with pytest.raises(ValueError, match=field) as info:
        CaptureConfig(**config)
    assert "<=" in str(info.value)  # says what was expected


def test_managers_and_verify_refuse_them_before_any_work():
    calls = []

    def make_inputs(t, r):
        calls.append(t)
        return {"x": torch.randn(t, 16)}

    with pytest.raises(ValueError, match="capture_sizes"):
        GraphManager(Wide(), make_inputs, {"capture_sizes": [1, 2**40], "max_num_reqs": 4}, backend="emulate")
    with pytest.raises(ValueError, match="capture_sizes"):
        CapturePlan(CaptureConfig(capture_sizes=[2**40], max_num_reqs=4))
    with pytest.raises(ValueError, match="capture_sizes"):
        verify(Wide(), make_inputs, capture_sizes=[2**40], backend="emulate")
    assert calls == []


def test_endless_size_lists_are_refused_without_reading_them():
    with pytest.raises(ValueError, match=f"more than {MAX_GRAPHS}"):
        CaptureConfig(capture_sizes=range(1, 2**40), max_num_reqs=4)
    with pytest.raises(ValueError, match="LoRA cases"):
        CaptureConfig(capture_sizes=range(1, 1025), max_num_reqs=4, lora_cases=range(17))


def test_replace_is_bounded_too():
    config = CaptureConfig(capture_sizes=[8], max_num_reqs=4)
    with pytest.raises(ValueError, match="capture_sizes"):
        config.replace(capture_sizes=[2**40])


def test_a_plan_at_the_bound_costs_what_its_descriptors_do():
    config = CaptureConfig(
        capture_sizes=[1, 512, MAX_CAPTURE_TOKENS],
        max_num_reqs=256,
        mode="FULL",
        lora_cases=[0, 1, 4, MAX_LORA_CASE],
    )
    plan = CapturePlan(config)
    # Nothing is precomputed per token count or per adapter count.
    assert plan._candidate_memo == {}
    tiered = sum(len(groups) for tiers in plan._tiers.values() for _, groups in tiers)
    assert tiered <= len(plan.descriptors)
    big = plan.dispatch(num_reqs=4, num_tokens=MAX_CAPTURE_TOKENS - 1)
    assert big.mode is GraphMode.FULL and big.num_tokens == MAX_CAPTURE_TOKENS
    assert plan.dispatch(num_reqs=4, num_tokens=MAX_CAPTURE_TOKENS + 1).mode is GraphMode.NONE
    assert plan.effective_loras(3) == 4 and plan.effective_loras(5) == MAX_LORA_CASE
    assert plan.effective_loras(10**9) == MAX_LORA_CASE
    assert plan.candidate_range(big) == range(513, MAX_CAPTURE_TOKENS + 1)
    first = plan.candidates(0)
    assert first and first[0].num_tokens == 1


# -- a capture that will not fit is refused with its estimate --------------------------------


class Wide(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _manager(sizes=(1, 4, 16), **kw) -> GraphManager:
    return GraphManager(
        Wide().eval(),
        lambda t, r: {"x": torch.randn(t, 16)},
        CaptureConfig(capture_sizes=sizes, max_num_reqs=4),
        backend="emulate",
        progress=False,
        **kw,
    )


def test_a_capture_that_does_not_fit_is_refused_and_the_manager_stays_usable(monkeypatch):
    mgr = _manager()
    monkeypatch.setattr(estimate, "available_memory", lambda device: 1000)
    with pytest.raises(
        CaptureError, match=r"refused before it started.*needs about .*1000 B available in RAM"
    ) as info:
        mgr.capture()
    assert info.value.descriptor is not None and info.value.descriptor.num_tokens == 16
    assert "fewer or smaller sizes" in str(info.value)
    assert not mgr.captured
    x = torch.randn(3, 16)
    assert torch.equal(mgr.run(x=x), mgr.eager(x=x))  # eager until a capture succeeds
    monkeypatch.setattr(estimate, "available_memory", lambda device: 1 << 40)
    mgr.capture()
    assert mgr.captured
    models.assert_matches_unpadded(mgr.run(x=x), mgr.eager(x=x))


def test_the_check_can_be_switched_off(monkeypatch):
    mgr = _manager()
    monkeypatch.setattr(estimate, "available_memory", lambda device: 1000)
    monkeypatch.setenv(estimate.CHECK_ENV, "0")
    mgr.capture()
    assert mgr.captured


def test_the_estimate_covers_the_pool_and_the_recording():
    mgr = _manager(sizes=(1, 4, 16))
    est = estimate.estimate_capture(mgr, mgr.plan.capture_order)
    assert est is not None and not est.extrapolated and est.count == 3
    # One forward at 16 tokens: x @ up (16 x 64 floats), relu, down (16 x 16 floats).
    assert est.transient_bytes == 4 * (16 * 64 * 2 + 16 * 16)
    # Peak: the largest graph's; plus the 1- and 4-token graphs' outputs.
    # Peak: the largest graph's (x @ up and its relu alive at once); plus the
    # 1- and 4-token graphs' outputs.
    assert est.graph_bytes == 4 * 16 * 64 * 2 + 4 * 16 * (1 + 4)
    mgr.capture()
    assert sum(mgr.graph_memory.values()) <= est.graph_bytes + 512 * 2 * len(mgr.plan.descriptors)


def test_the_estimate_leaves_the_random_generators_as_they_were():
    mgr = _manager()
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    assert estimate.estimate_capture(mgr, mgr.plan.capture_order) is not None
    assert torch.equal(torch.rand(3), want)


def test_large_graphs_are_extrapolated_from_small_shapes():
    mgr = _manager(sizes=(1, 4096))
    est = estimate.estimate_capture(mgr, mgr.plan.capture_order)
    assert est is not None and est.extrapolated
    direct = estimate.measure_forward(mgr.module, {"x": torch.randn(4096, 16)})
    assert est.transient_bytes == direct.created
    assert est.graph_bytes == direct.peak + 4 * 16 * 1


def test_extrapolation_follows_a_quadratic():
    assert estimate._extrapolate([(1, 10), (2, 20), (4, 40)], 100) == 1000
    assert estimate._extrapolate([(1, 1), (2, 4), (4, 16)], 10) == 100
    assert estimate._extrapolate([(1, 5), (2, 5), (4, 5)], 10**6) == 5


def test_static_inputs_that_will_not_fit_are_refused():
    probes = [{"x": torch.zeros(t, 1024)} for t, _ in PROBES]
    need = 65536 * 1024 * 4
    estimate.check_input_memory(
        probes,
        PROBES,
        max_tokens=65536,
        max_reqs=256,
        device=torch.device("cpu"),
        available=lambda device: 4 * need,
    )
    with pytest.raises(ValueError, match=r"static input buffers .*65536 tokens.*512\.0 MiB"):
        estimate.check_input_memory(
            probes,
            PROBES,
            max_tokens=65536,
            max_reqs=256,
            device=torch.device("cpu"),
            available=lambda device: need,
        )


# -- progress per descriptor ----------------------------------------------------------------


def _verify(progress):
    return verify(
        Wide(),
        lambda t, r: {"x": torch.randn(t, 16)},
        capture_sizes=[1, 2, 4],
        max_num_reqs=4,
        backend="emulate",
        checks=["replay_matches_eager"],
        progress=progress,
    )


def test_progress_shows_when_asked(capsys):
    assert _verify(True).ok
    err = capsys.readouterr().err
    assert "Wide (emulate): capture" in err and "Wide (emulate): checks" in err


@pytest.mark.parametrize("progress", [None, False])
def test_progress_is_quiet_when_not_a_terminal_or_not_asked(capsys, progress):
    assert _verify(progress).ok
    assert "Wide (emulate)" not in capsys.readouterr().err


# -- the fast CUDA capture's estimate, read from the allocator around its warm-up ----------


class Scratch(nn.Module):
    """Holds 2 MiB of scratch a token: 512 MiB at 256 tokens, more than the
    cuBLAS workspaces CudaBackend.begin() hands back, so that after a reset of
    the peak the largest warm-up sets a new one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = x.new_ones(x.shape[0], 1 << 19)
        return x + scratch.sum(1, keepdim=True)


def _cuda_manager(module: nn.Module):
    device = torch.device("cuda", torch.cuda.current_device())
    return GraphManager(
        module.to(device).eval(),
        lambda t, r: {"x": torch.randn(t, 16, device=device)},
        CaptureConfig(capture_sizes=(1, 4, 256), max_num_reqs=4),
        backend="cuda",
        device=device,
        progress=False,
    ), device


@pytest.mark.cuda
def test_the_warm_up_reading_is_the_forwards_own_peak_when_it_sets_one():
    mgr, device = _cuda_manager(Wide())
    kwargs = {"x": torch.randn(256, 16, device=device)}
    counted = estimate.measure_forward(mgr.module, kwargs)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)  # the test's own reset: the meter never resets
    meter = estimate.WarmupMeter(device)
    with torch.no_grad():
        meter.run(mgr.module, kwargs)
    assert meter.exact and meter.footprint is not None
    assert meter.footprint.output == counted.output
    # The allocator rounds each block up to 512 bytes; the counter counts storages.
    assert counted.peak <= meter.footprint.peak <= counted.peak + 512 * 4


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("loose", "room", "captured", "remeasured"),
    [
        (True, 2 << 30, True, 1),  # the bound (an old peak) would refuse: measured again, it fits
        (True, 1000, False, 1),  # measured again, it still does not fit: refused
        (False, 1000, False, 0),  # the warm-up set the peak: its reading refuses alone
        (False, 2 << 30, True, 0),
    ],
)
def test_the_fast_cuda_capture_refuses_from_its_warm_up_and_never_on_a_bound_alone(
    monkeypatch, loose, room, captured, remeasured
):
    mgr, device = _cuda_manager(Scratch())
    calls = []
    real = estimate.measure_forward
    monkeypatch.setattr(estimate, "measure_forward", lambda *a, **k: (calls.append(1), real(*a, **k))[-1])
    monkeypatch.setattr(estimate, "available_memory", lambda device: room)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    if loose:  # an earlier peak of the process, far above what the capture needs
        big = torch.empty(4 << 30, dtype=torch.uint8, device=device)
        del big
    if captured:
        mgr.capture()
        assert mgr.captured_descriptors == mgr.plan.capture_order
    else:
        with pytest.raises(CaptureError, match=r"refused before it started.*measured by an eager forward"):
            mgr.capture()
        assert not mgr.captured
    assert len(calls) == remeasured
    x = torch.randn(3, 16, device=device)
    with torch.no_grad():
        models.assert_matches_unpadded(mgr.run(x=x), mgr.module(x=x))
