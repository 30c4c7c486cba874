"""A quantized weight of our own: a wrapper tensor subclass, as torchao's are.

``Int8Weight`` holds no storage of its own. Its data is two inner tensors, the int8 values
(``qdata``, one row per output feature) and a scale per row (``scale``), handed out through
``__tensor_flatten__``; ``F.linear`` on it runs the quantized product (``__torch_function__``),
and the few ops a module's bookkeeping needs (``detach``, ``clone``, ``_to_copy`` to another
device, ``alias``) are rewrapped. Every other op raises, as torchao's subclasses do for ops
they do not implement, so a harness that treats it as a plain tensor (its storage, ``.view``,
``.to(float64)``) fails here as it would on a real quantized model.

Activations are quantized in three ways:

- ``act=None``: weight-only, the product in the activation's dtype;
- ``act="token"``: dynamic int8 with one scale per token (row), correct under padding;
- ``act="tensor"``: dynamic int8 with one scale over the whole batch, the bug: padded rows
  enter the scale of every real row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Weight", "quantize_linears"]

aten = torch.ops.aten

# Ops on the whole weight that move or copy it: applied to each inner tensor, then rewrapped.
_REWRAPPED = {aten.detach.default, aten.clone.default, aten.alias.default, aten._to_copy.default}


class Int8Weight(torch.Tensor):
    qdata: torch.Tensor
    scale: torch.Tensor
    act: str | None

    @staticmethod
    def __new__(
        cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, act: str | None = None
    ) -> Any:
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(
        self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, act: str | None = None
    ) -> None:
        self.qdata, self.scale, self.act = qdata, scale, act

    def __repr__(self) -> str:  # a wrapper has no data of its own to print
        return f"Int8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, act={self.act})"

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["qdata", "scale"], {"dtype": self.dtype, "act": self.act}

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: dict[str, Any], size: Any, stride: Any
    ) -> Int8Weight:
        return Int8Weight(inner["qdata"], inner["scale"], meta["dtype"], meta["act"])

    @classmethod
    def from_float(cls, weight: torch.Tensor, act: str | None = None) -> Int8Weight:
        """Symmetric int8 with a scale per output row (the scale in float32)."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qdata = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(qdata, scale, weight.dtype, act)

    def dequantize(self) -> torch.Tensor:
        return (self.qdata.float() * self.scale[:, None]).to(self.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return _linear(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _REWRAPPED:
            w = args[0]
            if func is aten._to_copy.default and kwargs.get("dtype", w.dtype) != w.dtype:
                raise NotImplementedError("Int8Weight keeps its dtype; dequantize() to convert it")
            moved = {k: v for k, v in kwargs.items() if k != "dtype"}
            return Int8Weight(func(w.qdata, **moved), func(w.scale, **moved), w.dtype, w.act)
        raise NotImplementedError(f"Int8Weight does not implement {func}")


def _quantize_rows(x: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values of ``x`` (rows of its last dimension) and their scale: one per row, or one over
    every row of the batch."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax()
    scale = amax.clamp(min=1e-8) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def _linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if w.act is None:
        y = (rows @ w.qdata.t().to(x.dtype)) * w.scale.to(x.dtype)
    else:
        xq, xs = _quantize_rows(rows, per_token=w.act == "token")
        # The int8 product, exact as an int8 GEMM's int32 accumulation is (so the same at every
        # batch shape): in float32, which holds every sum of fewer than 1040 products of int8
        # values exactly (|sum| < 2**24), and runs on every device (int32 matmul has no CUDA kernel).
        assert rows.shape[-1] < 1040, "the float32 accumulation is exact below 1040 features"
        acc = xq.float() @ w.qdata.t().float()
        y = (acc * xs * w.scale).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], w.shape[0])


def quantize_linears(module: nn.Module, act: str | None = None) -> nn.Module:
    """Every ``nn.Linear`` weight of ``module`` replaced by an ``Int8Weight`` parameter, in place."""
    if act not in (None, "token", "tensor"):
        raise ValueError(f"act must be None, 'token' or 'tensor'; got {act!r}")
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.weight = nn.Parameter(Int8Weight.from_float(sub.weight, act), requires_grad=False)
    return module
