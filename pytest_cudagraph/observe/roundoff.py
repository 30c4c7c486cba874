"""Unit roundoff and the precision of products: how far each floating dtype rounds, which ops
are the products and convolutions whose rounding differs between batch shapes, and the precision
an fp32 product or convolution runs at on a device under torch's current settings (TF32, or
bf16 under ``set_float32_matmul_precision("medium")``)."""

from __future__ import annotations

import torch

from .ops import _packets

#: The unit roundoff (half the gap between 1 and the next value) of each floating dtype.
_UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.complex128: 2.0**-53,
    torch.complex64: 2.0**-24,
}
for _name, _u in (
    ("float8_e4m3fn", 2.0**-4),
    ("float8_e4m3fnuz", 2.0**-4),
    ("float8_e5m2", 2.0**-3),
    ("float8_e5m2fnuz", 2.0**-3),
):
    if hasattr(torch, _name):
        _UNIT_ROUNDOFF[getattr(torch, _name)] = _u
#: TensorFloat-32: fp32's range with fp16's 10-bit mantissa.
TF32 = 2.0**-11


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype``; 0.0 for integers and bool (exact)."""
    return _UNIT_ROUNDOFF.get(dtype, 0.0)


# Where the bulk of a forward's rounding happens: long reductions whose
# order the kernel picks by shape. Elementwise ops round once per element,
# the same way at every shape.
_MATMUL = _packets(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "addmv",
    "mv",
    "dot",
    "vdot",
    "matmul",
    "linear",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_scaled_dot_product_attention_math",
)
_CONV = _packets(
    "convolution",
    "_convolution",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "mkldnn_convolution",
    "convolution_overrideable",
    "_slow_conv2d_forward",
    "conv2d",
    "conv1d",
    "conv3d",
)


def _fp32_roundoff(device: torch.device, conv: bool) -> float:
    """What an fp32 product or convolution rounds at on ``device`` under torch's current settings."""
    try:
        if conv:
            return TF32 if device.type == "cuda" and _tf32_convolutions() else 2.0**-24
        return _fp32_products(device)
    except (RuntimeError, AttributeError):
        # torch refuses to say (its legacy and new precision settings were mixed): the looser
        # reading, so that rounding is never taken for a bug.
        return TF32 if device.type == "cuda" else 2.0**-24


def _tf32_convolutions() -> bool:
    """Whether cuDNN may run fp32 convolutions in TF32 (on by default)."""
    setting = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    if setting in ("tf32", "ieee"):
        return bool(setting == "tf32")
    return bool(torch.backends.cudnn.allow_tf32)


def _fp32_products(device: torch.device) -> float:
    """The unit roundoff fp32 matrix products run at on ``device``."""
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return 2.0**-8  # fp32 products may run in bf16
    if device.type != "cuda":
        return 2.0**-24
    return TF32 if (torch.backends.cuda.matmul.allow_tf32 or precision == "high") else 2.0**-24
