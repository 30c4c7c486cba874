"""What the plugin's fixtures do: ``cudagraph_verify`` and ``cudagraph_manager``.

This module imports torch; the plugin imports it inside fixtures only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from .checks import VerifyReport, verify
from .manager import GraphManager
from .plan import CaptureConfig
from .pytest_report import make_record
from .settings import (
    CONFIG_KEYWORDS,
    VERIFY_KEYWORDS,
    Settings,
    check_keywords,
    concrete_backend,
    resolve,
    verify_keywords,
)

__all__ = ["ManagerFactory", "Verifier", "default_device"]

#: ``GraphManager``'s keywords besides the module, inputs and config.
MANAGER_KEYWORDS: tuple[str, ...] = ("backend", "device", "pad_values", "output_views", "progress",
                                     "eager_submodules", "batch_dims")

_NO_SIZES = (
    "needs capture_sizes: pass capture_sizes=..., set @pytest.mark.cudagraph(capture_sizes=...), "
    "or run with --cudagraph-sizes=1,2,4 (ini cudagraph_sizes)"
)


def default_device(backend: str) -> torch.device:
    """The device a backend runs on: the current CUDA device for 'cuda', the CPU for 'emulate'."""
    backend = concrete_backend(backend)
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "backend 'cuda' was asked for (fixture keyword, marker, --cudagraph-backend or ini "
                "cudagraph_backend), but torch.cuda.is_available() is False here; use 'emulate' or 'auto'"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backend_and_device(
    test: Settings, chosen: Mapping[str, Any], module: torch.nn.Module | None = None
) -> tuple[str, torch.device | str | None]:
    """Backend and device for a manager: given ones win; with no device the settings' pair is used.

    A device given without a backend keeps 'auto' so that the device decides.
    On CUDA a module already on a GPU stays on its GPU (under pytest-xdist,
    the worker's), whatever the current device.
    """
    device = chosen.get("device")
    if device is not None:
        return test.backend, device
    backend = concrete_backend(test.backend)
    if backend == "cuda" and module is not None:
        on = next((t.device for t in (*module.parameters(), *module.buffers())), None)
        if on is not None and on.type == "cuda":
            return backend, on
    return backend, default_device(backend)


class Verifier:
    """``cudagraph_verify(module, make_inputs, **keywords)``: ``verify`` with the test's settings.

    Keywords not given come from the marker, then the settings. A failed
    report fails the test with ``report.format()``; a passing one is returned.
    Every report is recorded, as a JSON-able dict, through ``sink``.
    """

    def __init__(
        self,
        settings: Settings,
        marker: Mapping[str, Any],
        sink: Callable[[dict[str, Any]], None],
        *,
        descriptor: str | None = None,
    ) -> None:
        self.settings = settings
        self.marker = dict(marker)
        self._sink = sink
        #: The one descriptor to verify (--cudagraph-split=descriptor), by label.
        self.descriptor = descriptor
        self.reports: list[VerifyReport] = []

    def keywords(self, module: torch.nn.Module | None = None, **call: Any) -> dict[str, Any]:
        """The keywords ``verify`` gets for these call keywords (without module and inputs)."""
        check_keywords(call, VERIFY_KEYWORDS, "cudagraph_verify")
        keywords = verify_keywords(self.settings, self.marker, call)
        backend, device = _backend_and_device(resolve(self.settings, self.marker, call), keywords, module)
        keywords["backend"] = backend
        keywords["device"] = device
        return keywords

    def __call__(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        **call: Any,
    ) -> VerifyReport:
        keywords = self.keywords(module, **call)
        if "capture_sizes" not in keywords:
            pytest.fail(f"cudagraph_verify {_NO_SIZES}", pytrace=False)
        if self.descriptor is not None:
            keywords["descriptors"] = (self.descriptor,)
        try:
            report = verify(module, make_inputs, **keywords)
        except ValueError as exc:
            if self.descriptor is None or "not in the plan" not in str(exc):
                raise
            pytest.fail(
                f"cudagraph_verify: this item verifies descriptor {self.descriptor} (--cudagraph-split="
                f"descriptor, planned from the marker), but the call's keywords plan other descriptors: {exc}. "
                "Set the plan in the marker only, or run with --cudagraph-split=test",
                pytrace=False,
            )
        self.reports.append(report)
        self._sink(make_record(report.to_dict(), keywords))
        if not report.ok:
            pytest.fail(report.format(), pytrace=False)
        return report


class ManagerFactory:
    """``cudagraph_manager(module, make_inputs, config=None, **keywords)`` -> ``GraphManager``.

    ``keywords`` are ``CaptureConfig``'s and ``GraphManager``'s (backend,
    device, pad_values, output_views, progress). Without ``config``, config
    keywords not given come from the marker, then the settings (sizes);
    ``max_num_reqs`` defaults to the largest capture size. Backend and device
    come from the settings unless given. ``release_all`` releases every
    manager made.
    """

    def __init__(self, settings: Settings, marker: Mapping[str, Any]) -> None:
        self.settings = settings
        self.marker = {k: v for k, v in marker.items() if k in CONFIG_KEYWORDS + MANAGER_KEYWORDS}
        self.managers: list[GraphManager] = []

    def __call__(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        config: CaptureConfig | Mapping[str, Any] | None = None,
        **keywords: Any,
    ) -> GraphManager:
        check_keywords(keywords, CONFIG_KEYWORDS + MANAGER_KEYWORDS, "cudagraph_manager")
        config_given = [k for k in keywords if k in CONFIG_KEYWORDS]
        if config is not None and config_given:
            raise TypeError(f"cudagraph_manager: pass config or its keywords ({', '.join(config_given)}), not both")
        marker = self.marker
        if config is not None:
            marker = {k: v for k, v in marker.items() if k not in CONFIG_KEYWORDS}
        chosen = verify_keywords(self.settings, marker, keywords)
        test = resolve(self.settings, marker, keywords)
        backend, device = _backend_and_device(test, chosen, module)
        if config is None:
            if "capture_sizes" not in chosen:
                pytest.fail(f"cudagraph_manager {_NO_SIZES}", pytrace=False)
            config_kw = {k: v for k, v in chosen.items() if k in CONFIG_KEYWORDS}
            config_kw.setdefault("max_num_reqs", max(config_kw["capture_sizes"]))
            config = CaptureConfig(**config_kw)
        # GraphManager's own keywords; backend and device were resolved above.
        extra = {k: v for k, v in chosen.items() if k in MANAGER_KEYWORDS and k not in ("backend", "device")}
        # Checked capture, as verify() does: a test is where bugs are named.
        manager = GraphManager(module, make_inputs, config, backend=backend, device=device,
                               checked_capture=True, **extra)
        self.managers.append(manager)
        return manager

    def release_all(self) -> None:
        errors: list[BaseException] = []
        for manager in reversed(self.managers):
            try:
                manager.release()
            except Exception as exc:  # release every one, then report the first failure
                errors.append(exc)
        self.managers.clear()
        if errors:
            raise errors[0]
