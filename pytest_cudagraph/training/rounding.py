"""Rounding made on purpose: how far a training step's results move when its kernels round otherwise.

A GPU may run another program under capture than eagerly at the same shape, and then the graph's
gradients differ from eager's in the last bits though eager reproduces itself bit for bit (seen on
an NVIDIA H200, torch 2.11, 2026-12-03: a LoRA adapter's gradient 2 bf16 ulps away under bf16
autocast, a GPT-2 embedding's tied gradient 3.9e-5 away; an embedding's backward has a capture path
of its own). Eager run twice then measures nothing (its drift is 0), and the dtype's tolerance is a
guess: absolute where gradients are small, and blind to cancellation.

``jittered()`` measures it instead: the step runs eagerly with the result of every op whose
rounding depends on the order a kernel picks (products, convolutions, attention, their backward,
reductions, scatters that accumulate) moved by one unit of rounding, ``u * (|x| + rms)`` with a
random sign, ``u`` the unit roundoff of the precision that op rounds at (bf16 under autocast, TF32
for fp32 products where torch allows it) and ``rms`` that of the op's whole result (another order
of a sum errs by the size of its terms, not of what they cancel to); the signs come from a
generator of its own, so the step's own random draws are not moved. What the
step leaves then differs from eager's by what one unit of rounding at each such op does to it,
cancellation and all, tensor by tensor. The floor is eager's, which runs the step's Python every
time: it cannot hold the bugs the step is checked for (state frozen at capture, a draw frozen at
capture, gradients let go), which live in the graph only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..observe import (
    _CONV,
    _MATMUL,
    DispatchMode,
    _fp32_roundoff,
    _packets,
    _written_arguments,
    unit_roundoff,
)

#: Reductions and accumulating scatters, beside the products of observe: their result's rounding
#: depends on the order the kernel adds in (split reductions, atomics, an embedding's backward that
#: groups by index). Pointwise ops, and their backward, round the same in any kernel: none here.
_REORDERS = _packets(
    "sum",
    "mean",
    "nansum",
    "embedding_dense_backward",
    "embedding_backward",
    "index_add",
    "scatter_add",
    "scatter_reduce",
    "index_put",
    "_index_put_impl",
    "index_reduce",
    "native_layer_norm_backward",
    "native_group_norm_backward",
    "native_batch_norm_backward",
    "_fused_rms_norm_backward",
)

_KINDS: dict[Any, str] = {}


def _kind(func: Any) -> str:
    """ "product", "conv", "reduction" or "" (an op whose rounding is the same in any kernel order)."""
    found = _KINDS.get(func)
    if found is None:
        packet = getattr(func, "overloadpacket", None)
        name = str(getattr(getattr(func, "_schema", None), "name", ""))
        if _written_arguments(func):
            found = ""  # it writes an argument in place: left as it is (its aliases would part)
        elif packet in _CONV or "convolution_backward" in name:
            found = "conv"
        elif packet in _MATMUL or (name.endswith("_backward") and "attention" in name):
            found = "product"
        elif packet in _REORDERS:
            found = "reduction"
        else:
            found = ""
        _KINDS[func] = found
    return found


class _Jitter(DispatchMode):
    def __init__(self, seed: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        #: How many results were moved, by op kind: a step with none has no floor to measure.
        self.moved = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = _kind(func)
        if not kind:
            return out
        return self._jitter(out, kind)

    def _jitter(self, out: Any, kind: str) -> Any:
        if isinstance(out, (list, tuple)):
            return type(out)(self._jitter(o, kind) for o in out)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not out.numel():
            return out
        u = unit_roundoff(out.dtype)
        if out.dtype == torch.float32 and kind != "reduction":
            u = max(u, _fp32_roundoff(out.device, conv=kind == "conv"))
        gen = self.generators.get(out.device)
        if gen is None:
            gen = self.generators[out.device] = torch.Generator(out.device).manual_seed(self.seed)
        wide = torch.float64 if out.dtype in (torch.float32, torch.float64) else torch.float32
        if out.device.type == "mps":
            wide = torch.float32
        x = out.to(wide)
        # One unit of rounding, of fixed size and random sign (a drawn size could be near 0 for a
        # scalar, and measure nothing): u times the element's size plus its tensor's rms, since
        # another order of the same sum errs by the size of its terms, not of a result they cancel to.
        sign = torch.randint(0, 2, out.shape, generator=gen, device=out.device).to(wide).mul_(2).sub_(1)
        rms = x.square().mean().sqrt()
        self.moved += 1
        return (x + sign * u * (x.abs() + rms)).to(out.dtype)


@contextlib.contextmanager
def jittered(seed: int) -> Iterator[_Jitter]:
    """Run the block (a step's forward and backward) with one unit of rounding added at every op
    whose rounding depends on the kernel's order; yields the mode (``moved``: how many results)."""
    mode = _Jitter(seed)
    with mode:
        yield mode
