"""What one rank does, however its process came to be: build its shard, verify it, say where it is.

The same on ranks the harness spawns (``spawn.py``) and on ranks a launcher started
(``launcher.py``); only how the process group comes to be and how the ranks hear from each other
differ. A rank:

- says where it is: "in NAME" while it is in a collective, "after NAME" once it returned ("" before
  its first), kept up to date by wrappers around ``torch.distributed``'s collectives and the
  emulator's replay of them, and written where its peers (or the spawning parent) read it; what a
  hang is named by;
- records what its peers are held to (``Seen``: for each real batch the manager ran, its shape,
  the descriptor that served it and the outputs; a data-parallel training step records its
  weights and gradients the same way);
- runs its work (``verify`` of ``build(rank, world_size)``, or a training step's verification)
  and keeps the report, or the exception that stopped it (``RankResult``).
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .. import peers

__all__ = [
    "COLLECTIVES",
    "RankResult",
    "RankStopped",
    "RankWork",
    "Seen",
    "VerifyWork",
    "Where",
    "portable",
    "recording",
    "run_rank",
    "watching",
]

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
    """One real batch (or one training step) as a rank ran it."""

    num_tokens: int
    num_reqs: int
    descriptor: str  # the label of the descriptor that served it
    output: Any  # on the CPU
    #: What it is, where not a real batch ("the weights after step 2 at FULL-T4-R4"), and why ranks
    #: that differ in it are wrong ("" for a real batch's outputs: a branch on the rank, say).
    what: str = ""
    cause: str = ""


@dataclass
class RankResult:
    rank: int
    report: Any = None  # VerifyReport
    seen: list[Seen] | None = None
    error: str | None = None  # the traceback that stopped the rank


class RankStopped(BaseException):
    """Raised into a rank's main thread by the harness when the rank is past its time: a
    ``BaseException``, so that no check's ``except Exception`` takes it for the check's failure."""


class Where:
    """Where a rank is, told to ``write`` (a file the parent reads, or a key of the ranks' store)."""

    def __init__(self, write: Callable[[str], object], agreement: Any = None) -> None:
        self.write = write
        self.depth = 0
        self.now = ""
        #: Holds each collective to the peers' before it runs (an ``agree.Agreement``; None: not held).
        self.agreement: Any = None
        if agreement is not None:
            self.hold(agreement)
        write("")

    def hold(self, agreement: Any) -> None:
        """Hold this rank's collectives to its peers' through ``agreement``, which says here what
        the rank waits for."""
        self.agreement = agreement
        agreement.say = self._say

    @contextlib.contextmanager
    def inside(self, name: str, held: Callable[[], object] | None = None) -> Iterator[None]:
        """``in NAME`` while the collective runs, ``after NAME`` once it returned; ``held``: what holds
        it to the peers' first (the rank waits for them to issue it too, not yet in it)."""
        self.depth += 1
        entered = False
        try:
            if self.depth == 1:
                if held is not None:  # it says what it waits for, in full (``Agreement.before``)
                    with _unseen():
                        held()
                self._say(f"in {name}{self._context()}")
            entered = True
            yield
        finally:
            self.depth -= 1
            if self.depth == 0 and entered:  # one held back by its peers never ran: it says so still
                self._say(f"after {name}{self._context()}")

    def forward_started(self) -> None:
        """A forward (or a replay) of the step began: counted by the agreement, and said, for a rank
        that stops in it before its first collective there."""
        agreement = self.agreement
        if agreement is None or peers.alone_now():  # a forward run alone is no forward of the step
            return
        agreement.forward_started()
        if self.depth == 0:
            self._say(
                f"in its forward {agreement.forwards} of {agreement.step_name}, before a collective of it"
            )

    def _context(self) -> str:
        """Which step of the verification and which forward of it, where the collectives are held."""
        agreement = self.agreement
        if agreement is None or not agreement.steps:
            return ""
        return f" ({agreement.step_name}, its forward {agreement.forwards})"

    def _say(self, text: str) -> None:
        self.now = text
        with contextlib.suppress(Exception):  # a store gone with its host: the verdict says so
            self.write(text)


#: The ``Where`` of the verification running in this process (None between verifications).
_current: list[Where] = []


def _unseen() -> contextlib.AbstractContextManager[None]:
    """The harness's own work around a collective (reading its tensors' shapes and dtypes, holding it
    to the peers', answering it alone) hidden from torch function modes: it is no call of the user's,
    and a mode that records a forward's calls (``checks.divergence``: where two runs part) would name
    it at the user's line of the collective, the first frame outside torch and this package."""
    import torch

    return torch._C.DisableTorchFunction()


def _install_watch() -> None:
    """Wrap ``torch.distributed``'s collectives once per process; each wrapper tells the current
    ``Where`` (if any) that the rank is in it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from ..backends import emulate

    if getattr(dist, "_cudagraph_watched", False):
        return

    def watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _current:
                return original(*args, **kwargs)
            if peers.alone_now():  # a failure's diagnosis on this rank alone: no peer issues it
                with _unseen():
                    return _alone(name, args, kwargs)
            where = _current[-1]
            with _unseen():
                first = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape")), None)
                shape = f" of {tuple(first.shape)}" if first is not None else ""
            agreement = where.agreement
            held = functools.partial(agreement.before, name, args, kwargs) if agreement is not None else None
            with where.inside(f"{name}{shape}", held):
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

    # The emulator's replay issues the captured collectives again, below dist.*: each is held to the
    # peers' as an eager one is, and a replay counts as a forward of its step.
    @contextlib.contextmanager
    def replayed(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[bool]:
        if not _current or peers.alone_now():
            yield peers.alone_now()
            return
        where = _current[-1]
        short = op.split(".")[1] if op.count(".") >= 1 else op
        agreement = where.agreement
        held = (
            functools.partial(agreement.before, f"{short} (replayed)", args, kwargs)
            if agreement is not None
            else None
        )
        with where.inside(f"{op} (replayed)", held):
            yield False

    def replay_started() -> None:
        if _current:
            _current[-1].forward_started()

    emulate.collective_watch = replayed
    emulate.replay_started = replay_started
    dist._cudagraph_watched = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def watching(where: Where) -> Iterator[Where]:
    """The collectives this process issues while the block runs are told to ``where``."""
    _install_watch()
    _current.append(where)
    agreement = where.agreement
    try:
        with peers.joined(agreement) if agreement is not None else contextlib.nullcontext():
            yield where
    finally:
        _current.remove(where)
        if agreement is not None:
            with contextlib.suppress(Exception):  # a store gone with its host: the verdict says so
                agreement.close()


@contextlib.contextmanager
def recording(seen: list[Seen]) -> Iterator[list[Seen]]:
    """Every real batch a ``GraphManager`` runs while the block runs: its shape, the descriptor
    serving it, its outputs (on the CPU)."""
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
    try:
        yield seen
    finally:
        GraphManager.run_batch = original  # type: ignore[method-assign]


#: What a rank runs: ``work(rank, world_size, device, seen) -> VerifyReport``, appending to
#: ``seen`` what the ranks are held to each other by. Picklable (a spawned rank receives it).
RankWork = Callable[[int, int, Any, list[Seen]], Any]


@dataclass(frozen=True)
class VerifyWork:
    """``verify`` of ``build(rank, world_size)`` with ``keywords``: the work of ``verify_distributed``."""

    build: Callable[..., Any]
    make_inputs: Callable[[int, int], Mapping[str, Any]]
    keywords: Mapping[str, Any]

    def __call__(self, rank: int, world_size: int, device: Any, seen: list[Seen]) -> Any:
        import torch

        from ..checks import verify

        seed = int(self.keywords.get("seed", 0))
        torch.manual_seed(seed)
        module = self.build(rank, world_size)
        if isinstance(module, torch.nn.Module):
            # Which forward a collective belongs to: what the ranks' collectives are held to.
            module.register_forward_pre_hook(_forward_started)
            module.register_forward_hook(_forward_ended, always_call=True)
        # Every rank draws the same inputs: the same seed, the same sequence of calls.
        torch.manual_seed(seed)
        with recording(seen):
            return verify(
                module,
                self.make_inputs,
                backend=_backend(device),
                device=device,
                progress=False,
                **self.keywords,
            )


def _alone(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A collective answered by this rank as if it were the only one (``peers.alone``): a reduction or
    a broadcast leaves its tensor as it is (the sum of one shard), a gather fills every place with
    this rank's tensor; any other is not answered."""
    tensors = [a for a in (*args, *kwargs.values()) if hasattr(a, "shape") or isinstance(a, list)]
    if name in ("all_reduce", "reduce", "broadcast", "barrier"):
        pass
    elif name == "all_gather" and len(tensors) >= 2 and isinstance(tensors[0], list):
        for out in tensors[0]:
            out.copy_(tensors[1])
    elif name == "all_gather_into_tensor" and len(tensors) >= 2:
        out, mine = tensors[0], tensors[1]
        out.copy_(mine.repeat(out.shape[0] // max(mine.shape[0], 1), *([1] * (mine.dim() - 1))))
    else:
        raise RuntimeError(
            f"{name} cannot be answered by one rank alone, as a failure's diagnosis on one rank needs: "
            "the failure stands undiagnosed"
        )
    if kwargs.get("async_op"):
        return _Done()
    return None


class _Done:
    """The work of a collective answered alone: complete."""

    def wait(self, *_: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _forward_started(*_: Any) -> None:
    if _current:
        _current[-1].forward_started()


def _forward_ended(*_: Any) -> None:
    # An always-called hook: torch runs it inside its ``except`` when the forward raised.
    import sys

    exc = sys.exc_info()[1]
    if exc is not None and _current and _current[-1].agreement is not None:
        _current[-1].agreement.forward_raised(exc)


def _backend(device: Any) -> str:
    return "cuda" if str(device).startswith("cuda") else "emulate"


def run_rank(rank: int, world_size: int, device: Any, work: RankWork) -> RankResult:
    """The rank's work, its report and records, or the exception that stopped it, told in words."""
    result = RankResult(rank)
    seen: list[Seen] = []
    try:
        result.report = work(rank, world_size, device, seen)
        result.seen = seen
    except (ValueError, TypeError) as exc:  # a usage error (make_inputs, keywords): its message says it all
        result.error = f"{type(exc).__name__}: {exc}"
    except RankStopped as exc:
        result.error = str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException:
        result.error = traceback.format_exc()
    return result


def portable(result: RankResult) -> bytes:
    """``result`` pickled; a finding holding something unpicklable travels as its words."""
    import pickle

    try:
        return pickle.dumps(result)
    except Exception:
        for outcome in getattr(result.report, "outcomes", []):
            finding = outcome.finding
            if finding is not None:
                finding.got, finding.expected = repr(finding.got), repr(finding.expected)
        return pickle.dumps(result)
