"""The training gallery cannot rot: each bug fails its check with its message; each fix passes."""

from __future__ import annotations

import re

import pytest

from examples.training.gallery import PAIRS, Case, Pair

SIZES = {"capture_sizes": (2, 4, 8), "max_num_reqs": 4}


def _verify(fixture, device, case: Case):
    return case.verify(fixture, device, **SIZES)


@pytest.mark.parametrize("pair", PAIRS, ids=[p.buggy.name for p in PAIRS])
def test_training_bug_is_caught(cudagraph_verify_training, cudagraph_device, pair: Pair):
    with pytest.raises(pytest.fail.Exception, match=rf"(?s)FAIL {pair.check} .*{pair.message}"):
        _verify(cudagraph_verify_training, cudagraph_device, pair.buggy)


@pytest.mark.parametrize("pair", PAIRS, ids=[p.fixed.name for p in PAIRS])
def test_training_fix_passes(cudagraph_verify_training, cudagraph_device, pair: Pair):
    report = _verify(cudagraph_verify_training, cudagraph_device, pair.fixed)
    assert report.ok
    # Every size captured and its replays held to eager: nothing passed for want of running.
    assert len(report.descriptors) == len(SIZES["capture_sizes"])
    held = [o for o in report.outcomes if o.check == "training_replay_matches_eager"]
    assert held and all(o.passed and not o.skipped for o in held)
    assert not re.search("could not run", report.format())
