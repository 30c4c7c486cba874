"""What the plugin's fixtures do: ``cudagraph_verify`` and ``cudagraph_manager``.

This module imports torch; the plugin imports it inside fixtures only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch

from ..checks import Check, VerifyReport, verify
from ..checks.registry import check_list
from ..errors import UsageError
from ..manager import GraphManager
from ..manager.devices import default_device, follow_device, inputs_on, move_to
from ..manager.layout import check_module
from ..options import MAX_WORLD_SIZE, VerifyOptions
from ..plan import CaptureConfig
from ..plan.validate import check_int
from .report import make_record
from .settings import (
    CONFIG_KEYWORDS,
    VERIFY_KEYWORDS,
    Settings,
    check_keywords,
    concrete_backend,
    resolve,
    split_labels,
    verify_keywords,
)

__all__ = [
    "Benchmark",
    "DistributedVerifier",
    "ManagerFactory",
    "RunnerVerifier",
    "Verifier",
    "default_device",
    "device_for_test",
    "follow_device",
    "inputs_on",
    "move_to",
]

#: ``GraphManager``'s keywords besides the module, inputs and config.
MANAGER_KEYWORDS: tuple[str, ...] = (
    "backend",
    "device",
    "pad_values",
    "output_views",
    "progress",
    "eager_submodules",
    "batch_dims",
)

#: ``verify_runner``'s keywords besides the runner, the module and make_inputs.
RUNNER_KEYWORDS: tuple[str, ...] = (
    "capture_sizes",
    "max_num_reqs",
    "max_tokens",
    "config",
    *VerifyOptions.runner_field_names(),
)

_NO_SIZES = (
    "needs capture_sizes: pass capture_sizes=..., set @pytest.mark.cudagraph(capture_sizes=...), "
    "or run with --cudagraph-sizes=1,2,4 (ini cudagraph_sizes)"
)


_R = TypeVar("_R")


def _usage(fixture: str, call: Callable[[], _R]) -> _R:
    """``call()``; a usage error (what the test gave is wrong: a keyword, a marker value, the
    module, make_inputs' results) fails the test with its one line, no traceback through the
    package (and once: the failure is raised outside the handler). Every fixture runs its whole
    call through this, keyword resolution included."""
    try:
        return call()
    except UsageError as exc:
        told = str(exc) if str(exc).startswith(fixture) else f"{fixture}: {exc}"
    pytest.fail(told, pytrace=False)


@dataclass(frozen=True)
class Launched:
    """The ranks a launcher started (torchrun, srun, a group the suite made): how many, and each
    verification's seconds (--cudagraph-rank-timeout)."""

    world_size: int
    timeout: float


def _on_ranks(
    launched: Launched | None, keywords: Mapping[str, Any], verification: Callable[[], VerifyReport]
) -> Callable[[], VerifyReport]:
    """``verification``, or under a launcher the same on every rank with the reports merged (one
    verdict on every rank)."""
    if launched is None:
        return verification
    from ..distributed.verify import across_launched_ranks

    backend = concrete_backend(str(keywords.get("backend", "auto")))
    return lambda: across_launched_ranks(verification, timeout=launched.timeout, backend=backend)


def _data_parallel(
    launched: Launched,
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    loss_fn: Callable[..., Any],
    keywords: Mapping[str, Any],
) -> Callable[[], VerifyReport]:
    """A DDP module's step under a launcher: ``verify_data_parallel`` on the launcher's ranks."""
    from ..distributed import verify_data_parallel

    own = {k: v for k, v in keywords.items() if k not in ("backend", "device", "autocast")}
    backend = concrete_backend(str(keywords.get("backend", "auto")))
    return lambda: verify_data_parallel(
        lambda rank, world_size: module,
        make_inputs,
        loss_fn,
        timeout=launched.timeout,
        backend=backend,
        **own,
    )


def device_for_test(backend: str) -> torch.device:
    """``default_device``, failing the test plainly (no traceback) where 'cuda' has no CUDA."""
    try:
        return default_device(backend)
    except ValueError as exc:
        told = str(exc)
    pytest.fail(
        f"{told}; a test that needs a GPU is marked @pytest.mark.cuda, which skips it where there is none",
        pytrace=False,
    )


def _check_module(module: object, where: str) -> None:
    check_module(module, f"{where}: module")


def _backend_and_device(
    test: Settings, chosen: Mapping[str, Any], module: torch.nn.Module | None = None
) -> tuple[str, torch.device | str | None]:
    try:
        return _resolve_backend_and_device(test, chosen, module)
    except ValueError as exc:  # backend='cuda' (marker or keyword) where there is no CUDA
        if "torch.cuda.is_available() is False" not in str(exc):
            raise
        told = str(exc)
    # Raised outside the handler: the message is printed once, not again as "during handling".
    pytest.fail(
        f"{told}; a test that needs a GPU is marked @pytest.mark.cuda, which skips it where there is none",
        pytrace=False,
    )


def _resolve_backend_and_device(
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


def _recorded(
    reports: list[VerifyReport],
    sink: Callable[[dict[str, Any]], None],
    report: VerifyReport,
    keywords: Mapping[str, Any],
) -> VerifyReport:
    """What every verifying fixture does with its report: keep it, record it (with the keywords it
    was made with) for the JSON report, and fail the test with the readable report when a check failed."""
    reports.append(report)
    sink(make_record(report.to_dict(), keywords))
    if not report.ok:
        pytest.fail(report.format(), pytrace=False)
    return report


class Verifier:
    """``cudagraph_verify(module, make_inputs, **keywords)``: ``verify`` with the test's settings.

    Keywords not given come from the marker, then the settings. A failed
    report fails the test with ``report.format()``; a passing one is returned.
    Every report is recorded, as a JSON-able dict, through ``sink``. On the
    cuda backend a CPU module is moved to the test's device in place and the
    tensors ``make_inputs`` returns are moved there, so a test written for the
    CPU runs unchanged on a GPU.
    """

    def __init__(
        self,
        settings: Settings,
        marker: Mapping[str, Any],
        sink: Callable[[dict[str, Any]], None],
        *,
        descriptor: str | None = None,
        hook_checks: list[Check] | None = None,
        launched: Launched | None = None,
    ) -> None:
        self.settings = settings
        #: Under torchrun or srun: every rank verifies its module and the reports are merged.
        self.launched = launched
        #: Checks the session's ``pytest_cudagraph_checks`` hooks added, run after the built-ins.
        self.hook_checks = list(hook_checks or [])
        self.marker = dict(marker)
        self._sink = sink
        #: The one descriptor to verify (--cudagraph-split=descriptor), by label.
        self.descriptor = descriptor
        self.reports: list[VerifyReport] = []

    def _check_split(self, call: Mapping[str, Any]) -> None:
        """Under --cudagraph-split=descriptor, fail when the call's keywords plan descriptors
        that no item verifies (items were made from the marker's plan at collection)."""
        given = {k: v for k, v in call.items() if v is not None}
        if not given:
            return
        planned = split_labels(self.settings, self.marker) or []
        wanted = split_labels(self.settings, {**self.marker, **given}) or []
        unverified = [label for label in wanted if label not in planned]
        if unverified:
            pytest.fail(
                f"cudagraph_verify: this item verifies descriptor {self.descriptor} (--cudagraph-split="
                f"descriptor: one item per descriptor of the marker's plan, {', '.join(planned)}), but the "
                f"call's keywords ({', '.join(sorted(given))}) plan descriptor(s) {', '.join(unverified)} too, "
                "which no item would verify. Set the plan in the marker only, or run with "
                "--cudagraph-split=test",
                pytrace=False,
            )

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
        return _usage("cudagraph_verify", lambda: self._verify(module, make_inputs, **call))

    def _verify(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        **call: Any,
    ) -> VerifyReport:
        _check_module(module, "cudagraph_verify")
        keywords = self.keywords(module, **call)
        if "capture_sizes" not in keywords:
            pytest.fail(f"cudagraph_verify {_NO_SIZES}", pytrace=False)
        if self.descriptor is not None:
            self._check_split(call)
            keywords["descriptors"] = (self.descriptor,)
        make_inputs = follow_device(module, make_inputs, keywords.get("device"))
        if self.hook_checks:
            keywords["extra_checks"] = [*self.hook_checks, *check_list(keywords.get("extra_checks"))]
        try:
            report = _on_ranks(self.launched, keywords, lambda: verify(module, make_inputs, **keywords))()
        except UsageError as exc:
            if self.descriptor is None or "not in the plan" not in str(exc):
                raise
            pytest.fail(
                f"cudagraph_verify: this item verifies descriptor {self.descriptor} (--cudagraph-split="
                f"descriptor, planned from the marker), but the call's keywords plan other descriptors: {exc}. "
                "Set the plan in the marker only, or run with --cudagraph-split=test",
                pytrace=False,
            )
        return _recorded(self.reports, self._sink, report, keywords)


class Benchmark:
    """``cudagraph_benchmark(module, make_inputs, **keywords)``: the ``BenchmarkRunner``'s call, a
    usage error (a keyword, the module, make_inputs) failing the test in one line."""

    def __init__(self, runner: Callable[..., Any]) -> None:
        self.runner = runner

    def __call__(
        self, module: torch.nn.Module, make_inputs: Callable[[int, int], Mapping[str, Any]], **keywords: Any
    ) -> Any:
        return _usage("cudagraph_benchmark", lambda: self.runner(module, make_inputs, **keywords))


class RunnerVerifier:
    """``cudagraph_verify_runner(runner, module, make_inputs, **keywords)``: ``verify_runner`` with the
    test's settings.

    Keywords not given come from the marker (those a runner takes; the
    marker may also hold a manager's), then the settings (capture sizes). A
    failed report fails the test with ``report.format()``; every report is
    recorded through ``sink`` as ``cudagraph_verify``'s are.
    """

    def __init__(
        self, settings: Settings, marker: Mapping[str, Any], sink: Callable[[dict[str, Any]], None]
    ) -> None:
        self.settings = settings
        self.marker = {k: v for k, v in marker.items() if k in RUNNER_KEYWORDS}
        self._sink = sink
        self.reports: list[VerifyReport] = []

    def __call__(
        self,
        runner: Callable[..., Any],
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        **call: Any,
    ) -> VerifyReport:
        return _usage("cudagraph_verify_runner", lambda: self._verify(runner, module, make_inputs, **call))

    def _verify(
        self,
        runner: Callable[..., Any],
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        **call: Any,
    ) -> VerifyReport:
        from ..runner import verify_runner

        _check_module(module, "cudagraph_verify_runner")
        check_keywords(call, RUNNER_KEYWORDS, "cudagraph_verify_runner")
        chosen = verify_keywords(self.settings, self.marker, call)
        keywords = {k: v for k, v in chosen.items() if k in RUNNER_KEYWORDS}
        if "config" in keywords:
            keywords.pop(
                "capture_sizes", None
            )  # the config holds its plan (the marker or options filled these in)
            keywords.pop("max_num_reqs", None)
        elif "capture_sizes" not in keywords:
            pytest.fail(f"cudagraph_verify_runner {_NO_SIZES}", pytrace=False)
        report = verify_runner(runner, module, make_inputs, **keywords)
        return _recorded(self.reports, self._sink, report, keywords)


def _training_keywords() -> tuple[str, ...]:
    """``verify_training``'s keyword-only arguments: the one source of the fixture's keywords."""
    from ..training import verify_training

    return tuple(
        name
        for name, p in inspect.signature(verify_training).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    )


class TrainingVerifier:
    """``cudagraph_verify_training(module, make_inputs, loss_fn, **keywords)``: ``verify_training``
    with the test's settings.

    Keywords not given come from the marker (those ``verify_training`` takes), then the settings
    (capture sizes, backend and device). On the cuda backend a CPU module is moved to the test's
    device and ``make_inputs``' tensors follow it, as with ``cudagraph_verify``. A failed report
    fails the test with ``report.format()``; every report is recorded.
    """

    def __init__(
        self,
        settings: Settings,
        marker: Mapping[str, Any],
        sink: Callable[[dict[str, Any]], None],
        *,
        launched: Launched | None = None,
    ) -> None:
        self.settings = settings
        #: Under torchrun or srun: every rank verifies its step and the reports are merged.
        self.launched = launched
        self.allowed = _training_keywords()
        self.marker = {k: v for k, v in marker.items() if k in self.allowed}
        self._sink = sink
        self.reports: list[VerifyReport] = []

    def __call__(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        loss_fn: Callable[..., Any],
        **call: Any,
    ) -> VerifyReport:
        return _usage("cudagraph_verify_training", lambda: self._verify(module, make_inputs, loss_fn, **call))

    def _verify(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        loss_fn: Callable[..., Any],
        **call: Any,
    ) -> VerifyReport:
        from ..training import verify_training

        _check_module(module, "cudagraph_verify_training")
        check_keywords(call, self.allowed, "cudagraph_verify_training")
        chosen = verify_keywords(self.settings, self.marker, call)
        backend, device = _backend_and_device(resolve(self.settings, self.marker, call), chosen, module)
        keywords = {k: v for k, v in chosen.items() if k in self.allowed}
        keywords["backend"], keywords["device"] = backend, device
        make_inputs = follow_device(module, make_inputs, device)
        verification = _on_ranks(
            self.launched, keywords, lambda: verify_training(module, make_inputs, loss_fn, **keywords)
        )
        if self.launched is not None and isinstance(module, torch.nn.parallel.DistributedDataParallel):
            verification = _data_parallel(self.launched, module, make_inputs, loss_fn, keywords)
        report = verification()
        return _recorded(self.reports, self._sink, report, keywords)


class DistributedVerifier:
    """``cudagraph_verify_distributed(build, make_inputs, **keywords)``: ``verify_distributed`` with the
    test's settings.

    Keywords not given come from the marker, then the settings: capture
    sizes, backend, and ``world_size`` (``--cudagraph-world-size``). On CUDA
    the ranks take ``world_size`` consecutive devices of
    ``--cudagraph-devices`` (every visible device by default), a block per
    xdist worker. A failed report fails the test with ``report.format()``.
    """

    def __init__(
        self,
        settings: Settings,
        marker: Mapping[str, Any],
        sink: Callable[[dict[str, Any]], None],
        *,
        worker: str | None = None,
        launched: Launched | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.settings = settings
        self.marker = dict(marker)
        self._sink = sink
        self.worker = worker
        #: The ranks a launcher started (None: the harness spawns ``world_size`` of its own).
        self.launched = launched
        #: Each rank's seconds, unless the call gives ``timeout=`` (--cudagraph-rank-timeout).
        self.timeout = launched.timeout if launched is not None else timeout
        self.reports: list[VerifyReport] = []

    def __call__(
        self,
        build: Callable[[int, int], torch.nn.Module],
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        **call: Any,
    ) -> VerifyReport:
        return _usage("cudagraph_verify_distributed", lambda: self._verify(build, make_inputs, **call))

    def _verify(
        self,
        build: Callable[[int, int], torch.nn.Module],
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        **call: Any,
    ) -> VerifyReport:
        from ..distributed import verify_distributed
        from .settings import rank_devices

        extra = ("world_size", "timeout", "replicated")
        check_keywords(call, (*VERIFY_KEYWORDS, *extra), "cudagraph_verify_distributed")
        world_size = call.pop("world_size", None)
        if world_size is None:
            world_size = self.settings.world_size
        launched = self.launched
        if launched is not None:  # torchrun, srun, the suite's group: the ranks that exist
            wanted = (
                None if world_size is None else check_int("world_size", world_size, maximum=MAX_WORLD_SIZE)
            )
            if wanted is not None and wanted != launched.world_size:
                pytest.skip(f"needs {wanted} ranks; the launcher started {launched.world_size}")
            world_size = launched.world_size
        if world_size is None:
            pytest.fail(
                "cudagraph_verify_distributed needs world_size: pass world_size=..., or run with "
                "--cudagraph-world-size=2 (ini cudagraph_world_size)",
                pytrace=False,
            )
        world_size = check_int("world_size", world_size, maximum=MAX_WORLD_SIZE)
        own = {k: call.pop(k) for k in extra if k in call}
        own["timeout"] = self.timeout if own.get("timeout") is None else own["timeout"]
        keywords = verify_keywords(self.settings, self.marker, call)
        if "capture_sizes" not in keywords:
            pytest.fail(f"cudagraph_verify_distributed {_NO_SIZES}", pytrace=False)
        backend = keywords.pop("backend", "auto")
        for name in ("device", "progress"):
            keywords.pop(name, None)
        devices = None
        if concrete_backend(backend) == "cuda" and launched is None:
            devices = rank_devices(
                self.worker, self.settings.devices, torch.cuda.device_count(), int(world_size)
            )
            if len(devices) < int(world_size):
                pytest.fail(
                    f"cudagraph_verify_distributed: world_size={world_size} needs {world_size} GPUs; "
                    f"this worker has {devices}",
                    pytrace=False,
                )
        report = verify_distributed(
            build,
            make_inputs,
            world_size=None if launched is not None else int(world_size),
            backend=backend,
            devices=devices,
            **own,
            **keywords,
        )
        return _recorded(self.reports, self._sink, report, {**keywords, "world_size": world_size})


class ManagerFactory:
    """``cudagraph_manager(module, make_inputs, config=None, **keywords)`` -> ``GraphManager``.

    ``keywords`` are ``CaptureConfig``'s and ``GraphManager``'s (backend,
    device, pad_values, output_views, progress). Without ``config``, config
    keywords not given come from the marker, then the settings (sizes);
    ``max_num_reqs`` defaults to the largest capture size. Backend and device
    come from the settings unless given; on a CUDA device a CPU module is
    moved there in place and the tensors ``make_inputs`` returns are moved
    there too. ``release_all`` releases every manager made.
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
        return _usage("cudagraph_manager", lambda: self._make(module, make_inputs, config, **keywords))

    def _make(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        config: CaptureConfig | Mapping[str, Any] | None = None,
        **keywords: Any,
    ) -> GraphManager:
        _check_module(module, "cudagraph_manager")
        check_keywords(keywords, CONFIG_KEYWORDS + MANAGER_KEYWORDS, "cudagraph_manager")
        config_given = [k for k in keywords if k in CONFIG_KEYWORDS]
        if config is not None and config_given:
            raise UsageError(
                f"cudagraph_manager: pass config or its keywords ({', '.join(config_given)}), not both"
            )
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
        make_inputs = follow_device(module, make_inputs, device)
        # Checked capture, as verify() does: a test is where bugs are named.
        manager = GraphManager(
            module, make_inputs, config, backend=backend, device=device, checked_capture=True, **extra
        )
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
