"""Hypothesis profiles for dispatch property tests.

``cudagraph-ci``: fast and derandomized, so CI runs are quick and repeatable.
``cudagraph-thorough``: many examples, for a nightly or pre-release run
(``pytest --hypothesis-profile=cudagraph-thorough``). Registering them loads
nothing; a suite chooses (this repository's root conftest loads
``cudagraph-ci`` when ``CI=true``). The plugin registers them where
``--hypothesis-profile`` names one and when the dispatch-properties fixture
runs, never at load: importing hypothesis costs a suite half a second.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

__all__ = ["CI_PROFILE", "THOROUGH_PROFILE", "register"]

CI_PROFILE = "cudagraph-ci"
THOROUGH_PROFILE = "cudagraph-thorough"


def register() -> None:
    settings.register_profile(
        CI_PROFILE,
        max_examples=60,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        THOROUGH_PROFILE,
        max_examples=2000,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
