"""Bad input, tried: each mistake a new user makes, through every door, classified.

    python scripts/bad_inputs.py            # every case (a few minutes on two cores)
    python scripts/bad_inputs.py --smoke    # a few cases of each kind: seconds
    python scripts/bad_inputs.py --list     # the cases, without running them

The promise it measures: a bad argument, keyword, marker value, option, ini value, environment
variable or ``make_inputs`` result gets one line saying what was wrong (a ``UsageError``; for an
option, the ini or the environment, pytest's usage error: exit 4 before any test runs; for a marker,
its own test fails), never a traceback through the package or torch, never a crash, never a silent
pass; and a correct verification right after it still passes. Each case is one of:

- ``right``: refused in one line naming the cause (or, for input that cannot be verified, a
  failed or "not verified" report), and the correct verification after it passed;
- ``traceback``: refused, but with a traceback through the package (an exception that is not a
  ``UsageError``, a test failing with the package's frames, an INTERNALERROR);
- ``wrong``: refused with a message that does not name the cause, or the session ended with an
  INTERNALERROR (a crash inside the plugin);
- ``hang``: the run did not end (stopped after a time limit);
- ``crash``: the interpreter died (a signal);
- ``accepted``: it passed, or ran, where it should have been refused or not verified;
- ``broke``: the correct verification after it failed.

Kinds: ``verify`` (``verify()``'s keywords and the module), ``inputs`` (``make_inputs``' results),
``fixture`` (every fixture's keywords, one pytest run), ``marker`` (the marker, the same run),
``option`` / ``ini`` / ``env`` (a pytest run each), ``plan`` (``cudagraph-plan``), ``file`` (paths the
plugin writes).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUTCOMES = ("right", "traceback", "wrong", "hang", "crash", "accepted", "broke")
#: A frame of the package in a test's failure: a traceback went through it.
PACKAGE_FRAME = re.compile(r"pytest_cudagraph[/\\][\w/\\]+\.py:\d+")
#: An expected outcome for input that cannot be verified: refused, or a report that does not pass.
NOT_VERIFIED = "(not verified)"


@dataclass
class Result:
    kind: str
    name: str
    outcome: str
    said: str


@dataclass(frozen=True)
class Case:
    kind: str
    name: str
    #: A regular expression the one line must match (what names the cause), or NOT_VERIFIED.
    expect: str
    #: What the case runs; its meaning depends on the kind (see the runners below).
    spec: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- in-process cases: verify() and make_inputs -------------------------------------------------


def _tiny() -> Any:
    import torch

    return torch.nn.Linear(4, 4)


def _make(num_tokens: int, num_reqs: int) -> dict[str, Any]:
    import torch

    return {"input": torch.randn(num_tokens, 4)}


def _correct() -> bool:
    """The verification every case is followed by: a correct module, which must pass."""
    from pytest_cudagraph import verify

    return bool(verify(_tiny(), _make, capture_sizes=[1, 2], backend="emulate").ok)


def _module_class() -> Any:
    """The class itself, where an instance of it is meant."""
    import torch

    return torch.nn.Linear


def _raises() -> Any:
    """A module whose forward raises: the user's exception, told with their line."""
    import torch

    class Raises(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("this forward raises on purpose")

    return Raises()


def _jit() -> Any:
    import torch

    return torch.jit.script(torch.nn.Linear(4, 4))


class _LeaksPadding:
    """A module that sums over every row, padded ones too: caught with random inputs."""

    @staticmethod
    def build() -> Any:
        import torch

        class Leaky(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                return self.lin(input) + input.sum(0, keepdim=True)

        return Leaky()


def _verify_cases() -> list[Case]:
    """(name, keywords, expected) for verify() with the tiny module and correct inputs."""
    import torch

    def v(name: str, expect: str, **keywords: Any) -> Case:
        return Case("verify", name, expect, {"capture_sizes": [1, 2], **keywords})

    def sized(name: str, expect: str, **keywords: Any) -> Case:
        return Case("verify", name, expect, keywords)

    return [
        sized("capture_sizes='abc'", "capture_sizes", capture_sizes="abc"),
        sized("capture_sizes=[]", "capture_sizes", capture_sizes=[]),
        sized("capture_sizes=[0]", "capture_sizes", capture_sizes=[0]),
        sized("capture_sizes=[1.5]", "capture_sizes", capture_sizes=[1.5]),
        sized("capture_sizes=tensor", "capture_sizes", capture_sizes=torch.tensor([1, 2])),
        sized("capture_sizes=b'1,2'", "capture_sizes", capture_sizes=b"1,2"),
        sized("capture_sizes=range(1, 2**40)", "capture_sizes", capture_sizes=range(1, 2**40)),
        sized("capture_sizes=[2**40]", "capture_sizes", capture_sizes=[2**40]),
        sized("capture_sizes missing", "capture_sizes"),
        v("capture_size= (a typo)", "did you mean 'capture_sizes'", capture_size=[1, 2]),
        v("rtoll= (a typo)", "did you mean 'rtol'", rtoll=1e-3),
        v("mode='BOGUS'", "mode", mode="BOGUS"),
        v("mode=5", "mode", mode=5),
        v("backend='gpu'", "backend", backend="gpu"),
        v("checks='bogus'", "bogus", checks="bogus"),
        v("checks=5", "checks", checks=5),
        v(
            "checks=['replay_matches_eagr']",
            "did you mean 'replay_matches_eager'",
            checks=["replay_matches_eagr"],
        ),
        v("rtol=-1", "rtol", rtol=-1),
        v("rtol='1e-3'", "rtol", rtol="1e-3"),
        v("atol=nan", "atol", atol=float("nan")),
        v("rtol=inf", "rtol", rtol=float("inf")),
        v("seed=1.5", "seed", seed=1.5),
        v("seed=2**70", "seed", seed=2**70),
        v("exhaustive='yes'", "exhaustive", exhaustive="yes"),
        v("batch_invariant='no'", "batch_invariant", batch_invariant="no"),
        v("progress='yes'", "progress", progress="yes"),
        v("descriptors=5", "descriptors", descriptors=5),
        v("descriptors=['NOPE']", "NOPE", descriptors=["NOPE"]),
        v("descriptors=[]", "descriptors", descriptors=[]),
        v("batch_dims=[1]", "batch_dims", batch_dims=[1]),
        v("batch_dims=5", "batch_dims", batch_dims=5),
        v("batch_dims={'input': 'x'}", "batch_dims", batch_dims={"input": "x"}),
        v("eager_submodules=5", "eager_submodules", eager_submodules=5),
        v("eager_submodules=['nope']", "nope", eager_submodules=["nope"]),
        v("pad_values=5", "pad_values", pad_values=5),
        v("pad_values={'input': 'x'}", "pad_values", pad_values={"input": "x"}),
        v("pad_values={'nope': 0}", "pad_values", pad_values={"nope": 0}),
        v("scratch_state=5", "scratch_state", scratch_state=5),
        v("scratch_state naming no buffer", "scratch_state names 'nope'", scratch_state={"nope": 0}),
        v("extra_checks=5", "extra_checks", extra_checks=5),
        v("batches=[]", "batches", batches=[]),
        v("batches=5", "batches", batches=5),
        v("device='tpu'", "device", device="tpu"),
        v("device=5", "device", device=5),
        v("device='cuda:0' without CUDA", "cuda", device="cuda:0"),
        v("device=object()", "device", device=object()),
        v("options='x'", "options", options="x"),
        sized("config=5", "config", config=5),
        sized("config={'capture_sizes': 'x'}", "capture_sizes", config={"capture_sizes": "x"}),
        v("max_num_reqs=0", "max_num_reqs", max_num_reqs=0),
        v("max_num_reqs=2**40", "max_num_reqs", max_num_reqs=2**40),
        v("lora_cases=[-1]", "lora_cases", lora_cases=[-1]),
        v("decode_query_len=0", "decode_query_len", decode_query_len=0),
        v("mode='NONE': nothing to verify", NOT_VERIFIED, mode="NONE"),
        v(
            "FULL_DECODE_ONLY, decode_query_len=4 at sizes [1, 2]: no descriptor",
            NOT_VERIFIED,
            mode="FULL_DECODE_ONLY",
            decode_query_len=4,
        ),
        Case("verify", "a list for a module", "module", {"capture_sizes": [1, 2]}, {"module": list}),
        Case(
            "verify", "a torch.jit.script module", "ScriptModule", {"capture_sizes": [1, 2]}, {"module": _jit}
        ),
        Case("verify", "make_inputs=5", "make_inputs", {"capture_sizes": [1, 2]}, {"make_inputs": 5}),
        Case(
            "verify",
            "the Module class, not an instance",
            r"pass Linear\(\)",
            {"capture_sizes": [1, 2]},
            {"module": _module_class},
        ),
        Case(
            "verify",
            "a forward that raises",
            "forward raises on purpose",
            {"capture_sizes": [1, 2]},
            {"module": _raises},
        ),
    ]


def _input_cases() -> list[Case]:
    import numpy as np
    import torch

    def i(name: str, expect: str, make: Callable[[int, int], Any], **extra: Any) -> Case:
        return Case("inputs", name, expect, {"capture_sizes": [1, 2]}, {"make_inputs": make, **extra})

    return [
        i("a tensor, not a dict", "dict", lambda n, r: torch.randn(n, 4)),
        i("None", "dict", lambda n, r: None),
        i("key 0, not a string", "key", lambda n, r: {0: torch.randn(n, 4)}),
        i("key None, not a string", "key", lambda n, r: {None: torch.randn(n, 4)}),
        i("a numpy array", "numpy", lambda n, r: {"input": np.random.randn(n, 4).astype("float32")}),
        i("a nested dict", "input", lambda n, r: {"input": {"x": torch.randn(n, 4)}}),
        i("a list of tensors", "input", lambda n, r: {"input": [torch.randn(n, 4)]}),
        i("a sparse tensor", "sparse", lambda n, r: {"input": torch.randn(n, 4).to_sparse()}),
        i("a string", "str", lambda n, r: {"input": "tokens"}),
        i("an object", "input", lambda n, r: {"input": object()}),
        i("a meta tensor", "meta", lambda n, r: {"input": torch.empty(n, 4, device="meta")}),
        i("a key forward does not take", "forward", lambda n, r: {"x": torch.randn(n, 4)}),
        i("all NaN", NOT_VERIFIED, lambda n, r: {"input": torch.full((n, 4), float("nan"))}),
        i("all inf", NOT_VERIFIED, lambda n, r: {"input": torch.full((n, 4), float("inf"))}),
        i(
            "all NaN, a module that leaks padding",
            NOT_VERIFIED,
            lambda n, r: {"input": torch.full((n, 4), float("nan"))},
            module=_LeaksPadding.build,
        ),
        i("raises", "make_inputs", lambda n, r: 1 / 0),
    ]


def _run_in_process(case: Case) -> Result:
    from pytest_cudagraph import verify
    from pytest_cudagraph.errors import UsageError

    module_factory = case.extra.get("module", _tiny)
    make_inputs = case.extra.get("make_inputs", _make)
    keywords = dict(case.spec)
    keywords.setdefault("backend", "emulate")
    outcome, said = "accepted", "passed"
    try:
        report = verify(module_factory(), make_inputs, **keywords)
    except UsageError as exc:
        said = str(exc)
        if case.expect != NOT_VERIFIED and not re.search(case.expect, said, re.IGNORECASE):
            outcome = "wrong"
        elif "\n" in said:
            outcome = "traceback"
        else:
            outcome = "right"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
        outcome = "traceback"
    else:
        if case.expect == NOT_VERIFIED and not report.ok:
            outcome, said = "right", report.format().splitlines()[0]
        else:
            said = report.format().splitlines()[0]
    try:
        fine = _correct()
    except Exception as exc:  # the bad call left something broken
        fine, said = False, f"{said} | then: {type(exc).__name__}: {exc}"
    if not fine:
        outcome = "broke"
    return Result(case.kind, case.name, outcome, said.splitlines()[0][:200] if said else "")


# -- pytest runs: the fixtures and the marker ----------------------------------------------------

FIXTURE_HEAD = """
import pytest, torch

def make(n, r):
    return {"input": torch.randn(n, 4)}

def lin():
    return torch.nn.Linear(4, 4)

def loss(out, inputs):
    return out.sum()

def build(rank, world_size):
    return torch.nn.Linear(4, 4)

class Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input):
        raise RuntimeError("this forward raises on purpose")
"""

#: (name, the test's body or its marker and body, expected): one test each in one file.
#: A fixture's call with the keywords of one case (``{}``): the rest is a correct call.
_V = "cudagraph_verify(lin(), make, capture_sizes=[1, 2], {})"
_T = "cudagraph_verify_training(lin(), make, loss, {})"
_R = "cudagraph_verify_runner(lin(), lin(), make, capture_sizes=[1, 2], {})"
_B = "cudagraph_benchmark(lin(), make, capture_sizes=[1, 2], {})"
_M = "cudagraph_manager(lin(), make, capture_sizes=[1, 2], {})"
_D = "cudagraph_verify_distributed(build, make, world_size=1, capture_sizes=[1, 2], {})"

FIXTURE_CASES: list[tuple[str, str, str]] = [
    ("verify capture_size= (a typo)", "cudagraph_verify(lin(), make, capture_size=[1, 2])", "did you mean"),
    ("verify capture_sizes='abc'", "cudagraph_verify(lin(), make, capture_sizes='abc')", "capture_sizes"),
    ("verify capture_sizes=[]", "cudagraph_verify(lin(), make, capture_sizes=[])", "capture_sizes"),
    ("verify capture_sizes=[1.5]", "cudagraph_verify(lin(), make, capture_sizes=[1.5])", "capture_sizes"),
    (
        "verify capture_sizes=range(1, 2**40)",
        "cudagraph_verify(lin(), make, capture_sizes=range(1, 2**40))",
        "capture_sizes",
    ),
    ("verify capture_sizes=b'1,2'", "cudagraph_verify(lin(), make, capture_sizes=b'1,2')", "capture_sizes"),
    ("verify mode='BOGUS'", _V.format("mode='BOGUS'"), "mode"),
    ("verify backend='gpu'", _V.format("backend='gpu'"), "backend"),
    ("verify checks='bogus'", _V.format("checks='bogus'"), "bogus"),
    ("verify rtol=-1", _V.format("rtol=-1"), "rtol"),
    ("verify atol=nan", _V.format("atol=float('nan')"), "atol"),
    ("verify seed=1.5", _V.format("seed=1.5"), "seed"),
    (
        "verify exhaustive='yes'",
        _V.format("exhaustive='yes'"),
        "exhaustive",
    ),
    (
        "verify descriptors=5",
        _V.format("descriptors=5"),
        "descriptors",
    ),
    (
        "verify batch_dims=[1]",
        _V.format("batch_dims=[1]"),
        "batch_dims",
    ),
    (
        "verify eager_submodules=5",
        _V.format("eager_submodules=5"),
        "eager_submodules",
    ),
    ("verify device='tpu'", _V.format("device='tpu'"), "device"),
    ("verify device=5", _V.format("device=5"), "device"),
    (
        "verify device='cuda:0' without CUDA",
        _V.format("device='cuda:0'"),
        "cuda",
    ),
    ("verify batches=[]", _V.format("batches=[]"), "batches"),
    (
        "verify scratch_state naming no buffer",
        _V.format("scratch_state={'nope': 0}"),
        "scratch_state names 'nope'",
    ),
    (
        "verify the Module class, not an instance",
        "cudagraph_verify(torch.nn.Linear, make, capture_sizes=[1, 2])",
        r"pass Linear\(\)",
    ),
    ("verify mode='NONE'", _V.format("mode='NONE'"), NOT_VERIFIED),
    (
        "verify all-NaN inputs",
        "cudagraph_verify(lin(), lambda n, r: {'input': torch.full((n, 4), float('nan'))}, capture_sizes=[1, 2])",
        NOT_VERIFIED,
    ),
    (
        "verify make_inputs key 0",
        "cudagraph_verify(lin(), lambda n, r: {0: torch.randn(n, 4)}, capture_sizes=[1, 2])",
        "key",
    ),
    (
        "verify a numpy input",
        "import numpy\n    cudagraph_verify(lin(), lambda n, r: {'input': numpy.zeros((n, 4), 'float32')}, capture_sizes=[1, 2])",
        "numpy",
    ),
    (
        "verify a jit module",
        "cudagraph_verify(torch.jit.script(lin()), make, capture_sizes=[1, 2])",
        "ScriptModule",
    ),
    (
        "training loss_fn=None",
        "cudagraph_verify_training(lin(), make, None, capture_sizes=[1, 2])",
        "loss_fn",
    ),
    (
        "training the Module class, not an instance",
        "cudagraph_verify_training(torch.nn.Linear, make, loss, capture_sizes=[1, 2])",
        r"pass Linear\(\)",
    ),
    (
        "training optimizer='adam'",
        _T.format("optimizer='adam', capture_sizes=[1, 2]"),
        "optimizer",
    ),
    (
        "training autocast='bf16'",
        _T.format("autocast='bf16', capture_sizes=[1, 2]"),
        "autocast",
    ),
    (
        "training steps=0",
        _T.format("steps=0, capture_sizes=[1, 2]"),
        "steps",
    ),
    (
        "training steps=10**9",
        _T.format("steps=10**9, capture_sizes=[1, 2]"),
        "steps",
    ),
    (
        "training stepz= (a typo)",
        _T.format("stepz=2, capture_sizes=[1, 2]"),
        "did you mean",
    ),
    (
        "training device='tpu'",
        _T.format("device='tpu', capture_sizes=[1, 2]"),
        "device",
    ),
    (
        "runner capture_sizes='abc'",
        "cudagraph_verify_runner(lin(), lin(), make, capture_sizes='abc')",
        "capture_sizes",
    ),
    (
        "runner checks='bogus'",
        _R.format("checks='bogus'"),
        "bogus",
    ),
    (
        "runner rtol=nan",
        _R.format("rtol=float('nan')"),
        "rtol",
    ),
    (
        "runner mode='FULL' (a manager's keyword)",
        _R.format("mode='FULL'"),
        "mode",
    ),
    ("runner runner=5", "cudagraph_verify_runner(5, lin(), make, capture_sizes=[1, 2])", "runner"),
    (
        "runner the Module class, not an instance",
        "cudagraph_verify_runner(lin(), torch.nn.Linear, make, capture_sizes=[1, 2])",
        r"pass Linear\(\)",
    ),
    (
        "runner a forward that raises",
        "cudagraph_verify_runner(lin(), Raises(), make, capture_sizes=[1, 2])",
        r"forward raises at test_cases\.py:\d+ in forward.*RuntimeError: this forward raises on purpose",
    ),
    (
        "runner scratch_state naming no buffer",
        _R.format("scratch_state={'nope': 0}"),
        "scratch_state names 'nope'",
    ),
    ("benchmark without capture_sizes", "cudagraph_benchmark(lin(), make)", "capture_sizes"),
    (
        "benchmark the Module class, not an instance",
        "cudagraph_benchmark(torch.nn.Linear, make, capture_sizes=[1, 2])",
        r"pass Linear\(\)",
    ),
    (
        "benchmark a forward that raises",
        "cudagraph_benchmark(Raises(), make, capture_sizes=[1, 2])",
        r"forward raises at test_cases\.py:\d+ in forward.*RuntimeError: this forward raises on purpose",
    ),
    (
        "benchmark capture_sizes='abc'",
        "cudagraph_benchmark(lin(), make, capture_sizes='abc')",
        "capture_sizes",
    ),
    (
        "benchmark mode='BOGUS'",
        _B.format("mode='BOGUS'"),
        "mode",
    ),
    ("benchmark rounds=0", _B.format("rounds=0"), "rounds"),
    (
        "benchmark rounds=10**12",
        _B.format("rounds=10**12"),
        "rounds",
    ),
    (
        "benchmark roundz= (a typo)",
        _B.format("roundz=3"),
        "did you mean",
    ),
    ("manager mode='BOGUS'", _M.format("mode='BOGUS'"), "mode"),
    (
        "manager the Module class, not an instance",
        "cudagraph_manager(torch.nn.Linear, make, capture_sizes=[1, 2])",
        r"pass Linear\(\)",
    ),
    ("manager capture_size= (a typo)", "cudagraph_manager(lin(), make, capture_size=[1, 2])", "did you mean"),
    (
        "manager pad_values=5",
        _M.format("pad_values=5"),
        "pad_values",
    ),
    ("manager device='tpu'", _M.format("device='tpu'"), "device"),
    (
        "distributed world_size=0",
        "cudagraph_verify_distributed(build, make, world_size=0, capture_sizes=[1, 2])",
        "world_size must be",
    ),
    (
        "distributed world_size=10**6",
        "cudagraph_verify_distributed(build, make, world_size=10**6, capture_sizes=[1, 2])",
        "world_size",
    ),
    (
        "distributed checks='bogus'",
        _D.format("checks='bogus'"),
        "bogus",
    ),
    (
        "distributed mode='BOGUS'",
        _D.format("mode='BOGUS'"),
        "mode",
    ),
    (
        "distributed timeout=nan",
        "cudagraph_verify_distributed(build, make, world_size=1, timeout=float('nan'), capture_sizes=[1, 2])",
        "timeout",
    ),
    (
        "distributed capture_size= (a typo)",
        "cudagraph_verify_distributed(build, make, world_size=1, capture_size=[1, 2])",
        "did you mean",
    ),
]

#: (name, the marker's arguments, expected): a test carrying it calls cudagraph_verify.
MARKER_CASES: list[tuple[str, str, str]] = [
    ("marker checks='bogus'", "capture_sizes=[1, 2], checks='bogus'", "bogus"),
    ("marker mode='BOGUS'", "capture_sizes=[1, 2], mode='BOGUS'", "mode"),
    ("marker batch_dims=[1]", "capture_sizes=[1, 2], batch_dims=[1]", "batch_dims"),
    ("marker descriptors=5", "capture_sizes=[1, 2], descriptors=5", "descriptors"),
    ("marker rtol=nan", "capture_sizes=[1, 2], rtol=float('nan')", "rtol"),
    ("marker capture_sizes='abc'", "capture_sizes='abc'", "capture_sizes"),
    ("marker capture_sizes=[2**40]", "capture_sizes=[2**40]", "capture_sizes"),
    ("marker rtoll= (a typo)", "capture_sizes=[1, 2], rtoll=1e-3", "did you mean"),
    ("marker positional", "[1, 2]", "positional"),
    ("marker seed=2**70", "capture_sizes=[1, 2], seed=2**70", "seed"),
    ("marker pad_values=5", "capture_sizes=[1, 2], pad_values=5", "pad_values"),
    ("marker device='tpu'", "capture_sizes=[1, 2], device='tpu'", "device"),
    ("marker lora_cases='x'", "capture_sizes=[1, 2], lora_cases='x'", "lora_cases"),
]

FIXTURE_FOR = {
    "training": "cudagraph_verify_training",
    "runner": "cudagraph_verify_runner",
    "benchmark": "cudagraph_benchmark",
    "manager": "cudagraph_manager",
    "distributed": "cudagraph_verify_distributed",
}


#: The run's conftest: a case that runs on (10**9 training steps) or would start a million ranks is
#: stopped and told as accepted, not left to take the machine.
LIMITS = """
import signal

import pytest

LIMIT_S = 40


class Stopped(BaseException):
    \"\"\"Not an Exception: the harness's own handlers (a check that raises fails and the run goes on)
    let it through.\"\"\"


@pytest.fixture(autouse=True)
def _limit():
    def stop(*_):
        raise Stopped("CASE RAN PAST ITS LIMIT")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S, 5)  # and again every 5 s, should one be swallowed
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def pytest_configure(config):
    import importlib

    spawn = importlib.import_module("torch.multiprocessing.spawn")  # the module, not torch.multiprocessing.spawn()
    original = spawn.start_processes

    def guarded(fn, args=(), nprocs=1, *rest, **keywords):
        if nprocs > 4:
            raise RuntimeError(f"CASE WOULD SPAWN {nprocs} PROCESSES")
        return original(fn, args, nprocs, *rest, **keywords)

    spawn.start_processes = guarded
"""
#: What the limits above say when they stopped a case: it ran where it should have been refused.
STOPPED = re.compile(r"CASE RAN PAST ITS LIMIT|CASE WOULD SPAWN \d+ PROCESSES")


def _test_source(cases: list[Case]) -> str:
    parts = [FIXTURE_HEAD]
    for number, case in enumerate(cases):
        if case.kind == "marker":
            parts.append(
                f"\n@pytest.mark.cudagraph({case.spec})\ndef test_case_{number}(cudagraph_verify):\n"
                "    cudagraph_verify(lin(), make)\n"
            )
        else:
            fixture = FIXTURE_FOR.get(case.name.split()[0], "cudagraph_verify")
            parts.append(f"\ndef test_case_{number}({fixture}):\n    {case.spec}\n")
    # The correct verification after them all, in the same process.
    parts.append(
        "\ndef test_zz_correct(cudagraph_verify):\n    cudagraph_verify(lin(), make, capture_sizes=[1, 2])\n"
    )
    return "".join(parts)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


#: The address space a pytest run may take: room for torch and a verification, and for at most a
#: couple of thousand threads' stacks. A thread count the plugin lets through to torch
#: (PYTEST_CUDAGRAPH_THREADS=100000 before #58) then fails inside that run alone, never by taking
#: the machine's process ids (pid_max is often 32768) from everything else running on it.
ADDRESS_SPACE = 16 << 30


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _pytest(
    folder: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *args],
        preexec_fn=_limited,
        cwd=folder,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _classify_test(case: Case, element: ET.Element | None) -> tuple[str, str]:
    if element is None:
        return "crash", "the test did not run (the session ended before it)"
    bad = element.find("failure")
    if bad is None:
        bad = element.find("error")
    if bad is None:
        skipped = element.find("skipped")
        if skipped is not None:
            return "accepted", f"skipped: {skipped.get('message', '')}"
        return "accepted", "passed"
    text = (bad.text or bad.get("message") or "").strip()
    lines = text.splitlines()
    said = lines[0] if lines else ""
    stopped = STOPPED.search(text)
    if stopped:
        return "accepted", stopped.group(0)
    if PACKAGE_FRAME.search(text) or "Traceback" in text:
        return "traceback", said
    if case.expect == NOT_VERIFIED:
        return "right", said  # it failed: what it could not verify was not passed
    if len(lines) > 1:  # a verification that ran (and failed on what it was given), not a refusal
        return "accepted", f"ran: {said}"
    if not re.search(case.expect, text, re.IGNORECASE):
        return "wrong", said
    return "right", said


def _run_fixture_file(cases: list[Case]) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="bad-inputs-") as tmp:
        folder = Path(tmp)
        (folder / "test_cases.py").write_text(_test_source(cases))
        (folder / "conftest.py").write_text(LIMITS)
        try:
            proc = _pytest(
                folder,
                "--cudagraph-backend=emulate",
                "--junitxml=out.xml",
                "-q",
                "test_cases.py",
                timeout=1200,
            )
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess([], -9, "the run went on past 1200 s", "")
        found: dict[str, ET.Element] = {}
        xml = folder / "out.xml"
        if xml.exists():
            for element in ET.parse(xml).iter("testcase"):
                found[element.get("name", "")] = element
    crashed = proc.returncode not in (0, 1) or "INTERNALERROR" in proc.stdout + proc.stderr
    if crashed and len(cases) > 1:
        # The session itself ended: find which case ended it, each in a run of its own.
        return [r for case in cases for r in _run_fixture_file([case])]
    if crashed:
        said = (proc.stdout + proc.stderr).strip().splitlines()
        if proc.returncode == -9:  # stopped after its time limit
            outcome = "hang"
        elif proc.returncode < 0:  # a signal: the interpreter died
            outcome = "crash"
        else:  # an INTERNALERROR or a usage error of the whole session
            outcome = "wrong"
        return [Result(cases[0].kind, cases[0].name, outcome, said[-1][:200] if said else "")]
    correct = found.get("test_zz_correct")
    broke = correct is None or correct.find("failure") is not None or correct.find("error") is not None
    results = []
    for number, case in enumerate(cases):
        outcome, said = _classify_test(case, found.get(f"test_case_{number}"))
        if broke and outcome == "right":
            outcome = "broke"
        results.append(Result(case.kind, case.name, outcome, said[:200]))
    return results


# -- pytest runs: options, the ini and the environment -------------------------------------------

NEVER = "def test_x():\n    open('ran', 'w').close()\n"
VERIFIES = (
    "import torch\n\ndef test_x(cudagraph_verify):\n    open('ran', 'w').close()\n"
    "    cudagraph_verify(torch.nn.Linear(4, 4), lambda n, r: {'input': torch.randn(n, 4)}, capture_sizes=[1, 2])\n"
)


def _session_cases() -> list[Case]:
    def o(name: str, expect: str, *args: str, **extra: Any) -> Case:
        return Case("option", name, expect, args, extra)

    def ini(name: str, expect: str, text: str) -> Case:
        return Case("ini", name, expect, (), {"ini": text})

    def env(name: str, expect: str, **variables: str) -> Case:
        return Case("env", name, expect, (), {"env": variables})

    return [
        o("--cudagraph-sizes=abc", "cudagraph-sizes", "--cudagraph-sizes=abc"),
        o("--cudagraph-sizes=99999999999999", "cudagraph-sizes", "--cudagraph-sizes=99999999999999"),
        o("--cudagraph-sizes=0", "cudagraph-sizes", "--cudagraph-sizes=0"),
        o("--cudagraph-backend=gpu", "cudagraph-backend", "--cudagraph-backend=gpu"),
        o("--cudagraph-checks=bogus", "bogus", "--cudagraph-checks=bogus"),
        o("--cudagraph-checks=determinsm", "did you mean", "--cudagraph-checks=determinsm"),
        o("--cudagraph-split=x", "cudagraph-split", "--cudagraph-split=x"),
        o("--cudagraph-world-size=0", "world-size", "--cudagraph-world-size=0"),
        o("--cudagraph-world-size=100000000", "world-size", "--cudagraph-world-size=100000000"),
        o("--cudagraph-isolate-timeout=nan", "isolate-timeout", "--cudagraph-isolate-timeout=nan"),
        o("--cudagraph-isolate-timeout=1e300", "isolate-timeout", "--cudagraph-isolate-timeout=1e300"),
        o("--cudagraph-devices=a", "cudagraph-devices", "--cudagraph-devices=a"),
        o("--cudagraph-devices=99999999999", "cudagraph-devices", "--cudagraph-devices=99999999999"),
        o("--cudagraph-report= (empty)", "cudagraph-report", "--cudagraph-report="),
        o("--cudagraph-bench-report= (empty)", "cudagraph-bench-report", "--cudagraph-bench-report="),
        o("--cudagraph-trace= (empty)", "cudagraph-trace", "--cudagraph-trace="),
        o("--cudagraph-trace=a folder", "cudagraph-trace", "--cudagraph-trace={tmp}/folder"),
        o("--cudagraph-trace=a FIFO", "not a regular file", "--cudagraph-trace={tmp}/fifo"),
        o("--cudagraph-compare= (empty)", "cudagraph-compare", "--cudagraph-compare="),
        ini("ini cudagraph_sizes = abc", "cudagraph_sizes", "cudagraph_sizes = abc"),
        ini("ini cudagraph_verify = maybe", "cudagraph_verify", "cudagraph_verify = maybe"),
        ini("ini cudagraph_checks = bogus", "bogus", "cudagraph_checks = bogus"),
        ini("ini cudagraph_split = nope", "cudagraph_split", "cudagraph_split = nope"),
        env("PYTEST_CUDAGRAPH_CAPTURE=bogus", "PYTEST_CUDAGRAPH_CAPTURE", PYTEST_CUDAGRAPH_CAPTURE="bogus"),
        env("PYTEST_CUDAGRAPH_THREADS=abc", "PYTEST_CUDAGRAPH_THREADS", PYTEST_CUDAGRAPH_THREADS="abc"),
        env("PYTEST_CUDAGRAPH_THREADS=100000", "PYTEST_CUDAGRAPH_THREADS", PYTEST_CUDAGRAPH_THREADS="100000"),
        env("PYTEST_CUDAGRAPH_THREADS=-1", "PYTEST_CUDAGRAPH_THREADS", PYTEST_CUDAGRAPH_THREADS="-1"),
        env(
            "PYTEST_CUDAGRAPH_MEMORY_CHECK=bogus",
            "PYTEST_CUDAGRAPH_MEMORY_CHECK",
            PYTEST_CUDAGRAPH_MEMORY_CHECK="bogus",
        ),
    ]


def _file_cases() -> list[Case]:
    """Paths the plugin writes that exist and are not regular files: a FIFO, a folder."""
    return [
        Case("file", "--cudagraph-report=a FIFO", "not a regular file", ("--cudagraph-report={tmp}/fifo",)),
        Case(
            "file",
            "--cudagraph-bench-report=a FIFO",
            "not a regular file",
            ("--cudagraph-bench-report={tmp}/fifo",),
        ),
        Case("file", "--cudagraph-report=a folder", "folder|directory", ("--cudagraph-report={tmp}/folder",)),
        Case(
            "file",
            "ini cudagraph_report = a FIFO",
            "not a regular file",
            (),
            {"ini": "cudagraph_report = fifo"},
        ),
    ]


def _run_session(case: Case) -> Result:
    with tempfile.TemporaryDirectory(prefix="bad-inputs-") as tmp:
        folder = Path(tmp)
        (folder / "folder").mkdir()
        os.mkfifo(folder / "fifo")
        (folder / "test_one.py").write_text(VERIFIES)
        ini = case.extra.get("ini")
        if ini:
            (folder / "pytest.ini").write_text(f"[pytest]\n{ini}\n")
        env = {**_env(), **case.extra.get("env", {})}
        args = [a.replace("{tmp}", tmp) for a in case.spec]
        try:
            proc = _pytest(folder, "--cudagraph-backend=emulate", *args, "test_one.py", env=env, timeout=120)
        except subprocess.TimeoutExpired:
            return Result(case.kind, case.name, "hang", "the run went on past 120 s")
        ran = (folder / "ran").exists()
        fifo_kept = (folder / "fifo").is_fifo()
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    said = errors[0] if errors else (output.strip().splitlines() or [""])[-1]
    if proc.returncode < 0:
        return Result(case.kind, case.name, "crash", f"signal {-proc.returncode}")
    if not fifo_kept:
        return Result(case.kind, case.name, "wrong", "the FIFO was replaced")
    if "INTERNALERROR" in output:  # the session itself ended inside the plugin
        return Result(case.kind, case.name, "wrong", f"INTERNALERROR: {said[:180]}")
    if "Traceback" in output:
        return Result(case.kind, case.name, "traceback", said[:200])
    if proc.returncode == 4 and not ran:
        if len(errors) != 1 or not re.search(case.expect, errors[0], re.IGNORECASE):
            return Result(case.kind, case.name, "wrong", said[:200])
        return Result(case.kind, case.name, "right", said[:200])
    if proc.returncode == 0:
        return Result(case.kind, case.name, "accepted", "the run passed")
    return Result(case.kind, case.name, "wrong", f"exit {proc.returncode}: {said[:180]}")


# -- cudagraph-plan --------------------------------------------------------------------------------


def _plan_cases() -> list[Case]:
    def p(name: str, expect: str, *args: str) -> Case:
        return Case("plan", name, expect, args)

    return [
        p("a folder for the trace", "folder|directory", "{tmp}/folder"),
        p("a FIFO for the trace", "regular file", "{tmp}/fifo"),
        p("a trace line of 2**40 tokens", "2\\*\\*20|1048576|num_tokens|line", "{tmp}/huge.csv"),
        p("a trace that does not exist", "no such|does not exist|not found", "{tmp}/nothing.csv"),
        p("--capture-sizes 99999999999", "capture", "{tmp}/trace.csv", "--capture-sizes", "99999999999"),
        p(
            "--max-num-reqs 99999999999",
            "max-num-reqs|max_num_reqs",
            "{tmp}/trace.csv",
            "--max-num-reqs",
            "99999999999",
        ),
        p("--max-graphs 10**12", "max-graphs", "{tmp}/trace.csv", "--max-graphs", "1000000000000"),
        p("--top 10**12", "top", "{tmp}/trace.csv", "--top", "1000000000000"),
        p("--json a FIFO", "not a regular file", "{tmp}/trace.csv", "--json", "{tmp}/fifo"),
        p("--json a folder", "folder|directory", "{tmp}/trace.csv", "--json", "{tmp}/folder"),
        p("--json '' (empty)", "empty", "{tmp}/trace.csv", "--json", ""),
        p("--plot a FIFO", "not a regular file", "{tmp}/trace.csv", "--plot", "{tmp}/fifo"),
        p(
            "--estimate-memory, a --module factory that raises",
            "--module",
            "{tmp}/trace.csv",
            "--max-graphs",
            "2",
            "--estimate-memory",
            "--module",
            "bad_inputs_factories:raises",
            "--make-inputs",
            "bad_inputs_factories:make",
        ),
        p(
            "--estimate-memory --backend cuda without CUDA",
            "--backend cuda",
            "{tmp}/trace.csv",
            "--max-graphs",
            "2",
            "--estimate-memory",
            "--backend",
            "cuda",
            "--module",
            "bad_inputs_factories:linear",
            "--make-inputs",
            "bad_inputs_factories:make",
        ),
        p(
            "--estimate-memory, a --module factory that returns no module",
            "--module",
            "{tmp}/trace.csv",
            "--max-graphs",
            "2",
            "--estimate-memory",
            "--module",
            "bad_inputs_factories:not_a_module",
            "--make-inputs",
            "bad_inputs_factories:make",
        ),
    ]


FACTORIES = """
import torch

def raises():
    raise RuntimeError("the factory failed")

def linear():
    return torch.nn.Linear(4, 4)

def not_a_module():
    return 5

def make(n, r):
    return {"input": torch.randn(n, 4)}
"""


def _run_plan(case: Case) -> Result:
    """``cudagraph-plan`` as users run it, in a process of its own: a write into a FIFO blocks, and
    the run is stopped after a minute (a hang) rather than this script with it."""
    with tempfile.TemporaryDirectory(prefix="bad-inputs-") as tmp:
        folder = Path(tmp)
        (folder / "folder").mkdir()
        os.mkfifo(folder / "fifo")
        (folder / "trace.csv").write_text("num_tokens,num_reqs\n3,1\n5,2\n8,4\n")
        (folder / "huge.csv").write_text(f"num_tokens,num_reqs\n3,1\n{2**40},1\n")
        (folder / "bad_inputs_factories.py").write_text(FACTORIES)
        args = [a.replace("{tmp}", tmp) for a in case.spec]
        env = _env()
        env["PYTHONPATH"] = f"{tmp}{os.pathsep}{env['PYTHONPATH']}"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest_cudagraph.plan_trace", *args],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                preexec_fn=_limited,
            )
        except subprocess.TimeoutExpired:
            os.close(os.open(folder / "fifo", os.O_RDONLY | os.O_NONBLOCK))  # let a blocked writer go
            return Result(case.kind, case.name, "hang", "the command went on past 60 s")
        fifo_kept = (folder / "fifo").is_fifo()
    status = proc.returncode
    if status < 0:
        return Result(case.kind, case.name, "crash", f"signal {-status}")
    if "Traceback" in proc.stderr:
        lines = proc.stderr.strip().splitlines()
        return Result(case.kind, case.name, "traceback", lines[-1][:200] if lines else "")
    err = io.StringIO(proc.stderr)
    errors = [line for line in err.getvalue().splitlines() if "error:" in line]
    said = errors[0] if errors else err.getvalue().strip()[:200]
    if not fifo_kept:
        return Result(case.kind, case.name, "wrong", "the FIFO was replaced")
    if status == 0:
        return Result(case.kind, case.name, "accepted", "exit 0")
    if status == 2 and len(errors) == 1 and re.search(case.expect, errors[0], re.IGNORECASE):
        return Result(case.kind, case.name, "right", said[:200])
    return Result(case.kind, case.name, "wrong", f"exit {status}: {said[:180]}")


# -- the environment read in process ------------------------------------------------------------


def _env_reading_cases() -> list[Case]:
    return [
        Case("env", "PYTEST_CUDAGRAPH_MEMORY_CHECK=false turns the estimate off", "off", "false"),
        Case("env", "PYTEST_CUDAGRAPH_MEMORY_CHECK=no turns the estimate off", "off", "no"),
        Case("env", "PYTEST_CUDAGRAPH_MEMORY_CHECK=0 turns the estimate off", "off", "0"),
    ]


def _run_env_reading(case: Case) -> Result:
    from pytest_cudagraph.manager import estimate

    old = os.environ.get("PYTEST_CUDAGRAPH_MEMORY_CHECK")
    os.environ["PYTEST_CUDAGRAPH_MEMORY_CHECK"] = case.spec
    try:
        enabled = estimate.memory_check_enabled()
    except Exception as exc:
        return Result(case.kind, case.name, "traceback", f"{type(exc).__name__}: {exc}"[:200])
    finally:
        if old is None:
            os.environ.pop("PYTEST_CUDAGRAPH_MEMORY_CHECK")
        else:
            os.environ["PYTEST_CUDAGRAPH_MEMORY_CHECK"] = old
    return Result(case.kind, case.name, "accepted" if enabled else "right", f"enabled={enabled}")


# -- the run --------------------------------------------------------------------------------------


def _cases() -> dict[str, list[Case]]:
    fixtures = [Case("fixture", name, expect, body) for name, body, expect in FIXTURE_CASES]
    markers = [Case("marker", name, expect, args) for name, args, expect in MARKER_CASES]
    return {
        "verify": _verify_cases(),
        "inputs": _input_cases(),
        "pytest": fixtures + markers,
        "session": _session_cases() + _file_cases(),
        "plan": _plan_cases(),
        "env_reading": _env_reading_cases(),
    }


def _smoke(cases: dict[str, list[Case]]) -> dict[str, list[Case]]:
    return {group: items[:2] for group, items in cases.items()}


def run(cases: dict[str, list[Case]], show: Callable[[str], None]) -> list[Result]:
    results: list[Result] = []

    def each(found: list[Result]) -> None:
        for r in found:
            show(f"  {r.outcome:<9} {r.kind:<8} {r.name}: {r.said}")
        results.extend(found)

    each([_run_in_process(c) for c in cases["verify"] + cases["inputs"]])
    for group in ("fixture", "marker"):  # a marker that ends the session costs its group's run only
        chosen = [c for c in cases["pytest"] if c.kind == group]
        if chosen:
            each(_run_fixture_file(chosen))
    each([_run_session(c) for c in cases["session"]])
    each([_run_plan(c) for c in cases["plan"]])
    each([_run_env_reading(c) for c in cases["env_reading"]])
    return results


def summary(results: list[Result]) -> list[str]:
    by_kind: dict[str, Counter[str]] = {}
    for r in results:
        by_kind.setdefault(r.kind, Counter())[r.outcome] += 1
    lines = [f"| kind | cases | {' | '.join(OUTCOMES)} |", "|---|---:|" + "---:|" * len(OUTCOMES)]
    for kind, counts in by_kind.items():
        cells = " | ".join(str(counts[o]) for o in OUTCOMES)
        lines.append(f"| {kind} | {sum(counts.values())} | {cells} |")
    total = Counter(r.outcome for r in results)
    lines.append(f"| all | {len(results)} | {' | '.join(str(total[o]) for o in OUTCOMES)} |")
    lines.append(f"{total['right']} of {len(results)} bad inputs handled right")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="two cases of each group: proves the script runs"
    )
    parser.add_argument("--list", action="store_true", help="list the cases and stop")
    parser.add_argument("--quiet", action="store_true", help="the table alone, not a line per case")
    parser.add_argument("--case", metavar="TEXT", help="run the cases whose name holds TEXT only")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="GROUP",
        help="run these groups only: verify inputs pytest session plan env_reading",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = _cases()
    if args.only:
        cases = {group: items if group in args.only else [] for group, items in cases.items()}
    if args.case:
        cases = {group: [c for c in items if args.case in c.name] for group, items in cases.items()}
    if args.smoke:
        cases = _smoke(cases)
    if args.list:
        for group in cases.values():
            for case in group:
                print(f"{case.kind:<8} {case.name}")
        print(f"{sum(len(g) for g in cases.values())} cases")
        return 0
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    results = run(cases, (lambda _line: None) if args.quiet else print)
    print()
    for line in summary(results):
        print(line)
    print(f"({time.monotonic() - started:.0f} s, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
