"""LoRA graphs per active-adapter count, and dispatch by that count."""

from __future__ import annotations

import functools

import pytest
import torch

from examples.lora import LORA_CASES, NO_ADAPTER, LoraLinear, make_inputs


@pytest.mark.cudagraph(
    capture_sizes=(1, 2, 4, 8, 16),
    max_num_reqs=8,
    mode="FULL",
    lora_cases=LORA_CASES,
    pad_values={"token_adapter": NO_ADAPTER},
)
def test_lora_graphs(cudagraph_verify, cudagraph_device):
    torch.manual_seed(0)
    module = LoraLinear().to(cudagraph_device)
    report = cudagraph_verify(module, functools.partial(make_inputs, device=cudagraph_device))
    assert {d.num_active_loras for d in report.descriptors} <= set(LORA_CASES)


@pytest.mark.cudagraph(capture_sizes=(4, 8), max_num_reqs=8, mode="FULL", lora_cases=LORA_CASES)
def test_active_adapter_count_picks_the_graph(cudagraph_manager, cudagraph_device):
    torch.manual_seed(0)
    module = LoraLinear().to(cudagraph_device).eval()
    manager = cudagraph_manager(
        module,
        functools.partial(make_inputs, device=cudagraph_device),
        pad_values={"token_adapter": NO_ADAPTER},
    )
    manager.capture()
    for active, case in [(0, 0), (1, 1), (2, 2), (3, 4), (4, 4)]:
        inputs = make_inputs(6, 3, active=active, device=cudagraph_device)
        assert manager.dispatch(num_reqs=3, num_tokens=6, num_active_loras=active).num_active_loras == case
        out = manager.run_batch(inputs, num_reqs=3, num_active_loras=active)
        with torch.no_grad():
            expected = module.base(inputs["x"])
            for adapter in inputs["active_ids"][:active].tolist():
                delta = inputs["x"] @ module.lora_a[adapter] @ module.lora_b[adapter]
                expected = expected + torch.where((inputs["token_adapter"] == adapter)[:, None], delta, 0.0)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
