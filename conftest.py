"""Repository-root conftest: makes the root importable (``tests``, ``examples``)
and picks the hypothesis profile: fast and derandomized under CI (``CI=true``).

Without CUDA it has Triton interpret its kernels (``TRITON_INTERPRET=1``).

The plugin itself is loaded through its ``pytest11`` entry point once the
package is installed (``pip install -e .``); it registers the profiles.
"""

from __future__ import annotations

import os

import torch
from hypothesis import settings

from pytest_cudagraph.plugin.profiles import CI_PROFILE, register

# Without CUDA, Triton kernels (examples/kernels) run in Triton's interpreter on CPU tensors; it is
# chosen when triton is first imported (torch._dynamo imports it), so before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

register()
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile(CI_PROFILE)
