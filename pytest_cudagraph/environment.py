"""The environment variables pytest-cudagraph reads: each one's name, what it does and how its
value is read, in one table, and read in one place (``read``).

The plugin checks every one when pytest starts (``check_all``): a value it cannot read stops the
run with pytest's usage error (exit 4) before anything is collected, instead of failing every
test, or crashing a worker, when the code that reads it first runs. Booleans read as pytest reads
an ini boolean (``1/0``, ``true/false``, ``yes/no``, ``on/off``, ``y/n``, ``t/f``, any case).
Pure Python: importing this module imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .plan.validate import UsageError, short

__all__ = [
    "CAPTURE",
    "ISOLATED",
    "MAX_THREADS",
    "MEMORY_CHECK",
    "THREADS",
    "VARIABLES",
    "EnvVar",
    "check_all",
    "read",
    "read_bool",
]

#: The most torch intra-op threads ``PYTEST_CUDAGRAPH_THREADS`` may ask for. More threads than
#: cores only wait on each other, and far more crash the interpreter inside torch's OpenMP
#: (libgomp): its start of a parallel region puts every new thread's start data on the calling
#: thread's stack (alloca), which 100000 threads overflow (a segmentation fault in the first
#: parallel reduction, observe.bit_sums), and thread creation fails (libgomp exits) from about
#: 20000 on a machine with an ordinary process limit.
MAX_THREADS = 1024

#: As pytest reads an ini boolean (``_pytest.config._strtobool``).
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, what it does (``--help`` shows it), how a value that is
    set is read (``parse(text, name)``: a ``UsageError`` naming the variable when it cannot be) and
    what it is when unset or empty."""

    name: str
    help: str
    parse: Callable[[str, str], Any]
    default: Any = None


def read_bool(text: str, name: str) -> bool:
    """A boolean as an ini boolean reads: ``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off``."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise UsageError(f"{name}={short(text)}: expected true or false (1/0, yes/no, on/off), as an ini boolean")


def _threads(text: str, name: str) -> int:
    try:
        count = int(text.strip())
    except ValueError:
        count = -1
    if not 0 <= count <= MAX_THREADS:
        raise UsageError(
            f"{name}={short(text)}: expected a number of torch threads from 1 to {MAX_THREADS}, or 0 to leave "
            "torch's own"
        )
    return count


def _capture(text: str, name: str) -> str:
    word = text.strip().lower()
    if word not in ("checked", "fast"):
        raise UsageError(f"{name}={short(text)}: expected checked or fast (the mode of every capture)")
    return word


def _path(text: str, name: str) -> str:
    return text


THREADS = EnvVar(
    "PYTEST_CUDAGRAPH_THREADS",
    "torch intra-op threads of a test process (0: leave torch alone; default: the cores shared among xdist "
    f"workers, unless OMP_NUM_THREADS or MKL_NUM_THREADS is set; at most {MAX_THREADS})",
    _threads,
)
CAPTURE = EnvVar(
    "PYTEST_CUDAGRAPH_CAPTURE", "checked or fast: the mode of every capture, over the default", _capture
)
MEMORY_CHECK = EnvVar(
    "PYTEST_CUDAGRAPH_MEMORY_CHECK",
    "false (0, no, off) skips the graph-memory estimate made before capturing",
    read_bool,
    True,
)
ISOLATED = EnvVar(
    "PYTEST_CUDAGRAPH_ISOLATED",
    "set by --cudagraph-isolate in its child processes (not for users to set)",
    _path,
)
#: Every variable, in the order ``--help`` lists them.
VARIABLES: tuple[EnvVar, ...] = (THREADS, CAPTURE, MEMORY_CHECK, ISOLATED)


def read(var: EnvVar, env: Mapping[str, str] | None = None) -> Any:
    """``var``'s value in ``env`` (default: ``os.environ``), read as its table entry says; its
    default when unset or blank; a ``UsageError`` naming it when it cannot be read."""
    text = (os.environ if env is None else env).get(var.name, "")
    if not text.strip():
        return var.default
    return var.parse(text, var.name)


def check_all(env: Mapping[str, str] | None = None) -> None:
    """Read every variable: the first that cannot be read is a ``UsageError``."""
    for var in VARIABLES:
        read(var, env)
