"""A forward run in a higher precision than its own: the reference of the ``padded_size`` check.

Eager at a graph's padded shape, cut to the real rows, should equal eager on
the real batch: a property of eager alone, which rounding blurs. In bf16 two
batch shapes differ by several percent (another GEMM tiling, through 32
layers), so a computation that depends on the padded size hides below that
blur. Run in float64 the same two forwards differ by rounding of about 1e-13,
and any such computation stands out by orders of magnitude.

``raised`` runs a block with every floating computation promoted, op by op,
without copying the module: a ``TorchDispatchMode`` converts each op's
float16, bfloat16 and float32 operands to float64 as it runs, turns requests
for those dtypes (``.to(torch.float32)``, ``torch.zeros(dtype=...)``,
autocast's casts) into float64, and leaves everything else as it is:

- views run on the tensor itself, so a write through a view still reaches it
  (a KV cache written through a slice);
- an op that writes a tensor of a lower precision (the module's own state:
  a cache, a counter) writes it in that tensor's dtype, as the module does;
- casts to float8 and integers stay: quantization is part of the module's
  computation, and rounding the same float64 value the same way gives the
  same result at every shape;
- an op with no float64 kernel (fused attention called directly,
  ``_scaled_mm``) runs in float32 with TF32 off, and the record says so: the
  reference's precision is then float32's;
- an op that runs in neither raises ``NoReference`` with the op and its error.

Weights are converted as each op reads them, so the extra memory is the
largest weight in float64 plus the forward's activations in float64, never a
copy of the model. A product whose weight would be large in float64 (an LLM's
lm_head: 3.9 GiB at 8B) is computed a block of the weight's columns at a time,
each block converted as it is used; large CUDA tensors are converted by a
Triton kernel of the module's own (``_to_float64``), faster than ``.to()``.

The package, a subject a module: ``raising`` (the dispatch mode and ``raised``), ``convert`` (what
each dtype becomes, operands raised, the conversion kernel, products in blocks of columns),
``noise`` (the floor's noise), ``record`` (``Record`` and its words, ``NoReference``).
"""

from __future__ import annotations

from .raising import raised
from .record import NoReference, Record

__all__ = ["NoReference", "Record", "raised"]
