"""Planted bugs in Hugging Face layers, each beside its correct twin.

Each buggy module is a realistic variant of a model of ``hf_models``; the
check that must catch it is named in its docstring and asserted by
``test_hf_bugs.py``. Build them after ``torch.manual_seed(0)``.

- ``BidirectionalLlamaLayer``: a Llama layer on the *eager* attention
  with no mask. ``LlamaAttention.is_causal`` is True, but only SDPA reads
  that flag; HF's eager attention applies the mask it is given and nothing
  else, so the layer is bidirectional and real tokens attend to the padded
  ones. Caught by ``padded_size`` (and ``padding_isolation``). Twin:
  ``CausalEagerLlamaLayer`` builds the causal mask from the padded shape.
- ``AuxHiddenLlamaLayer``: keeps its post-attention hidden states on
  ``self.aux_hidden`` for an EAGLE-style drafter. In a graph that attribute
  is a tensor in graph memory, written by whichever graph replayed last and
  padded to its size, not the batch's hidden states. Caught by
  ``side_outputs``. Twin: ``AuxHiddenOutputLlamaLayer`` returns them.
- ``HostSyncLongRopeLlamaLayer``: a long-context rotary embedding (Phi-3
  LongRoPE style: short or long rescale factors by sequence length) that reads
  the largest position with ``.item()``. Caught by ``capture_safety``. Twin:
  ``DeviceLongRopeLlamaLayer`` picks the factors with ``torch.where``.
- ``PythonStepGPT2Block``: a GPT-2 block whose update is scaled by an
  inverse-square-root schedule of a Python step counter (``self.step += 1``).
  A graph freezes the capture-time step. Caught by ``replay_matches_eager``.
  Twin: ``BufferStepGPT2Block`` counts in a registered buffer, in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from .hf_models import HEADS, HIDDEN, RopeLayer, gpt2_config, llama_config

__all__ = [
    "ORIGINAL_CONTEXT",
    "AuxHiddenLlamaLayer",
    "AuxHiddenOutputLlamaLayer",
    "BidirectionalLlamaLayer",
    "BufferStepGPT2Block",
    "CausalEagerLlamaLayer",
    "DeviceLongRopeLlamaLayer",
    "EagerLlamaLayer",
    "HostSyncLongRopeLlamaLayer",
    "PythonStepGPT2Block",
    "position_inputs",
]


# -- (1) bidirectional attention: padded tokens leak into real ones ------------------
class EagerLlamaLayer(RopeLayer):
    """A Llama layer on HF's eager attention; ``causal=False`` passes no mask (the bug)."""

    def __init__(self, causal: bool) -> None:
        super().__init__(LlamaDecoderLayer(llama_config(attn_implementation="eager"), layer_idx=0))
        self.causal = causal
        self.eval()

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Any:
        mask = None
        if self.causal:
            # (1, 1, T, T) additive mask from the (padded) shape: fixed per graph, so capturable.
            t = hidden_states.shape[1]
            mask = torch.full(
                (t, t), float("-inf"), device=hidden_states.device, dtype=hidden_states.dtype
            ).triu(1)[None, None]
        return self.layer(
            hidden_states, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin)
        )


class BidirectionalLlamaLayer(EagerLlamaLayer):
    def __init__(self) -> None:
        super().__init__(causal=False)


class CausalEagerLlamaLayer(EagerLlamaLayer):
    def __init__(self) -> None:
        super().__init__(causal=True)


# -- (3) an intermediate kept on a plain attribute ------------------------------------
class _AuxLlama(RopeLayer):
    """``LlamaDecoderLayer.forward`` spelled out, to reach the post-attention hidden states."""

    def __init__(self) -> None:
        super().__init__(LlamaDecoderLayer(llama_config(), layer_idx=0))
        self.eval()

    def _halves(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layer
        attn, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden_states),
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=(cos, sin),
        )
        aux = hidden_states + attn
        return aux + layer.mlp(layer.post_attention_layernorm(aux)), aux


class AuxHiddenLlamaLayer(_AuxLlama):
    """Stores the post-attention hidden states on ``self.aux_hidden`` for a drafter (the bug)."""

    aux_hidden: torch.Tensor | None = None

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        out, aux = self._halves(hidden_states, position_ids, cos, sin)
        self.aux_hidden = aux  # a drafter reads this after the step
        return out


class AuxHiddenOutputLlamaLayer(_AuxLlama):
    """Returns the post-attention hidden states beside the output: ``(out, aux)``."""

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._halves(hidden_states, position_ids, cos, sin)


# -- (4) a host sync in the rotary embedding --------------------------------------------
#: The context the short factors were trained for; beyond it the long ones apply.
ORIGINAL_CONTEXT = 6


class _LongRopeLlama(nn.Module):
    """A Llama layer computing its own rotary embeddings, with short and long frequencies."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = LlamaDecoderLayer(llama_config(), layer_idx=0)
        head_dim = HIDDEN // HEADS
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("short_inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", inv_freq / 4.0, persistent=False)
        self.eval()

    def inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype)
        out: torch.Tensor = self.layer(
            hidden_states, position_ids=position_ids, position_embeddings=(cos, sin)
        )
        return out


class HostSyncLongRopeLlamaLayer(_LongRopeLlama):
    """Reads the sequence length to the host with ``.item()`` to choose the factors (the bug)."""

    def inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        seq_len = position_ids.max().item() + 1
        return self.long_inv_freq if seq_len > ORIGINAL_CONTEXT else self.short_inv_freq


class DeviceLongRopeLlamaLayer(_LongRopeLlama):
    """Chooses the factors on the device; padded positions are 0 (the engine's contract, declared with
    ``pad_values={"position_ids": 0}``), so the choice follows the real tokens."""

    def inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        long = position_ids.max() + 1 > ORIGINAL_CONTEXT
        return torch.where(long, self.long_inv_freq, self.short_inv_freq)


def position_inputs(device: str | torch.device = "cpu") -> Any:
    """``hidden_states (1, T, H)`` and ``position_ids (1, T)``: the layer makes its own rotary embeddings."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, Any]:
        return {
            "hidden_states": torch.randn(1, num_tokens, HIDDEN, device=device),
            "position_ids": torch.arange(num_tokens, device=device)[None],
        }

    return make_inputs


# -- (5) a Python step counter ----------------------------------------------------------
def _block_output(out: Any) -> torch.Tensor:
    """GPT2Block returns a tensor in transformers 5, a tuple ``(hidden_states, ...)`` in 4.x."""
    return out[0] if isinstance(out, tuple) else out


class PythonStepGPT2Block(GPT2Block):
    """Scales the block's update by ``step ** -0.5``, counting steps in a Python int (the bug)."""

    def __init__(self) -> None:
        super().__init__(gpt2_config(), layer_idx=0)
        self.step = 0
        self.eval()

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.step += 1
        update = _block_output(super().forward(hidden_states, **kwargs)) - hidden_states
        return hidden_states + update * self.step**-0.5


class BufferStepGPT2Block(GPT2Block):
    """The same schedule with the step in a registered buffer, advanced in place."""

    def __init__(self) -> None:
        super().__init__(gpt2_config(), layer_idx=0)
        self.register_buffer("step", torch.zeros(()))
        self.eval()

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.step.add_(1)
        update = _block_output(super().forward(hidden_states, **kwargs)) - hidden_states
        return hidden_states + update * self.step.rsqrt()
