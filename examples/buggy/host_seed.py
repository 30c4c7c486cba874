"""A sampler whose seed and offset reach its kernel as Python numbers, the offset incremented on every
call: a graph freezes both at capture, so every replay repeats the capture's draw.

Caught by ``rng``, which names the kernel and the number that moves. The plugin prints:

    HostOffsetSampler on emulate (cpu) in train mode: 4/4 descriptors captured and verified (every descriptor), 6 real batches, 12 failure(s) in fresh_inputs, replay_matches_eager, rng, 10 skipped; capture 17 ms, graph memory 3.0 KiB, peak memory 391.4 MiB (373.5 MiB before)
    FAIL rng                    FULL-T8-R4
         cudagraph_gallery.hash_noise.default at examples/buggy/host_seed.py:55 in forward (offset: 1 -> 2, kept in offset) is handed host numbers that change on every forward (a seed or an offset kept in Python and incremented per call): a graph freezes them at capture, so every replay repeats the draw made at capture while eager draws anew. Keep the counter in a device tensor the kernel reads and advances in place, or draw through torch's generator (torch.rand(..., generator=...)), which graphs advance on every replay
         real batch (num_reqs=3, num_tokens=5, num_active_loras=0, num_ubatches=1)

    (CPU emulator, `pytest --cudagraph-verify`, capture sizes 1, 2, 4, 8; the rng failure shown; also failed: fresh_inputs, replay_matches_eager)
"""

from __future__ import annotations

import torch

from .common import Base

# A counter-based generator, as sampling kernels take it: noise from (seed, offset, element index) alone,
# on the device, with no generator object. Two ops: the offset as a Python int, or read from a tensor
# the kernel advances in place (what a graph can replay).
_LIB = torch.library.Library("cudagraph_gallery", "DEF")
_LIB.define("hash_noise(Tensor like, int seed, int offset) -> Tensor")
_LIB.define("hash_noise_at(Tensor like, int seed, Tensor(a!) offset) -> Tensor")


def _noise(like: torch.Tensor, seed: int, offset: torch.Tensor | int) -> torch.Tensor:
    index = torch.arange(like.numel(), device=like.device, dtype=torch.float64).view(like.shape)
    phase = (index + 7919.0 * offset + 104729.0 * seed) * 12.9898
    return (torch.sin(phase) * 43758.5453).frac().abs().to(like.dtype)


def _hash_noise(like: torch.Tensor, seed: int, offset: int) -> torch.Tensor:
    return _noise(like, seed, offset)


def _hash_noise_at(like: torch.Tensor, seed: int, offset: torch.Tensor) -> torch.Tensor:
    out = _noise(like, seed, offset.to(torch.float64))
    offset.add_(1)
    return out


_LIB.impl("hash_noise", _hash_noise, "CompositeExplicitAutograd")
_LIB.impl("hash_noise_at", _hash_noise_at, "CompositeExplicitAutograd")


class HostOffsetSampler(Base):
    """Keeps its offset in Python and hands it to the kernel: frozen at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.seed = 1234
        self.offset = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.offset += 1
        return self.lin(x) + torch.ops.cudagraph_gallery.hash_noise(x, self.seed, self.offset)


class DeviceOffsetSampler(Base):
    """Keeps its offset in a buffer the kernel reads and advances in place: every replay draws anew."""

    def __init__(self) -> None:
        super().__init__()
        self.seed = 1234
        self.register_buffer("offset", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.ops.cudagraph_gallery.hash_noise_at(x, self.seed, self.offset)
