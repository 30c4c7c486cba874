"""Argument validation shared by the public API: one home for "an integer >= 1", so that every
function says it the same way. Pure Python."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["UsageError", "check_int", "int_list", "is_int", "optional_int", "short"]


class UsageError(ValueError):
    """What the caller gave is wrong: the message is one line that says what was wrong, what was
    expected and what to do. The pytest fixtures fail the test with it alone, no traceback."""


def short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to about ``limit`` characters (a long list in a message says its start)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}... ({len(text)} characters)"


def is_int(value: object) -> bool:
    """An int and not a bool (True is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` when it is an integer >= ``minimum``; ValueError naming ``name`` otherwise."""
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise UsageError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value  # type: ignore[return-value]


def optional_int(name: str, value: object, minimum: int = 1) -> int | None:
    """``check_int``, or None."""
    if value is not None and (not is_int(value) or value < minimum):  # type: ignore[operator]
        raise UsageError(f"{name} must be an integer >= {minimum} or None; got {value!r}")
    return value  # type: ignore[return-value]


def int_list(name: str, values: Any, minimum: int = 1, what: str = "") -> list[int]:
    """A non-empty iterable of integers >= ``minimum``, sorted and without repeats; ``what`` says
    what they are, in the message."""
    expected = f"{name} must be a non-empty list of integers >= {minimum}{f' ({what})' if what else ''}"
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{expected}; got {values!r}")
    items = list(values)
    if not items or not all(is_int(v) and v >= minimum for v in items):
        raise ValueError(f"{expected}; got {items!r}")
    return sorted(set(items))
