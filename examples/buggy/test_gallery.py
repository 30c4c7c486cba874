"""The gallery cannot rot: each buggy module fails its check with its message; each fix passes."""

from __future__ import annotations

import pytest
import torch

from examples.buggy.common import token_inputs
from examples.buggy.padding_leak import MaskByMultiply
from examples.buggy.python_scalar import ScaledByTemperature, scalar_inputs, tensor_inputs
from examples.buggy.shape_branch import NoShapeBranch, ShapeBranch
from examples.buggy.weight_sync import Synced, syncing_inputs
from tests.bugs import PAIRS

# Every descriptor, also without --cudagraph-verify: some bugs show at one size only.
CONFIG = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "exhaustive": True}
# (check, buggy, fixed, message, extra keywords: a strictness the pair is caught under, make_inputs)
GALLERY = [(p.check, p.buggy, p.correct, p.message, p.kwargs, p.make_inputs) for p in PAIRS] + [
    (
        "padded_size",
        ShapeBranch,
        NoShapeBranch,
        r"a computation depends on the padded batch size",
        {},
        token_inputs,
    ),
]
FIELDS = ("check", "buggy", "fixed", "message", "extra", "inputs")


@pytest.mark.parametrize(FIELDS, GALLERY, ids=[g[1].__name__ for g in GALLERY])
def test_bug_is_caught(cudagraph_verify, cudagraph_device, check, buggy, fixed, message, extra, inputs):
    torch.manual_seed(0)
    with pytest.raises(pytest.fail.Exception, match=rf"(?s)FAIL {check} .*{message}"):
        cudagraph_verify(buggy().to(cudagraph_device), inputs(cudagraph_device), **CONFIG, **extra)


@pytest.mark.parametrize(FIELDS, GALLERY, ids=[f"{g[2].__name__}-{g[1].__name__}" for g in GALLERY])
def test_fix_passes(cudagraph_verify, cudagraph_device, check, buggy, fixed, message, extra, inputs):
    torch.manual_seed(0)
    assert cudagraph_verify(fixed().to(cudagraph_device), inputs(cudagraph_device), **CONFIG, **extra).ok


def test_strict_padding_bug_passes_finite_padding(cudagraph_verify, cudagraph_device):
    """Masking by multiplication is exact under every padding an engine leaves: only the strictness fails it."""
    torch.manual_seed(0)
    module = MaskByMultiply().to(cudagraph_device)
    assert cudagraph_verify(module, token_inputs(cudagraph_device), **CONFIG, nonfinite_padding=False).ok


def test_python_scalar_drawn_per_batch_is_held_per_graph_and_named(cudagraph_verify, cudagraph_device):
    module = ScaledByTemperature().to(cudagraph_device)
    # Each graph holds its capture's temperature: the failure names it, and says only a tensor serves it.
    with pytest.raises(
        pytest.fail.Exception,
        match=r"(?s)FAIL padded_size .*input 'temperature' is a Python value, which a graph holds at the value "
        r"its capture was given: .*Pass it as a tensor input .*make_inputs gives it another value at the same "
        r"shape, which no one value can serve",
    ):
        cudagraph_verify(module, scalar_inputs(cudagraph_device), **CONFIG)
    assert cudagraph_verify(module, tensor_inputs(cudagraph_device), **CONFIG).ok


def test_weights_synced_in_place_by_make_inputs_pass_and_rebound_ones_are_caught(
    cudagraph_verify, cudagraph_device
):
    """A weight sync between batches is the state each run starts from, not a forward's write."""
    torch.manual_seed(0)
    module = Synced().to(cudagraph_device)
    report = cudagraph_verify(
        module, syncing_inputs(module, in_place=True, device=cudagraph_device), **CONFIG
    )
    assert report.ok and any(
        "make_inputs writes module tensor(s) 'lin.weight' in place" in n for n in report.notes
    )
    module = Synced().to(cudagraph_device)
    with pytest.raises(
        pytest.fail.Exception,
        match=r"(?s)FAIL address_stability .*module tensor 'lin.weight' moved: make_inputs rebound it",
    ):
        cudagraph_verify(module, syncing_inputs(module, in_place=False, device=cudagraph_device), **CONFIG)
