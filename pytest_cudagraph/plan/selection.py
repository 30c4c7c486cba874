"""Which descriptors a verification covers: pure Python, shared by verify() and the plugin's split."""

from __future__ import annotations

from collections.abc import Iterable

from .descriptor import BatchDescriptor

__all__ = ["select_descriptors"]


def select_descriptors(descs: Iterable[BatchDescriptor], *, exhaustive: bool) -> list[BatchDescriptor]:
    """All descriptors, or (quick) the smallest and largest of each mode, in capture order."""
    ordered = list(descs)
    if exhaustive:
        return ordered
    keep: set[BatchDescriptor] = set()
    for mode in {d.mode for d in ordered}:
        same = [d for d in ordered if d.mode is mode]
        keep.add(min(same, key=lambda d: (d.num_tokens, d.num_active_loras)))
        keep.add(max(same, key=lambda d: (d.num_tokens, -d.num_active_loras)))
    return [d for d in ordered if d in keep]
