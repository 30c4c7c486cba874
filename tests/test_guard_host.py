"""The guard on values the host hands to the device, on capture queries, and on where a call was made.

Every "caught" module below does something a real CUDA capture refuses, and
its twin does the same job in a way the capture accepts. What CUDA accepts
and refuses was read off an H200 (torch 2.11, one capture per case): the
comment on each twin says why it is capturable. On the emulator the graph's
device is the CPU, so the guard tells host values apart by where they were
made (Python data or a factory given no device, inside the forward).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytest_cudagraph
from pytest_cudagraph import CaptureConfig, CaptureError, GraphManager
from pytest_cudagraph import guard as guard_module
from pytest_cudagraph.guard import (
    CaptureGuard,
    ModuleTracker,
    Violation,
    check_op,
    find_violations,
    host_methods_watched,
)

aten = torch.ops.aten
D = 8
SIZES = [1, 2, 4]


def make_inputs(device: torch.device | str = "cpu") -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, D, device=device)}

    return make


def verify(module: nn.Module, backend: str = "emulate", device: torch.device | str = "cpu") -> Any:
    return pytest_cudagraph.verify(
        module.to(device), make_inputs(device), capture_sizes=SIZES, backend=backend, device=device
    )


def guarded_violations(module: nn.Module, x: torch.Tensor | None = None) -> list[Violation]:
    """Every violation of one eager forward under the guard, as capture_safety runs it (on the CPU)."""
    x = torch.randn(4, D) if x is None else x  # made outside: made inside, it would be a host value

    def forward() -> None:
        with torch.no_grad():
            module(x=x)

    return find_violations(forward, ModuleTracker(module), torch.device("cpu"))


def capture_safety_failures(report: Any) -> list[Any]:
    return [o for o in report.failures if o.check == "capture_safety"]


def line_of(func: Any, text: str) -> int:
    """The line of ``func``'s source that holds ``text``."""
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if text in line)


def assert_location(location: str, func: Any, text: str) -> None:
    path, _, rest = location.rpartition(":")
    assert Path(path).resolve() == Path(__file__).resolve(), location
    assert rest == f"{line_of(func, text)} in {func.__name__}", location


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("buf", torch.zeros(D))
        self.register_buffer("idx", torch.tensor([1, 2]))
        self.register_buffer("two", torch.tensor(2.0))
        self.register_buffer("pair", torch.tensor([1.0, 2.0]))


# -- A: code that asks whether it is captured ---------------------------------------------
def is_capturing() -> bool:
    # As transformers' is_cuda_stream_capturing asks: on a CPU-only build the
    # query raises outside a capture (the guard leaves it to torch there), and
    # the eager runs verify compares against are outside one.
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class SkipsSyncUnderCapture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_capturing():
            bool(x.sum() > 0)  # a validity check done only outside a capture
        return self.lin(x)


class AlwaysSyncs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bool(x.sum() > 0)
        return self.lin(x)


def test_code_that_asks_whether_it_is_captured_takes_its_capture_path(backend, device):
    report = verify(SkipsSyncUnderCapture(), backend, device)
    assert report.ok, report.format()
    failed = capture_safety_failures(verify(AlwaysSyncs(), backend, device))
    assert failed and all("bool(tensor)" in o.message for o in failed)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return type(exc)


def test_the_capture_query_is_torchs_own_outside_a_guard():
    original = torch.cuda.is_current_stream_capturing
    original_graphs = torch.cuda.graphs.is_current_stream_capturing
    before = _outcome(original)
    guard = CaptureGuard(ModuleTracker(nn.Identity()), torch.device("cpu"))
    with host_methods_watched():
        # Replaced for the whole sequence, but with no guard active it is torch's answer.
        assert torch.cuda.is_current_stream_capturing is not original
        assert _outcome(torch.cuda.is_current_stream_capturing) == before
        with guard.function_mode():
            assert torch.cuda.is_current_stream_capturing() is True
            assert torch.cuda.graphs.is_current_stream_capturing() is True
            guard.suspended += 1  # an exempt eager piece runs outside the capture
            assert _outcome(torch.cuda.is_current_stream_capturing) == before
            guard.suspended -= 1
        assert _outcome(torch.cuda.is_current_stream_capturing) == before
    assert torch.cuda.is_current_stream_capturing is original
    assert torch.cuda.graphs.is_current_stream_capturing is original_graphs
    with pytest.raises(KeyError), guard.function_mode():
        raise KeyError("the forward failed")
    assert torch.cuda.is_current_stream_capturing is original
    assert torch.cuda.graphs.is_current_stream_capturing is original_graphs
    assert _outcome(torch.cuda.is_current_stream_capturing) == before


def test_a_hugging_face_llama_passes_capture_safety():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids[None], use_cache=False).logits[0]

    report = pytest_cudagraph.verify(
        Logits(),
        lambda t, r: {"input_ids": torch.randint(0, 128, (t,))},
        capture_sizes=[1, 2, 4, 8],
        max_num_reqs=1,
        backend="emulate",
    )
    # transformers skips its `bool(torch.all(mask == 1))` when a stream is capturing.
    assert not capture_safety_failures(report), report.format()


# -- B: where the call was made -----------------------------------------------------------
class Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[torch.nonzero(x > 0)[:1, 0]]


class SyncsAtTwoLines(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Nonzero()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for _ in range(2):
            total += x.sum().item()  # one call site, met twice
        y = self.inner(x)
        return y * total + x.max().item()  # a second call site


def test_a_violation_names_the_line_that_called_it():
    found = guarded_violations(SyncsAtTwoLines())
    assert [(v.op, v.module_path) for v in found] == [
        ("Tensor.item()", ""),
        ("aten.nonzero.default", "inner"),
        ("Tensor.item()", ""),
    ]
    assert_location(found[0].location, SyncsAtTwoLines.forward, "total += x.sum().item()")
    assert_location(found[1].location, Nonzero.forward, "torch.nonzero")
    assert_location(found[2].location, SyncsAtTwoLines.forward, "x.max().item()")
    assert found[0] != found[2]  # the same op at two call sites is two violations
    assert found[0].location in found[0].describe()


# -- C: values made on the host -----------------------------------------------------------
# (1) written into a graph tensor, or read with graph tensors.
class WritesNumberByIndex(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf[0] = 3.0
        return self.lin(x) + self.buf


class FillsInPlace(WithBuffers):
    # fill_ takes the number by value into its kernel: no copy.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf[0:1].fill_(3.0)
        return self.lin(x) + self.buf


class WritesNumberAtIndices(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf[self.idx] = 2.0
        return self.lin(x) + self.buf


class WritesDeviceValueAtIndices(WithBuffers):
    # The value is a buffer: index_put_ copies device to device.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf[self.idx] = self.two
        return self.lin(x) + self.buf


class WritesHostTensor(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf[0:2] = torch.tensor([1.0, 2.0])
        return self.lin(x) + self.buf


class CopiesDeviceTensor(WithBuffers):
    # A device-to-device copy_ is a kernel the graph records.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf[0:2].copy_(self.pair)
        return self.lin(x) + self.buf


class AddsHostVector(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.tensor([1.0] * D)


class ScalesByHostScalar(WithBuffers):
    # A 0-dim CPU tensor as an operand of an arithmetic op is a CPU scalar,
    # passed to the kernel by value: the capture accepted it.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor(2.0)


class WhereHostScalar(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, self.lin(x), torch.tensor(0.0))


class WherePythonNumber(WithBuffers):
    # torch.where makes the number a scalar on the condition's device itself.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, self.lin(x), 0.0)


# (2) Python data copied to the device.
class TensorOnDevice(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.tensor([2.0] * D, device=x.device)


class AsTensorOnDevice(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.as_tensor([2.0] * D, device=x.device)


class FullOnDevice(WithBuffers):
    # torch.full on the device is a fill kernel with the number as its argument.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.full((D,), 2.0, device=x.device)


class NewTensor(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + x.new_tensor([2.0] * D)


class NewFull(WithBuffers):
    # new_full, like torch.full, fills on the device.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + x.new_full((D,), 2.0)


# (3) a host-made tensor moved to the device.
class MovesHostRange(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.arange(D).to(x.device)


class RangeOnDevice(WithBuffers):
    # arange on the device is a kernel: nothing is copied.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.arange(D, device=x.device)


class MovesHostScalar(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.tensor(3.0).to(x.device)


class ScalarOnDevice(WithBuffers):
    # scalar_tensor on the device is a fill, like torch.full.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.scalar_tensor(3.0, device=x.device)


class MovesDerivedHostValue(WithBuffers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (torch.arange(D) * 2)[None].to(x.device)


class HostArithmeticStaysOnHost(WithBuffers):
    # Work on host values alone runs on the host at capture (a constant);
    # its 0-dim result then reaches the device as a CPU scalar operand.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.arange(D) * 2
        h[0] = 5
        return self.lin(x) * h.sum()


W, DATA, MOVE = guard_module._WRITE_REASON, guard_module._DATA_TO_DEVICE_REASON, guard_module._MOVE_REASON
CAUGHT = [
    # module, op and reason named on the emulator, the line that does it, a capturable twin
    (WritesNumberByIndex, "aten.copy_.default", W, "self.buf[0] = 3.0", FillsInPlace),
    (
        WritesNumberAtIndices,
        "aten.index_put_.default",
        W,
        "self.buf[self.idx] = 2.0",
        WritesDeviceValueAtIndices,
    ),
    (WritesHostTensor, "aten.copy_.default", W, "torch.tensor([1.0, 2.0])", CopiesDeviceTensor),
    (
        AddsHostVector,
        "aten.add.Tensor",
        guard_module._OPERAND_REASON,
        "torch.tensor([1.0] * D)",
        ScalesByHostScalar,
    ),
    (WhereHostScalar, "aten.where.self", guard_module._WHERE_REASON, "torch.where", WherePythonNumber),
    (TensorOnDevice, "torch.tensor(..., device=...)", DATA, "torch.tensor(", FullOnDevice),
    (AsTensorOnDevice, "torch.as_tensor(..., device=...)", DATA, "torch.as_tensor(", FullOnDevice),
    (NewTensor, "Tensor.new_tensor()", DATA, "x.new_tensor", NewFull),
    (MovesHostRange, "Tensor.to(device)", MOVE, "torch.arange(D).to", RangeOnDevice),
    (MovesHostScalar, "Tensor.to(device)", MOVE, "torch.tensor(3.0).to", ScalarOnDevice),
    (MovesDerivedHostValue, "Tensor.to(device)", MOVE, "(torch.arange(D) * 2)", HostArithmeticStaysOnHost),
]


@pytest.mark.parametrize(
    ("caught", "op", "reason", "line", "twin"), CAUGHT, ids=[c[0].__name__ for c in CAUGHT]
)
def test_a_host_value_on_the_graphs_path_is_named_on_the_emulator(caught, op, reason, line, twin):
    found = guarded_violations(caught())
    assert [(v.op, v.reason, v.module_path) for v in found] == [(op, reason, "")]
    assert_location(found[0].location, caught.forward, line)
    # The emulated capture refuses it too, naming the same op.
    mgr = GraphManager(
        caught().eval(),
        make_inputs(),
        CaptureConfig(capture_sizes=SIZES, max_num_reqs=4),
        backend="emulate",
        device=torch.device("cpu"),
    )
    with pytest.raises(CaptureError) as info:
        mgr.capture()
    assert info.value.op == op
    assert f"{line_of(caught.forward, line)} in forward" in str(info.value)


@pytest.mark.parametrize(
    ("caught", "op", "reason", "line", "twin"), CAUGHT, ids=[c[0].__name__ for c in CAUGHT]
)
def test_a_host_value_fails_capture_safety_and_its_twin_passes(
    backend, device, caught, op, reason, line, twin
):
    torch.manual_seed(0)
    assert capture_safety_failures(verify(caught(), backend, device))
    torch.manual_seed(0)
    report = verify(twin(), backend, device)
    assert report.ok, report.format()


def test_values_used_on_the_host_alone_are_not_flagged():
    class HostOnly(WithBuffers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(D)
            positions[0] = 7  # a write into a host tensor: no device involved
            scale = torch.tensor(2.0)
            return self.lin(x) * scale + positions.sum() * torch.tensor(0.5)

    assert guarded_violations(HostOnly()) == []


# -- the CUDA path's rule, on a constructed call -------------------------------------------
def test_check_op_names_a_cpu_scalar_written_into_a_device_tensor():
    # Fake CUDA tensors stand in for device memory: check_op reads only devices and shapes.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        dest = torch.empty(4, device="cuda")
        element = torch.empty((), device="cuda")
        idx = torch.zeros(2, dtype=torch.int64, device="cuda")
        lifted = torch.empty(2, device="cuda")
    cuda = torch.device("cuda", 0)
    value = torch.tensor(3.0)  # a 0-dim CPU tensor: what `t[0] = 3.0` writes
    written = ("aten.copy_.default", W)
    assert check_op(aten.copy_.default, (element, value), {}, cuda) == written
    assert check_op(aten.index_put_.default, (dest, [idx], value), {}, cuda) == ("aten.index_put_.default", W)
    assert check_op(aten.where.self, (dest > 0, dest, value), {}, cuda) == (
        "aten.where.self",
        guard_module._WHERE_REASON,
    )
    assert check_op(aten.lift_fresh.default, (lifted,), {}, cuda) == ("aten.lift_fresh.default", DATA)
    # A CPU scalar as an operand, or filled from, is taken by value: capturable.
    assert check_op(aten.mul.Tensor, (dest, value), {}, cuda) is None
    assert check_op(aten.fill_.Tensor, (dest, value), {}, cuda) is None
    # On the emulator every tensor is on the CPU: provenance, not check_op, decides there.
    assert check_op(aten.copy_.default, (torch.zeros(()), value), {}, torch.device("cpu")) is None


# -- t[mask] = number is masked_fill_ on a GPU: captured, so never flagged ------------------
class FillsByMask(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[y < 0] = 0.0  # index_put_ with a boolean mask and a CPU scalar: masked_fill_ (captured on the H200)
        return y


class FillsByMaskFromDevice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[y < 0] = x.max()  # a device value through a boolean mask: nonzero, a host sync
        return y


def test_boolean_mask_fill_with_a_number_is_not_flagged(backend, device):
    from pytest_cudagraph.checks import verify

    make = lambda t, r: {"x": torch.randn(t, 4, device=device)}  # noqa: E731
    report = verify(FillsByMask(), make, capture_sizes=(1, 2, 4), backend=backend, device=device)
    assert report.ok, report.format()
    report = verify(FillsByMaskFromDevice(), make, capture_sizes=(1, 2, 4), backend=backend, device=device)
    failed = [o for o in report.failures if o.check == "capture_safety"]
    assert failed and "boolean-mask indexing" in failed[0].message, report.format()


class StartsEmpty(torch.nn.Module):
    """Starts from an empty device tensor, as transformers' DynamicCache does: a copy of nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = torch.tensor([], dtype=x.dtype, device=x.device)
        return torch.cat([start, x.reshape(-1)]).reshape(x.shape) * 2


def test_empty_python_data_on_the_device_is_not_flagged(backend, device):
    from pytest_cudagraph.checks import verify

    make = lambda t, r: {"x": torch.randn(t, 4, device=device)}  # noqa: E731
    report = verify(StartsEmpty(), make, capture_sizes=(1, 2, 4), backend=backend, device=device)
    assert report.ok, report.format()
