"""A compiled extension called directly: an RMSNorm in C (CPU, through ctypes) or CUDA (through
CuPy, on torch's current stream), reading and writing raw pointers, so torch's dispatcher never
sees it. Like engines' kernels it accumulates in float32 for float32 and float64 alike, and picks
its block from the token count, so its rounding changes with the batch shape.

``available(device)`` says whether it can be built here (a C compiler, or CuPy), and why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

__all__ = ["available", "rms_norm_ext"]

_C = r"""
#include <math.h>
#define NORM(NAME, T)                                                                 \
void NAME(const T* x, const T* w, T* y, long rows, long d, float eps, long block) {   \
    for (long r = 0; r < rows; ++r) {                                                 \
        float acc[64] = {0};                                                          \
        for (long c = 0; c < d; ++c) { float v = (float)x[r * d + c]; acc[c % block] += v * v; } \
        float s = 0.f;                                                                \
        for (long b = 0; b < block; ++b) s += acc[b];                                 \
        float rstd = 1.f / sqrtf(s / (float)d + eps);                                 \
        for (long c = 0; c < d; ++c) y[r * d + c] = (T)((float)x[r * d + c] * rstd * (float)w[c]); \
    }                                                                                 \
}
NORM(rms_norm_f32, float)
NORM(rms_norm_f64, double)
"""

_CUDA = r"""
template <typename T>
__device__ void norm(const T* x, const T* w, T* y, long d, float eps, long block) {
    long r = blockIdx.x;
    float acc[64] = {0};
    for (long c = 0; c < d; ++c) { float v = (float)x[r * d + c]; acc[c % block] += v * v; }
    float s = 0.f;
    for (long b = 0; b < block; ++b) s += acc[b];
    float rstd = rsqrtf(s / (float)d + eps);
    for (long c = threadIdx.x; c < d; c += blockDim.x) y[r * d + c] = (T)((float)x[r * d + c] * rstd * (float)w[c]);
}
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* y, long d, float eps, long block) {
    norm<float>(x, w, y, d, eps, block);
}
extern "C" __global__ void rms_norm_f64(const double* x, const double* w, double* y, long d, float eps, long block) {
    norm<double>(x, w, y, d, eps, block);
}
"""

_NAMES = {torch.float32: "rms_norm_f32", torch.float64: "rms_norm_f64"}


def _block(rows: int) -> int:
    """The blocking heuristic on the token count: another summation order per shape."""
    return 8 if rows < 4 else 16 if rows < 8 else 32


@cache
def _cpu_library() -> Any:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    digest = hashlib.sha256(_C.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"cudagraph_examples_rms_{digest}.so"
    if not out.exists():
        src = out.with_suffix(".c")
        src.write_text(_C)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", str(src), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    for name in _NAMES.values():
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_long]
    return lib


@cache
def _cuda_module() -> Any:
    import cupy

    return cupy.RawModule(code=_CUDA, options=("-std=c++14",), name_expressions=None)


def available(device: torch.device | str) -> str:
    """'' where the extension can run on ``device``, else why not."""
    try:
        if torch.device(device).type == "cuda":
            _cuda_module()
        else:
            _cpu_library()
    except Exception as exc:
        return f"the example extension cannot be built here ({type(exc).__name__}: {exc})"
    return ""


def rms_norm_ext(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of a contiguous 2-D ``x`` (float32 or float64), launched outside torch."""
    name = _NAMES.get(x.dtype)
    if name is None or w.dtype != x.dtype:
        raise TypeError(f"rms_norm_ext takes float32 or float64, got {x.dtype} and {w.dtype}")
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty_like(x)
    rows, d = x.shape
    if x.is_cuda:
        import cupy

        kernel = _cuda_module().get_function(name)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream)
        with stream:
            kernel(
                (rows,),
                (128,),
                (
                    x.data_ptr(),
                    w.data_ptr(),
                    y.data_ptr(),
                    cupy.int64(d),
                    cupy.float32(eps),
                    cupy.int64(_block(rows)),
                ),
            )
    else:
        getattr(_cpu_library(), name)(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, d, eps, _block(rows))
    return y
