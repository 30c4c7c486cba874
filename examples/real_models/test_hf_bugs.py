"""Planted bugs in Hugging Face layers: each is caught by its check, each twin passes.

Every descriptor is verified (``exhaustive=True``), with or without
``--cudagraph-verify``. The assertions match the plugin's ``FAIL <check>``
line only, never an error text of torch or transformers. Skipped without
transformers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from torch import nn

from examples.real_models.hf_bugs import (
    AuxHiddenLlamaLayer,
    AuxHiddenOutputLlamaLayer,
    BidirectionalLlamaLayer,
    BufferStepGPT2Block,
    CausalEagerLlamaLayer,
    DeviceLongRopeLlamaLayer,
    HostSyncLongRopeLlamaLayer,
    PythonStepGPT2Block,
    position_inputs,
)
from examples.real_models.hf_models import hidden_inputs, llama_rotary, rope_inputs

CONFIG = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "exhaustive": True}


def _rope(device: Any) -> Callable[[int, int], dict[str, Any]]:
    return rope_inputs(llama_rotary(device), device)


@dataclass(frozen=True)
class Pair:
    check: str
    buggy: type[nn.Module]
    fixed: type[nn.Module]
    inputs: Callable[[Any], Callable[[int, int], dict[str, Any]]]
    keywords: dict[str, Any] = field(default_factory=dict)


PAIRS = [
    # (1) eager attention without a mask is bidirectional: padded tokens leak in.
    Pair("padded_size", BidirectionalLlamaLayer, CausalEagerLlamaLayer, _rope),
    # (3) hidden states kept on self.aux_hidden for a drafter.
    Pair("side_outputs", AuxHiddenLlamaLayer, AuxHiddenOutputLlamaLayer, _rope),
    # (4) .item() on the largest position to pick the rotary factors.
    # Padded positions are 0 by the engine's contract, which the choice relies on: declared, so that
    # padding_isolation keeps it instead of filling padded positions with other values.
    Pair(
        "capture_safety",
        HostSyncLongRopeLlamaLayer,
        DeviceLongRopeLlamaLayer,
        position_inputs,
        {"pad_values": {"position_ids": 0}},
    ),
    # (5) a Python step counter scaling the block's update.
    Pair("replay_matches_eager", PythonStepGPT2Block, BufferStepGPT2Block, hidden_inputs),
]


@pytest.mark.parametrize("pair", PAIRS, ids=[p.buggy.__name__ for p in PAIRS])
def test_bug_is_caught(cudagraph_verify, cudagraph_device, pair):
    torch.manual_seed(0)
    module = pair.buggy().to(cudagraph_device)
    with pytest.raises(pytest.fail.Exception, match=rf"FAIL {re.escape(pair.check)} "):
        cudagraph_verify(module, pair.inputs(cudagraph_device), **CONFIG, **pair.keywords)


@pytest.mark.parametrize("pair", PAIRS, ids=[p.fixed.__name__ for p in PAIRS])
def test_fix_passes(cudagraph_verify, cudagraph_device, pair):
    torch.manual_seed(0)
    module = pair.fixed().to(cudagraph_device)
    assert cudagraph_verify(module, pair.inputs(cudagraph_device), **CONFIG, **pair.keywords).ok
