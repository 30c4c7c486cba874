"""The mutants of code that runs only on a CUDA device, killed only by CUDA tests: run with
``python scripts/mutants.py --cuda`` on a GPU (on a CPU their tests skip, and a mutant would
survive for want of a device, not of a test)."""

from __future__ import annotations

from ..common import Mutant

#: The checked capture's later descriptors on CUDA (issue #48).
LIGHT = ("tests/test_capture_light.py",)

CUDA_MUTANTS: list[Mutant] = [
    Mutant(
        "cuda-capture-later-ones-unobserved",
        "pytest_cudagraph/guard/__init__.py",
        "        if self.observer is not None and not self.suspended:\n",
        "        if self.observer is not None and not self.suspended and self.rules:\n",
        LIGHT,
        "a later capture's ops are not observed: what it alone draws is never seen",
    ),
    Mutant(
        "cuda-capture-later-ones-bare",
        "pytest_cudagraph/backends/cuda.py",
        "            if backend.checked:\n",
        "            if backend.checked and guard.rules:\n",
        LIGHT,
        "a later capture runs without the guard's dispatch mode: an op only the device refuses is not "
        "named, nothing is observed or kept alive",
    ),
    Mutant(
        "cuda-capture-first-unruled",
        "pytest_cudagraph/manager/capture.py",
        'return backend.name == "cuda" and backend.checked and bool(self.state.guarded_every_op)',
        'return backend.name == "cuda" and backend.checked',
        LIGHT,
        "the checked sequence's first capture is not held to the rules either",
    ),
    Mutant(
        "cuda-poison-one-way",
        "pytest_cudagraph/backends/cuda.py",
        "                block_bytes.fill_(POISON_BYTES[which])\n",
        "                block_bytes.fill_(POISON_BYTES[0])\n",
        ("tests/test_diagnoses.py::test_a_cuda_replay_reading_an_extension_buffer_nobody_wrote_is_named",),
        "the graphs' free memory is poisoned one way only (its blocks found once): a replay reading what "
        "nobody wrote is never told",
    ),
]
