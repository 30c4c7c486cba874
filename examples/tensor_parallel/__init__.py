"""Tensor-parallel modules verified on every rank: `pytest examples/tensor_parallel`."""
