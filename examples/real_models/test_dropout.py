"""Dropout in train mode is verified through the rng check, never passed in silence.

``nn.TransformerEncoderLayer(dropout=0.1)`` in train mode draws random
numbers in every forward. A graph must draw them from the seeded generator
as eager does (the ``rng`` check: seeded replay against seeded eager, and
fresh draws on every replay). The verdict must come from that check: an
``rng`` outcome that ran on draws (not skipped, not "draws no random
numbers", which is what a module silently switched to eval reports), or a
failure that names ``rng``.
"""

from __future__ import annotations

import pytest

from examples.real_models.torch_models import ENCODER_PADS, encoder_inputs, encoder_layer

CONFIG = {"capture_sizes": (1, 2, 4, 8), "max_num_reqs": 4, "exhaustive": True, "pad_values": ENCODER_PADS}


def test_train_mode_dropout_goes_through_the_rng_check(cudagraph_verify, cudagraph_device):
    module = encoder_layer(dropout=0.1).to(cudagraph_device).train()
    try:
        report = cudagraph_verify(module, encoder_inputs(cudagraph_device), **CONFIG)
    except pytest.fail.Exception as failure:
        assert "FAIL rng " in str(failure), f"failed, but not on the rng check:\n{failure}"
        return
    finally:
        assert module.training  # left in the mode it was verified in
    rng = [o for o in report.outcomes if o.check == "rng"]
    assert rng, "no rng outcome in the report"
    ran = [o for o in rng if not o.skipped]
    assert ran, f"every rng outcome was skipped: {[o.message for o in rng]}"
    # A passing rng outcome on a dropout layer must have seen random draws;
    # "the module draws no random numbers" means it ran in eval mode.
    assert all(o.figures.get("random") is True for o in ran), [(o.message, o.figures) for o in ran]
