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
  hangs or reads the wrong bytes, and gloo stops a rank ("Received data size
  doesn't match expected size"). Caught by ``rank_agreement``, naming the
  rank and the ``all_reduce`` it was in.
- ``SkippedCollective`` (twin: ``TPMLP``): rank 1 skips the all-reduce on
  batches of more than ``SKIP_ABOVE`` rows, as a fast path (``if num_tokens
  > N: skip the reduce, another layer will``) taken on one rank only. Rank 0
  waits in ``all_reduce`` for a peer that never comes: on NCCL a hang, which
  the harness's timeout names; on gloo rank 1's next all-reduce (of a smaller
  batch) pairs with rank 0's, and the size mismatch stops rank 1 inside it.
  Caught by ``rank_agreement``, naming the rank and the ``all_reduce``.
- ``RankBranch`` (twin: ``TPMLP``): the row-parallel bias is added by rank 0
  only, after the all-reduce (the author meant "add it once" but put the
  rank test on the wrong side of the sum). Each rank's graph matches its own
  eager forward, so every other check passes; the outputs that must be
  replicated differ across ranks. Caught by ``rank_agreement`` on rank 1.

``verify_distributed(..., world_size=2, capture_sizes=[1, 2, 4],
backend="emulate")`` prints (2026-11-30 20:33 UTC, torch 2.13.0+cpu, two
gloo ranks on the CPU; first lines of each report):

    RankBranch on emulate (2 ranks (gloo, cpu)) in train mode: 3/3 descriptors captured and verified (every descriptor), 38 real batches, 1 failure(s) in rank_agreement, 4 skipped; capture 18 ms, graph memory 2.0 KiB
    FAIL rank_agreement         module rank 1
         rank 1 disagrees with rank 0 at real batch 1 of the run: outputs that must be replicated differ (the output: values differ): a Python branch on the rank, or a collective missing on one rank's path (replicated=False if these outputs are sharded); rank 1 gave -0.2307678461074829, rank 0 gave -0.08559766411781311

    SkippedCollective on emulate (2 ranks (gloo, cpu)) in train mode: 0/3 descriptors captured and verified (every descriptor), 0 real batches, 4 failure(s) in capture_safety, rank_agreement, 27 skipped; capture 0 ms, graph memory 0 B
    FAIL rank_agreement         module rank 1
         ranks ended without a report: rank 1 ended (killed by signal 6) without a report, in all_reduce of (2, 16) (its stderr says why) (finished: ranks [0]). A collective one rank issues and another does not (a branch on the rank, a different graph or padding per rank) waits forever, or fails on mismatched sizes

    RankDependentPadding on emulate (2 ranks (gloo, cpu)) in train mode: 0/3 descriptors captured and verified (every descriptor), 0 real batches, 4 failure(s) in capture_safety, rank_agreement, 27 skipped; capture 0 ms, graph memory 0 B
    FAIL rank_agreement         module rank 0
         ranks ended without a report: rank 0 ended (killed by signal 6) without a report, in all_reduce of (4, 16) (its stderr says why) (finished: ranks [1]). A collective one rank issues and another does not (a branch on the rank, a different graph or padding per rank) waits forever, or fails on mismatched sizes

(The other rank's capture_safety failures that follow, "Connection reset by
peer" in its collectives, are the consequence: its peer is gone.)
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
