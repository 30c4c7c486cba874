"""A small Llama-like causal LM whose attention and norms run through kernels for half precision.

``TinyLM`` takes one sequence of ``num_tokens`` token ids (positions ``0 .. num_tokens - 1``):
embedding, then per layer RMSNorm -> q, k, v projections -> rotary -> causal attention -> output
projection, added back; RMSNorm -> a gated SiLU MLP, added back; a final RMSNorm and the LM head.
It returns the logits, (num_tokens, vocab). Padded tokens come after the real ones, so causal
attention keeps them from the real rows: a correct model computes the real rows the same at every
padded size, up to rounding.

Attention runs through the custom op ``kernels.attention`` (``attention="op"``: bfloat16 or float16
alone) or torch's SDPA (``"sdpa"``); the norms through the Triton ``kernels.rms_norm``
(``norm="triton"``: bfloat16 alone) or plain torch (``"torch"``). With the kernels the float64
reference of ``padded_size`` cannot run the model unless their references stand in for them.

Two errors on the padded sizes, off by default: at a token count that is a multiple of 8 (what
graphs captured at 8, 16, 24, 32 tokens run, serving smaller batches padded up), ``logit_error``
scales the logits by ``1 + logit_error`` and ``mlp_error`` scales the last layer's MLP output by
``1 + mlp_error``. With plain SDPA and torch norms ``padded_size`` catches either at 0.1 % in
float64. Through the kernels it cannot run the model, and ``real_batches``, holding the graph to
eager within bfloat16's rounding, lets either through even at 1 % (measured on the emulator,
capture sizes 1 to 32); the references put the float64 question back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from .kernels import attention, rms_norm, rms_norm_reference

__all__ = [
    "CAPTURE_SIZES",
    "EPS",
    "HEADS",
    "HIDDEN",
    "LAYERS",
    "MAX_NUM_REQS",
    "PADDED_EVERY",
    "VOCAB",
    "TinyLM",
    "build",
    "inputs",
    "make_inputs",
]

HIDDEN = 256
LAYERS = 4
VOCAB = 512
HEADS = 4
EPS = 1e-6
ROPE_BASE = 10000.0
#: The MLP's width, in hiddens.
MLP_RATIO = 2
#: The errors act at token counts that are multiples of this.
PADDED_EVERY = 8
#: What the tests capture: one sequence a batch, up to 32 tokens (make_inputs ignores num_reqs).
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32)
MAX_NUM_REQS = 32

ATTENTIONS = ("op", "sdpa")
NORMS = ("triton", "torch")


class RMSNorm(nn.Module):
    """RMSNorm through the Triton kernel (``norm="triton"``) or plain torch (``"torch"``)."""

    def __init__(self, hidden: int, norm: str) -> None:
        super().__init__()
        self.norm = norm
        # Not all ones: a weight the kernel must read right.
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm == "triton":
            return rms_norm(x, self.weight, EPS)
        return rms_norm_reference(x, self.weight, EPS)


def _rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (heads, tokens, head_dim) at ``positions`` (tokens,), the two halves
    rotated (Llama's ``rotate_half``). The angles in float32 (float64 in the raised reference),
    the rotation in ``x``'s dtype; a position's angles are the same at every batch size."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_BASE ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str) -> None:
        super().__init__()
        self.heads = heads
        self.attention = attention
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, hidden) -> (heads, tokens, head_dim), as the op takes it."""
        t, h = x.shape
        return x.view(t, self.heads, h // self.heads).transpose(0, 1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = _rotary(self._split(self.q_proj(x)), positions)
        k = _rotary(self._split(self.k_proj(x)), positions)
        v = self._split(self.v_proj(x))
        if self.attention == "op":
            out = attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(0, 1).reshape(x.shape))


class MLP(nn.Module):
    """Llama's gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, MLP_RATIO * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, MLP_RATIO * hidden, bias=False)
        self.down_proj = nn.Linear(MLP_RATIO * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str, norm: str, mlp_error: float = 0.0) -> None:
        super().__init__()
        self.input_norm = RMSNorm(hidden, norm)
        self.attn = Attention(hidden, heads, attention)
        self.post_attention_norm = RMSNorm(hidden, norm)
        self.mlp = MLP(hidden)
        #: The bug, ``TinyLM``'s last layer's alone: the MLP's output scaled by ``1 + mlp_error`` at
        #: token counts that are multiples of ``PADDED_EVERY``.
        self.mlp_error = mlp_error

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), positions)
        m = self.mlp(self.post_attention_norm(h))
        if self.mlp_error and h.shape[0] % PADDED_EVERY == 0:  # the bug: the padded size decides
            m = m * (1.0 + self.mlp_error)
        return h + m


class TinyLM(nn.Module):
    """A Llama-like causal LM over one sequence: ``forward(input_ids)`` -> logits (num_tokens, vocab).

    ``attention``: "op" (the custom op ``cgref::attention``, half precision alone) or "sdpa";
    ``norm``: "triton" (``kernels.rms_norm``, bfloat16 alone) or "torch". ``logit_error`` and
    ``mlp_error``: the errors on the padded sizes (the module's docstring), 0 for a correct model."""

    def __init__(
        self,
        hidden: int = HIDDEN,
        layers: int = LAYERS,
        vocab: int = VOCAB,
        heads: int = HEADS,
        attention: str = "op",
        norm: str = "triton",
        logit_error: float = 0.0,
        mlp_error: float = 0.0,
    ) -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention is one of {ATTENTIONS}, got {attention!r}")
        if norm not in NORMS:
            raise ValueError(f"norm is one of {NORMS}, got {norm!r}")
        if hidden % heads or (hidden // heads) % 2:
            raise ValueError(f"hidden ({hidden}) must split into {heads} heads of an even size (rotary)")
        self.logit_error = logit_error
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            Layer(hidden, heads, attention, norm, mlp_error if i == layers - 1 else 0.0)
            for i in range(layers)
        )
        self.norm = RMSNorm(hidden, norm)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        positions = torch.arange(n, device=input_ids.device)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, positions)
        logits = self.lm_head(self.norm(h))
        if self.logit_error and n % PADDED_EVERY == 0:  # the bug: the padded size decides
            logits = logits * (1.0 + self.logit_error)
        return logits


def inputs(
    device: torch.device | str = "cpu", vocab: int = VOCAB
) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """``make_inputs`` for ``TinyLM`` on ``device``: one sequence of ``num_tokens`` random ids, whatever
    ``num_reqs`` is (the batch is one request's prefill)."""

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, vocab, (num_tokens,), device=device)}

    return make_inputs


#: ``make_inputs`` on the CPU, for the default vocabulary.
make_inputs = inputs()


def build(dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", **kw: object) -> TinyLM:
    """``TinyLM(**kw)`` from seed 0, in ``dtype`` on ``device``, in eval mode."""
    torch.manual_seed(0)
    return TinyLM(**kw).to(device=device, dtype=dtype).eval()  # type: ignore[arg-type]
