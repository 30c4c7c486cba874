"""The downstream project's conftest: hypothesis settings, and proof that the
plugin came from the installed distribution, loaded by its entry point."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import pytest_cudagraph
from hypothesis import settings

settings.register_profile("ci", max_examples=60, derandomize=True, database=None, deadline=None)
settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    # Loaded through the pytest11 entry point of the installed distribution (pytest lists the
    # plugins it loaded from entry points with their distribution), not by -p or PYTEST_PLUGINS.
    dists = {dist.project_name for _, dist in config.pluginmanager.list_plugin_distinfo()}
    if "pytest-cudagraph" not in dists or not config.pluginmanager.hasplugin("cudagraph"):
        raise pytest.UsageError(
            f"pytest-cudagraph was not loaded through its pytest11 entry point "
            f"(entry-point plugins from: {sorted(dists)})"
        )
    args = config.invocation_params.args
    if "cudagraph" in " ".join(a for a in args if a.startswith("-p")) or os.environ.get("PYTEST_PLUGINS"):
        raise pytest.UsageError(
            f"the plugin must load by itself; got args {args} "
            f"PYTEST_PLUGINS={os.environ.get('PYTEST_PLUGINS')!r}"
        )
    # The repository the wheel was built from must not be what runs (.ci/downstream.sh sets it).
    repo = os.environ.get("CUDAGRAPH_REPO")
    where = Path(pytest_cudagraph.__file__).resolve()
    if repo and where.is_relative_to(Path(repo).resolve()):
        raise pytest.UsageError(f"pytest_cudagraph imported from the repository: {where}")


def pytest_report_header(config: pytest.Config) -> str:
    where = Path(pytest_cudagraph.__file__).parent
    return f"downstream: pytest_cudagraph {pytest_cudagraph.__version__} from {where}"
