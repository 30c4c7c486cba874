"""How a downstream suite adds its check to every verification of the tests beneath this conftest."""

from __future__ import annotations

import pytest

from examples.custom_check.check import kv_cache_check
from examples.custom_check.kv_cache import SCRATCH
from pytest_cudagraph.checks import Check


def pytest_cudagraph_checks(config: pytest.Config) -> list[Check]:
    return [kv_cache_check(scratch=SCRATCH)]
