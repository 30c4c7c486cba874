"""Kernels launched outside torch's dispatcher: Triton, a custom op for low precision, an extension."""
