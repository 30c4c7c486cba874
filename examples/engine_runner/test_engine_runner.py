"""An engine's own CUDA-graph runner held to the decoder's eager forward by ``verify_runner``.

The correct ``EngineRunner`` passes every check; each runner of ``buggy.py``
fails the check that names its bug, and its twin (``EngineRunner``, which
differs from it in that one method) passes. On the CPU the runner runs
eagerly on its static buffers, so every bug but ``SilentEagerRunner``'s shows
there; that one needs CUDA (``@pytest.mark.cuda``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import pytest_cudagraph
from examples.decoder import MAX_REQS, SCRATCH_STATE, TinyDecoder
from examples.engine_runner.buggy import (
    BUGS,
    LiveSlotPaddingRunner,
    SilentEagerRunner,
    SmallGraphRunner,
    StaleContextRunner,
    StaleTableRunner,
    ViewOutputRunner,
)
from examples.engine_runner.runner import EngineRunner, make_engine_inputs

# Tiny: real batches of 5 tokens down to 1 (5 is the eager fallback), one
# request per token, all within the decoder's MAX_REQS.
SIZES = [1, 2, 4]
#: Padded tokens may write the padding slot of every layer's KV cache, nothing else.
KEYWORDS: dict[str, Any] = {"capture_sizes": SIZES, "max_num_reqs": MAX_REQS, "scratch_state": SCRATCH_STATE}


def _setup(cls: type[EngineRunner], device: torch.device) -> tuple[EngineRunner, TinyDecoder, Any]:
    torch.manual_seed(0)
    module = TinyDecoder().to(device).eval()
    # Mid-run, as an engine verifies it: every request already has context in
    # the KV cache. In an all-zero cache a stray write of zeros (a masked
    # padded token's key, say) into a live slot would change nothing to see.
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name.endswith(("k_cache", "v_cache")):
                buf.normal_()
    return cls(module, SIZES, device=device), module, functools.partial(make_engine_inputs, device=device)


def _verify(cls: type[EngineRunner], device: torch.device | str = "cpu") -> pytest_cudagraph.VerifyReport:
    runner, module, make = _setup(cls, torch.device(device))
    return pytest_cudagraph.verify_runner(runner, module, make, **KEYWORDS)


def _failed(report: pytest_cudagraph.VerifyReport) -> set[str]:
    return {o.check for o in report.failures}


def test_engine_runner_passes_every_check_on_the_cpu() -> None:
    report = _verify(EngineRunner)
    assert report.ok, report.format()
    # Every check but graph_coverage ran; that one says it needs CUDA.
    assert {o.check for o in report.skips} == {"graph_coverage"}


def test_engine_runner_through_the_fixture(
    cudagraph_verify_runner: Any, cudagraph_device: torch.device
) -> None:
    runner, module, make = _setup(EngineRunner, cudagraph_device)
    report = cudagraph_verify_runner(runner, module, make, **KEYWORDS)
    assert report.ok


@pytest.mark.parametrize(
    "cls",
    [StaleTableRunner, LiveSlotPaddingRunner, StaleContextRunner, SmallGraphRunner, ViewOutputRunner],
    ids=lambda cls: cls.__name__,
)
def test_buggy_runner_fails_its_check_on_the_cpu(cls: type[EngineRunner]) -> None:
    report = _verify(cls)
    assert BUGS[cls] in _failed(report), report.format()


def test_stale_context_is_also_caught_by_fresh_inputs() -> None:
    assert "fresh_inputs" in _failed(_verify(StaleContextRunner))


def test_silent_eager_runner_passes_on_the_cpu() -> None:
    # No graph exists on the CPU, so running a size eagerly is no finding here:
    # graph_coverage says it could not run, and every other check passes.
    report = _verify(SilentEagerRunner)
    assert report.ok, report.format()
    assert "graph_coverage" in {o.check for o in report.skips}


@pytest.mark.cuda
@pytest.mark.parametrize("cls", list(BUGS), ids=lambda cls: cls.__name__)
def test_buggy_runner_fails_its_check_on_cuda(cls: type[EngineRunner]) -> None:
    report = _verify(cls, "cuda")
    assert BUGS[cls] in _failed(report), report.format()


@pytest.mark.cuda
def test_engine_runner_replays_a_graph_for_every_captured_size_on_cuda() -> None:
    report = _verify(EngineRunner, "cuda")
    assert report.ok, report.format()
    assert not report.skips, report.format()
