"""The ranks' reports made one, in one place for ranks spawned and ranks a launcher started.

``merged``: every outcome of every rank, with its ``rank`` (shown as ``FULL-T4-R4 rank 1``), and
``rank_agreement`` first: a rank that did not finish (named with where it was), or, when every rank
finished, whether they ran the same real batches with the same descriptors and (replicated) equal
outputs.
"""

from __future__ import annotations

from typing import Any

from ..checks.compare import first_difference
from ..checks.report import Finding, Outcome, VerifyReport
from .rank import RankResult

__all__ = ["AGREEMENT_CHECK", "agreement", "async_note", "merged", "still_running"]

#: The check that holds the ranks to each other (and names a rank that hangs).
AGREEMENT_CHECK = "rank_agreement"


def async_note(where: str, backend: str) -> str:
    """Why a rank stuck on NCCL is "after" its collective, not "in" it."""
    if backend != "cuda" or not where.startswith("after "):
        return ""
    # NCCL queues a collective on the GPU and returns to Python at once (so
    # does a graph replay holding one): the host then blocks on the first
    # thing that waits for the GPU, while the GPU waits in that collective or
    # an earlier one whose peer never came.
    return (
        " (NCCL returns before a collective completes: the rank waits on the GPU, in this collective or an "
        "earlier one)"
    )


def merged(
    results: dict[int, RankResult],
    hung: dict[int, str],
    world_size: int,
    backend: str,
    replicated: bool,
    started_by: str = "",
) -> VerifyReport:
    """One report of the ranks' (``hung``: the ranks without a result, each with why, in words).
    ``started_by``: who started the ranks, said with the device ("torchrun", say; "" for spawn)."""
    group = "gloo, cpu" if backend == "emulate" else "nccl, one GPU a rank"
    by = f"; {started_by}" if started_by else ""
    first = next((r.report for r in results.values() if r.report is not None), None)
    report = VerifyReport(
        module=first.module if first is not None else "the sharded module",
        backend=backend,
        device=f"{world_size} ranks ({group}{by})",
        mode=first.mode if first is not None else "",
        exhaustive=first.exhaustive if first is not None else True,
        checks=(*(first.checks if first is not None else ()), AGREEMENT_CHECK),
        descriptors=first.descriptors if first is not None else (),
        planned=first.planned if first is not None else 0,
        config=first.config if first is not None else {},
        training=first.training if first is not None else None,
        kind=first.kind if first is not None else "manager",
    )
    if first is not None:
        report.notes.extend(first.notes)
    for rank in sorted(results):
        result = results[rank]
        if result.error is not None:
            report.add(
                [
                    Outcome(
                        AGREEMENT_CHECK,
                        None,
                        False,
                        f"rank {rank} stopped: {result.error.strip()}",
                        rank=rank,
                    )
                ]
            )
            continue
        for outcome in result.report.outcomes:
            outcome.rank = rank
            report.add([outcome])
        report.capture_seconds = max(report.capture_seconds, result.report.capture_seconds)
        report.check_seconds = max(report.check_seconds, result.report.check_seconds)
        report.real_batches += result.report.real_batches
        # Each rank's peak, and the largest as the report's: the rank that needs the most memory
        # decides whether the shards fit.
        report.rank_peak_memory[rank] = result.report.peak_memory
        if result.report.peak_memory >= report.peak_memory:
            report.peak_memory = result.report.peak_memory
            report.memory_at_start = result.report.memory_at_start
            report.memory_kind = result.report.memory_kind
        if rank == 0:  # one rank's pools stand for all: every rank captures the same descriptors
            report.graph_memory = dict(result.report.graph_memory)
    # The ranks' agreement first: when ranks disagree or stop, the failures of
    # the others (a peer's connection reset in their collectives) follow from it.
    per_rank, report.outcomes = report.outcomes, []
    if hung:
        finished = sorted(set(range(world_size)) - set(hung))
        stuck = any("still running" in why for why in hung.values())
        what = "hang" if stuck else "ranks ended without a report"
        own_code = any("not at a collective" in why for why in hung.values())
        report.add(
            [
                Outcome(
                    AGREEMENT_CHECK,
                    None,
                    False,
                    f"{what}: {'; '.join(hung[r] for r in sorted(hung))}"
                    f"{f' (finished: ranks {finished})' if finished else ''}. "
                    + (
                        "A rank whose own code does not return holds its peers at their next collective"
                        if own_code
                        else "A rank's process that ends stops the launch (the launcher ends every rank)"
                        if any("stopped answering" in why for why in hung.values())
                        else "A collective one rank issues and another does not (a branch on the rank, a different "
                        "graph or padding per rank) waits forever, or fails on mismatched sizes"
                    ),
                    Finding(),
                    rank=min(hung),
                )
            ]
        )
    else:
        report.add([agreement(results, replicated)])
    report.add(per_rank)
    return report


def agreement(results: dict[int, RankResult], replicated: bool) -> Outcome:
    """Every rank ran the same real batches with the same descriptors, and (replicated) equal outputs."""
    ranks = sorted(r for r, res in results.items() if res.seen is not None)
    if len(ranks) < 2:
        what = "one rank" if ranks else "no rank finished its work"
        return Outcome(AGREEMENT_CHECK, None, True, f"{what}: nothing to agree on", skipped=True)
    base = results[ranks[0]].seen or []
    for rank in ranks[1:]:
        other = results[rank].seen or []
        if len(other) != len(base):
            return Outcome(
                AGREEMENT_CHECK,
                None,
                False,
                f"rank {rank} ran {len(other)} real batches and rank {ranks[0]} {len(base)}: the ranks did "
                "not run the same steps",
                rank=rank,
            )
        for i, (a, b) in enumerate(zip(base, other, strict=True)):
            shape = {"num_tokens": a.num_tokens, "num_reqs": a.num_reqs}
            if (a.num_tokens, a.num_reqs) != (b.num_tokens, b.num_reqs):
                return _disagree(
                    rank,
                    ranks[0],
                    i,
                    f"batch shapes differ ({a.num_tokens} tokens, {a.num_reqs} "
                    f"requests on rank {ranks[0]}; {b.num_tokens}, {b.num_reqs} on rank {rank}): "
                    "make_inputs gives the ranks different batches",
                    shape,
                )
            if a.descriptor != b.descriptor:
                return _disagree(
                    rank,
                    ranks[0],
                    i,
                    f"rank {ranks[0]} served it with {a.descriptor} and rank {rank} "
                    f"with {b.descriptor}: the ranks pad to different sizes, so their collectives "
                    "carry mismatched tensors",
                    shape,
                )
            if replicated:
                diff = first_difference(b.output, a.output)
                if diff is not None:
                    where = diff.path or "the output"
                    cause = a.cause or (
                        "a Python branch on the rank, or a collective missing on one rank's path "
                        "(replicated=False if these outputs are sharded)"
                    )
                    return _disagree(
                        rank,
                        ranks[0],
                        i,
                        f"{'values' if a.cause else 'outputs'} that must be replicated differ ({where}: "
                        f"{diff.reason}): {cause}",
                        shape,
                        diff,
                        a.what,
                    )
    return Outcome(AGREEMENT_CHECK, None, True, figures={"ranks": len(ranks), "batches": len(base)})


def _disagree(
    rank: int, base: int, index: int, what: str, shape: dict[str, int], diff: Any = None, at: str = ""
) -> Outcome:
    finding = Finding(real_batch=shape)
    if diff is not None:
        # Rank against rank, not graph against eager: the values go in the message.
        if diff.got is not None or diff.expected is not None:
            what += f"; rank {rank} gave {diff.got!r}, rank {base} gave {diff.expected!r}"
        finding = Finding(
            output=diff.path, index=diff.index, real_batch=shape, max_abs=diff.max_abs, max_ulp=diff.max_ulp
        )
    return Outcome(
        AGREEMENT_CHECK,
        None,
        False,
        f"rank {rank} disagrees with rank {base} at {at or f'real batch {index + 1} of the run'}: {what}",
        finding,
        rank=rank,
    )


def still_running(rank: int, timeout: float, where: str, backend: str) -> str:
    """Why a rank has no result when the time ran out: where it was, and what that means."""
    said = f"rank {rank} still running after {timeout:g} s, {where or 'before its first collective'}"
    note = async_note(where, backend)
    if note or (
        where.startswith(("in ", "waiting for its peers")) and not where.startswith("in its forward")
    ):
        return said + note
    # Past its last collective (or before its first): its own code has not returned.
    return f"{said}, not at a collective: its own code runs or waits there (a loop, a sleep, a lock, a host-side wait)"
