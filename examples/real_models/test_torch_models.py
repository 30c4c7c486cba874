"""torch's own layers, every graph verified against eager: `pytest --cudagraph-verify examples/`.

No transformers needed: these tests never skip.
"""

from __future__ import annotations

import pytest

from examples.real_models.torch_models import (
    ATTENTION_PADS,
    ENCODER_PADS,
    basic_block,
    causal_self_attention,
    encoder_inputs,
    encoder_layer,
    image_inputs,
    self_attention_inputs,
)

SIZES = (1, 2, 4, 8)


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4, pad_values=ENCODER_PADS)
def test_transformer_encoder_layer_causal(cudagraph_verify, cudagraph_device):
    # Sequence first, src (T, 1, E); the (T, T) mask follows num_tokens in both
    # dimensions and pads with -inf; is_causal=True is a Python constant.
    module = encoder_layer().to(cudagraph_device)
    assert cudagraph_verify(module, encoder_inputs(cudagraph_device)).ok


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4, pad_values=ATTENTION_PADS)
def test_multihead_attention_causal(cudagraph_verify, cudagraph_device):
    # Batch first, x (1, T, E): tokens are the second dimension; the output is
    # nn.MultiheadAttention's own (attn_output, None).
    module = causal_self_attention().to(cudagraph_device)
    assert cudagraph_verify(module, self_attention_inputs(cudagraph_device)).ok


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4)
def test_resnet_basic_block_eval(cudagraph_verify, cudagraph_device):
    # Images (N, C, H, W), N following num_tokens; BatchNorm in eval mode uses
    # its running statistics, so padded images touch no real one.
    module = basic_block().to(cudagraph_device)
    assert not module.training
    assert cudagraph_verify(module, image_inputs(cudagraph_device)).ok
    assert not module.training  # verified, and left, in the mode it was in


@pytest.mark.cudagraph(capture_sizes=SIZES, max_num_reqs=4)
def test_square_mask_needs_its_pad_value(cudagraph_verify, cudagraph_device):
    # Zeros in the padded columns of an additive mask would let every real
    # token attend to the padded ones: what "masked out" is belongs to the
    # module, so the manager refuses to guess and asks for pad_values.
    module = encoder_layer().to(cudagraph_device)
    # A usage error: the test fails with its one line (no traceback through the package).
    with pytest.raises(pytest.fail.Exception, match=r"(?s)'src_mask'.*pad_values"):
        cudagraph_verify(module, encoder_inputs(cudagraph_device))
