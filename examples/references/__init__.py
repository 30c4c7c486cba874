"""References: plain-torch functions that stand in for kernels the float64 reference cannot run.

A serving model's attention and norms run through kernels written for bfloat16 or float16 alone, so
``padded_size``'s float64 reference cannot run them; handed a plain-torch function per kernel
(``references={op: fn}`` or ``register_reference(op, fn)``), it runs that function in the kernel's
place. ``kernels`` holds two such kernels (a custom op for attention, a Triton RMSNorm behind a
Python function) with their references; ``model`` a small Llama-like causal LM that calls them,
with two errors on padded sizes for the reference to catch.
"""
