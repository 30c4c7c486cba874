"""Who called an op the guard found: the finding itself, the line that called it, the submodule running.

A ``Violation`` names the op, the reason, the submodule (``ModuleTracker``
follows the forward's submodules by hooks) and the first line of the caller's
code (``call_site``), so a failed capture points at the user's code rather
than at torch or this package.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch


@dataclass(frozen=True)
class Violation:
    """One op that cannot be captured, and where it was called.

    ``location`` is part of equality: the same op called from two lines is
    two violations, one call repeated (a loop) is one.
    """

    op: str
    reason: str
    module_path: str
    #: "path:line in function" of the call, the first frame outside torch,
    #: this package and contextlib/functools; "" when unknown.
    location: str = ""

    def describe(self) -> str:
        where = f"submodule '{self.module_path}'" if self.module_path else "the top-level module"
        at = f", at {self.location}" if self.location else ""
        return f"{self.op} ({self.reason}) in {where}{at}"


# Frames that are machinery, not the caller a violation should name.
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# this package: pytest_cudagraph/, the folder above this one (guard/)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SKIPPED_DIRS = (_TORCH_DIR, _PACKAGE_DIR)
# Triton's package, where installed (found without importing it).
_TRITON_DIRS = tuple(
    os.path.join(os.path.abspath(p), "triton") + os.sep
    for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"))
    if p
)
_SKIPPED_FILES = frozenset(
    os.path.abspath(m.__file__) for m in (contextlib, functools) if m.__file__ is not None
)


def call_site(frame: FrameType | None = None, *, launch: bool = False) -> str:
    """ "path:line in function" of the first frame outside torch, this package and contextlib/functools
    (``launch``: and Triton, whose launch machinery stands between a kernel's caller and its launch).

    Walked only when a violation is reported: the failure path pays for it.
    """
    skipped = _SKIPPED_DIRS + _TRITON_DIRS if launch else _SKIPPED_DIRS
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    while f is not None:
        filename = os.path.abspath(f.f_code.co_filename)
        if not filename.startswith(skipped) and filename not in _SKIPPED_FILES:
            return f"{_short_path(filename)}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return ""


def _library_dirs() -> tuple[str, ...]:
    """Where installed libraries and the standard library live: code the user did not write."""
    found = {
        os.path.abspath(p) + os.sep
        for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
        if p
    }
    found.update(
        os.path.abspath(p) + os.sep for p in sys.path if p.endswith(("site-packages", "dist-packages"))
    )
    return tuple(sorted(found))


_LIBRARY_DIRS = _library_dirs()


def in_library(site_file: str) -> bool:
    """Whether a file is an installed library's or the standard library's (not the user's own code)."""
    filename = os.path.abspath(site_file)
    return filename.startswith(_LIBRARY_DIRS) or any(
        marker in filename
        for marker in (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
    )


def _users(filename: str) -> bool:
    """Whether a file is the user's own code: outside torch, this package, installed libraries
    (site-packages) and the standard library."""
    filename = os.path.abspath(filename)
    return (
        not filename.startswith(_SKIPPED_DIRS) and filename not in _SKIPPED_FILES and not in_library(filename)
    )


def user_site(frame: FrameType | None = None) -> str:
    """ "path:line in function" of the first frame in the user's own code: outside torch, this package,
    installed libraries (site-packages) and the standard library; "" when none is on the stack."""
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    while f is not None:
        if _users(f.f_code.co_filename):
            return f"{_short_path(os.path.abspath(f.f_code.co_filename))}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return ""


def raised_at(exc: BaseException) -> str:
    """ "path:line in function" where ``exc`` left the user's own code: the innermost frame of its
    traceback in it (the line that raised, or that called into torch or a library that raised);
    "" when its traceback has none."""
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if _users(code.co_filename):
            found = f"{_short_path(os.path.abspath(code.co_filename))}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return found


def _short_path(filename: str) -> str:
    cwd = os.getcwd() + os.sep
    if filename.startswith(cwd):
        return filename[len(cwd) :]
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        _head, found, tail = filename.rpartition(marker)
        if found:
            return tail
    return filename


class ModuleTracker:
    """Keeps the dotted path of the submodule whose forward is running."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._stack: list[str] = []
        #: The submodule that was running when a tracked forward last failed.
        self.failed_path = ""
        #: Ops the emulator's guard met that the capturability table does not cover, with the
        #: submodule that ran each first: whether CUDA captures them is not known.
        self.not_known: dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the module tree's names again (after submodules are added or replaced)."""
        self._named = list(self._module.named_modules())

    @property
    def path(self) -> str:
        return self._stack[-1] if self._stack else ""

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self._stack = []
        handles = []
        for name, sub in self._named:
            if not name:
                continue
            handles.append(sub.register_forward_pre_hook(functools.partial(self._enter, name)))
            handles.append(sub.register_forward_hook(self._leave))
        try:
            yield
        except BaseException:
            # Where the forward was when it failed, for the error message:
            # the stack itself is cleared below.
            self.failed_path = self.path
            raise
        finally:
            for h in handles:
                h.remove()
            self._stack = []

    def _enter(self, name: str, _module: Any, _args: Any) -> None:
        self._stack.append(name)

    def _leave(self, _module: Any, _args: Any, _out: Any) -> None:
        if self._stack:
            self._stack.pop()
