"""torchao's quantized models (``quantize_(model, config)``), whose weights are tensor subclasses,
verified like any other: an MLP and a small HF Llama in bf16, int8 weight-only and dynamic int8.

Needs torchao (``pip install "pytest-cudagraph[quant]"``); skipped without it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

torchao = pytest.importorskip("torchao", reason="the torchao examples need torchao (pip install torchao)")

from torchao.quantization import (  # noqa: E402
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    quantize_,
)

D, H = 64, 256
CONFIG = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "exhaustive": True}
CONFIGS = {"int8_weight_only": Int8WeightOnlyConfig, "int8_dynamic": Int8DynamicActivationInt8WeightConfig}


def _mlp(config: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.SiLU(), nn.Linear(H, D)).to(device=device, dtype=torch.bfloat16)
    quantize_(model, CONFIGS[config]())
    return model.eval()


def _mlp_inputs(device: torch.device):
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"input": torch.randn(num_tokens, D, dtype=torch.bfloat16, device=device)}

    return make_inputs


def _llama(config: str, device: torch.device) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    quantize_(model, CONFIGS[config]())
    return model


def _llama_inputs(device: torch.device):
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, 256, (1, num_tokens), device=device),
            "use_cache": False,
        }

    return make_inputs


MODELS = {"mlp": (_mlp, _mlp_inputs), "llama": (_llama, _llama_inputs)}


@pytest.mark.parametrize("model", list(MODELS))
def test_int8_weight_only_passes(cudagraph_verify, cudagraph_device, model):
    build, inputs = MODELS[model]
    report = cudagraph_verify(build("int8_weight_only", cudagraph_device), inputs(cudagraph_device), **CONFIG)
    assert report.ok
    ran = {o.check for o in report.outcomes if not o.skipped}
    assert {"address_stability", "state", "padded_size", "real_batches", "replay_matches_eager"} <= ran


@pytest.mark.parametrize("model", list(MODELS))
def test_int8_dynamic_is_named_as_the_host_sync_a_capture_meets(cudagraph_verify, cudagraph_device, model):
    """torchao 0.18's dynamic int8 reaches ``safe_int_mm`` on CUDA, which formats its input (a host
    sync): a real capture fails there, and the emulator, which runs torchao's CPU path, names the
    same function (the guard's table of library paths that only CUDA takes)."""
    build, inputs = MODELS[model]
    with pytest.raises(pytest.fail.Exception) as failed:
        cudagraph_verify(build("int8_dynamic", cudagraph_device), inputs(cudagraph_device), **CONFIG)
    text = str(failed.value)
    assert "FAIL capture_safety" in text and "safe_int_mm" in text
    assert "host sync" in text
