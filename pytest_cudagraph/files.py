"""Writing a file whole: a reader sees the old file or the new one, never a torn one.

No torch and nothing above it, so the plugin's reports (the JSON report, the
benchmark's Markdown) share it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .errors import UsageError

__all__ = ["atomic_write_text", "check_output_path"]


def check_output_path(path: Path | str) -> Path:
    """``path`` as a ``Path`` when the plugin may write a file there: not empty, and either absent
    or a regular file. A folder, a device (``/dev/null``, ``/dev/full``), a FIFO or a socket is not
    the plugin's to replace (``os.replace`` over a device node, run as root, would put a plain file
    in its place), and a ``UsageError`` says so."""
    if not str(path).strip():
        raise UsageError("an empty path: give a file path, such as out.json")
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:  # nothing there (or a folder above it that is a file: the write will say so)
        return path
    if stat.S_ISDIR(mode):
        raise UsageError(f"{path} is a directory; give a file path, such as {path / 'report.json'}")
    if not stat.S_ISREG(mode):
        kind = (
            "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "not a file"
        )
        raise UsageError(
            f"{path} exists and is not a regular file ({kind}); pytest-cudagraph writes its files whole and will not "
            "replace it: give the path of a new or regular file"
        )
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``.

    A reader sees the old file or the new one, never a torn one, and of two
    runs writing one path the last to finish wins whole. A path that exists and is not a regular
    file is never replaced (``check_output_path``: a ``UsageError``).
    """
    check_output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as a plain write would (mkstemp makes it 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
