"""Hooks a downstream ``conftest.py`` (or plugin) implements to extend pytest-cudagraph.

The plugin registers these specifications (``pytest_addhooks``), as
pytest-benchmark and pytest-xdist register theirs. Example, in a conftest.py::

    from pytest_cudagraph.checks import Check

    def pytest_cudagraph_checks(config):
        return [Check("kv_cache_outside_slots", kv_untouched, compares="...")]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..checks.registry import Check


@pytest.hookspec
def pytest_cudagraph_checks(config: pytest.Config) -> Iterable[Check] | None:
    """Return checks (``pytest_cudagraph.checks.Check``) to run in the verifications of the tests it covers.

    Called for each test that verifies, with the hooks of plugins and of the
    conftest.py files above the test (a conftest's checks apply to the tests
    beneath it). Every implementation's checks are added after the
    built-ins, in the order pytest calls them, run by default
    unless a check is registered with ``default=False``, and are selected by
    name with ``checks=`` like the built-ins. Their outcomes appear in the
    failure message, the terminal summary and the JSON report.
    """
    return None
