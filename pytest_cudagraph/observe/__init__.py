"""What a forward does to its module, seen op by op.

Two things the checks need and cannot read off the module itself:

- **Which parameters and buffers a forward writes.** Verification restores
  the module between runs and compares its state; copying every parameter
  for that would double an 8B model's memory. Only what a forward writes
  (a KV cache, a counter, running statistics) needs a copy, and every write
  passes through the dispatcher as an op whose schema marks the argument it
  writes (``alias_info.is_write``), so a dispatch mode sees each one.
- **The precision its arithmetic runs at.** Eager runs of different batch
  shapes round differently (another GEMM tiling, another reduction order),
  and how far is set by the coarsest precision the matrix products and
  convolutions run at: bf16, or TF32 for fp32 tensors on a GPU that allows
  it, whatever dtype the output has.

The observer is fed by the capture guard (every op of a checked capture and
of the guarded eager runs) and by ``observing`` for eager forwards of its
own (a learning pass, the probes). ``restoring`` runs forwards whose effect
must not stay: it copies each tensor just before its first write and puts the
copies back afterwards, so a forward that writes nothing costs no copy.

The package, a subject a module: ``ops`` (what an op does, from its schema), ``roundoff`` (unit
roundoff and the precision of products), ``tensors`` (the walk over a module's parameters and
buffers), ``observer`` (``ForwardObserver``), ``modes`` (the dispatch modes: the base, observing,
restoring, poisoning, outside a forward), ``fingerprint`` (fingerprints and bit sums).
"""

from __future__ import annotations

from .fingerprint import bit_sums, fingerprint
from .modes import (
    DispatchMode,
    buffers_restored,
    internal_error,
    observing,
    outside_forward,
    poisoned,
    restoring,
)
from .observer import ForwardObserver
from .ops import _packets as _packets
from .ops import _written_arguments as _written_arguments
from .ops import data_read, draws_random, written_tensors
from .roundoff import _CONV as _CONV
from .roundoff import _MATMUL as _MATMUL
from .roundoff import TF32, unit_roundoff
from .roundoff import _fp32_roundoff as _fp32_roundoff
from .tensors import MODULE_INTERNALS, module_tensors, named_tensors, plain_parts, quantizes

__all__ = [
    "MODULE_INTERNALS",
    "TF32",
    "DispatchMode",
    "ForwardObserver",
    "bit_sums",
    "buffers_restored",
    "data_read",
    "draws_random",
    "fingerprint",
    "internal_error",
    "module_tensors",
    "named_tensors",
    "observing",
    "outside_forward",
    "plain_parts",
    "poisoned",
    "quantizes",
    "restoring",
    "unit_roundoff",
    "written_tensors",
]
