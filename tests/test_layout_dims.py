"""Inputs whose batch dimension is not the first, inputs with several, and
outputs of any structure cut along every dimension that follows the batch."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph import GraphManager
from pytest_cudagraph.checks.compare import leaves
from pytest_cudagraph.checks.verify_context import clone_tree

CONFIG = {"capture_sizes": [1, 2, 4, 8], "max_num_reqs": 4}
VOCAB = 32


def no_grad_eager(module: nn.Module, **inputs: Any) -> Any:
    with torch.no_grad():
        return module(**inputs)


class TokenLM(nn.Module):
    """``input_ids (1, T)`` -> logits ``(1, T, V)``: a language model's shapes, position-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def ids_inputs(device: torch.device) -> Any:
    return lambda t, r: {"input_ids": torch.randint(0, VOCAB, (1, t), device=device)}


# -- inputs: the batch dimension in any position -------------------------------------------
def test_tokens_in_dim_1_are_learned_and_logits_cut_along_dim_1(backend, device):
    module = TokenLM().to(device).eval()
    mgr = GraphManager(module, ids_inputs(device), CONFIG, backend=backend, device=device)
    spec = mgr.input_specs["input_ids"]
    assert (spec.kind, spec.dim, spec.offset, spec.dims) == ("tokens", 1, 0, ((1, "tokens", 0),))
    assert spec.buffer is not None and spec.buffer.shape == (1, 8)
    assert mgr.forward_inputs(4, 4)["input_ids"].shape == (1, 4)
    mgr.capture()
    for t in (1, 3, 5, 8):
        x = torch.randint(0, VOCAB, (1, t), device=device)
        out = mgr.run(input_ids=x)
        assert out.shape == (1, t, VOCAB)
        torch.testing.assert_close(out, no_grad_eager(module, input_ids=x))
    # The message shows num_tokens where it belongs.
    with pytest.raises(
        ValueError,
        match=r"input 'input_ids' has shape \(2, 5\); expected a torch.int64 tensor "
        r"of shape \(1, num_tokens\)",
    ):
        mgr.run(input_ids=torch.zeros(2, 5, dtype=torch.long, device=device))


class Flattening(nn.Module):
    """``x (B, T, H)`` with B fixed: ``view`` needs the graph's input contiguous, as eager's is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        return self.lin(x.view(b * t, h)).view(b, t, h)


@pytest.mark.parametrize("batch_dims", [None, {"x": 1}, {"x": -2}], ids=["learned", "explicit", "negative"])
def test_b_t_h_input_follows_tokens_in_dim_1(backend, device, batch_dims):
    module = Flattening().to(device).eval()
    mgr = GraphManager(
        module,
        lambda t, r: {"x": torch.randn(2, t, 6, device=device)},
        CONFIG,
        backend=backend,
        device=device,
        batch_dims=batch_dims,
    )
    assert mgr.input_specs["x"].dims == ((1, "tokens", 0),)
    assert mgr.input_specs["x"].expected() == "a torch.float32 tensor of shape (2, num_tokens, 6)"
    # The graph of a shape reads a contiguous window of the buffer, so view() works in it.
    assert mgr.forward_inputs(4, 4)["x"].is_contiguous()
    mgr.capture()
    x = torch.randn(2, 3, 6, device=device)
    out = mgr.run(x=x)
    assert out.shape == (2, 3, 6)
    torch.testing.assert_close(out, no_grad_eager(module, x=x))


def test_explicit_batch_dims_are_validated(backend, device):
    make = ids_inputs(device)

    def build(**kw):
        return GraphManager(TokenLM().to(device), make, CONFIG, backend=backend, device=device, **kw)

    with pytest.raises(
        ValueError, match=r"batch_dims names unknown input\(s\) \['ids'\]; inputs are \['input_ids'\]"
    ):
        build(batch_dims={"ids": 1})
    with pytest.raises(
        ValueError,
        match=r"batch_dims\['input_ids'\] = 2 is out of range for its 2-dimensional "
        r"input .* expected a dimension in \[-2, 1\]",
    ):
        build(batch_dims={"input_ids": 2})
    with pytest.raises(
        ValueError,
        match=r"batch_dims\['input_ids'\] = 0, but dimension 0 is 1 at every shape "
        r"seen, and dimension\(s\) \[1\] change with the batch instead",
    ):
        build(batch_dims={"input_ids": 0})
    with pytest.raises(ValueError, match=r"batch_dims\['input_ids'\] must be an int"):
        build(batch_dims={"input_ids": "1"})
    with pytest.raises(ValueError, match="batch_dims must map input names"):
        build(batch_dims=[1])
    with pytest.raises(ValueError, match=r"batch_dims\['use_cache'\] names a Python value"):
        GraphManager(
            TokenLM().to(device),
            lambda t, r: {**make(t, r), "use_cache": False},
            CONFIG,
            backend=backend,
            device=device,
            batch_dims={"use_cache": 0},
        )
    # Given, but another dimension changes too: refused rather than padded wrong.
    with pytest.raises(ValueError, match=r"batch_dims\['m'\] = 0, but dimension\(s\) \[1\] also change"):
        GraphManager(
            nn.Identity(),
            lambda t, r: {"input": torch.zeros(t, 2, device=device), "m": torch.zeros(t, t, device=device)},
            CONFIG,
            backend=backend,
            device=device,
            batch_dims={"m": 0},
            pad_values={"m": 0},
        )


# -- inputs with several dimensions that follow the batch ------------------------------------
def causal_mask_inputs(device: torch.device) -> Any:
    def make_inputs(t: int, r: int) -> dict[str, Any]:
        mask = torch.triu(torch.full((t, t), float("-inf"), device=device), diagonal=1)
        return {"src": torch.randn(t, 1, 16, device=device), "src_mask": mask}

    return make_inputs


def test_square_mask_requires_a_pad_value(backend, device):
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0).to(device).eval()
    with pytest.raises(
        ValueError,
        match=r"input 'src_mask' has several dimensions that follow the batch \(dim 0 "
        r"follows num_tokens, dim 1 follows num_tokens\).*Pass "
        r"pad_values=\{'src_mask': float\('-inf'\)\}",
    ):
        GraphManager(layer, causal_mask_inputs(device), CONFIG, backend=backend, device=device)
    with pytest.raises(ValueError, match=r"pad_values\['src_mask'\] = 'edge' needs one dimension"):
        GraphManager(
            layer,
            causal_mask_inputs(device),
            CONFIG,
            backend=backend,
            device=device,
            pad_values={"src_mask": "edge"},
        )
    with pytest.raises(ValueError, match=r"input 'm' .*pad_values=\{'m': False\} or \{'m': True\}"):
        GraphManager(
            nn.Identity(),
            lambda t, r: {
                "input": torch.zeros(t, device=device),
                "m": torch.ones(t, t, dtype=torch.bool, device=device),
            },
            CONFIG,
            backend=backend,
            device=device,
        )


def test_square_mask_is_padded_as_a_block(backend, device):
    # nn.TransformerEncoderLayer, seq-first: src (T, 1, E) and an additive (T, T) mask.
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0).to(device).eval()
    mgr = GraphManager(
        layer,
        causal_mask_inputs(device),
        CONFIG,
        backend=backend,
        device=device,
        pad_values={"src_mask": float("-inf")},
    )
    spec = mgr.input_specs["src_mask"]
    assert spec.kind == "multi" and spec.dims == ((0, "tokens", 0), (1, "tokens", 0))
    assert spec.expected() == "a torch.float32 tensor of shape (num_tokens, num_tokens)"
    mgr.capture()
    inputs = causal_mask_inputs(device)(5, 1)
    out = mgr.run(**inputs)
    assert out.shape == (5, 1, 16)
    torch.testing.assert_close(out, no_grad_eager(layer, **inputs))
    # The 8-token graph read an (8, 8) window: the real 5 x 5 block, -inf around it.
    window = spec.buffer.view(-1)[:64].view(8, 8)
    assert torch.equal(window[:5, :5], inputs["src_mask"])
    assert bool((window[5:] == float("-inf")).all()) and bool((window[:, 5:] == float("-inf")).all())
    # Its padding is declared meaning, not garbage to fill: padding_views leaves it out.
    desc = mgr.dispatch(num_reqs=1, num_tokens=5)
    assert [name for name, _ in mgr.padding_views(desc, mgr.batch_of(inputs))] == ["src"]


class PerRequestSum(nn.Module):
    """``assign (T, R)``, one-hot token -> request: sums each request's tokens."""

    def forward(self, x: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
        return assign.t() @ x


def request_inputs(device: torch.device) -> Any:
    def make_inputs(t: int, r: int) -> dict[str, Any]:
        owner = torch.arange(t, device=device) % r
        return {
            "x": torch.randn(t, 4, device=device),
            "assign": torch.nn.functional.one_hot(owner, r).to(torch.float32),
        }

    return make_inputs


def test_input_whose_dims_follow_different_counts(backend, device):
    module = PerRequestSum()
    mgr = GraphManager(
        module, request_inputs(device), CONFIG, backend=backend, device=device, pad_values={"assign": 0.0}
    )
    spec = mgr.input_specs["assign"]
    assert spec.kind == "multi" and spec.dims == ((0, "tokens", 0), (1, "reqs", 0))
    assert spec.expected() == "a torch.float32 tensor of shape (num_tokens, num_reqs)"
    mgr.capture()
    inputs = request_inputs(device)(5, 2)
    batch = mgr.batch_of(inputs)
    assert (batch.num_tokens, batch.num_reqs) == (5, 2)  # requests read from assign's dimension 1
    out = mgr.run(**inputs)
    assert out.shape == (2, 4)
    torch.testing.assert_close(out, no_grad_eager(module, **inputs))
    with pytest.raises(ValueError, match=r"inputs disagree on num_tokens: 'x' says 5, 'assign' says 6"):
        mgr.run(x=inputs["x"], assign=request_inputs(device)(6, 2)["assign"])


# -- padding_views -----------------------------------------------------------------------------
def test_padding_views_are_the_padded_part_of_each_buffer(backend, device):
    module = Flattening().to(device).eval()
    mgr = GraphManager(
        module,
        lambda t, r: {"x": torch.randn(2, t, 6, device=device)},
        CONFIG,
        backend=backend,
        device=device,
    )
    mgr.capture()
    x = torch.randn(2, 3, 6, device=device)
    batch = mgr.batch_of({"x": x})
    desc = mgr.dispatch(num_reqs=batch.num_reqs, num_tokens=batch.num_tokens)
    assert desc.num_tokens == 4
    mgr.load_inputs(desc, {"x": x}, batch)
    [(name, view)] = mgr.padding_views(desc, batch)
    buffer = mgr.static_inputs["x"]
    assert name == "x" and view.shape == (2, 1, 6)
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # Exactly the entries the graph reads that no real token wrote: filling them
    # leaves the real block of the window alone.
    view.fill_(float("nan"))
    window = mgr.forward_inputs(desc.num_tokens, mgr.capture_reqs(desc))["x"]
    assert torch.equal(window[:, :3], x) and bool(window[:, 3:].isnan().all())
    # No padding at all: nothing to fill.
    full = torch.randn(2, 4, 6, device=device)
    assert mgr.padding_views(desc, mgr.batch_of({"x": full})) == []


# -- outputs -------------------------------------------------------------------------------------
class AttentionWeights(nn.Module):
    """nn.MultiheadAttention, seq-first: x (T, 1, E) -> ((T, 1, E), weights (1, T, T))."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> Any:
        return self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=True)


def test_attention_weights_are_cut_on_both_dims(backend, device):
    module = AttentionWeights().to(device).eval()

    def make_inputs(t: int, r: int) -> dict[str, Any]:
        return {
            "x": torch.randn(t, 1, 8, device=device),
            "key_padding_mask": torch.zeros(1, t, dtype=torch.bool, device=device),
        }

    # Padded keys are masked out (True), so real queries never see them.
    mgr = GraphManager(
        module, make_inputs, CONFIG, backend=backend, device=device, pad_values={"key_padding_mask": True}
    )
    assert mgr.input_specs["key_padding_mask"].dims == ((1, "tokens", 0),)
    mgr.capture()
    inputs = make_inputs(3, 1)
    out, weights = mgr.run(**inputs)
    expected = no_grad_eager(module, **inputs)
    assert out.shape == (3, 1, 8) and weights.shape == (1, 3, 3)
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(weights, expected[1])


@dataclasses.dataclass
class Hidden:
    hidden: torch.Tensor
    pooled: torch.Tensor  # (1, H): whole
    note: str = "plain"


@dataclasses.dataclass(frozen=True)
class FrozenHidden:
    hidden: torch.Tensor
    scaled: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        # Derived at construction: a rebuild must copy it, not construct anew.
        object.__setattr__(self, "scaled", self.hidden * 2)


Pair = namedtuple("Pair", ["hidden", "pooled"])


def _model_output(hidden: torch.Tensor, pooled: torch.Tensor) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    # hidden_states and attentions are None: left out by pytree, put back as None.
    return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled)


WRAPPERS = {
    "dataclass": lambda h, p: Hidden(h, p),
    "frozen_dataclass": lambda h, p: FrozenHidden(h),
    "namedtuple": lambda h, p: Pair(h, p),
    "dict": lambda h, p: {"hidden": h, "pooled": p},
    "model_output": _model_output,
    "nested": lambda h, p: (Hidden(h, p), [{"inner": FrozenHidden(h)}]),
}


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, 8)

    def forward(self, input_ids: torch.Tensor) -> Any:
        hidden = self.embed(input_ids)  # (1, T, 8)
        return WRAPPERS[self.kind](hidden, hidden[:, 0])  # pooled: the first token, whole


def _same_structure(got: Any, expected: Any) -> None:
    assert type(got) is type(expected)
    got_leaves, exp_leaves = leaves(got), leaves(expected)
    assert [p for p, _ in got_leaves] == [p for p, _ in exp_leaves]
    for (path, g), (_, e) in zip(got_leaves, exp_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.shape == e.shape, path
            torch.testing.assert_close(g, e, msg=path)
        else:
            assert g == e, path


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_structured_outputs_come_back_in_their_type_cut(backend, device, kind):
    if kind == "model_output":
        pytest.importorskip("transformers")
    module = Structured(kind).to(device).eval()
    mgr = GraphManager(module, ids_inputs(device), CONFIG, backend=backend, device=device)
    mgr.capture()
    x = torch.randint(0, VOCAB, (1, 3), device=device)
    out = mgr.run(input_ids=x)
    expected = no_grad_eager(module, input_ids=x)
    _same_structure(out, expected)
    first = out[0] if kind == "nested" else out
    hidden = (
        first["last_hidden_state"]
        if kind == "model_output"
        else (first["hidden"] if kind == "dict" else first.hidden)
    )
    assert hidden.shape == (1, 3, 8)  # cut along dim 1 from the 4-token graph's (1, 4, 8)
    if kind == "model_output":
        assert out.hidden_states is None and out.attentions is None
        assert list(out.keys()) == ["last_hidden_state", "pooler_output"]
    if kind in ("frozen_dataclass", "nested"):
        frozen = out if kind == "frozen_dataclass" else out[1][0]["inner"]
        assert frozen.scaled.shape == (1, 3, 8)
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen.hidden = frozen.scaled  # type: ignore[misc]
    # Owned by the caller: the next run does not change them.
    before = clone_tree(out)
    mgr.run(input_ids=torch.randint(0, VOCAB, (1, 3), device=device))
    _same_structure(out, before)


def test_compare_and_clone_see_dataclass_fields():
    value = (Hidden(torch.ones(2), torch.zeros(1)), {"logits": torch.ones(3)})
    assert [p for p, _ in leaves(value)] == ["[0].hidden", "[0].pooled", "[0].note", "[1]['logits']"]
    cloned = clone_tree(value)
    assert type(cloned[0]) is Hidden and cloned[0].note == "plain"
    assert cloned[0].hidden is not value[0].hidden and torch.equal(cloned[0].hidden, value[0].hidden)


class Unrelated(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, x: torch.Tensor) -> Any:
        flat = x.reshape(-1)  # (2 * T,): follows neither count
        return {"logits": flat} if self.where == "dict" else (x, flat)


@pytest.mark.parametrize(("where", "path"), [("dict", r"\['logits'\]"), ("tuple", r"\[1\]")])
def test_output_unrelated_to_the_batch_is_refused(backend, device, where, path):
    mgr = GraphManager(
        Unrelated(where),
        lambda t, r: {"x": torch.randn(t, 2, device=device)},
        CONFIG,
        backend=backend,
        device=device,
    )
    with pytest.raises(
        ValueError,
        match=rf"output {path} has shape \(14,\) at \(num_tokens=7, num_reqs=3\) and "
        r"\(10,\) at \(num_tokens=5, num_reqs=2\).* can only cut dimensions that "
        r"follow num_tokens or num_reqs",
    ):
        mgr.capture()
    assert not mgr.captured


class PowersOfTwo(TokenLM):
    """Runs only at power-of-two lengths: the probes fail, the descriptors decide."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        if n & (n - 1):
            raise RuntimeError("only powers of two")
        return super().forward(input_ids)


def test_without_probes_descriptors_settle_which_dims_follow(backend, device):
    module = PowersOfTwo().to(device).eval()
    mgr = GraphManager(module, ids_inputs(device), CONFIG, backend=backend, device=device)
    mgr.capture()
    assert mgr.state.probed_rows is None  # the probe shapes (7, 11 tokens) cannot run
    # Dim 0 is 1 at every descriptor (whole); dim 2 is the vocabulary (whole); dim 1 follows tokens.
    assert all(entry.out_dims == [((1, "tokens"),)] for entry in mgr.state.entries.values())
    x = torch.randint(0, VOCAB, (1, 4), device=device)
    torch.testing.assert_close(mgr.run(input_ids=x), no_grad_eager(module, input_ids=x))
    # A batch of 3 runs in the 4-token graph: padded to a power of two, cut back to 3.
    out = mgr.run(input_ids=x[:, :3])
    assert out.shape == (1, 3, VOCAB)
    torch.testing.assert_close(out, no_grad_eager(module, input_ids=x)[:, :3])


# -- a whole Hugging Face model ---------------------------------------------------------------------
def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_llama_for_causal_lm_takes_input_ids_1_by_t(backend, device):
    model = tiny_llama().to(device)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # use_cache=False, a Python constant frozen into every graph: the model
    # builds no cache (a DynamicCache made inside a capture is not capturable).
    def make_inputs(t: int, r: int) -> dict[str, Any]:
        return {"input_ids": torch.randint(0, 128, (1, t), device=device), "use_cache": False}

    mgr = GraphManager(
        model,
        make_inputs,
        {"capture_sizes": [1, 2, 4, 8], "max_num_reqs": 1},
        backend=backend,
        device=device,
        pad_values={"input_ids": 0},
    )
    assert mgr.input_specs["input_ids"].dims == ((1, "tokens", 0),)
    assert mgr.input_specs["use_cache"].kind == "const"
    mgr.capture()
    for t in (1, 3, 5, 8):
        ids = torch.randint(0, 128, (1, t), device=device)
        out = mgr.run(input_ids=ids, use_cache=False)
        expected = no_grad_eager(model, input_ids=ids, use_cache=False)
        assert isinstance(out, CausalLMOutputWithPast)
        assert list(out.keys()) == ["logits"] and out.loss is None
        assert out.logits.shape == (1, t, 128)  # cut along dim 1 from the graph's padded length
        torch.testing.assert_close(out.logits, expected.logits)
