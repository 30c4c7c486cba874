"""Where and on what a run happened, for the JSON report: the machine and the commit.

As pytest-benchmark's ``machine_info`` and ``commit_info``: a report kept by a
CI job says which torch, CUDA, driver, device, Python and commit its figures
came from. Pure Python: torch is asked only when the run already imported it
(a suite that never used the plugin's engine does not pay for it).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["commit_info", "imported_modules", "machine_info", "now_utc", "packages"]

#: Distributions the report always names, installed or not (null where not): the plugin and what it
#: runs on. Every other distribution is named where a module of it was imported (``packages``).
_PACKAGES = (
    "pytest-cudagraph",
    "pytest",
    "torch",
    "transformers",
    "hypothesis",
    "pytest-xdist",
    "pytest-benchmark",
)


def _normal(name: str) -> str:
    """A distribution's name as PEP 503 compares names: 'Pytest_Xdist' -> 'pytest-xdist'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules() -> set[str]:
    """The top-level names of the modules imported in this process now ('triton', 'torchao', ...)."""
    return {name.partition(".")[0] for name in list(sys.modules)}


def packages(modules: Iterable[str] = ()) -> dict[str, str | None]:
    """The versions of the distributions that took part in the run: those of ``_PACKAGES``
    (None where not installed) and every installed distribution a module of ``modules`` (top-level
    names imported in this process or another of the run: an xdist worker, an isolated child)
    or of this process belongs to, by PEP 503 name, sorted. Derived from what was imported, so
    the kernels' and the quantization libraries' (triton, torchao) are there when a test used them,
    and nothing is that no test imported."""
    found: dict[str, str | None] = {name: _version(name) for name in _PACKAGES}
    owners = metadata.packages_distributions()
    for module in imported_modules() | set(modules):
        for distribution in owners.get(module, ()):
            name = _normal(distribution)
            if found.get(name) is None:
                found[name] = _version(distribution)
    return dict(sorted(found.items()))


def now_utc() -> str:
    """The time now, UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    """A short command's stripped output, or None when it cannot run or fails."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _torch_info() -> dict[str, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    info: dict[str, Any] = {
        "version": str(torch.__version__),
        "cuda": torch.version.cuda,
        "cudnn": None,
        "devices": [],
    }
    try:
        if torch.cuda.is_available():
            info["cudnn"] = torch.backends.cudnn.version()
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                info["devices"].append(
                    {
                        "index": index,
                        "name": props.name,
                        "capability": f"{props.major}.{props.minor}",
                        "memory_bytes": int(props.total_memory),
                    }
                )
    except Exception as exc:  # a lost CUDA context: say so rather than lose the report
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def machine_info(modules: Iterable[str] = ()) -> dict[str, Any]:
    """Python, the operating system, the CPU count, the versions of the packages that took part
    (``packages``: this process's imports and ``modules``, those of the run's other processes),
    torch and its devices, and the NVIDIA driver (from ``nvidia-smi``, where there is one)."""
    driver = None
    if shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        driver = out.splitlines()[0].strip() if out else None
    return {
        "node": platform.node(),
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "cpu_count": os.cpu_count(),
        "packages": packages(modules),
        "torch": _torch_info(),
        "nvidia_driver": driver,
    }


def commit_info(folder: Path) -> dict[str, Any]:
    """The git commit the run's folder is at: its id, time, branch and whether the tree had changes
    (None values and ``error`` where the folder is not in a git repository or git is missing)."""
    top = _run(["git", "rev-parse", "--show-toplevel"], folder) if shutil.which("git") else None
    if top is None:
        return {
            "id": None,
            "time": None,
            "branch": None,
            "dirty": None,
            "error": f"{folder} is not in a git repository (or git is not installed)",
        }
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], folder)
    return {
        "id": _run(["git", "rev-parse", "HEAD"], folder),
        "time": _run(["git", "log", "-1", "--format=%cI"], folder),
        "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], folder),
        "dirty": bool(status) if status is not None else None,
        "project": Path(top).name,
    }
