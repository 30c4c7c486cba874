"""The check each bug of the gallery (``examples/buggy``) must fail, and its correct twin.

Every check of the harness is proven by a pair: the buggy module must fail
that check with the expected message, the twin must pass every check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from examples.buggy.batch_statistics import (
    BatchStatistics,
    BatchStatisticsInBf16Kernel,
    BatchStatisticsInFloat32Kernel,
    TokenStatistics,
    TokenStatisticsInBf16Kernel,
    TokenStatisticsInFloat32Kernel,
)
from examples.buggy.class_count import CountsClasses, CountsClassesGiven
from examples.buggy.common import D, token_inputs
from examples.buggy.device_solver import InvertsInForward, InvertsWithoutCheck
from examples.buggy.dynamic_rope import DynamicNTKRotary, StaticRotary
from examples.buggy.expert_load import HashRoutedLoad, MaskedHashRoutedLoad, id_inputs
from examples.buggy.forward_context import (
    CountsStepsInDict,
    CountsStepsOnDevice,
    ReadsCopiedTemperature,
    ReadsReplacedTemperature,
    ReadsTokenCount,
    TakesTokenCount,
    context_inputs,
)
from examples.buggy.host_seed import DeviceOffsetSampler, HostOffsetSampler
from examples.buggy.host_sync import HostSync, HostSyncFixed
from examples.buggy.host_value import CountsOnDevice, WritesPythonCount
from examples.buggy.input_mutation import CopiesInput, MutatesInput
from examples.buggy.list_index import PermutesWithBuffer, PermutesWithList
from examples.buggy.output_alias import ReturnsStatsBuffer, ReturnsStatsCopy
from examples.buggy.padding_leak import MaskByMultiply, MaskBySelect, PoolsPaddedRows
from examples.buggy.python_input import BoundedByMaxSeqLen, ScalesByMaxSeqLen, seq_len_inputs
from examples.buggy.python_state import BufferCounter, PythonCounter
from examples.buggy.query_len import PlannedPerGraph, PlannedPerRequestCount
from examples.buggy.rebound_buffer import RebindsBuffer, UpdatesBufferInPlace
from examples.buggy.reseed import DrawsNoise, ReseedsInForward
from examples.buggy.side_output import ReturnsHidden, StoresHidden
from examples.buggy.stale_cache import IdentityMemo, NoMemo
from examples.buggy.uninitialized import SplitKIntoEmpty, SplitKIntoWritten
from examples.buggy.unregistered_state import RegisteredState, UnregisteredState
from examples.speculative import spec_inputs

__all__ = [
    "PAIRS",
    "D",
    "IdentityMemo",
    "NoMemo",
    "Pair",
    "PythonCounter",
    "id_inputs",
    "spec_inputs",
    "token_inputs",
]


@dataclass(frozen=True)
class Pair:
    check: str
    buggy: type[nn.Module]
    correct: type[nn.Module]
    message: str  # a regex the failure message must match
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: The name of the make_inputs factory in this module (a name, so that pytester files can import it).
    inputs: str = "token_inputs"

    def make_inputs(self, device: Any = "cpu") -> Any:
        return INPUTS[self.inputs](device)


INPUTS = {
    "token_inputs": token_inputs,
    "id_inputs": id_inputs,
    "spec_inputs": spec_inputs,
    "seq_len_inputs": seq_len_inputs,
    "context_inputs": context_inputs,
}


PAIRS = [
    Pair(
        "capture_safety", HostSync, HostSyncFixed, r"Tensor\.item\(\) \(host sync\) in the top-level module"
    ),
    Pair(
        "capture_safety",
        WritesPythonCount,
        CountsOnDevice,
        r"aten\.copy_\.default \(host-to-device copy: a value made on the host .* in the top-level module",
    ),
    # An op whose CUDA kernel code syncs: known on the CPU from the table learned on a GPU.
    Pair(
        "capture_safety",
        InvertsInForward,
        InvertsWithoutCheck,
        r"aten\._linalg_check_errors\.default \(a CUDA graph capture refuses it",
    ),
    # Shapes and values decide: one_hot reads its class count back only when none is given.
    Pair(
        "capture_safety",
        CountsClasses,
        CountsClassesGiven,
        # The emulator names the call; on a GPU the guard stops the read-back beneath it.
        r"(torch\.nn\.functional\.one_hot\(num_classes=-1\) \(host sync|aten\._local_scalar_dense\.default \()",
    ),
    # A Python list index: copied to the device below every dispatcher (learned on the H200).
    Pair(
        "capture_safety",
        PermutesWithList,
        PermutesWithBuffer,
        r"(Tensor\.__getitem__ with a Python list index|aten\.lift_fresh\.default) \(host-to-device copy",
    ),
    Pair(
        "replay_matches_eager",
        PythonCounter,
        BufferCounter,
        r"Python state changes on every forward \(calls:",
    ),
    Pair("fresh_inputs", IdentityMemo, NoMemo, r"with fresh inputs after capture, replay differs from eager"),
    # Speculative decoding: metadata planned per request count, shared by graphs of several query lengths.
    Pair(
        "padded_size",
        PlannedPerRequestCount,
        PlannedPerGraph,
        r"the module computes something else when it is "
        r"captured: on the real batch itself, eager on its capture path",
        {"mode": "FULL_DECODE_ONLY", "decode_query_len": 4, "decode_query_lens": (1, 2, 3, 4)},
        "spec_inputs",
    ),
    Pair(
        "padded_size",
        BatchStatistics,
        TokenStatistics,
        r"eager at the graph's padded size \(\d+ tokens?\), cut to the \d+ real rows?, differs from eager on "
        r"(those \d+ tokens|that token) by .* in float64.*: a computation depends on the padded batch size",
    ),
    # A rotary table made for the padded length (dynamic NTK scaling).
    Pair(
        "padded_size",
        DynamicNTKRotary,
        StaticRotary,
        r"differs from eager on (those \d+ tokens|that token) by .*: a computation depends on the padded batch size",
    ),
    # A kernel for float32 alone: the reference runs in float32 with TF32 off.
    Pair(
        "padded_size",
        BatchStatisticsInFloat32Kernel,
        TokenStatisticsInFloat32Kernel,
        r"in float32 \(TF32 off\), where rounding moves it by .*: a computation depends on the padded batch size",
    ),
    # No reference (float64 or float32) can run a kernel for bf16 alone: the floor of the module's own precision.
    Pair(
        "real_batches",
        BatchStatisticsInBf16Kernel,
        TokenStatisticsInBf16Kernel,
        r"real rows (are off systematically|differ from eager on the unpadded batch by)",
    ),
    # Integer rows of padding: ids a router counts (hash-routed expert loads).
    Pair(
        "padding_isolation",
        HashRoutedLoad,
        MaskedHashRoutedLoad,
        r"module state 'load' changes when padded rows of 'ids' hold .* instead of their pad value: padded rows "
        r"write into state",
        inputs="id_inputs",
    ),
    Pair(
        "padding_isolation",
        PoolsPaddedRows,
        MaskBySelect,
        r"real rows change when padded rows of 'x' hold random values instead of zeros: padding leaks into real "
        r"rows",
    ),
    # Non-finite padding is a strictness beyond what engines do; its failures say so.
    Pair(
        "padding_isolation",
        MaskByMultiply,
        MaskBySelect,
        r"real rows change when padded rows of 'x' hold NaN instead of zeros: padding leaks into real rows "
        r".*found by nonfinite_padding=True",
        kwargs={"nonfinite_padding": True},
    ),
    Pair(
        "state", MutatesInput, CopiesInput, r"input \['x'\] is mutated in place by eager but not by run\(\)"
    ),
    Pair(
        "side_outputs",
        StoresHidden,
        ReturnsHidden,
        r"forward stores a new tensor in the plain attribute 'hidden' on every call.*still holds the tensor "
        r"stored at capture",
    ),
    Pair(
        "determinism",
        SplitKIntoEmpty,
        SplitKIntoWritten,
        r"forward reads memory nobody wrote: aten\.add_\.Tensor reads what aten\.empty\.memory_format handed back",
    ),
    Pair(
        "determinism",
        UnregisteredState,
        RegisteredState,
        r"two replays of the same inputs, from the same module state and seed, differ",
    ),
    Pair(
        "output_lifetime",
        ReturnsStatsBuffer,
        ReturnsStatsCopy,
        r"an output returned by run\(\) on the eager \(NONE\) path changed when later batches ran",
    ),
    Pair(
        "address_stability",
        RebindsBuffer,
        UpdatesBufferInPlace,
        r"module tensor 'running' moved: it was rebound to another tensor",
    ),
    Pair("rng", ReseedsInForward, DrawsNoise, r"under the same seed, replay draws differ from eager draws"),
    # A seed and an offset handed to a kernel as Python numbers: every replay repeats the capture's draw.
    Pair(
        "rng",
        HostOffsetSampler,
        DeviceOffsetSampler,
        r"cudagraph_gallery\.hash_noise\.default at \S*examples/buggy/host_seed\.py:\d+ in forward \(offset: (\d+) -> "
        r"(?!\1)\d+, kept in offset\) is handed host numbers that change on every forward.* every replay repeats "
        r"the draw made at capture",
    ),
    # A Python number among the inputs that decides the result: held per graph at its capture's value.
    Pair(
        "padded_size",
        ScalesByMaxSeqLen,
        BoundedByMaxSeqLen,
        r"input 'max_seq_len' is a Python value, which a graph holds at the value its capture was given: "
        r"FULL-T(\d+)-R\d+ holds max_seq_len=(\d+), this batch has max_seq_len=(?!\2)\d+, and the graph's result "
        r"depends on it.* Pass it as a tensor input .*, or give it one value for every size",
        inputs="seq_len_inputs",
    ),
    # State forward reads from outside the module (issue #69): a forward context the runner fills each
    # step, named by where it lives, the line that read it and both values.
    Pair(
        "real_batches",
        ReadsTokenCount,
        TakesTokenCount,
        r"Python value\(s\) forward reads from outside the module changed since FULL-T\d+-R\d+ was captured "
        r"\(FORWARD_CONTEXT\['meta'\]\.num_actual_tokens \(a module-level dict of examples\.buggy\.forward_context, "
        r"read at \S*examples/buggy/forward_context\.py:\d+ in ReadsTokenCount\.forward\): (\d+) at capture, "
        r"(?!\1)\d+ now\).* with it put back eager gives the graph's result",
        inputs="context_inputs",
    ),
    Pair(
        "fresh_inputs",
        ReadsReplacedTemperature,
        ReadsCopiedTemperature,
        r"FORWARD_CONTEXT\['temperature'\] \(a module-level dict of examples\.buggy\.forward_context, read at "
        r"\S*examples/buggy/forward_context\.py:\d+ in ReadsReplacedTemperature\.forward\) holds another tensor "
        r"than when FULL-T\d+-R\d+ was captured .* copy into the captured tensor instead",
        inputs="context_inputs",
    ),
    Pair(
        "replay_matches_eager",
        CountsStepsInDict,
        CountsStepsOnDevice,
        r"Python state changes on every forward \(STEPS\['step'\] \(a module-level dict of "
        r"examples\.buggy\.forward_context, read at \S*examples/buggy/forward_context\.py:\d+ in "
        r"CountsStepsInDict\.forward\): (\d+) -> (?!\1)\d+\)",
    ),
]
