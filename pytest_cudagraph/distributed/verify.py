"""``verify_distributed``: a sharded module verified on every rank, and the ranks against each other.

The ranks are those a launcher started (torchrun, srun, a group the suite made: ``launcher.py``),
each running its own share where it stands, or, without one, processes spawned here
(``spawn.py``); ``on_ranks`` runs any rank's work either way and merges the reports
(``merge.py``), for ``verify_distributed`` and for training across data-parallel ranks.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..checks.arguments import check_keywords
from ..checks.report import VerifyReport
from ..options import MAX_SECONDS, MAX_WORLD_SIZE
from ..plan.validate import UsageError, check_int
from ..references import normalized, registered
from . import launcher
from .merge import AGREEMENT_CHECK, merged
from .rank import RankWork, Seen, VerifyWork, recording
from .spawn import launch

__all__ = ["AGREEMENT_CHECK", "across_launched_ranks", "on_ranks", "verify_distributed"]


def _check_picklable(name: str, fn: Any, where: str = "verify_distributed") -> None:
    if not callable(fn):
        raise TypeError(f"{where}: {name} must be a function; got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{where}: {name} must be picklable, as each rank runs in a process of its own: a "
            f"function defined at the top level of an importable module (not a lambda or a closure); "
            f"pickling {fn!r} failed with {type(exc).__name__}: {exc}"
        ) from None


def _resolve_backend(backend: str, world_size: int, where: str = "verify_distributed") -> str:
    if backend not in ("auto", "cuda", "emulate"):
        raise ValueError(f"{where}: backend must be 'auto', 'cuda' or 'emulate'; got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "cuda" if gpus >= world_size else "emulate"
    if backend == "cuda" and gpus < world_size:
        raise ValueError(
            f"{where}: backend='cuda' runs one rank a GPU, and world_size={world_size} "
            f"needs {world_size} GPUs; {gpus} are visible. Use backend='emulate' (gloo on the CPU)"
        )
    return backend


def on_ranks(
    work: RankWork,
    *,
    world_size: int | None,
    timeout: float,
    backend: str,
    replicated: bool,
    devices: list[int] | None,
    where: str,
    picklable: dict[str, Any],
) -> VerifyReport:
    """``work`` on every rank, the reports merged: on the launcher's ranks where a launcher started
    this process (``world_size`` None: as many as it started), else on ``world_size`` spawned ones
    (``picklable``: what a spawned rank receives, checked by name first)."""
    if world_size is not None:
        check_int(f"{where}: world_size", world_size, maximum=MAX_WORLD_SIZE)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_SECONDS:
        raise UsageError(
            f"{where}: timeout must be a positive number of seconds up to {MAX_SECONDS:.0f}; got {timeout!r}"
        )
    ranks = launcher.current(float(timeout))
    if ranks is not None:
        if world_size is not None and world_size != ranks.world_size:
            raise ValueError(
                f"{where}: world_size={world_size}, but {ranks.started_by or 'the launcher'} started "
                f"{ranks.world_size} ranks: the verification runs on the ranks that exist (leave world_size out)"
            )
        chosen = _resolve_backend(backend, 1, where)
        results, hung = ranks.run(launcher.next_label(ranks), work, float(timeout), chosen)
        return merged(results, hung, ranks.world_size, chosen, replicated, ranks.started_by)
    if world_size is None:
        raise ValueError(
            f"{where}: needs world_size=N: no launcher started this process (no RANK and WORLD_SIZE, no srun "
            "step of several tasks, no process group), so the harness spawns the ranks itself"
        )
    for name, fn in picklable.items():
        _check_picklable(name, fn, where)
    chosen = _resolve_backend(backend, world_size, where)
    if devices is not None and len(devices) < world_size:
        raise ValueError(f"{where}: devices={devices} has fewer than world_size={world_size} entries")
    with tempfile.TemporaryDirectory(prefix="cudagraph-ranks-") as folder:
        results, hung = launch(world_size, Path(folder), chosen, work, devices, float(timeout))
    return merged(results, hung, world_size, chosen, replicated)


def verify_distributed(
    build: Callable[[int, int], torch.nn.Module],
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    *,
    world_size: int | None = None,
    timeout: float = 120.0,
    backend: str = "auto",
    replicated: bool = True,
    devices: list[int] | None = None,
    **keywords: Any,
) -> VerifyReport:
    """Verify a tensor-parallel module on ``world_size`` ranks, and the ranks against each other.

    Under a launcher (torchrun, srun, a process group the suite made) the
    ranks are the processes it started: each runs its own share here, on
    its ``LOCAL_RANK``'s GPU on CUDA, and ``world_size`` (if given) must be
    theirs. Otherwise each rank is a process of its own (started with
    torch.multiprocessing's spawn): it joins a process group (gloo for the emulator, NCCL on CUDA,
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
    if "capture_sizes" not in keywords and "config" not in keywords:
        raise UsageError("verify_distributed: needs capture_sizes=[...] (or config=...), as verify() does")
    for name in ("device", "progress"):
        if name in keywords:
            raise TypeError(f"verify_distributed: {name} is chosen per rank by the harness; do not pass it")
    # What each rank's verify() would refuse, refused here once, before any rank starts.
    rest = {k: v for k, v in keywords.items() if k not in ("config", "options")}
    check_keywords(keywords.get("config"), keywords.get("options"), rest, "verify_distributed")
    # The suite's registered references (a conftest's) with the call's: the spawned ranks import no
    # conftest. Ops travel by name, Python functions by reference (picklable where top-level).
    refs = normalized(keywords.get("references")).merged_over(registered())
    if refs:
        keywords = {**keywords, "references": refs}
    return on_ranks(
        VerifyWork(build, make_inputs, keywords),
        world_size=world_size,
        timeout=timeout,
        backend=backend,
        replicated=replicated,
        devices=devices,
        where="verify_distributed",
        picklable={"build": build, "make_inputs": make_inputs},
    )


def across_launched_ranks(
    verification: Callable[[], VerifyReport], *, timeout: float, backend: str, replicated: bool = False
) -> VerifyReport:
    """A verification this process runs on a module it holds (``cudagraph_verify`` of a module the
    test built), run on every rank a launcher started at once and merged, so that every rank ends
    the test with the same verdict: the same real batches served by the same descriptors on every
    rank, and (``replicated``) equal outputs."""

    def work(rank: int, world_size: int, device: Any, seen: list[Seen]) -> VerifyReport:
        with recording(seen):
            return verification()

    return on_ranks(
        work,
        world_size=None,
        timeout=timeout,
        backend=backend,
        replicated=replicated,
        devices=None,
        where="a verification on the launcher's ranks",
        picklable={},
    )
