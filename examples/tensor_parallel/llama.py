"""A Llama-shaped decoder sharded tensor-parallel, as serving engines shard it.

``TPLlama(shape, rank, world_size)`` is one rank's shard: token embedding and
LM head replicated; in each layer the attention sharded by heads (the q, k and
v projections column-parallel, each rank holding ``heads / world_size`` query
heads and ``kv_heads / world_size`` key-value heads, grouped-query attention
with rotary positions), the output projection row-parallel and one
``dist.all_reduce`` after it; the MLP's gate and up projections
column-parallel, its down projection row-parallel and one ``dist.all_reduce``
after it; RMSNorms replicated. ``TPLlama(shape, None, world_size)`` is the
unsharded reference: the same weights whole, and no collective.

The weights are random and made shard by shard: each shard of each matrix
from a seed of its own (its name and its index among ``world_size`` shards),
so a rank makes only its own shards (an 8B shape never exists whole on one
rank) and the reference concatenates them all. Attention runs over the
batch's flat tokens, causal: padded rows come after the real ones, so no real
row reads one.

``SMALL`` is the CPU suite's shape (gloo); ``LLAMA3_8B`` is Llama-3-8B's (32
layers, hidden 4096, 32 query heads and 8 key-value heads, intermediate 14336,
vocabulary 128256), for two GPUs in bf16.

Two bugs of sharding, in the last layer's MLP, for the checks to catch at any
shape (``bug=``):

- ``"residual_before_sum"``: every rank adds the residual to its partial sum
  before the all-reduce, so the sum counts it ``world_size`` times. The ranks
  agree; the unsharded reference does not.
- ``"rank_branch"``: rank 1 leaves the residual out after the all-reduce. Each
  rank's graphs match its own eager forward; the replicated outputs differ
  (``rank_agreement``).
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .tp import device


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SMALL = LlamaShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128)
LLAMA3_8B = LlamaShape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
SHAPES = {"small": SMALL, "8B": LLAMA3_8B}
BUGS = ("", "residual_before_sum", "rank_branch")


def _chunk(name: str, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """One shard's weights, from a seed of its own (std 0.02, as Llama's initialiser)."""
    gen = torch.Generator(dev)
    gen.manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen, device=dev) * 0.02).to(dtype)


def _weight(
    name: str,
    rows: int,
    cols: int,
    split: int | None,
    rank: int | None,
    world_size: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> nn.Parameter:
    """Matrix ``name`` (rows x cols) split along dimension ``split`` into ``world_size`` shards:
    rank ``rank``'s shard, or (rank None) every shard concatenated. ``split`` None: replicated."""
    if split is None:
        return nn.Parameter(_chunk(name, (rows, cols), dtype, dev), requires_grad=False)
    size = (rows, cols)[split]
    if size % world_size:
        raise ValueError(f"{name}: dimension {split} of size {size} does not split over {world_size} ranks")
    shard = (rows // world_size, cols) if split == 0 else (rows, cols // world_size)
    ranks = range(world_size) if rank is None else [rank]
    parts = [_chunk(f"{name}/{r}of{world_size}", shard, dtype, dev) for r in ranks]
    return nn.Parameter(torch.cat(parts, dim=split), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, dev: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=dev), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layer(nn.Module):
    """One decoder layer's shard (see the module's docstring)."""

    def __init__(
        self,
        s: LlamaShape,
        i: int,
        rank: int | None,
        ws: int,
        dtype: torch.dtype,
        dev: torch.device,
        bug: str = "",
    ) -> None:
        super().__init__()
        self.shape, self.sharded = s, rank is not None and ws > 1
        self.rank, self.bug = rank, bug
        self.heads = s.heads // ws if rank is not None else s.heads
        self.kv_heads = s.kv_heads // ws if rank is not None else s.kv_heads
        if s.heads % ws or s.kv_heads % ws:
            raise ValueError(f"{s.heads} query and {s.kv_heads} key-value heads do not split over {ws} ranks")
        w = functools.partial(_weight, rank=rank, world_size=ws, dtype=dtype, dev=dev)
        hd, kv = s.head_dim, s.kv_heads * s.head_dim
        self.q = w(f"layer{i}.q", s.hidden, s.hidden, 0)  # stored (out, in), as nn.Linear stores
        self.k = w(f"layer{i}.k", kv, s.hidden, 0)
        self.v = w(f"layer{i}.v", kv, s.hidden, 0)
        self.o = w(f"layer{i}.o", s.hidden, s.hidden, 1)
        self.gate = w(f"layer{i}.gate", s.intermediate, s.hidden, 0)
        self.up = w(f"layer{i}.up", s.intermediate, s.hidden, 0)
        self.down = w(f"layer{i}.down", s.hidden, s.intermediate, 1)
        self.norm1 = RMSNorm(s.hidden, s.eps, dtype, dev)
        self.norm2 = RMSNorm(s.hidden, s.eps, dtype, dev)
        self.head_dim = hd

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums, summed over the ranks."""
        if self.sharded:
            dist.all_reduce(y)
        return y

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        h = self.norm1(x)
        q = F.linear(h, self.q).view(t, self.heads, hd).transpose(0, 1)
        k = F.linear(h, self.k).view(t, self.kv_heads, hd).transpose(0, 1)
        v = F.linear(h, self.v).view(t, self.kv_heads, hd).transpose(0, 1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self._reduced(F.linear(a.transpose(0, 1).reshape(t, self.heads * hd), self.o))
        h = self.norm2(x)
        m = F.silu(F.linear(h, self.gate)) * F.linear(h, self.up)
        if self.bug == "residual_before_sum":
            return self._reduced(x + F.linear(m, self.down))
        if self.bug == "rank_branch" and self.rank == 1:
            return self._reduced(F.linear(m, self.down))
        return x + self._reduced(F.linear(m, self.down))


class TPLlama(nn.Module):
    """Rank ``rank``'s shard of a Llama-shaped decoder over ``world_size`` ranks (rank None: the
    unsharded reference); logits of every token, replicated on every rank."""

    def __init__(
        self,
        shape: LlamaShape,
        rank: int | None,
        world_size: int,
        dtype: torch.dtype = torch.float32,
        dev: torch.device | None = None,
        bug: str = "",
    ) -> None:
        super().__init__()
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {BUGS}; got {bug!r}")
        dev = dev if dev is not None else device()
        self.shape = shape
        self.embed = _weight("embed", shape.vocab, shape.hidden, None, rank, world_size, dtype, dev)
        last = shape.layers - 1
        self.layers = nn.ModuleList(
            Layer(shape, i, rank, world_size, dtype, dev, bug if i == last else "")
            for i in range(shape.layers)
        )
        self.norm = RMSNorm(shape.hidden, shape.eps, dtype, dev)
        self.head = _weight("head", shape.vocab, shape.hidden, None, rank, world_size, dtype, dev)
        hd = shape.head_dim
        freqs = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        self.freqs: torch.Tensor
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        # Positions of the flat batch: row i at position i (padded rows come last).
        angles = torch.outer(
            torch.arange(input_ids.shape[0], device=x.device, dtype=torch.float32), self.freqs
        )
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(x.dtype)
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.linear(self.norm(x), self.head)


def make_inputs(num_tokens: int, num_reqs: int, *, vocab: int = SMALL.vocab) -> dict[str, torch.Tensor]:
    """A flat batch of token ids (from the global generator, which the harness seeds identically
    on every rank: the batch is replicated)."""
    return {"input_ids": torch.randint(1, vocab, (num_tokens,)).to(device())}


def build(
    rank: int, world_size: int, *, shape: str = "small", dtype: str = "float32", bug: str = ""
) -> TPLlama:
    """This rank's shard of ``SHAPES[shape]`` in ``dtype``, with ``bug`` (picklable with
    functools.partial)."""
    return TPLlama(SHAPES[shape], rank, world_size, getattr(torch, dtype), bug=bug)
