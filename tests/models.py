"""Small modules the manager tests capture: correct ones and buggy twins."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pytest_cudagraph import current_descriptor


def assert_matches_unpadded(got: torch.Tensor, expected: torch.Tensor) -> None:
    """A graph padded to more rows than the batch against eager on the batch: two programs (another
    GEMM tiling), so equal within the dtype's rounding, never bit for bit (MKL takes other kernels
    below 4 rows on AMD CPUs; bf16 GEMMs round by row count on GPUs)."""
    torch.testing.assert_close(got, expected)


class MLP(nn.Module):
    """A residual MLP block: the smallest realistic case."""

    def __init__(self, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(F.gelu(self.up(x))))


def mlp_inputs(d: int = 32, *, device: str | torch.device = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, d, generator=gen).to(device)}

    return make_inputs


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(0, 1).reshape(t, d))


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP over a flat token batch.

    Tokens attend causally within their own request; padded tokens are never
    attended to (``is_padding``), so real rows do not depend on padding.
    """

    def __init__(self, d: int = 32, heads: int = 4, max_pos: int = 1024) -> None:
        super().__init__()
        self.pos = nn.Embedding(max_pos, d)
        self.norm1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = MLP(d, 2 * d)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor, is_padding: torch.Tensor
    ) -> torch.Tensor:
        # Padded rows may hold anything (NaN included): zero them before they
        # meet real rows, since a masked attention weight of 0 times NaN is NaN.
        h = torch.where(is_padding[:, None], 0.0, x + self.pos(positions))
        same_req = req_ids[:, None] == req_ids[None, :]
        causal = positions[:, None] >= positions[None, :]
        mask = same_req & causal & ~is_padding[None, :]
        # A padded query row may see no key at all; let it see itself so the
        # softmax stays finite (its output is cut off anyway).
        mask = mask | torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
        h = h + self.attn(self.norm1(h), mask)
        return self.mlp(self.norm2(h))


def block_inputs(d: int = 32, *, device: str | torch.device = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        # Split tokens over requests as evenly as possible.
        sizes = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        req_ids = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(sizes))
        positions = torch.cat([torch.arange(s) for s in sizes])
        return {
            "x": torch.randn(num_tokens, d, generator=gen).to(device),
            "positions": positions.to(device),
            "req_ids": req_ids.to(device),
        }

    return make_inputs


class RequestHead(nn.Module):
    """Per-token hidden states plus a per-request output (sampled rows)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(
        self, x: torch.Tensor, last_token: torch.Tensor, query_start_loc: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        h = self.proj(x)
        return {
            "hidden": h,
            "logits": h[last_token] * 2.0,
            "lens": query_start_loc[1:] - query_start_loc[:-1],
        }


def request_inputs(d: int = 16, *, device: str | torch.device = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        sizes = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(torch.tensor(sizes), 0)
        return {
            "x": torch.randn(num_tokens, d, generator=gen).to(device),
            "last_token": (qsl[1:] - 1).to(device),
            "query_start_loc": qsl.to(device),
        }

    return make_inputs


class Counter(nn.Module):
    """Mutates a buffer in place on every forward (graph-safe)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x)


class PythonScale(nn.Module):
    """Reads a Python float: frozen into the graph at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class Noisy(nn.Module):
    """Draws random numbers inside the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x)


class LoraLike(nn.Module):
    """Specialises on the LoRA case of the descriptor being captured."""

    def __init__(self, d: int = 8, adapters: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a = nn.Parameter(torch.randn(adapters, d, 2) * 0.1)
        self.b = nn.Parameter(torch.randn(adapters, 2, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        desc = current_descriptor()
        n = desc.num_active_loras if desc is not None else 0
        y = self.base(x)
        for i in range(n):  # Python loop frozen per LoRA case: by design
            y = y + x @ self.a[i] @ self.b[i]
        return y


class HostSync(nn.Module):
    """Switchable bug: ``kind`` picks an op a graph cannot hold."""

    def __init__(self, kind: str | None) -> None:
        super().__init__()
        self.kind = kind
        self.inner = Inner(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Inner(nn.Module):
    def __init__(self, owner: HostSync) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self._owner = [owner]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        kind = self._owner[0].kind
        if kind == "item":
            return y * y.sum().item()
        if kind == "bool":
            return y if (y.sum() > 0) else -y
        if kind == "nonzero":
            return y[: y.nonzero().shape[0] % 2 + 1].sum(0, keepdim=True).expand_as(y)
        if kind == "mask":
            return y + y[y > 0].sum()
        if kind == "tolist":
            return y * float(len(y.tolist()))
        if kind == "cpu":
            return y + y.cpu().to(y.device)
        if kind == "repeat_interleave":
            reps = torch.ones(y.shape[0], dtype=torch.int64, device=y.device)
            return torch.repeat_interleave(y, reps, dim=0)
        return y


def bf16_llama(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int | None = None,
) -> nn.Module:
    """A ``LlamaForCausalLM`` of this shape with weights drawn from seed 0, in bf16, in eval mode (the
    suite's Llama at small size; transformers is imported here, for suites that skip without it)."""
    import transformers

    torch.manual_seed(0)
    extra = {"max_position_embeddings": max_positions} if max_positions is not None else {}
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
