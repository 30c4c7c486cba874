"""Repository-root conftest: makes the root importable (``tests``, ``examples``)
and picks the hypothesis profile: fast and derandomized under CI (``CI=true``).

The plugin itself is loaded through its ``pytest11`` entry point once the
package is installed (``pip install -e .``); it registers the profiles.
"""

from __future__ import annotations

import os

from hypothesis import settings

from pytest_cudagraph.plugin.profiles import CI_PROFILE, register

register()
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile(CI_PROFILE)
