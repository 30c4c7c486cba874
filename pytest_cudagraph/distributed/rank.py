"""What one rank's process does: join the group, build its shard, verify it, write what it saw.

Runs in a process the launcher started (``torch.multiprocessing``, spawn).
Everything it reports goes into files in the run's folder, so that the
parent can read what every rank did even when one of them never returns:

- ``rank{r}.where``: "in NAME" while the rank is in a collective, "after
  NAME" once it returned ("" before its first), kept
  up to date by wrappers around ``torch.distributed``'s collectives and the
  emulator's replay of them; what a hang is named by.
- ``rank{r}.pkl``: the rank's ``VerifyReport`` and its agreement records
  (``Seen``: for each real batch the manager ran, its shape, the descriptor
  that served it and the outputs), or the exception that stopped it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["COLLECTIVES", "RankResult", "Seen", "rank_main"]

#: The ``torch.distributed`` functions a module calls to communicate: each is
#: wrapped in a rank's process so that the rank says where it waits.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
)


@dataclass
class Seen:
    """One real batch as a rank's manager ran it."""

    num_tokens: int
    num_reqs: int
    descriptor: str  # the label of the descriptor that served it
    output: Any  # on the CPU


@dataclass
class RankResult:
    rank: int
    report: Any = None  # VerifyReport
    seen: list[Seen] | None = None
    error: str | None = None  # the traceback that stopped the rank


class _Where:
    """Writes the collective a rank is in to its ``.where`` file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.depth = 0

    @contextlib.contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """``in NAME`` while the collective runs, ``after NAME`` once it returned."""
        self.depth += 1
        if self.depth == 1:
            self.path.write_text(f"in {name}")
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.path.write_text(f"after {name}")


def _watch_collectives(where: _Where) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from ..backends import emulate

    def watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            first = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape")), None)
            shape = f" of {tuple(first.shape)}" if first is not None else ""
            with where.inside(f"{name}{shape}"):
                return original(*args, **kwargs)

        return wrapper

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue
        wrapper = watched(name, original)
        setattr(dist, name, wrapper)
        if getattr(distributed_c10d, name, None) is original:
            setattr(distributed_c10d, name, wrapper)
    # The emulator's replay issues the captured collectives again, below dist.*.
    emulate.collective_watch = lambda op: where.inside(f"{op} (replayed)")


def _record_batches(seen: list[Seen]) -> None:
    """Record every real batch the manager runs: its shape, the descriptor serving it, its outputs."""
    from ..checks.verify_context import clone_tree
    from ..manager import GraphManager, tree

    original = GraphManager.run_batch

    def run_batch(self: Any, inputs: Any, batch: Any = None, **keywords: Any) -> Any:
        out = original(self, inputs, batch, **keywords)
        b = batch if batch is not None else self.batch_of(inputs, **keywords)
        seen.append(
            Seen(
                b.num_tokens,
                b.num_reqs,
                self.dispatch_batch(b).label(),
                tree.tree_map(lambda t: t.detach().cpu() if hasattr(t, "detach") else t, clone_tree(out)),
            )
        )
        return out

    GraphManager.run_batch = run_batch  # type: ignore[method-assign]


def rank_main(
    rank: int,
    world_size: int,
    init_file: str,
    folder: str,
    backend: str,
    build: Callable[..., Any],
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    keywords: dict[str, Any],
    devices: list[int] | None,
    sys_path: list[str],
) -> None:
    """One rank: the process group, ``build(rank, world_size)``, ``verify`` with ``keywords``."""
    sys.path[:] = sys_path
    out = Path(folder)
    result = RankResult(rank)
    where = _Where(out / f"rank{rank}.where")
    where.path.write_text("")
    try:
        import torch
        import torch.distributed as dist

        from ..checks import verify

        device: Any = "cpu"
        if backend == "cuda":
            index = devices[rank] if devices else rank
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        dist.init_process_group(
            "nccl" if backend == "cuda" else "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
        )
        _watch_collectives(where)
        seen: list[Seen] = []
        _record_batches(seen)
        torch.manual_seed(int(keywords.get("seed", 0)))
        module = build(rank, world_size)
        # Every rank draws the same inputs: the same seed, the same sequence of calls.
        torch.manual_seed(int(keywords.get("seed", 0)))
        result.report = verify(
            module, make_inputs, backend=backend, device=device, progress=False, **keywords
        )
        result.seen = seen
    except (ValueError, TypeError) as exc:  # a usage error (make_inputs, keywords): its message says it all
        result.error = f"{type(exc).__name__}: {exc}"
    except BaseException:
        result.error = traceback.format_exc()
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


def _write(path: Path, result: RankResult) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        data = pickle.dumps(result)
    except Exception:  # a finding holding something unpicklable: the report's words still travel
        result.report = _plain_report(result.report)
        data = pickle.dumps(result)
    tmp.write_bytes(data)
    tmp.replace(path)


def _plain_report(report: Any) -> Any:
    for outcome in getattr(report, "outcomes", []):
        finding = outcome.finding
        if finding is not None:
            finding.got, finding.expected = repr(finding.got), repr(finding.expected)
    return report
