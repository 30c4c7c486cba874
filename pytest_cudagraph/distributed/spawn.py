"""Ranks the harness starts itself: one process a rank (torch.multiprocessing's spawn), one host.

The ranks join a process group through a file in a folder of the run's own, and tell the parent
everything through files there, so that the parent reads what every rank did even when one of
them never returns:

- ``rank{r}.where``: where the rank is (``rank.Where``);
- ``rank{r}.pkl``: its ``RankResult`` (the report and its records, or the exception that stopped it).

The parent waits until every rank wrote its result or the timeout passed; a rank without a result
is named with where it was, and every rank is stopped.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from .merge import still_running
from .rank import RankResult, RankWork, Where, portable, run_rank, watching

__all__ = ["launch", "rank_main"]


def rank_main(
    rank: int,
    world_size: int,
    folder: str,
    backend: str,
    work: RankWork,
    devices: list[int] | None,
    sys_path: list[str],
) -> None:
    """One spawned rank: the process group (through a file), the work, its result in a file."""
    sys.path[:] = sys_path
    out = Path(folder)
    where_path = out / f"rank{rank}.where"
    where = Where(where_path.write_text)
    result = RankResult(rank)
    try:
        import torch
        import torch.distributed as dist

        device: Any = "cpu"
        if backend == "cuda":
            index = devices[rank] if devices else rank
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        dist.init_process_group(
            "nccl" if backend == "cuda" else "gloo",
            init_method=f"file://{out / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
        )
        from torch.distributed import PrefixStore  # type: ignore[attr-defined]
        from torch.distributed.distributed_c10d import _get_default_store

        from .agree import Agreement

        where.hold(
            Agreement(
                PrefixStore("pytest-cudagraph-ops/", _get_default_store()),
                rank,
                world_size,
                lambda r: _ended(out, r),
            )
        )
        with watching(where):
            result = run_rank(rank, world_size, device, work)
    except BaseException as exc:  # joining the group failed: the rank says so
        result.error = f"{type(exc).__name__}: {exc}"
    _write(out / f"rank{rank}.pkl", result)
    # A finished rank keeps its end of the group open until the parent says
    # every rank is done (or gives up): a peer still in a collective then
    # waits, and is reported as waiting there, instead of failing on a
    # connection this rank closed.
    release = out / "release"
    while not release.exists():
        time.sleep(0.05)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: a peer that hangs must not hold this rank


def _ended(folder: Path, rank: int) -> bool | str:
    """Whether spawned rank ``rank`` ended its work: True where it wrote its result, why where its
    process ended without one (the parent says so in ``rank{r}.ended``), False while it works."""
    if (folder / f"rank{rank}.pkl").exists():
        return True
    ended = folder / f"rank{rank}.ended"
    return ended.read_text() if ended.exists() else False


def launch(
    world_size: int,
    folder: Path,
    backend: str,
    work: RankWork,
    devices: list[int] | None,
    timeout: float,
) -> tuple[dict[int, RankResult], dict[int, str]]:
    """Run the ranks: (what each rank wrote, {rank: why it has no result} for the others)."""
    from torch.multiprocessing.spawn import start_processes

    # The children start from scratch (spawn): they find the test's modules on the parent's path.
    context = start_processes(  # type: ignore[no-untyped-call]
        rank_main,
        args=(world_size, str(folder), backend, work, devices, list(sys.path)),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    processes = context.processes

    def waiting() -> bool:  # a rank alive without a result (finished ranks wait for the release)
        for r, p in enumerate(processes):
            ended = folder / f"rank{r}.ended"
            if not p.is_alive() and not (folder / f"rank{r}.pkl").exists() and not ended.exists():
                # Its peers, waiting for it at a collective, learn at once that it never comes.
                ended.write_text(f"ended ({_how(p.exitcode)}): its process is gone")
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
            missing[rank] = still_running(rank, timeout, where, backend)
        else:
            missing[rank] = (
                f"rank {rank} ended ({_how(process.exitcode)}) without a report, "
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


def _how(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _write(path: Path, result: RankResult) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(portable(result))
    tmp.replace(path)
