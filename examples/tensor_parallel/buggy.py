"""Tensor-parallel bugs that one rank alone cannot show, each with its correct twin in ``tp.py``.

Every rank of a tensor-parallel group must run the same program on the same
batch: the same graph (descriptor), the same padding, the same collectives in
the same order. Each rank's graphs can match its own eager forward while the
group is broken:

- ``RankDependentPadding`` (twin: ``TPMLP`` with ``tp.make_inputs``): rank 1
  builds a batch of one more token than its peers, as a worker does that
  appends a speculative or bonus token the scheduler did not send to the
  others. Every graph of rank 1 then holds one more row than rank 0's graph
  of the same descriptor: its padded batch differs, and so does the tensor
  its all-reduce carries. Each rank alone is consistent; together, NCCL
  hangs or reads the wrong bytes, and gloo ends a rank ("Received data size
  doesn't match expected size"). Named before any rank enters the
  all-reduce: the ranks hold each collective to their peers' (issue #68).
- ``SkippedCollective`` (twin: ``TPMLP``): rank 1 skips the all-reduce on
  batches of more than ``SKIP_ABOVE`` rows, as a fast path (``if num_tokens
  > N: skip the reduce, another layer will``) taken on one rank only. Rank 0
  would wait in ``all_reduce`` for a peer that never comes (on NCCL a hang);
  named at the collective rank 1 skipped, before rank 0 enters it.
- ``RankBranch`` (twin: ``TPMLP``): the row-parallel bias is added by rank 0
  only, after the all-reduce (the author meant "add it once" but put the
  rank test on the wrong side of the sum). Each rank's graph matches its own
  eager forward, so every other check passes; the outputs that must be
  replicated differ across ranks. Caught by ``rank_agreement`` on rank 1.

``python -m examples.tensor_parallel.show`` prints (2026-12-05 21:10 UTC,
torch 2.13.0+cpu, two gloo ranks on the CPU; the first lines of each report):

    RankDependentPadding: ... 2 failure(s) in rank_agreement, 1 skipped
    FAIL rank_agreement         module rank 0
         rank 0 stopped: collectives differ between ranks at the 1st of learn: rank 0 issues all_reduce of (1, 16) float32 at examples/tensor_parallel/tp.py:104 in forward (the 1st collective of its forward 1); rank 1 issues all_reduce of (2, 16) float32 at examples/tensor_parallel/tp.py:104 in forward (the 1st collective of its forward 1): a collective given another shape or dtype on one rank (padding or sharding that depends on the rank). No rank entered it

    SkippedCollective: ... 2 failure(s) in rank_agreement, 1 skipped
    FAIL rank_agreement         module rank 0
         rank 0 stopped: collectives differ between ranks at the 2nd of learn: rank 0 issues all_reduce of (4, 16) float32 at examples/tensor_parallel/buggy.py:79 in forward (the 1st collective of its forward 2); rank 1 ended that step having issued 1: rank 1 ended a forward without issuing what rank 0 issues there: a collective one rank skips (a branch on the rank or on what only one rank holds). No rank entered it

    RankBranch on emulate (2 ranks (gloo, cpu)) in train mode: 3/3 descriptors captured and verified (every descriptor), 18 real batches, 1 failure(s) in rank_agreement, 4 skipped
    FAIL rank_agreement         module rank 1
         rank 1 disagrees with rank 0 at real batch 1 of the run: outputs that must be replicated differ (the output: values differ): a Python branch on the rank, or a collective missing on one rank's path (replicated=False if these outputs are sharded)

No process is ended by gloo, and the next verification runs on the same ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .tp import TPMLP, D, device, reference_mlp

#: Batches larger than this make rank 1 of ``SkippedCollective`` skip its reduce.
SKIP_ABOVE = 2


def make_inputs_rank_dependent(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    """``tp.make_inputs``, but rank 1 builds one token more than its peers."""
    extra = 1 if dist.is_initialized() and dist.get_rank() == 1 else 0
    return {"x": torch.randn(num_tokens + extra, D).to(device())}


class RankDependentPadding(TPMLP):
    """``TPMLP`` itself: the bug is in the batch rank 1 builds (``make_inputs_rank_dependent``)."""


def build_rank_dependent_padding(rank: int, world_size: int) -> RankDependentPadding:
    return RankDependentPadding(reference_mlp(), rank, world_size).to(device())


class SkippedCollective(TPMLP):
    """Rank 1 skips the all-reduce on batches of more than ``SKIP_ABOVE`` rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        # The bug: a rank-local shortcut. Rank 0 enters all_reduce and waits
        # for a peer that never comes.
        if not (self.rank == 1 and x.shape[0] > SKIP_ABOVE):
            dist.all_reduce(y)
        return y + self.bias


def build_skipped_collective(rank: int, world_size: int) -> SkippedCollective:
    return SkippedCollective(reference_mlp(), rank, world_size).to(device())


class RankBranch(TPMLP):
    """Adds the bias on rank 0 only, after the all-reduce: replicated outputs differ."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        dist.all_reduce(y)
        # The bug: "add the bias once" belongs before the sum (on one rank)
        # or after it (on every rank), not after it on one rank.
        if self.rank == 0:
            y = y + self.bias
        return y


def build_rank_branch(rank: int, world_size: int) -> RankBranch:
    return RankBranch(reference_mlp(), rank, world_size).to(device())
