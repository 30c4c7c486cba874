"""References for kernels the float64 reference cannot run (#56): keys, the registry, standing in,
each reference held against its kernel, and what the report says.

The kernels here take bfloat16 alone, as FlashAttention does: a custom op (``tref::attention``), a
custom op that writes its output argument (``tref::scale_into``) and a Python function that refuses
other dtypes (a Triton wrapper's shape). ``examples/references`` holds the serving-sized twins
(a Llama-like LM, a Triton RMSNorm).
"""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytest_cudagraph import register_reference, verify
from pytest_cudagraph.checks.kernel_references import AGREEMENT_CAP
from pytest_cudagraph.errors import UsageError
from pytest_cudagraph.precision import raised
from pytest_cudagraph.references import References, clear_registered, normalized, redirected

D, HEADS, VOCAB = 64, 4, 128
SIZES = [1, 2, 4, 8, 16]


@torch.library.custom_op("tref::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention for bfloat16 alone (FlashAttention's contract)."""
    if q.dtype != torch.bfloat16:
        raise TypeError(f"tref::attention takes bfloat16 only, got {q.dtype}")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def _keep_inputs(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _attention_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlashAttention's backward, recomputed (a training step runs it)."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)


attention.register_autograd(_attention_backward, setup_context=_keep_inputs)


@torch.library.custom_op("tref::leaky_attention", mutates_args=())
def leaky_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A kernel whose own code lets padded rows reach real ones: no causal mask."""
    if q.dtype != torch.bfloat16:
        raise TypeError(f"tref::leaky_attention takes bfloat16 only, got {q.dtype}")
    return F.scaled_dot_product_attention(q, k, v)


@leaky_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("tref::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Writes 2x into ``out``, an engine's output-buffer convention; bfloat16 alone."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"tref::scale_into takes bfloat16 only, got {x.dtype}")
    out.copy_(x * 2)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """As references are written: in float32, the result in the inputs' dtype (in the float64
    reference both casts become float64's)."""
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return out.to(q.dtype)


def bidirectional_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def scale_into_reference(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


def gate(x: torch.Tensor) -> torch.Tensor:
    """A kernel outside the dispatcher's view, as a Triton wrapper is: bfloat16 alone."""
    if x.dtype != torch.bfloat16:
        raise TypeError("gate takes bfloat16 only")
    return x * torch.sigmoid(x)


def gate_reference(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def scaled(by: float) -> Any:
    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * (1 + by)

    return reference


class Tiny(nn.Module):
    """Embedding, one attention block through ``attention`` (``leaky_attention``), a gate through ``gate``, the logits; the
    logits scaled by 1 + ``error`` where the token count is a multiple of 8 (a padded-size bug)."""

    def __init__(
        self, leaky: bool = False, error: float = 0.0, use_gate: bool = False, float_input: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)
        self.leaky, self.error, self.use_gate, self.float_input = leaky, error, use_gate, float_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.float_input else self.emb(x)
        t = h.shape[0]
        q, k, v = self.qkv(h).view(t, 3, HEADS, D // HEADS).permute(1, 2, 0, 3)
        a = (leaky_attention if self.leaky else attention)(q, k, v).permute(1, 0, 2).reshape(t, D)
        h = h + self.o(a)
        if self.use_gate:
            h = gate(h)
        y = self.head(h)
        return y * (1 + self.error) if t % 8 == 0 else y


def make_ids(t: int, r: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randint(0, VOCAB, (t,))}


def make_hidden(t: int, r: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(t, D, dtype=torch.bfloat16)}


def tiny(**kw: Any) -> Tiny:
    torch.manual_seed(0)
    return Tiny(**kw).to(torch.bfloat16).eval()


def run(module: nn.Module, make: Any = make_ids, **kw: Any) -> Any:
    return verify(module, make, capture_sizes=SIZES, backend="emulate", progress=False, **kw)


def failed(report: Any, check: str) -> list[Any]:
    return [o for o in report.failures if o.check == check]


# -- keys --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        attention,
        torch.ops.tref.attention,
        torch.ops.tref.attention.default,
        "tref::attention",
        " tref::attention",
    ],
    ids=["custom_op", "packet", "overload", "string", "padded-string"],
)
def test_every_form_of_an_op_key_names_the_op(key: Any) -> None:
    refs = normalized({key: attention_reference})
    (entry,) = refs.entries
    assert entry.name == "tref::attention" and entry.is_op
    assert refs.for_op(torch.ops.tref.attention.default) is entry
    assert refs.for_op(torch.ops.aten.mm.default) is None


def test_a_python_function_key_is_the_function_itself() -> None:
    (entry,) = normalized({gate: gate_reference}).entries
    assert entry.key is gate and not entry.is_op and entry.name.endswith("gate")
    assert entry.fn_name.endswith("gate_reference")


@pytest.mark.parametrize(
    ("references", "says"),
    [
        ({"tref::no_such_op": attention_reference}, "no op 'tref::no_such_op' is registered"),
        ({"not an op": attention_reference}, "is not an op name"),
        ({3: attention_reference}, "a key is a torch.library custom op"),
        ({attention: "sdpa"}, "must be a function of plain torch ops"),
        ({torch.ops.aten.mm: attention_reference}, "one of torch's own ops"),
        ({gate: gate}, "is the kernel itself"),
        ([attention, attention_reference], "references must map each kernel"),
    ],
    ids=[
        "unknown-op",
        "not-a-name",
        "not-callable-key",
        "not-callable-value",
        "aten",
        "itself",
        "not-a-mapping",
    ],
)
def test_a_wrong_reference_is_one_usage_line_before_anything_runs(references: Any, says: str) -> None:
    calls = []

    class Refuses(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x)
            return x

    with pytest.raises(UsageError) as caught:
        verify(Refuses(), make_hidden, capture_sizes=[1, 2], backend="emulate", references=references)
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert not calls  # refused before the module ran


def test_register_reference_refuses_what_references_refuses() -> None:
    with pytest.raises(UsageError, match="no op 'tref::missing' is registered"):
        register_reference("tref::missing", attention_reference)


# -- standing in ---------------------------------------------------------------------------------------


def test_a_reference_stands_in_for_the_op_in_float64() -> None:
    module = tiny()
    ids = torch.randint(0, VOCAB, (8,))
    with pytest.raises(Exception, match="bfloat16 only"):
        with raised():
            module(ids)
    with raised(references=normalized({attention: attention_reference})) as record:
        out = module(ids)
    assert out.dtype == torch.float64
    assert record.stood_in == {"tref::attention": f"{__name__}.attention_reference"}
    assert "references standing in for tref::attention" in record.described


def test_a_references_own_casts_are_raised_like_the_modules() -> None:
    """A reference written in float32 (``q.float()``, as references are) computes in float64 in the
    reference run: otherwise the float64 question through it would be float32's."""
    seen: list[torch.dtype] = []

    def watching(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append(q.float().dtype)
        return attention_reference(q, k, v)

    with raised(references=normalized({attention: watching})):
        tiny()(torch.randint(0, VOCAB, (8,)))
    assert seen == [torch.float64]


def test_a_python_function_is_redirected_wherever_the_module_reaches_it() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    this = types.ModuleType("elsewhere")
    this.gate = gate  # reached as an attribute of a module
    closure_gate = gate

    def through_closure(x: torch.Tensor) -> torch.Tensor:
        return closure_gate(x)

    code = gate.__code__
    refs = normalized({gate: gate_reference})
    with raised(references=refs) as record:
        for call in (gate, this.gate, through_closure):  # the global, the attribute, a closure
            assert call(x).dtype == torch.float64
    assert list(record.stood_in) == [refs.entries[0].name]
    assert gate.__code__ is code  # put back
    assert gate(x).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="bfloat16 only"):
        gate(x.double())


def _wrapped(fn: Any) -> Any:
    """A decorator's wrapper: a function with a closure, as an engine's kernel entry point often is."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def test_a_wrapper_with_a_closure_and_a_lambda_are_redirected_too() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    wrapped = _wrapped(gate)
    as_lambda = lambda x: gate(x)  # noqa: E731
    for key in (wrapped, as_lambda):
        code = key.__code__
        with raised(references=normalized({key: gate_reference})) as record:
            assert key(x).dtype == torch.float64
        assert len(record.stood_in) == 1 and key.__code__ is code
        assert key(x).dtype == torch.bfloat16


def test_a_redirect_is_put_back_when_the_block_raises() -> None:
    code = gate.__code__
    with pytest.raises(RuntimeError, match="boom"):
        with redirected(normalized({gate: gate_reference}).functions, lambda *a: None):
            assert gate.__code__ is not code
            raise RuntimeError("boom")
    assert gate.__code__ is code


def test_padded_size_asks_in_float64_through_the_reference_and_catches_a_small_error() -> None:
    refs = {attention: attention_reference}
    buggy = run(tiny(error=1e-3), references=refs)
    assert failed(buggy, "padded_size"), buggy.format()
    message = failed(buggy, "padded_size")[0].message
    assert "references standing in for tref::attention" in message
    correct = run(tiny(), references=refs)
    assert correct.ok, correct.format()
    # The batches asked in float64 (the largest always) ran through the reference.
    ran = [o for o in correct.outcomes if o.check == "padded_size" and o.figures.get("float64")]
    assert ran and all(o.figures["stood_in"] == ["tref::attention"] for o in ran)
    assert "references standing in for tref::attention" in correct.summary()
    held = [o for o in correct.outcomes if o.check == "references"]
    assert len(held) == 1 and held[0].passed and held[0].figures["relative_rms"] <= held[0].figures["limit"]


def test_without_a_reference_padded_size_says_which_kernel_needs_one() -> None:
    report = run(tiny(error=1e-3))
    skipped = [o for o in report.outcomes if o.check == "padded_size"]
    assert skipped and all(o.skipped for o in skipped)
    # The reason one line (#66); the sentence that adds the reference in its detail (-v, the JSON report).
    assert skipped[0].message == "the module cannot run in float64 nor in float32"
    assert "for tref::attention, hand the harness a plain-torch reference" in skipped[0].detail
    assert "references={'tref::attention': fn}" in skipped[0].detail
    assert "register_reference('tref::attention', fn)" in skipped[0].detail
    assert report.references == []


def test_a_python_function_reference_keeps_the_question_alive() -> None:
    refs = {attention: attention_reference, gate: gate_reference}
    buggy = run(tiny(error=1e-3, use_gate=True), references=refs)
    assert failed(buggy, "padded_size"), buggy.format()
    correct = run(tiny(use_gate=True), references=refs)
    assert correct.ok, correct.format()
    assert {r["op"].rsplit(".", 1)[-1]: r["stood_in"] for r in correct.references} == {
        "tref::attention": True,
        "gate": True,
    }
    # With the gate left out, the report names it as the kernel without a reference.
    half = run(tiny(use_gate=True), references={attention: attention_reference})
    reasons = " ".join(o.detail for o in half.outcomes if o.check == "padded_size")
    assert "gate takes bfloat16 only" in reasons


# -- each reference held against its kernel ------------------------------------------------------------


def test_a_reference_that_disagrees_with_its_kernel_fails_saying_where_and_by_how_much() -> None:
    report = run(tiny(), references={"tref::attention": scaled(0.05)})
    (wrong,) = failed(report, "references")
    assert (
        "the reference for tref::attention" in wrong.message and "disagrees with the kernel" in wrong.message
    )
    assert "call 1 of 1 held, arguments [4, 16, 16] bfloat16" in wrong.message  # the largest size's call
    assert wrong.figures["relative_rms"] > wrong.figures["limit"]
    assert all(o.skipped for o in report.outcomes if o.check == "padded_size")  # it stands in for nothing
    assert report.references[0]["held"] == "disagrees" and report.references[0]["stood_in"] is False


def test_the_agreement_limit_has_a_wrong_reference_just_above_it() -> None:
    """The correct reference sits well inside the limit; one off by twice the limit fails, one off by
    an eighth of it passes."""
    held = [
        o
        for o in run(tiny(), references={attention: attention_reference}).outcomes
        if o.check == "references"
    ]
    limit = held[0].figures["limit"]
    assert held[0].figures["relative_rms"] < limit / 2
    assert limit == pytest.approx(AGREEMENT_CAP * held[0].figures["floor"])
    assert failed(run(tiny(), references={attention: scaled(2 * limit)}), "references")
    assert not failed(run(tiny(), references={attention: scaled(limit / 8)}), "references")


def test_a_reference_that_raises_or_returns_another_shape_is_named() -> None:
    def raises(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise ValueError("unsupported head size")

    def cut(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_reference(q, k, v)[..., :-1]

    (a,) = failed(run(tiny(), references={attention: raises}), "references")
    assert "raises on the kernel's arguments (ValueError: unsupported head size)" in a.message
    (b,) = failed(run(tiny(), references={attention: cut}), "references")
    assert "the reference returns shape [4, 16, 15] where the kernel returns [4, 16, 16]" in b.message


def test_what_a_kernel_writes_into_its_arguments_is_held_too() -> None:
    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            scale_into(self.lin(x), out)
            return out

    def wrong(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 3)

    torch.manual_seed(0)
    module = Writes().to(torch.bfloat16).eval()
    ok = run(module, make_hidden, references={scale_into: scale_into_reference})
    assert not failed(ok, "references"), ok.format()
    (bad,) = failed(run(module, make_hidden, references={scale_into: wrong}), "references")
    assert "args[1] as the kernel wrote it" in bad.message


def test_a_kernel_the_module_never_calls_is_said_so() -> None:
    report = run(
        tiny(), references={attention: attention_reference, leaky_attention: bidirectional_reference}
    )
    (skipped,) = [o for o in report.outcomes if o.check == "references" and o.skipped]
    assert skipped.message.startswith("the module did not call tref::leaky_attention in one forward of ")
    assert "so its reference was not held against it" in skipped.message
    assert "check that the key names what the module calls" in skipped.detail
    assert report.ok


def test_a_kernel_that_leaks_padded_rows_is_caught_whatever_its_reference() -> None:
    """The kernel's own code attends to padded rows: the checks that run the kernel itself catch it,
    with a reference that matches it (which holds) and with one that does not (which is named)."""
    for reference in (bidirectional_reference, attention_reference):
        report = run(tiny(leaky=True, float_input=True), make_hidden, references={leaky_attention: reference})
        caught = {o.check for o in report.failures} & {"padding_isolation", "real_batches"}
        assert caught, report.format()
        assert bool(failed(report, "references")) == (reference is attention_reference)


# -- the suite's registry, the report ------------------------------------------------------------------


@pytest.fixture
def registry() -> Any:
    clear_registered()
    yield
    clear_registered()


def test_a_registered_reference_serves_every_verification_and_a_calls_own_wins(registry: Any) -> None:
    register_reference(attention, attention_reference)
    assert failed(run(tiny(error=1e-3)), "padded_size")
    assert failed(run(tiny(), references={"tref::attention": scaled(0.05)}), "references")


def test_where_no_float64_question_is_asked_the_references_are_listed_unheld() -> None:
    report = run(tiny(), references={attention: attention_reference}, batch_invariant=True)
    assert [(r["op"], r["held"], r["stood_in"]) for r in report.references] == [
        ("tref::attention", "not held", False)
    ]


def test_the_json_report_carries_the_references() -> None:
    report = run(tiny(), references={attention: attention_reference})
    data = json.loads(report.to_json())
    (entry,) = data["references"]
    assert entry["op"] == "tref::attention" and entry["held"] == "agrees" and entry["stood_in"] is True
    assert entry["reference"].endswith("attention_reference") and entry["calls"] == 1
    jsonschema = pytest.importorskip("jsonschema")
    from importlib import resources

    schema = json.loads(resources.files("pytest_cudagraph").joinpath("data/report.schema.json").read_text())
    report_schema = _report_schema(schema)
    jsonschema.validate(data, report_schema)


def _report_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The part of the plugin's report schema that describes one ``VerifyReport.to_dict()``."""

    def find(node: Any) -> Any:
        if isinstance(node, dict):
            props = node.get("properties", {})
            if "references" in props and "outcomes" in props:
                return node
            for value in node.values():
                found = find(value)
                if found is not None:
                    return found
        if isinstance(node, list):
            for value in node:
                found = find(value)
                if found is not None:
                    return found
        return None

    found = find(schema)
    assert found is not None
    return {**found, "$defs": schema.get("$defs", {})}


def test_references_is_a_references_object_once_given() -> None:
    from pytest_cudagraph import VerifyOptions

    opts = VerifyOptions(references={attention: attention_reference})
    assert isinstance(opts.references, References) and len(opts.references.entries) == 1


# -- ranks ---------------------------------------------------------------------------------------------


def build_tiny(rank: int, world_size: int) -> Tiny:
    return tiny()


def build_buggy(rank: int, world_size: int) -> Tiny:
    return tiny(error=1e-3)


def test_spawned_ranks_take_the_call_s_and_the_suite_s_references(registry: Any) -> None:
    """The ranks are processes of their own, which import no conftest: the registered references
    travel with the call's (ops by name, functions by reference)."""
    from pytest_cudagraph import verify_distributed

    plan = {"capture_sizes": [1, 2, 4, 8], "world_size": 2, "backend": "emulate", "timeout": 300.0}
    report = verify_distributed(build_tiny, make_ids, references={attention: attention_reference}, **plan)
    assert report.ok, report.format()
    ran = [o for o in report.outcomes if o.check == "padded_size" and o.figures.get("float64")]
    assert {o.rank for o in ran} == {0, 1} and all(o.figures["stood_in"] == ["tref::attention"] for o in ran)
    register_reference("tref::attention", attention_reference)
    caught = verify_distributed(build_buggy, make_ids, **plan)
    assert {o.rank for o in failed(caught, "padded_size")} == {0, 1}, caught.format()
