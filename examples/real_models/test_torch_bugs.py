"""Planted bugs in torch's own layers: each is caught by its check, each twin passes.

Every descriptor is verified (``exhaustive=True``), with or without
``--cudagraph-verify``. The assertions match the plugin's ``FAIL <check>``
line only, never an error text of torch.
"""

from __future__ import annotations

import re

import pytest

from examples.real_models.torch_bugs import bidirectional_self_attention, training_block
from examples.real_models.torch_models import (
    ATTENTION_PADS,
    basic_block,
    causal_self_attention,
    image_inputs,
    self_attention_inputs,
)

CONFIG = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "exhaustive": True}


def _x_only(device):
    make = self_attention_inputs(device)
    return lambda num_tokens, num_reqs: {"x": make(num_tokens, num_reqs)["x"]}


def _fails(check: str) -> str:
    return rf"FAIL {re.escape(check)} "


def test_bidirectional_self_attention_leaks_padding(cudagraph_verify, cudagraph_device):
    # No attn_mask: real tokens attend to the padded ones.
    module = bidirectional_self_attention().to(cudagraph_device)
    with pytest.raises(pytest.fail.Exception, match=_fails("padded_size")):
        cudagraph_verify(module, _x_only(cudagraph_device), **CONFIG)


def test_causal_self_attention_passes(cudagraph_verify, cudagraph_device):
    module = causal_self_attention().to(cudagraph_device)
    assert cudagraph_verify(
        module, self_attention_inputs(cudagraph_device), pad_values=ATTENTION_PADS, **CONFIG
    ).ok


def test_batchnorm_in_train_mode_is_caught(cudagraph_verify, cudagraph_device):
    # Batch statistics over padded images: the module is verified in train mode,
    # the mode it is in, not switched to eval behind the user's back.
    module = training_block().to(cudagraph_device)
    with pytest.raises(pytest.fail.Exception, match=_fails("padded_size")):
        cudagraph_verify(module, image_inputs(cudagraph_device), **CONFIG)
    assert module.training


def test_batchnorm_in_eval_mode_passes(cudagraph_verify, cudagraph_device):
    module = basic_block().to(cudagraph_device)
    assert cudagraph_verify(module, image_inputs(cudagraph_device), **CONFIG).ok
