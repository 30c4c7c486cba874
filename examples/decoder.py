"""A tiny decoder-only transformer, run the way an inference engine runs it.

Tokens of all requests are flattened into one batch. Per token: ``input_ids``,
``positions`` (within its request), ``slot_mapping`` (where its key and value
go in the KV cache) and ``token_req`` (its request's row). Per request:
``req_base`` (its first cache slot), ``seq_lens`` (context after this step) and
``query_start_loc`` (prefix sums of its tokens in the batch, one more row than
requests). The KV cache is a buffer written in place at the slot indices;
padded tokens are sent to ``PAD_SLOT``, a slot no request ever reads.
Attention is causal within each request, reading the request's cached context
up to each token's position; padded tokens are masked through ``is_padding``.

The forward returns per-token logits and the logits of each request's last
token (what a sampler reads).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64
D = 32
HEADS = 2
MAX_REQS = 8
MAX_CTX = 64  # cache slots per request
NUM_SLOTS = MAX_REQS * MAX_CTX
PAD_SLOT = NUM_SLOTS  # the extra last slot: written by padded tokens, never read


class Attention(nn.Module):
    """Writes this step's keys and values into the KV cache, then attends.

    The piece an engine keeps out of PIECEWISE graphs (its kernels take
    per-batch metadata): the decoder's tests run it eagerly between graph
    segments there (``eager_submodules=[Attention]``), while FULL graphs
    capture it with the rest.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(NUM_SLOTS + 1, D))
        self.register_buffer("v_cache", torch.zeros(NUM_SLOTS + 1, D))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        context: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        t = q.shape[0]
        # In place: a graph replays the same writes at the same slots' addresses.
        self.k_cache.index_copy_(0, slot_mapping, k)
        self.v_cache.index_copy_(0, slot_mapping, v)
        keys = self.k_cache[context].view(t, MAX_CTX, HEADS, D // HEADS).transpose(1, 2)
        values = self.v_cache[context].view(t, MAX_CTX, HEADS, D // HEADS).transpose(1, 2)
        query = q.reshape(t, HEADS, 1, D // HEADS)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[:, None, None, :])
        return attn.reshape(t, D)


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.attn = Attention()
        self.out = nn.Linear(D, D, bias=False)
        self.norm2 = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        h = h + self.out(self.attn(q, k, v, slot_mapping, context, visible))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class TinyDecoder(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(MAX_CTX, D)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.register_buffer("ctx_offsets", torch.arange(MAX_CTX))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        token_req: torch.Tensor,
        req_base: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        is_padding: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        # Padded rows may hold anything: zero them before they meet real rows.
        h = torch.where(is_padding[:, None], 0.0, self.embed(input_ids) + self.pos(positions))
        # Each token reads its request's cache slots, up to its own position
        # (causal) and within the request's context.
        context = req_base[token_req][:, None] + self.ctx_offsets[None, :]
        visible = (self.ctx_offsets[None, :] <= positions[:, None]) & (
            self.ctx_offsets[None, :] < seq_lens[token_req][:, None]
        )
        for layer in self.layers:
            h = layer(h, positions, slot_mapping, context, visible)
        logits = self.lm_head(self.norm(h))
        last = query_start_loc[1:] - 1
        return {"logits": logits, "sampled": logits[last]}


# Pad values: padded tokens write to the padding slot and read request 0 at
# position 0; padded requests repeat the batch's end in query_start_loc.
PAD_VALUES = {"slot_mapping": PAD_SLOT, "query_start_loc": "edge"}
#: Where padded rows may write: the padding slot of every layer's cache.
SCRATCH_STATE = {f"layers.{i}.attn.{name}": PAD_SLOT for i in range(2) for name in ("k_cache", "v_cache")}
#: What PIECEWISE graphs run eagerly between their segments.
EAGER_SUBMODULES = [Attention]


def make_inputs(
    num_tokens: int,
    num_reqs: int,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """A batch of ``num_reqs`` requests sharing ``num_tokens`` new tokens as evenly as possible.

    Each request already has some context in the cache; its new tokens follow it.
    """
    if num_tokens > num_reqs * MAX_CTX:
        raise ValueError(f"{num_tokens} tokens do not fit {num_reqs} requests of {MAX_CTX} slots")
    sizes = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
    positions, token_req, seq_lens = [], [], []
    for r, q in enumerate(sizes):
        start = int(torch.randint(0, MAX_CTX - q + 1, (1,), generator=generator))
        positions.append(torch.arange(start, start + q))
        token_req.append(torch.full((q,), r))
        seq_lens.append(start + q)
    pos = torch.cat(positions)
    req = torch.cat(token_req)
    # Request r owns cache slots [r * MAX_CTX, (r + 1) * MAX_CTX): requests
    # are laid out by batch row, as an engine's block table would place them.
    base = torch.arange(num_reqs) * MAX_CTX
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(sizes), 0)
    batch = {
        "input_ids": torch.randint(0, VOCAB, (num_tokens,), generator=generator),
        "positions": pos,
        "slot_mapping": base[req] + pos,
        "token_req": req,
        "req_base": base,
        "seq_lens": torch.tensor(seq_lens),
        "query_start_loc": qsl,
    }
    return {k: v.to(device) for k, v in batch.items()}
