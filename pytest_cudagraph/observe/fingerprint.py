"""Fingerprints of a tensor's bits: two sums (plain and weighted by position) that any change to an
element changes, read without copying the tensor; a write no op showed is found by them."""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODULUS = 65521  # the largest prime below 2**16: weights 1..65521 never line up with a power-of-two layout
#: Rows of ``_MODULUS`` elements summed per step (``bit_sums``): 4.2 M elements, a 32 MiB int64 copy.
_ROWS = 64


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two sums over ``t``'s bit patterns, plain and weighted by position: a
    change to any element (or two elements swapped) changes one of them, short
    of a contrived collision. Costs one read of the tensor and a few chunks of
    scratch memory, never a copy of it, and one synchronization."""
    plain, weighted = bit_sums(t).tolist()
    return int(plain), int(weighted)


def bit_sums(t: torch.Tensor) -> torch.Tensor:
    """``fingerprint``'s two sums as a tensor on ``t``'s device, not read: queued work, no
    synchronization (prints of many tensors are read at once).

    The weighted sum is ``sum((i mod M + 1) * bits[i])``: the bits viewed as rows of M, summed down
    their columns (each element read once, in its own width, accumulated in int64), then weighted
    by column, and the last partial row apart. The integer copies and position weights of every
    element that a direct sum makes cost 20 times the reads at real size (a Llama-8B's 15 GiB of
    weights fingerprinted in about 200 ms on an H200, instead of 10 ms). int64 sums wrap, the same
    way in any order."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    ints = (
        flat.view(_INT_OF_SIZE[size])
        if size in _INT_OF_SIZE and flat.dtype not in _INT_OF_SIZE.values()
        else flat
    )
    rows = ints.numel() // _MODULUS
    weights = torch.arange(1, _MODULUS + 1, device=ints.device, dtype=torch.int64)
    total = torch.zeros(2, dtype=torch.int64, device=ints.device)
    if rows:
        # A sum in int64 of narrower integers copies them to int64 first: a few rows at a time, so
        # the copy stays small (a whole embedding table's would be 3.9 GiB at 8B).
        matrix = ints[: rows * _MODULUS].view(rows, _MODULUS)
        columns = matrix[:_ROWS].sum(dim=0, dtype=torch.int64)
        for lo in range(_ROWS, rows, _ROWS):
            columns += matrix[lo : lo + _ROWS].sum(dim=0, dtype=torch.int64)
        total[0] += columns.sum()
        total[1] += weights.mul_(columns).sum()
        weights = torch.arange(1, _MODULUS + 1, device=ints.device, dtype=torch.int64)
    tail = ints[rows * _MODULUS :].to(torch.int64)
    total[0] += tail.sum()
    total[1] += weights[: tail.numel()].mul_(tail).sum()
    return total
