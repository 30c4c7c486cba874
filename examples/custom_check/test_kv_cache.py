"""The engine's check through the plugin: `pytest --cudagraph-verify examples/custom_check`.

conftest.py adds ``kv_cache_outside_slots`` to every verification here, after
the built-in checks. The correct writer passes every check; its off-by-one
twin passes every built-in check (eager and replay agree) and fails the
engine's own.
"""

from __future__ import annotations

import functools

import pytest

from examples.custom_check.check import kv_cache_check
from examples.custom_check.kv_cache import PAD_VALUES, SCRATCH, OffByOneKVWriter, PagedKVWriter, make_inputs
from pytest_cudagraph import verify
from pytest_cudagraph.checks import CHECKS

PLAN = {
    "capture_sizes": (1, 2, 4, 8),
    "max_num_reqs": 4,
    "pad_values": PAD_VALUES,
    "scratch_state": {"kv": SCRATCH},
}


@pytest.mark.cudagraph(**PLAN)
def test_the_correct_writer_passes_every_check(cudagraph_verify, cudagraph_device):
    module = PagedKVWriter().to(cudagraph_device)
    report = cudagraph_verify(module, functools.partial(make_inputs, device=cudagraph_device))
    ran = {o.check for o in report.outcomes if not o.skipped}
    assert "kv_cache_outside_slots" in ran and report.ok


@pytest.mark.cudagraph(**PLAN)
def test_the_off_by_one_writer_fails_only_the_engines_check(cudagraph_verify, cudagraph_device):
    module = OffByOneKVWriter().to(cudagraph_device)
    with pytest.raises(pytest.fail.Exception, match="kv_cache_outside_slots"):
        cudagraph_verify(module, functools.partial(make_inputs, device=cudagraph_device))
    report = cudagraph_verify.reports[-1]
    assert {o.check for o in report.failures} == {"kv_cache_outside_slots"}
    assert report.failures[0].finding is not None and report.failures[0].finding.output.startswith("kv[")


def test_the_check_through_verify_extra_checks(cudagraph_backend, cudagraph_device):
    """Without the plugin: verify(..., extra_checks=[...]); checks= selects it by name."""
    inputs = functools.partial(make_inputs, device=cudagraph_device)
    check = kv_cache_check(scratch=SCRATCH)
    kwargs = {**PLAN, "backend": cudagraph_backend, "extra_checks": [check]}
    good = verify(PagedKVWriter().to(cudagraph_device), inputs, **kwargs)
    bad = verify(OffByOneKVWriter().to(cudagraph_device), inputs, **kwargs)
    assert good.ok and not bad.ok
    assert {o.check for o in bad.failures} == {"kv_cache_outside_slots"}
    only = verify(
        OffByOneKVWriter().to(cudagraph_device), inputs, checks=["kv_cache_outside_slots"], **kwargs
    )
    assert {o.check for o in only.outcomes} == {"kv_cache_outside_slots"}
    assert not only.ok
    # Without the check, every built-in check passes the buggy twin: eager and replay agree.
    builtin = verify(OffByOneKVWriter().to(cudagraph_device), inputs, **{**kwargs, "extra_checks": None})
    assert builtin.ok and set(builtin.checks) >= set(CHECKS)
