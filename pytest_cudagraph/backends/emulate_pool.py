"""The emulator's graph memory: one pool per backend, shared by every graph captured into it, as the
CUDA graphs of one manager share a private pool of the caching allocator.

When a capture ends, every storage it created gets a region (``_Pool.place``), placed as a caching
allocator would place it: a storage occupies its region from the step that creates it to the last
step that reads or writes it, and later storages (of this capture or of later ones) reuse the
region after that, best fit first; what does not fit goes to one new segment sized to its
high-water mark. Storages that something still holds when the capture ends keep their region
(``_Held``) until the last holder lets go (``reclaim``). Segments are anonymous mappings that
never move, so graphs captured earlier keep working as the pool grows."""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Every region is a multiple of this many bytes, and so starts at such a
#: multiple: the CUDA caching allocator rounds every block up to 512 bytes
#: (kMinBlockSize), so small tensors cost here what they cost in a real pool.
#: Its 2 MiB and 20 MiB segment sizes are not copied: a capture adds one
#: segment of exactly the memory it lacked, so each graph's figure is its own
#: need, not the driver's granularity.
BLOCK = 512

_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(storage: torch.UntypedStorage) -> int:
    """References to a storage: one per tensor on it, and one for its Python object."""
    assert _USE_COUNT is not None
    return int(_USE_COUNT(storage._cdata))


def _round(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


FreeList = list[tuple[int, int]]  # (offset, size), sorted by offset, never two adjacent


def _give_back(free: FreeList, offset: int, size: int) -> None:
    """Return a block to a free list, merged with its free neighbours."""
    i = bisect.bisect_left(free, (offset, 0))
    if i < len(free) and free[i][0] == offset + size:
        size += free.pop(i)[1]
    if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
        i -= 1
        prev_offset, prev_size = free.pop(i)
        offset, size = prev_offset, prev_size + size
    free.insert(i, (offset, size))


class _Segment:
    """Pool memory that never moves, so graphs captured earlier keep working as the pool grows.

    An anonymous mapping: page-aligned (so every region is 512-aligned), and
    its pages cost memory only once written. Tensors reach it through storages
    made by ``torch.frombuffer``, each of which keeps the mapping alive: a
    tensor still held after ``release()`` stays valid, as a CUDA block in use
    outlives the graphs of its pool.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffer = mmap.mmap(-1, size)
        #: What the graphs' own tensors (their steps) are made on.
        self.storage = torch.frombuffer(self.buffer, dtype=torch.uint8).untyped_storage()
        self.free: FreeList = [(0, size)]

    def region(self, offset: int, size: int) -> torch.UntypedStorage:
        """A storage of its own over one region, for the tensors other code holds.

        Its reference count tells whether any such tensor (or a view taken of
        it later) is still alive: the graphs' own tensors are on ``storage``.
        """
        view = memoryview(self.buffer)[offset : offset + size]
        return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


@dataclass
class _Held:
    """A region that something outside the graphs held when its capture ended."""

    segment: _Segment
    offset: int
    size: int
    storage: torch.UntypedStorage  # the region's own storage: what the holders' tensors are on


@dataclass
class _Request:
    key: int
    size: int  # rounded to BLOCK
    birth: int
    death: int | None  # last step that uses it; None while it is held


class _Pool:
    """The memory every emulated graph of one backend shares."""

    def __init__(self) -> None:
        self.segments: list[_Segment] = []
        self.held: list[_Held] = []
        #: Storages left where they were (see emulate.py, _EmulatedCapture.end): counted
        #: as graph memory, outside the segments.
        self.pinned_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.segments) + self.pinned_bytes

    def reclaim(self) -> None:
        """Free the held regions whose last holder has let go since."""
        kept = []
        for h in self.held:
            if _use_count(h.storage) > 1:
                kept.append(h)
            else:
                _give_back(h.segment.free, h.offset, h.size)
        self.held = kept

    def place(self, requests: list[_Request]) -> tuple[dict[int, tuple[_Segment, int]], int]:
        """Give each request a region, growing the pool by at most one segment.

        Replays the capture's allocations and frees in step order against the
        pool's free blocks, best fit first, as a caching allocator would; what
        does not fit goes to a new segment sized to its high-water mark.
        Returns each request's place and the bytes the pool grew by. The
        free lists change only once every request has its place.
        """
        free = [list(s.free) for s in self.segments]
        tail: FreeList = []  # the new segment's free blocks
        lists = [*free, tail]
        top = 0  # the new segment's size so far
        where: dict[int, tuple[int, int]] = {}  # key -> (index into lists, offset)
        born: dict[int, list[_Request]] = {}
        dies: dict[int, list[_Request]] = {}
        for r in requests:
            born.setdefault(r.birth, []).append(r)
            if r.death is not None:
                dies.setdefault(r.death, []).append(r)
        for step in sorted(born.keys() | dies.keys()):
            # An op's outputs are allocated before its inputs can be freed:
            # a result never shares memory with what it was computed from.
            for r in born.get(step, ()):
                best: tuple[int, int, int] | None = None  # (size, list, position)
                for li, blocks in enumerate(lists):
                    for pos, (_, size) in enumerate(blocks):
                        if size >= r.size and (best is None or size < best[0]):
                            best = (size, li, pos)
                if best is not None:
                    size, li, pos = best
                    offset = lists[li][pos][0]
                    if size == r.size:
                        del lists[li][pos]
                    else:
                        lists[li][pos] = (offset + r.size, size - r.size)
                    where[r.key] = (li, offset)
                    continue
                # Grow the new segment, starting inside a free block at its end.
                offset = top
                if tail and tail[-1][0] + tail[-1][1] == top:
                    offset = tail.pop()[0]
                top = offset + r.size
                where[r.key] = (len(free), offset)
            for r in dies.get(step, ()):
                li, offset = where[r.key]
                _give_back(lists[li], offset, r.size)
        for segment, blocks in zip(self.segments, free, strict=True):
            segment.free = blocks
        new: _Segment | None = None
        if top:
            new = _Segment(top)
            new.free = tail
            self.segments.append(new)
        placed: dict[int, tuple[_Segment, int]] = {}
        for key, (li, offset) in where.items():
            owner = self.segments[li] if li < len(free) else new
            assert owner is not None
            placed[key] = (owner, offset)
        return placed, top
