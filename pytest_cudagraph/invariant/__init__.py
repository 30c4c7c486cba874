"""Forwards whose products and reductions round the same at the padded and the real batch size.

``padded_size`` asks whether eager at a graph's padded size, cut to the real
rows, equals eager on the real batch. In the module's own precision the two
forwards run other kernels (cuBLAS and MKL pick a tiling per row count; a
reduction picks its split per number of rows), so a correct bf16 Llama
differs from itself by several percent across shapes, and the question used
to be asked in float64 at every size: two float64 forwards a size, about
1.8x a hand-written capture loop at 8B in float64 products alone.

``invariant`` runs a forward in the module's own precision with every
product and every row-wise reduction computed on its rows padded up to a
multiple of ``ROWS`` (8): 505 real rows and their graph's 512 padded rows
both reach the kernel as 512 rows, one program for both, so a row that the
module computes alike comes out alike bit for bit. No capture size of
vLLM's plans (1, 2, 4, then multiples of 8) has another multiple of 8
between a real batch and its padded size, so the two always meet.

What it covers and what it does not (``Invariance`` records both): it is a
``TorchFunctionMode``, so it sees the calls the module's Python makes, and
pads

- products with a matrix on the right (``F.linear``, ``@``, ``matmul``,
  ``mm``, ``addmm``, ``mv``: the rows of the left operand) and products of
  stacks (``bmm``, ``baddbmm``: the rows of each);
- reductions over trailing dims (``sum``, ``mean``, ``var``, ``std``,
  norms, ``logsumexp``, ``softmax``, ``log_softmax``, ``layer_norm``,
  ``rms_norm``): the leading rows;
- ``F.scaled_dot_product_attention`` over queries and keys of one length,
  causal or with a mask over (queries, keys);
- on the CPU, unary transcendental functions (``rsqrt``, ``silu``, ``exp``,
  ...): their operand to whole SIMD vectors.

Passed through as they are: elementwise arithmetic (each element alone:
rounded the same at every size), reductions that include the leading dim
(statistics over the batch: the bug class itself), ``einsum``, custom ops,
Triton kernels and extensions. They may or may not round alike; where they
do not, the two forwards differ and the float64 route decides. The calls it
sees are also its trace: each with its float, bool and string arguments.

The invariance it relies on is checked where it is used: the first padded
call of each function on each feature shape (at each row count for
attention) also runs with the rows past the first half zeroed, and the first
half must come out bit for bit the same (rows computed independently of each
other in one call); a call that fails is named
(``Invariance.not_row_local``), and the fast route then settles nothing.

A bit-for-bit agreement of the two forwards is a verdict (the real rows do
not depend on the padded size, in the program the graph runs up to the
tiling of its kernels); a difference is not (it may be a kernel passed
through that rounds per size), and ``padded_size`` then asks float64.
"""

from __future__ import annotations

from .mode import ROWS, Invariance, invariant

__all__ = ["ROWS", "Invariance", "invariant"]
