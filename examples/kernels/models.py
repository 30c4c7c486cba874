"""Small models around kernels launched outside torch's dispatcher, correct and buggy.

Each is Linear -> a norm (or an int8 round trip) -> Linear over tokens of width ``D``, in the
dtype given. The correct ones compute every row from that row alone; their kernels round
differently at different batch shapes, as such kernels do. The buggy ones let padded rows reach
real ones: inside a kernel (a statistic over every launched row), or in torch code beside it (an
error on the padded sizes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .extension import rms_norm_ext
from .ops import rms_norm_bf16_only, rms_norm_lowp
from .triton_kernels import fake_quant, rms_norm, rms_norm_over_launch

__all__ = ["CORRECT", "D", "KernelMLP", "PaddedSizeError", "inputs"]

D = 128
EPS = 1e-6

Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: name -> the norm each model calls between its two linear layers.
NORMS: dict[str, Norm] = {
    "triton_autotune": lambda h, w: rms_norm(h, w, EPS, how="autotune"),
    "triton_heuristic": lambda h, w: rms_norm(h, w, EPS, how="heuristic"),
    "custom_op_lowp": lambda h, w: rms_norm_lowp(h, w, EPS),
    "extension": lambda h, w: rms_norm_ext(h, w, EPS),
    "custom_op_bf16_only": lambda h, w: rms_norm_bf16_only(h, w, EPS),
    "triton_per_token_quant": lambda h, w: fake_quant(h, per_token=True) * w,
    # The bugs inside a kernel: padded rows reach real ones.
    "triton_launch_statistic": lambda h, w: rms_norm_over_launch(h, w, EPS),
    "triton_launch_absmax": lambda h, w: fake_quant(h, per_token=False) * w,
}

#: The correct models and the dtypes they are verified in (the extension takes float32; the
#: bf16-only op bfloat16).
CORRECT: dict[str, tuple[torch.dtype, ...]] = {
    "triton_autotune": (torch.float32, torch.bfloat16),
    "triton_heuristic": (torch.float32, torch.bfloat16),
    "custom_op_lowp": (torch.float32, torch.bfloat16),
    "triton_per_token_quant": (torch.float32, torch.bfloat16),
    "extension": (torch.float32,),
    "custom_op_bf16_only": (torch.bfloat16,),
}
#: Kernel bugs and the correct model of the same kernel.
KERNEL_BUGS = {"triton_launch_statistic": "triton_autotune", "triton_launch_absmax": "triton_per_token_quant"}


class KernelMLP(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.norm_name = norm
        self.up = nn.Linear(D, D)
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(D))
        self.down = nn.Linear(D, D)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return NORMS[self.norm_name](self.up(x), self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.hidden(x))


class PaddedSizeError(KernelMLP):
    """A correct kernel, and beside it in torch code an error of ``error`` (relative) at even
    token counts: the padded sizes of capture sizes 2, 4, 8."""

    def __init__(self, norm: str, error: float) -> None:
        super().__init__(norm)
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        if h.shape[0] % 2 == 0:
            h = h * (1.0 + self.error)
        return self.down(h)


def inputs(device: torch.device | str, dtype: torch.dtype) -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, D, device=device, dtype=dtype)}

    return make_inputs
