"""Tensor-parallel layers the way serving engines shard them (Megatron's pattern).

Each rank builds its module with ``build_xxx(rank, world_size)``: every rank
creates the FULL weights from the same seed and keeps its shard, so the
sharded model computes what the unsharded one does (``reference_xxx()``),
up to the order of the sums. The layers talk through plain
``torch.distributed`` calls on the default group:

- ``TPMLP``: a column-parallel ``Linear`` (each rank holds ``hidden /
  world_size`` of the hidden units), GELU, a row-parallel ``Linear`` (each
  rank multiplies its slice of the hidden units) and a ``dist.all_reduce``
  summing the partial outputs. The bias of the row-parallel layer is added
  once, after the sum.
- ``TPAttention``: causal self-attention over the batch's flat tokens,
  sharded by heads: each rank holds ``heads / world_size`` heads of the q, k,
  v projections and the matching columns of the output projection, then
  ``dist.all_reduce``. Causal attention is padding-safe here because padded
  rows come after the real ones: a real row attends only to rows before it.

The outputs are replicated: after the all-reduce every rank holds the same
tensor. The builders and ``make_inputs`` are top-level functions, so they
pickle into the processes ``verify_distributed`` spawns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

D = 16
HIDDEN = 32
HEADS = 4
SEED = 0


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU (gloo)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    """A flat batch of ``num_tokens`` hidden states (from the global generator,
    which the harness seeds identically on every rank: the batch is replicated)."""
    return {"x": torch.randn(num_tokens, D).to(device())}


def _shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    if t.shape[dim] % world_size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over {world_size} ranks")
    return t.chunk(world_size, dim=dim)[rank].clone()


# ---------------------------------------------------------------------------
# MLP


class ReferenceMLP(nn.Module):
    """The unsharded MLP: ``down(gelu(up(x)))``."""

    def __init__(self, d: int = D, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def reference_mlp() -> ReferenceMLP:
    """The unsharded MLP, built from the seed every rank builds its shard from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return ReferenceMLP()


class TPMLP(nn.Module):
    """Column-parallel up, GELU, row-parallel down, then ``dist.all_reduce``."""

    def __init__(self, full: ReferenceMLP, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        hidden, d = full.down.weight.shape[1], full.down.weight.shape[0]
        shard = hidden // world_size
        self.up = nn.Linear(d, shard)
        self.down = nn.Linear(shard, d, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(_shard(full.up.weight, 0, rank, world_size))
            self.up.bias.copy_(_shard(full.up.bias, 0, rank, world_size))
            self.down.weight.copy_(_shard(full.down.weight, 1, rank, world_size))
        # The row-parallel bias is added once, after the sum (adding it on
        # every rank before the sum would count it world_size times).
        self.bias = nn.Parameter(full.down.bias.detach().clone())

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce."""
        return self.down(F.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        dist.all_reduce(y)
        return y + self.bias


def build_tp_mlp(rank: int, world_size: int) -> TPMLP:
    """This rank's shard of ``reference_mlp()``, on this rank's device."""
    return TPMLP(reference_mlp(), rank, world_size).to(device())


# ---------------------------------------------------------------------------
# Attention


class ReferenceAttention(nn.Module):
    """Unsharded causal self-attention over the flat token dimension."""

    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.out = nn.Linear(d, d)

    def attend(self, x: torch.Tensor, q: nn.Linear, k: nn.Linear, v: nn.Linear, heads: int) -> torch.Tensor:
        t = x.shape[0]
        head_dim = q.weight.shape[0] // heads

        def split(y: torch.Tensor) -> torch.Tensor:  # (T, heads * hd) -> (heads, T, hd)
            return y.view(t, heads, head_dim).transpose(0, 1)

        # Causal over the batch's rows: padded rows come last, so no real row
        # ever reads one.
        o = F.scaled_dot_product_attention(split(q(x)), split(k(x)), split(v(x)), is_causal=True)
        return o.transpose(0, 1).reshape(t, heads * head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attend(x, self.q, self.k, self.v, self.heads))


def reference_attention() -> ReferenceAttention:
    """The unsharded attention, built from the seed every rank builds its shard from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return ReferenceAttention()


class TPAttention(ReferenceAttention):
    """Causal self-attention sharded by heads, then ``dist.all_reduce``.

    Each rank holds ``heads / world_size`` heads of q, k and v (rows of the
    projections) and the matching columns of the output projection; the
    partial outputs are summed across ranks and the output bias added once.
    """

    def __init__(self, full: ReferenceAttention, rank: int, world_size: int) -> None:
        super().__init__()
        if full.heads % world_size:
            raise ValueError(f"{full.heads} heads do not split over {world_size} ranks")
        self.rank, self.world_size = rank, world_size
        self.heads = full.heads // world_size
        d = full.out.weight.shape[0]
        local = full.q.weight.shape[0] // world_size
        self.q = nn.Linear(d, local, bias=False)
        self.k = nn.Linear(d, local, bias=False)
        self.v = nn.Linear(d, local, bias=False)
        self.out = nn.Linear(local, d, bias=False)
        with torch.no_grad():
            # Heads are contiguous blocks of head_dim rows: rank r's chunk
            # holds heads [r * heads / ws, (r + 1) * heads / ws).
            for name in ("q", "k", "v"):
                getattr(self, name).weight.copy_(_shard(getattr(full, name).weight, 0, rank, world_size))
            self.out.weight.copy_(_shard(full.out.weight, 1, rank, world_size))
        self.bias = nn.Parameter(full.out.bias.detach().clone())

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads' share of the output, before the all-reduce."""
        return self.out(self.attend(x, self.q, self.k, self.v, self.heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        dist.all_reduce(y)
        return y + self.bias


def build_tp_attention(rank: int, world_size: int) -> TPAttention:
    """This rank's heads of ``reference_attention()``, on this rank's device."""
    return TPAttention(reference_attention(), rank, world_size).to(device())


# ---------------------------------------------------------------------------
# A variant with the other collective: the all-gather


class TPMLPAllGather(TPMLP):
    """``TPMLP`` with the column-parallel output gathered instead of reduced.

    The up projection's shards are gathered with ``dist.all_gather`` (each
    rank then holds every hidden unit), and each rank runs the whole down
    projection: more traffic, same result, a second collective for the
    harness to capture.
    """

    def __init__(self, full: ReferenceMLP, rank: int, world_size: int) -> None:
        super().__init__(full, rank, world_size)
        self.full_down = nn.Linear(full.down.weight.shape[1], full.down.weight.shape[0])
        self.full_down.load_state_dict(full.down.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))  # (T, hidden / ws)
        shards = [torch.empty_like(h) for _ in range(self.world_size)]
        dist.all_gather(shards, h.contiguous())
        # Rank-major, as the shards were cut: (T, hidden).
        return self.full_down(torch.cat(shards, dim=1))


def build_tp_mlp_all_gather(rank: int, world_size: int) -> TPMLPAllGather:
    """``TPMLP`` whose hidden units are all-gathered, on this rank's device."""
    return TPMLPAllGather(reference_mlp(), rank, world_size).to(device())
