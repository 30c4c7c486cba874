"""Tiny Hugging Face models, built from their config classes with seeded random weights.

Nothing is fetched from the hub: every model comes from a config object
(``LlamaConfig(...)``), never from ``from_pretrained``. Sizes are tiny
(hidden 32, 4 heads, 1-2 layers, vocabulary 128) so that verification on the
CPU emulator takes a second or two per model.

Layout of the inputs. A Hugging Face layer takes ``(batch, seq, hidden)``
and these inputs hold one sequence, ``(1, T, H)``, so the token dimension is
the *second* one: the graph manager pads it, not the leading batch
dimension of size 1. ``num_reqs`` is ignored: without a KV cache the layer
sees the batch as one sequence of ``T`` tokens (one prefill), and causal
attention keeps padded tokens, which come last, out of every real token's
view.

Attention runs through SDPA with no mask, so causality comes from the
attention's ``is_causal`` flag (what ``LlamaModel`` itself does when no
padding mask is needed). A layer built with ``attn_implementation="eager"``
and no mask is *bidirectional*: that is one of the planted bugs
(``hf_bugs.EagerLlamaLayer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM, Qwen2Config, ViTConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
from transformers.models.vit.modeling_vit import ViTLayer

__all__ = [
    "HIDDEN",
    "VOCAB",
    "RopeLayer",
    "gpt2_block",
    "gpt2_config",
    "hidden_inputs",
    "llama_config",
    "llama_layer",
    "llama_rotary",
    "lm_inputs",
    "patch_inputs",
    "qwen2_config",
    "qwen2_layer",
    "qwen2_rotary",
    "rope_inputs",
    "tiny_llama_lm",
    "vit_layer",
]

HIDDEN = 32
HEADS = 4
KV_HEADS = 2  # grouped-query attention, as in Llama 3 and Qwen2
INTERMEDIATE = 64
VOCAB = 128
MAX_POSITIONS = 64
PATCHES = 5  # ViT: 4 patches of an 8x8 image at patch size 4, plus the CLS token

Inputs = Callable[[int, int], dict[str, Any]]


# What Llama and Qwen2 share: tiny, grouped-query, SDPA, token ids inside the vocabulary.
_ROPE_DECODER = {
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
    "attn_implementation": "sdpa",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def llama_config(**overrides: Any) -> LlamaConfig:
    return LlamaConfig(**{**_ROPE_DECODER, **overrides})


def qwen2_config(**overrides: Any) -> Qwen2Config:
    return Qwen2Config(**{**_ROPE_DECODER, **overrides})


def gpt2_config(**overrides: Any) -> GPT2Config:
    kw: dict[str, Any] = {
        "n_embd": HIDDEN,
        "n_inner": INTERMEDIATE,
        "n_layer": 1,
        "n_head": HEADS,
        "n_positions": MAX_POSITIONS,
        "vocab_size": VOCAB,
        "attn_implementation": "sdpa",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    kw.update(overrides)
    return GPT2Config(**kw)


class RopeLayer(nn.Module):
    """A rotary decoder layer (Llama, Qwen2) whose ``(cos, sin)`` arrive as two tensors.

    Why this wrapper, and nothing more: ``LlamaDecoderLayer.forward`` takes
    ``position_embeddings`` as a *tuple* ``(cos, sin)``. The graph manager
    keeps one static buffer per keyword input, each a tensor whose rows
    follow ``num_tokens``; a tuple of two tensors is no such tensor. So
    ``cos`` and ``sin`` travel as two keyword tensors of shape
    ``(1, T, head_dim)`` and are packed into the tuple here; the layer is
    called exactly as ``LlamaModel`` calls it (no mask: SDPA's causal flag).
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Any:
        return self.layer(hidden_states, position_ids=position_ids, position_embeddings=(cos, sin))


def llama_layer(**overrides: Any) -> RopeLayer:
    torch.manual_seed(0)
    return RopeLayer(LlamaDecoderLayer(llama_config(**overrides), layer_idx=0)).eval()


def qwen2_layer(**overrides: Any) -> RopeLayer:
    torch.manual_seed(0)
    return RopeLayer(Qwen2DecoderLayer(qwen2_config(**overrides), layer_idx=0)).eval()


def rope_inputs(rotary: nn.Module, device: str | torch.device = "cpu") -> Inputs:
    """``hidden_states (1, T, H)``, ``position_ids (1, T)`` and the rotary ``cos``, ``sin`` ``(1, T, head_dim)``.

    ``rotary`` is the model's own ``LlamaRotaryEmbedding`` / ``Qwen2RotaryEmbedding``
    (on ``device``), so the embeddings are exactly those the model would pass.
    """

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        hidden = torch.randn(1, num_tokens, HIDDEN, device=device)
        position_ids = torch.arange(num_tokens, device=device)[None]
        with torch.no_grad():
            cos, sin = rotary(hidden, position_ids)
        return {"hidden_states": hidden, "position_ids": position_ids, "cos": cos, "sin": sin}

    return make_inputs


def llama_rotary(device: str | torch.device = "cpu", **overrides: Any) -> LlamaRotaryEmbedding:
    return LlamaRotaryEmbedding(llama_config(**overrides)).to(device)


def qwen2_rotary(device: str | torch.device = "cpu", **overrides: Any) -> Qwen2RotaryEmbedding:
    return Qwen2RotaryEmbedding(qwen2_config(**overrides)).to(device)


def gpt2_block(**overrides: Any) -> GPT2Block:
    """A GPT-2 block; it takes ``hidden_states (1, T, H)`` alone (causal through SDPA)."""
    torch.manual_seed(0)
    return GPT2Block(gpt2_config(**overrides), layer_idx=0).eval()


def hidden_inputs(device: str | torch.device = "cpu") -> Inputs:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(1, num_tokens, HIDDEN, device=device)}

    return make_inputs


def vit_layer() -> ViTLayer:
    """A ViT encoder layer over a batch of images: ``(N, patches, H)``, N following num_tokens.

    Attention inside an image is bidirectional, and rightly so: padding adds
    whole images, which no real image attends to.
    """
    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        image_size=8,
        patch_size=4,
        attn_implementation="sdpa",
    )
    return ViTLayer(config).eval()


def patch_inputs(device: str | torch.device = "cpu") -> Inputs:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"hidden_states": torch.randn(num_tokens, PATCHES, HIDDEN, device=device)}

    return make_inputs


def tiny_llama_lm() -> LlamaForCausalLM:
    """A whole two-layer ``LlamaForCausalLM``: embeddings, rotary, causal mask, layers, norm, head."""
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(num_hidden_layers=2)).eval()


def lm_inputs(device: str | torch.device = "cpu") -> Inputs:
    """``input_ids (1, T)`` and ``use_cache=False``, a Python constant frozen into every graph."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {"input_ids": torch.randint(0, VOCAB, (1, num_tokens), device=device), "use_cache": False}

    return make_inputs
