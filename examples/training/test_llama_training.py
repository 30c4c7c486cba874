"""A transformers causal LM trained as a graph: a tiny random Llama, its gradient checkpointing off
and on, its loss masked to the real tokens (passes) or averaged over padded ones too (caught)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128
SIZES = {"capture_sizes": (4, 8), "max_num_reqs": 1}


def _llama(checkpointing: bool) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _inputs(device: Any) -> Any:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, VOCAB, (1, num_tokens), device=device)
        # weight: 1 on real tokens; padded rows hold its pad value, 0, and so weigh nothing.
        return {"input_ids": ids, "weight": torch.ones(1, num_tokens, device=device)}

    return make_inputs


def next_token_loss(out: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    per_token = torch.nn.functional.cross_entropy(
        out.logits[0, :-1].float(), inputs["input_ids"][0, 1:], reduction="none"
    )
    weight = inputs["weight"][0, 1:]
    return (per_token * weight).sum() / weight.sum().clamp(min=1)


def unmasked_loss(out: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), inputs["input_ids"][0, 1:])


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, capturable=True)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_llama_trains_as_a_graph(cudagraph_verify_training, cudagraph_device, checkpointing):
    report = cudagraph_verify_training(
        _llama(checkpointing).to(cudagraph_device),
        _inputs(cudagraph_device),
        next_token_loss,
        optimizer=adamw,
        **SIZES,
    )
    held = {o.check for o in report.outcomes if o.passed and not o.skipped}
    assert {"training_capture", "training_replay_matches_eager", "training_padding"} <= held


def test_a_loss_over_padded_tokens_is_caught(cudagraph_verify_training, cudagraph_device):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)FAIL training_padding .*'input_ids' at \d+"):
        cudagraph_verify_training(
            _llama(False).to(cudagraph_device),
            _inputs(cudagraph_device),
            unmasked_loss,
            optimizer=adamw,
            **SIZES,
        )


# peft asks transformers a deprecated question (is_gradient_checkpointing): its warning, not ours.
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_llama_fine_tunes_with_lora_as_a_graph(cudagraph_verify_training, cudagraph_device):
    """LoRA from peft: only the adapters train (the base weights are frozen), in bf16 autocast."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        _llama(False), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    report = cudagraph_verify_training(
        lora.to(cudagraph_device),
        _inputs(cudagraph_device),
        next_token_loss,
        optimizer=lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], capturable=True),
        autocast=torch.bfloat16,
        **SIZES,
    )
    held = {o.check for o in report.outcomes if o.passed and not o.skipped}
    # PeftModel's forward takes **kwargs only, so which inputs reach the model cannot be read from
    # it: training_padding skips, saying so; the real batches hold the padding to eager.
    assert {"training_capture", "training_replay_matches_eager", "training_real_batches"} <= held
