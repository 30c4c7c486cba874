"""``verify_distributed``: a sharded module verified on every rank, and the ranks against each other."""

from __future__ import annotations

import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..checks.compare import first_difference
from ..checks.engine import check_keywords
from ..checks.report import Finding, Outcome, VerifyReport
from ..options import MAX_SECONDS, MAX_WORLD_SIZE
from ..plan.validate import UsageError, check_int
from .rank import RankResult, rank_main

__all__ = ["AGREEMENT_CHECK", "verify_distributed"]

#: The check that holds the ranks to each other (and names a rank that hangs).
AGREEMENT_CHECK = "rank_agreement"


def _check_picklable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"verify_distributed: {name} must be a function; got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"verify_distributed: {name} must be picklable, as each rank runs in a process of its own: a "
            f"function defined at the top level of an importable module (not a lambda or a closure); "
            f"pickling {fn!r} failed with {type(exc).__name__}: {exc}"
        ) from None


def _resolve_backend(backend: str, world_size: int) -> str:
    if backend not in ("auto", "cuda", "emulate"):
        raise ValueError(f"verify_distributed: backend must be 'auto', 'cuda' or 'emulate'; got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "cuda" if gpus >= world_size else "emulate"
    if backend == "cuda" and gpus < world_size:
        raise ValueError(
            f"verify_distributed: backend='cuda' runs one rank a GPU, and world_size={world_size} "
            f"needs {world_size} GPUs; {gpus} are visible. Use backend='emulate' (gloo on the CPU)"
        )
    return backend


def verify_distributed(
    build: Callable[[int, int], torch.nn.Module],
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    *,
    world_size: int,
    timeout: float = 120.0,
    backend: str = "auto",
    replicated: bool = True,
    devices: list[int] | None = None,
    **keywords: Any,
) -> VerifyReport:
    """Verify a tensor-parallel module on ``world_size`` ranks, and the ranks against each other.

    Each rank is a process of its own (started with torch.multiprocessing's
    spawn): it joins a process group (gloo for the emulator, NCCL on CUDA,
    one GPU a rank: ``devices[rank]``, else the rank's index), builds its
    shard with ``build(rank, world_size)`` and runs ``verify`` on it with
    ``keywords`` (``capture_sizes`` and the rest of ``verify``'s), from the
    same seed on every rank, so ``make_inputs`` gives every rank the same
    batches. ``build`` and ``make_inputs`` must be picklable (top-level
    functions of an importable module).

    The report merges the ranks: every outcome of every rank, with its
    ``rank``, and the ``rank_agreement`` check: for each real batch the
    ranks ran, the same descriptor served it on every rank (the same shape,
    so the same padding), and, with ``replicated=True``, its outputs are
    equal on every rank (what follows an all-reduce or an all-gather is).
    A rank that has not finished after ``timeout`` seconds is a hang: every
    rank is stopped, and ``rank_agreement`` fails naming each rank that did
    not finish and the collective it waits in.
    """
    check_int("verify_distributed: world_size", world_size, maximum=MAX_WORLD_SIZE)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_SECONDS:
        raise UsageError(
            f"verify_distributed: timeout must be a positive number of seconds up to {MAX_SECONDS:.0f}; got {timeout!r}"
        )
    if "capture_sizes" not in keywords and "config" not in keywords:
        raise UsageError("verify_distributed: needs capture_sizes=[...] (or config=...), as verify() does")
    for name in ("device", "progress"):
        if name in keywords:
            raise TypeError(f"verify_distributed: {name} is chosen per rank by the harness; do not pass it")
    # What each rank's verify() would refuse, refused here once, before any process starts.
    rest = {k: v for k, v in keywords.items() if k not in ("config", "options")}
    check_keywords(keywords.get("config"), keywords.get("options"), rest, "verify_distributed")
    _check_picklable("build", build)
    _check_picklable("make_inputs", make_inputs)
    chosen = _resolve_backend(backend, world_size)
    if devices is not None and len(devices) < world_size:
        raise ValueError(
            f"verify_distributed: devices={devices} has fewer than world_size={world_size} entries"
        )
    with tempfile.TemporaryDirectory(prefix="cudagraph-ranks-") as folder:
        results, hung = _launch(
            world_size, Path(folder), chosen, build, make_inputs, keywords, devices, timeout
        )
    return _merged(results, hung, world_size, chosen, replicated, timeout)


def _launch(
    world_size: int,
    folder: Path,
    backend: str,
    build: Any,
    make_inputs: Any,
    keywords: dict[str, Any],
    devices: list[int] | None,
    timeout: float,
) -> tuple[dict[int, RankResult], dict[int, str]]:
    """Run the ranks: (what each rank wrote, {rank: why it has no result} for the others)."""
    from torch.multiprocessing.spawn import start_processes

    init_file = str(folder / "rendezvous")
    # The children start from scratch (spawn): they find the test's modules on the parent's path.
    context = start_processes(  # type: ignore[no-untyped-call]
        rank_main,
        args=(
            world_size,
            init_file,
            str(folder),
            backend,
            build,
            make_inputs,
            keywords,
            devices,
            list(sys.path),
        ),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    processes = context.processes

    def waiting() -> bool:  # a rank alive without a result (finished ranks wait for the release)
        return any(p.is_alive() and not (folder / f"rank{r}.pkl").exists() for r, p in enumerate(processes))

    while time.monotonic() < deadline and waiting():
        time.sleep(0.1)
    missing: dict[int, str] = {}
    results: dict[int, RankResult] = {}
    for rank, process in enumerate(processes):
        path = folder / f"rank{rank}.pkl"
        where_file = folder / f"rank{rank}.where"
        where = where_file.read_text() if where_file.exists() else ""
        if path.exists():
            results[rank] = pickle.loads(path.read_bytes())
        elif process.is_alive():
            missing[rank] = (
                f"rank {rank} still running after {timeout:g} s, "
                f"{where or 'before its first collective'}{_async_note(where, backend)}"
            )
        else:
            code = process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            missing[rank] = (
                f"rank {rank} ended ({how}) without a report, "
                f"{where or 'before its first collective'} (its stderr says why)"
            )
    (folder / "release").write_text("")
    if missing:  # a rank in a collective never returns from it: stop them all
        for process in processes:
            if process.is_alive():
                process.kill()
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)
    return results, missing


def _async_note(where: str, backend: str) -> str:
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


def _merged(
    results: dict[int, RankResult],
    hung: dict[int, str],
    world_size: int,
    backend: str,
    replicated: bool,
    timeout: float,
) -> VerifyReport:
    first = next((r.report for r in results.values() if r.report is not None), None)
    report = VerifyReport(
        module=first.module if first is not None else "the sharded module",
        backend=backend,
        device=f"{world_size} ranks ({'gloo, cpu' if backend == 'emulate' else 'nccl, one GPU a rank'})",
        mode=first.mode if first is not None else "",
        exhaustive=first.exhaustive if first is not None else True,
        checks=(*(first.checks if first is not None else ()), AGREEMENT_CHECK),
        descriptors=first.descriptors if first is not None else (),
        planned=first.planned if first is not None else 0,
        config=first.config if first is not None else {},
        training=first.training if first is not None else None,
    )
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
        report.add(
            [
                Outcome(
                    AGREEMENT_CHECK,
                    None,
                    False,
                    f"{what}: {'; '.join(hung[r] for r in sorted(hung))}"
                    f"{f' (finished: ranks {finished})' if finished else ''}. A collective one rank issues and another "
                    "does not (a branch on the rank, a different graph or padding per rank) waits forever, or fails "
                    "on mismatched sizes",
                    Finding(),
                    rank=min(hung),
                )
            ]
        )
    else:
        report.add([_agreement(results, replicated)])
    report.add(per_rank)
    return report


def _agreement(results: dict[int, RankResult], replicated: bool) -> Outcome:
    """Every rank ran the same real batches with the same descriptors, and (replicated) equal outputs."""
    ranks = sorted(r for r, res in results.items() if res.seen is not None)
    if len(ranks) < 2:
        return Outcome(AGREEMENT_CHECK, None, True, "one rank: nothing to agree on", skipped=True)
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
                    return _disagree(
                        rank,
                        ranks[0],
                        i,
                        f"outputs that must be replicated differ ({where}: "
                        f"{diff.reason}): a Python branch on the rank, or a collective missing on one "
                        "rank's path (replicated=False if these outputs are sharded)",
                        shape,
                        diff,
                    )
    return Outcome(AGREEMENT_CHECK, None, True, figures={"ranks": len(ranks), "batches": len(base)})


def _disagree(
    rank: int, base: int, index: int, what: str, shape: dict[str, int], diff: Any = None
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
        f"rank {rank} disagrees with rank {base} at real batch {index + 1} of the run: {what}",
        finding,
        rank=rank,
    )
