"""State forward reads from outside the module and its inputs is named by what it is (issue #69): where
it lives (a module-level dict or object, a class attribute, a closure cell, a ContextVar, a
thread-local), the line that read it, and its values at capture and now; a tensor put in place of
the captured one is named as replaced; a counter forward moves in a module-level dict is not called
nondeterminism. The gallery pairs of tests/bugs.py (``ReadsTokenCount``, ``ReadsReplacedTemperature``,
``CountsStepsInDict``) hold the forward context and the counter in tests/test_checks.py too.
"""

from __future__ import annotations

import contextvars
import inspect
import re
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from examples.buggy.common import Base, D
from examples.buggy.forward_context import ReadsTokenCount, context_inputs
from pytest_cudagraph.checks import verify
from pytest_cudagraph.checks.outside import Outside

SIZES = [1, 2, 4, 8]


def _verify(module: nn.Module, make_inputs: Any, backend: str = "emulate", **kwargs: Any) -> Any:
    """Quick mode by default, on ``backend`` (the tests that take the ``backend`` fixture run on CUDA too)."""
    torch.manual_seed(0)
    kwargs.setdefault("capture_sizes", SIZES)
    kwargs.setdefault("max_num_reqs", 4)
    kwargs.setdefault("exhaustive", False)
    device = "cuda" if backend == "cuda" else "cpu"
    return verify(module.to(device), make_inputs, backend=backend, **kwargs)


def _line(cls: type, text: str) -> int:
    """The line of ``cls``'s forward that holds ``text``."""
    lines, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _drawn() -> float:
    return float(torch.rand(()) + 0.5)


# -- every kind of place, each changed by make_inputs after the capture -----------------------------------

SCALES: dict[str, float] = {"scale": 1.0}
NAMESPACE = types.SimpleNamespace(scale=1.0)
SCALE_VAR: contextvars.ContextVar[float] = contextvars.ContextVar("SCALE_VAR", default=1.0)
LOCAL = threading.local()


def get_scale() -> float:
    return SCALES["scale"]


class _ClassScale(Base):
    scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _ThroughGetter(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = get_scale()
        return self.lin(x) * scale


class _ContextVarScale(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * SCALE_VAR.get()


class _ThreadLocalScale(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * LOCAL.scale


class _NamespaceScale(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * NAMESPACE.scale


def _closure_scale() -> tuple[nn.Module, dict[str, float]]:
    box = {"scale": 1.0}

    class _ClosureScale(Base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * box["scale"]

    return _ClosureScale(), box


def _case(name: str) -> tuple[nn.Module, Callable[[], None], str, str, int]:
    """(module, what make_inputs sets each step, the name, what it is, the line that reads it)."""
    if name == "class attribute":

        def set_class() -> None:
            _ClassScale.scale = _drawn()

        return (
            _ClassScale(),
            set_class,
            "_ClassScale.scale",
            "a class attribute of _ClassScale",
            _line(_ClassScale, "self.scale"),
        )
    if name == "through a function":
        return (
            _ThroughGetter(),
            lambda: SCALES.__setitem__("scale", _drawn()),
            "SCALES['scale']",
            f"a module-level dict of {__name__}",
            _line(_ThroughGetter, "get_scale()"),
        )
    if name == "ContextVar":
        return (
            _ContextVarScale(),
            lambda: SCALE_VAR.set(_drawn()) and None,
            "SCALE_VAR.get()",
            f"a ContextVar of {__name__}",
            _line(_ContextVarScale, "SCALE_VAR.get()"),
        )
    if name == "thread-local":
        return (
            _ThreadLocalScale(),
            lambda: setattr(LOCAL, "scale", _drawn()),
            "LOCAL.scale",
            f"a thread-local of {__name__}",
            _line(_ThreadLocalScale, "LOCAL.scale"),
        )
    if name == "module-level object":
        return (
            _NamespaceScale(),
            lambda: setattr(NAMESPACE, "scale", _drawn()),
            "NAMESPACE.scale",
            f"a module-level object of {__name__}",
            _line(_NamespaceScale, "NAMESPACE.scale"),
        )
    module, box = _closure_scale()
    return (
        module,
        lambda: box.__setitem__("scale", _drawn()),
        "box['scale']",
        "a closure cell of _closure_scale.<locals>._ClosureScale.forward",
        _line(type(module), 'box["scale"]'),
    )


@pytest.mark.parametrize(
    "kind",
    [
        "class attribute",
        "closure cell",
        "ContextVar",
        "thread-local",
        "module-level object",
        "through a function",
    ],
)
def test_a_value_read_from_outside_the_module_is_named_by_where_it_lives_its_line_and_both_values(
    kind: str, backend: str, device: torch.device
):
    LOCAL.scale = 1.0
    module, step, name, what, line = _case(kind)

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        step()
        return {"x": torch.randn(num_tokens, D, device=device)}

    report = _verify(module, make_inputs, backend)
    failed = [o for o in report.failures if o.check == "fresh_inputs"]
    assert failed, report.format()
    match = re.search(
        rf"Python value\(s\) forward reads from outside the module changed since FULL-T\d+-R\d+ was captured "
        rf"\({re.escape(name)} \({re.escape(what)}, read at tests/test_outside_state\.py:{line} in \S+\): "
        r"([\d.]+) at capture, ([\d.]+) now\).* with it put back eager gives the graph's result",
        failed[0].message,
    )
    assert match and match.group(1) != match.group(2), failed[0].message
    assert "nondeterministic" not in report.format()


# -- the forward context of the gallery, in full mode ------------------------------------------------------


def test_each_batch_runs_with_its_own_forward_context_and_padding_names_the_held_value(
    backend: str, device: torch.device
):
    """padded_size's float64 runs come after other batches were made: each reads the context make_inputs
    filled for it, so eager is right at every size, and only the checks of a graph fail (what the graph
    froze). padding_isolation, which sees a leak the frozen count makes, says so."""
    report = _verify(ReadsTokenCount(), context_inputs(device), backend, exhaustive=True)
    failed = {o.check for o in report.failures}
    assert failed == {"fresh_inputs", "real_batches", "padding_isolation"}, report.format()
    leak = next(o for o in report.failures if o.check == "padding_isolation")
    assert re.search(
        r"Forward reads values from outside the module that move from batch to batch \(FORWARD_CONTEXT\['meta'\]"
        r"\.num_actual_tokens .*: (\d+) at capture, (?!\1)\d+ now\), which a graph holds at its capture",
        leak.message,
    ), leak.message


# -- a counter forward moves ---------------------------------------------------------------------------------

NOISE = {"seed": 1234, "offset": 0}


class _HashNoise(Base):
    """A seed and an offset from a module-level dict, in plain torch arithmetic (no kernel sees them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NOISE["offset"] += 1
        index = torch.arange(x.numel(), dtype=torch.float64, device=x.device).view(x.shape)
        phase = (index + 7919.0 * NOISE["offset"] + 104729.0 * NOISE["seed"]) * 12.9898
        return self.lin(x) + (torch.sin(phase) * 43758.5453).frac().to(x.dtype)


@pytest.mark.parametrize("sizes", [SIZES, [4]], ids=["sizes", "one size"])
def test_a_host_counter_in_plain_arithmetic_is_named_with_its_values_and_no_floor_is_printed(
    sizes: list[int], backend: str, device: torch.device
):
    report = _verify(
        _HashNoise(), lambda n, r: {"x": torch.randn(n, D, device=device)}, backend, capture_sizes=sizes
    )
    said = report.format()
    line = _line(_HashNoise, "+= 1")
    failed = [o for o in report.failures if o.check == "replay_matches_eager"]
    assert failed and re.search(
        rf"Python state changes on every forward \(NOISE\['offset'\] \(a module-level dict of {re.escape(__name__)}, "
        rf"read at tests/test_outside_state\.py:{line} in _HashNoise\.forward\): "
        r"(\d+) -> (?!\1)\d+\)",
        failed[0].message,
    ), said
    assert "nondeterministic" not in said, said
    summary = said.splitlines()[0]
    assert "float64 reference" in summary, summary
    assert "no floor or limit (forward moves Python state on every call: NOISE['offset'])" in summary, summary
    assert not re.search(r"floor \d", summary), summary


# -- how places are found -----------------------------------------------------------------------------------


def test_only_what_forward_takes_from_a_place_counts_as_read():
    """A forward context holds many fields; a forward that reads one is not said to read the others."""
    context: dict[str, Any] = {"meta": types.SimpleNamespace(count=3, unused=7), "other": torch.ones(2)}

    class Reads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            meta = context["meta"]
            return x * meta.count

    outside = Outside(Reads())
    with outside.watching():
        Reads()(torch.ones(2))
    leaves = outside.leaves()
    read = {name for name in leaves if outside.read_by_forward(name)}
    assert read == {"context['meta'].count"}, leaves
    assert outside.site("context['meta'].count").endswith(
        f":{_line(Reads, 'meta.count')} in {Reads.forward.__qualname__}"
    )
