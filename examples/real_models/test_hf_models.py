"""Hugging Face layers and a whole causal LM, every graph verified against eager.

Built from config classes with seeded random weights; nothing is downloaded.
Skipped without transformers (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from examples.real_models.hf_models import (
    VOCAB,
    gpt2_block,
    hidden_inputs,
    llama_layer,
    llama_rotary,
    lm_inputs,
    patch_inputs,
    qwen2_layer,
    qwen2_rotary,
    rope_inputs,
    tiny_llama_lm,
    vit_layer,
)

SIZES = (1, 2, 4, 8)


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4)
def test_llama_decoder_layer(cudagraph_verify, cudagraph_device):
    # hidden_states (1, T, H), position_ids (1, T), cos and sin (1, T, head_dim)
    # from the model's own LlamaRotaryEmbedding; causal through SDPA.
    module = llama_layer().to(cudagraph_device)
    make = rope_inputs(llama_rotary(cudagraph_device), cudagraph_device)
    assert cudagraph_verify(module, make).ok


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4)
def test_qwen2_decoder_layer(cudagraph_verify, cudagraph_device):
    # As Llama, with biases on q, k and v.
    module = qwen2_layer().to(cudagraph_device)
    make = rope_inputs(qwen2_rotary(cudagraph_device), cudagraph_device)
    assert cudagraph_verify(module, make).ok


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4)
def test_gpt2_block(cudagraph_verify, cudagraph_device):
    module = gpt2_block().to(cudagraph_device)
    assert cudagraph_verify(module, hidden_inputs(cudagraph_device)).ok


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4)
def test_vit_layer(cudagraph_verify, cudagraph_device):
    # A batch of images (N, patches, H): bidirectional attention inside each
    # image, and padding adds whole images that no real one sees.
    module = vit_layer().to(cudagraph_device)
    assert cudagraph_verify(module, patch_inputs(cudagraph_device)).ok


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4)
def test_llama_causal_lm(cudagraph_verify, cudagraph_device):
    # The whole model on input_ids (1, T), use_cache=False as a Python
    # constant; its CausalLMOutputWithPast is returned unchanged (no wrapper).
    module = tiny_llama_lm().to(cudagraph_device)
    assert cudagraph_verify(module, lm_inputs(cudagraph_device)).ok


def test_llama_causal_lm_run_returns_its_model_output(cudagraph_manager, cudagraph_device):
    # What a user of the manager gets back: the model's own output type, cut to
    # the real tokens, equal to eager on the unpadded batch.
    module = tiny_llama_lm().to(cudagraph_device)
    make = lm_inputs(cudagraph_device)
    manager = cudagraph_manager(module, make, capture_sizes=SIZES, max_num_reqs=4)
    manager.capture()
    torch.manual_seed(1)
    inputs = make(5, 1)  # served by the 8-token graph: 3 padded tokens
    out = manager.run_batch(inputs, num_reqs=1)  # one sequence: one request
    with torch.no_grad():
        expected = module(**inputs)
    assert isinstance(out, CausalLMOutputWithPast)
    assert out.logits.shape == (1, 5, VOCAB)
    torch.testing.assert_close(out.logits, expected.logits)
