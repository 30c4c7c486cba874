"""Every failure names its true cause (issue #57): Python values among the inputs held per graph,
host numbers that seed a kernel, Python attributes changed outside forward, where two runs first
differ (the user's line, a kernel's caller), and the words of the reference's precision.

Each cause is proven by a module with the bug, which must fail with the cause named, and a correct
twin, which must pass. The gallery pairs of tests/bugs.py (``ScalesByMaxSeqLen``,
``HostOffsetSampler``) hold the two commonest in tests/test_checks.py too.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from examples.buggy.common import D, token_inputs
from examples.buggy.host_seed import DeviceOffsetSampler
from examples.buggy.python_input import BoundedByMaxSeqLen, ScalesByMaxSeqLen, seq_len_inputs
from pytest_cudagraph import GraphManager
from pytest_cudagraph.checks import verify
from pytest_cudagraph.checks.divergence import parting
from pytest_cudagraph.precision import Record
from pytest_cudagraph.units import counted

SIZES = [1, 2, 4, 8]


def _verify(module: nn.Module, make_inputs: Any, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    kwargs.setdefault("capture_sizes", SIZES)
    kwargs.setdefault("max_num_reqs", 4)
    return verify(module, make_inputs, backend="emulate", **kwargs)


def _failed(report: Any, check: str) -> list[Any]:
    return [o for o in report.failures if o.check == check]


# -- 1. a Python number among the inputs ----------------------------------------------------------------


class _RefusesFloat64(nn.Module):
    """A forward for float32 alone (no float64 reference runs): real_batches asks the question."""

    def __init__(self, scales: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scales = scales

    def forward(self, x: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError("float32 only")
        return self.lin(x) / max_seq_len if self.scales else self.lin(x)


def test_a_python_number_that_decides_the_result_is_named_with_both_values_where_no_float64_runs():
    report = _verify(_RefusesFloat64(scales=True), seq_len_inputs(), checks=["-padded_size"])
    failed = _failed(report, "real_batches")
    assert failed, report.format()
    assert re.search(
        r"input 'max_seq_len' is a Python value, which a graph holds at the value its capture was given: "
        r"FULL-T8-R4 holds max_seq_len=11, this batch has max_seq_len=8",
        failed[0].message,
    ), report.format()
    twin = _verify(_RefusesFloat64(scales=False), seq_len_inputs(), checks=["-padded_size"])
    assert twin.ok, twin.format()


def test_a_python_number_the_graph_does_not_depend_on_passes_every_check_at_every_size():
    # Quick mode asks padded_size at the sizes it does not capture too: each with make_inputs' value
    # at its own shape, as its graph would hold it.
    for exhaustive in (True, False):
        report = _verify(BoundedByMaxSeqLen(), seq_len_inputs(), exhaustive=exhaustive)
        assert report.ok, report.format()
    report = _verify(ScalesByMaxSeqLen(), seq_len_inputs(), exhaustive=False)
    assert {o.descriptor.label() for o in _failed(report, "padded_size")} >= {"FULL-T4-R4", "FULL-T8-R4"}


def test_the_manager_replays_a_python_number_as_captured_and_runs_eagerly_with_the_one_given():
    torch.manual_seed(0)
    module = ScalesByMaxSeqLen()
    manager = GraphManager(module, seq_len_inputs(), {"capture_sizes": [4, 8], "max_num_reqs": 4})
    manager.capture()
    x = torch.randn(3, D)
    # The graph of 4 tokens holds max_seq_len = 7 (make_inputs' at its shape), the one of 8 holds 11.
    # Each is held bit for bit to eager at its own padded shape, on the rows it read, cut to the real
    # rows: eager on the real rows alone is another GEMM shape, which MKL may round otherwise.
    with torch.no_grad():
        for batch, given, held in ((x, 6, 7), (torch.cat([x, x]), 9, 11)):
            got = manager.run(x=batch, max_seq_len=given).clone()
            desc = manager.dispatch(manager.batch_of({"x": batch, "max_seq_len": given}))
            padded = manager.forward_inputs(desc.num_tokens, manager.capture_reqs(desc))
            assert padded["max_seq_len"] == held and padded["x"].shape[0] > batch.shape[0], desc
            assert torch.equal(padded["x"][: batch.shape[0]], batch)
            assert torch.equal(got, (module.lin(padded["x"]) / held)[: batch.shape[0]]), given
        # Beyond the largest graph the batch runs eagerly, with its own value.
        big = torch.randn(9, D)
        assert torch.equal(manager.run(x=big, max_seq_len=12), module(big, 12))
    with pytest.raises(ValueError, match=r"missing input\(s\) \['max_seq_len'\]"):
        manager.run(x=x)


# -- 2. host numbers that seed a kernel -----------------------------------------------------------------


class _SamplerState(nn.Module):
    """The gallery's host-offset sampler with its counter in a dict (no attribute a walk finds)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.state = {"seed": 1234, "offset": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state["offset"] += 1
        return self.lin(x) + torch.ops.cudagraph_gallery.hash_noise(
            x, self.state["seed"], self.state["offset"]
        )


def test_host_numbers_kept_outside_the_module_attributes_are_named_by_rng_not_as_nondeterminism():
    report = _verify(_SamplerState(), token_inputs(), capture_sizes=[1, 2, 4])
    rng = _failed(report, "rng")
    assert rng and re.search(
        r"hash_noise\.default at tests/test_causes\.py:\d+ in forward \(offset: (\d+) -> (?!\1)\d+\) is handed host "
        r"numbers that change on every forward",
        rng[0].message,
    ), report.format()
    said = report.format()
    assert "nondeterministic" not in said and "depends on the padded batch size" not in said, said
    # The cross-shape questions cannot hold a module that draws anew on every call: skipped, saying why.
    skipped = [o for o in report.outcomes if o.check in ("padded_size", "real_batches") and not o.passed]
    assert not skipped, said
    assert any(
        o.check == "padded_size" and o.skipped and "host numbers" in o.message for o in report.outcomes
    )
    assert _verify(DeviceOffsetSampler(), token_inputs(), capture_sizes=[1, 2, 4]).ok


def test_a_triton_kernel_handed_a_python_seed_and_offset_is_named_by_rng():
    pytest.importorskip("triton")
    from examples.kernels.triton_kernels import noise_at, noise_from

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.offset = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.offset += 1
            return self.lin(x) + noise_from(x, 1234, self.offset)

    class Device(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.register_buffer("offset", torch.zeros(1, dtype=torch.int64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + noise_at(x, 1234, self.offset)

    report = _verify(Host(), token_inputs(), capture_sizes=[1, 2])
    rng = _failed(report, "rng")
    assert rng and re.search(
        r"Triton kernel _noise_kernel at examples/kernels/triton_kernels\.py:\d+ in noise_from \(offset: (\d+) -> "
        r"(?!\1)\d+, kept in offset\) is handed host numbers",
        rng[0].message,
    ), report.format()
    twin = _verify(Device(), token_inputs(), capture_sizes=[1, 2])
    assert twin.ok, twin.format()


# -- 3. Python attributes changed outside forward -------------------------------------------------------


class _Refit(nn.Module):
    """A weight refit (in make_inputs, as an RL engine syncs weights) updates a scale; forward reads
    its Python float copy (the bug) or the buffer itself (the twin)."""

    def __init__(self, reads_float: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("k_scale", torch.ones(()))
        self._k_scale_float = 1.0
        self.reads_float = reads_float
        self.refits = 0

    def refit(self) -> None:
        self.refits += 1
        value = 1.0 + self.refits / 8
        self.k_scale.fill_(value)
        self._k_scale_float = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (self._k_scale_float if self.reads_float else self.k_scale)


def _refitting(module: _Refit) -> Any:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        module.refit()
        return {"x": torch.randn(num_tokens, D)}

    return make_inputs


def test_a_python_attribute_a_refit_changes_is_named_with_its_values_at_capture_and_now():
    module = _Refit(reads_float=True)
    report = _verify(module, _refitting(module), capture_sizes=[1, 2, 4])
    failed = _failed(report, "replay_matches_eager")
    assert failed, report.format()
    match = re.search(
        r"Python attribute\(s\) changed since FULL-T4-R4 was captured \(_k_scale_float: ([\d.]+) at capture, "
        r"([\d.]+) now\), by something other than forward .* with it put back eager gives the graph's result",
        failed[0].message,
    )
    assert match and match.group(1) != match.group(2), report.format()
    twin = _Refit(reads_float=False)
    assert _verify(twin, _refitting(twin), capture_sizes=[1, 2, 4]).ok


# -- 4. where two runs first differ ---------------------------------------------------------------------


def test_a_bug_in_the_users_wrapper_around_a_hugging_face_model_is_named_at_its_line():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )

    class Centered(nn.Module):
        def __init__(self, over_tokens: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inner = transformers.Qwen2ForCausalLM(config).eval()
            self.dim = 1 if over_tokens else -1

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            logits = self.inner(input_ids=input_ids).logits
            return logits - logits.mean(dim=self.dim, keepdim=True)  # the line a report must name

    def ids(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, 64, (1, num_tokens))}

    # Quick mode, one request: the sizes it does not capture are cut as the graphs' (1, T, V) logits are.
    report = _verify(Centered(over_tokens=True).eval(), ids, max_num_reqs=1, exhaustive=False)
    failed = _failed(report, "padded_size")
    assert failed, report.format()
    assert all(
        o.finding.first_call.startswith("torch.Tensor.mean at tests/test_causes.py:")
        and o.finding.first_call.endswith("in forward, in the top-level module")
        for o in failed
    ), report.format()
    assert "values first differ at torch.Tensor.mean" in report.format()
    twin = _verify(Centered(over_tokens=False).eval(), ids, max_num_reqs=1, exhaustive=False)
    assert twin.ok, twin.format()


def test_a_kernel_bug_is_named_at_the_kernels_caller_not_at_the_submodule_after_it():
    pytest.importorskip("triton")
    from examples.kernels.models import KernelMLP, inputs

    report = _verify(
        KernelMLP("triton_launch_statistic"), inputs("cpu", torch.float32), capture_sizes=[1, 2, 4]
    )
    failed = _failed(report, "padded_size")
    assert failed, report.format()
    first = failed[0].finding
    assert first.submodule == "down", report.format()  # its input differs: the cause is before it
    assert re.match(
        r"Triton kernel _rms_norm_launch at examples/kernels/triton_kernels\.py:\d+ in rms_norm_over_launch",
        first.first_call,
    ), report.format()


def test_a_branch_inside_a_library_is_told_with_the_users_frame_that_led_there():
    common = [("torch.add", "model.py:3 in forward", "model.py:3 in forward")]
    library = "transformers/masking_utils.py:761 in find_packed_sequence_indices"
    said = parting(
        [*common, ("torch.Tensor.all", library, "model.py:9 in forward")],
        [*common, ("torch.Tensor.cumsum", library, "model.py:9 in forward")],
    )
    assert f"calls torch.Tensor.all at {library}, reached from model.py:9 in forward" in said
    # The user's own line needs no "reached from".
    said = parting([*common, ("f", "m.py:4 in forward", "m.py:4 in forward")], common)
    assert "calls f at m.py:4 in forward where" in said and "reached from" not in said


# -- 8. words -------------------------------------------------------------------------------------------


def test_a_kernel_that_keeps_the_references_precision_is_not_said_to_hold_less():
    record = Record()
    record.outside["Triton kernel 'k'"] = "float64's precision"
    assert record.precision == "float64" and not record.lower
    record.outside["Triton kernel 'j'"] = "float32's precision"
    assert record.precision == "float64, except where it holds less (Triton kernel 'j': float32's precision)"


def test_counts_of_one_are_said_in_the_singular():
    assert [counted(1, "token"), counted(2, "token"), counted(1, "real row")] == [
        "1 token",
        "2 tokens",
        "1 real row",
    ]
