"""The Triton norm behind ``torch.library.custom_op``, as engines register their kernels: the
dispatcher sees the op whole, never inside it, and the op accepts only the dtypes its kernel was
written for (float16, bfloat16 and float32; one of them bfloat16 alone, as fused attention
extensions do)."""

from __future__ import annotations

import torch

from .triton_kernels import rms_norm

__all__ = ["rms_norm_bf16_only", "rms_norm_lowp"]

_LOW = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("cudagraph_examples::rms_norm_lowp", mutates_args=())
def rms_norm_lowp(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in _LOW or w.dtype not in _LOW:
        raise TypeError(f"rms_norm_lowp takes float16, bfloat16 or float32, got {x.dtype}")
    return rms_norm(x, w, eps, how="heuristic")


@rms_norm_lowp.register_fake
def _(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cudagraph_examples::rms_norm_bf16_only", mutates_args=())
def rms_norm_bf16_only(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"rms_norm_bf16_only takes bfloat16, got {x.dtype}")
    return rms_norm(x, w, eps, how="heuristic")


@rms_norm_bf16_only.register_fake
def _(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)
