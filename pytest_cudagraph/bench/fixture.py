"""What ``cudagraph_benchmark`` does: one pytest-benchmark entry per descriptor and kind.

For a module and ``make_inputs`` it captures every descriptor, then times
eager, ``GraphManager.run()`` and bare replay for each (CUDA events on the
GPU). Each of those becomes an entry in pytest-benchmark's session, grouped
per module, with ``extra_info`` holding the descriptor, padding, speedup over
eager and graph memory, so ``--benchmark-json``, ``--benchmark-compare`` and
``--benchmark-compare-fail`` work as users know them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from .. import faults
from ..errors import CaptureError, EagerFailure, InternalError
from ..guard.tracker import raised_at
from ..manager import GraphManager
from ..options import capture_config
from ..plan import CaptureConfig, GraphMode
from ..plan.validate import UsageError, check_int, check_keywords
from .measure import DescriptorBench, measure_manager
from .memory import estimate_full_graph_memory, estimate_pool_replica
from .timing import Timing

__all__ = ["KINDS", "MAX_CALLS", "MAX_ROUNDS", "BenchmarkRunner"]

KINDS = ("eager", "run", "replay")
#: The most rounds (and warm-up calls) a benchmark takes, and calls a round: beyond them a count is
#: a typo (10**12) that would time for ever.
MAX_ROUNDS = 10_000
MAX_CALLS = 100_000
#: The runner's own keywords, beside ``CaptureConfig``'s.
_OWN = ("rounds", "calls_per_round", "warmup", "pad_values")


class BenchmarkRunner:
    """``cudagraph_benchmark(module, make_inputs, *, capture_sizes, ...) -> list[DescriptorBench]``."""

    def __init__(
        self,
        node: pytest.Item,
        session: Any,
        *,
        backend: str,
        device: torch.device | None,
        record: Callable[[dict[str, Any]], None],
    ) -> None:
        self._node = node
        self._session = session  # pytest-benchmark's BenchmarkSession
        self._backend = backend
        self._device = device
        self._record = record

    def __call__(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        *,
        rounds: int = 30,
        calls_per_round: int = 20,
        warmup: int = 10,
        pad_values: Mapping[str, Any] | None = None,
        **config: Any,
    ) -> list[DescriptorBench] | None:
        check_keywords(config, (*_OWN, *CaptureConfig.field_names()), "cudagraph_benchmark")
        if self._session is None:
            raise UsageError("cudagraph_benchmark needs pytest-benchmark (pip install pytest-benchmark)")
        check_int("rounds", rounds, maximum=MAX_ROUNDS)
        check_int("calls_per_round", calls_per_round, maximum=MAX_CALLS)
        check_int("warmup", warmup, minimum=0, maximum=MAX_ROUNDS)
        if "capture_sizes" not in config:
            raise UsageError("cudagraph_benchmark needs capture_sizes: the token counts to capture and time")
        manager = GraphManager(
            module.eval() if isinstance(module, torch.nn.Module) else module,
            make_inputs,
            capture_config(None, config),
            backend=self._backend,
            device=self._device,
            pad_values=pad_values,
            measure_device_memory=True,
        )
        try:
            try:
                manager.capture()
            except CaptureError as exc:
                _forward_raises(manager, exc)  # the module's own exception, told in one line
                raise
            if self._session.disabled:
                # As pytest-benchmark does under xdist or --benchmark-disable:
                # run once, so the test still proves the graphs run, and time nothing.
                warnings.warn(
                    "cudagraph_benchmark: benchmarks are disabled (pytest-benchmark under xdist, or "
                    "--benchmark-disable); each graph ran once and nothing was timed",
                    pytest.PytestWarning,
                    stacklevel=2,
                )
                untimed = measure_manager(manager, rounds=1, calls_per_round=1, warmup=0)
                # Still a row per descriptor for the Markdown report (merged from
                # xdist workers): descriptor, padding and graph memory, no times.
                full = [d for d in manager.captured_descriptors if d.mode is GraphMode.FULL]
                memory = {
                    "full_graphs": len(full),
                    "full_graph_memory_measured_bytes": sum(manager.device_memory[d] for d in full),
                    "full_graph_memory_estimate_bytes": None,
                    "full_graph_memory_replica_estimate_bytes": None,
                }
                for bench in untimed:
                    row = bench.row()
                    row.update(
                        eager_s=None,
                        run_s=None,
                        replay_s=None,
                        speedup=None,
                        replay_speedup=None,
                        timed=False,
                        test=self._node.nodeid,
                        module=type(module).__name__,
                        backend=manager.backend,
                        device=str(manager.device),
                        **memory,
                    )
                    self._record(row)
                return None
            results = measure_manager(manager, rounds=rounds, calls_per_round=calls_per_round, warmup=warmup)
            # vLLM's estimate of all FULL graphs from the two largest, beside
            # what capturing all of them measured (device-wide).
            full = [d for d in manager.captured_descriptors if d.mode is GraphMode.FULL]
            measured = sum(manager.device_memory[d] for d in full)
            estimate = estimate_full_graph_memory(manager, measured=measured) if full else None
            # Ours: the largest graph captured, the others' pool use replayed eagerly.
            replica = (
                estimate_pool_replica(manager, measured=measured)
                if full and manager.backend == "cuda"
                else None
            )
        finally:
            manager.release()
        group = type(module).__name__
        memory = {
            "full_graphs": len(full),
            "full_graph_memory_measured_bytes": measured,
            "full_graph_memory_estimate_bytes": estimate.estimate if estimate is not None else None,
            "full_graph_memory_replica_estimate_bytes": replica.estimate if replica is not None else None,
        }
        for bench in results:
            bench.extra.update(memory)
            self._add(group, bench)
            row = bench.row()
            row.update(
                test=self._node.nodeid,
                module=group,
                backend=manager.backend,
                device=str(manager.device),
                **memory,
            )
            self._record(row)
        return results

    def _add(self, group: str, bench: DescriptorBench) -> None:
        from pytest_benchmark.fixture import BenchmarkFixture

        session = self._session
        label = bench.descriptor.label()
        info = {
            "descriptor": label,
            "tokens": bench.descriptor.num_tokens,
            "real_tokens": bench.batch.num_tokens,
            "padding": bench.padding,
            "graph_memory_bytes": bench.graph_memory,
            "emulated": bench.emulated,
            # No speedup claims from the emulator: its times are the CPU's.
            "speedup_over_eager": bench.speedup,
            "replay_speedup_over_eager": bench.replay_speedup,
            **bench.extra,
        }
        timings: dict[str, Timing] = {"eager": bench.eager, "run": bench.run, "replay": bench.replay}
        for kind in KINDS:
            fixture = BenchmarkFixture(  # type: ignore[no-untyped-call]
                self._node,
                add_stats=session.benchmarks.append,
                logger=session.logger,
                warner=self._node.warn,
                disabled=session.disabled,
                **dict(session.options, group=group),
            )
            fixture.name = f"{self._node.name}[{kind}-{label}]"
            fixture.fullname = f"{self._node.nodeid}[{kind}-{label}]"
            fixture.extra_info.update(info, kind=kind)
            timing = timings[kind]
            stats = fixture._make_stats(timing.per_round_calls)  # type: ignore[no-untyped-call]
            for seconds in timing.rounds:
                stats.update(seconds * timing.per_round_calls)


def _forward_raises(manager: GraphManager, failed: CaptureError) -> None:
    """An ``EagerFailure`` when the capture of ``failed.descriptor`` failed because the module's forward
    raises there eagerly too (run again once, as ``manager.eager``): the user's exception and the line
    of their code it left, in one line. Nothing when the capture failed at an op a graph cannot hold,
    or the eager forward runs: then it is the capture that failed, told by ``failed`` itself."""
    desc = failed.descriptor
    if failed.op is not None or desc is None:
        return
    reqs = manager.capture_reqs(desc)
    try:
        manager.eager(**manager.make_inputs(desc.num_tokens, reqs))
    except Exception as exc:
        if faults.is_sticky(exc):
            raise  # the CUDA context is gone: told as such, not as the module's exception
        InternalError.raise_if_in(exc)  # the harness's own bookkeeping failed: never the module's
        site = raised_at(exc)
        said = (faults.described(exc, manager.device).strip().splitlines() or [type(exc).__name__])[0]
        raise EagerFailure(
            f"{type(manager.module).__name__}'s forward raises{f' at {site}' if site else ''}, eagerly at "
            f"(num_tokens={desc.num_tokens}, num_reqs={reqs}), before anything is captured: {said}. Nothing can "
            f"be captured or timed; run module(**make_inputs({desc.num_tokens}, {reqs})) eagerly to see it"
        ) from exc
