"""Argument validation shared by the public API: one home for "an integer >= 1", so that every
function says it the same way. Pure Python."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from itertools import islice
from typing import Any

__all__ = [
    "MAX_ITEMS",
    "UsageError",
    "check_int",
    "check_keywords",
    "check_tolerance",
    "did_you_mean",
    "int_list",
    "is_int",
    "optional_int",
    "short",
    "text_items",
    "unknown_keyword",
]

#: The most items a list argument is read for (capture sizes, token counts): an endless iterable
#: (``range(1, 2**40)``) is refused after this many, never materialised.
MAX_ITEMS = 1 << 14


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


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` when it is an integer >= ``minimum`` (and <= ``maximum``, when given); a
    ``UsageError`` naming ``name`` otherwise."""
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise UsageError(f"{name} must be an integer >= {minimum}; got {short(value)}")
    if maximum is not None and value > maximum:  # type: ignore[operator]
        raise UsageError(f"{name} must be an integer <= {maximum}; got {short(value)}, far beyond any use")
    return value  # type: ignore[return-value]


def check_tolerance(name: str, value: object, maximum: float = math.inf) -> float | None:
    """A tolerance: None (the dtype's default) or a finite number from 0 to ``maximum``. NaN would
    make every comparison pass (or fail) whatever the values, and inf passes everything; a relative
    tolerance above 1 (``maximum``) lets a result of any sign pass."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= maximum
    ):
        bound = f"from 0 to {maximum:g}" if math.isfinite(maximum) else ">= 0"
        raise UsageError(
            f"{name} must be a finite number {bound}, or None for the dtype's default; got {short(value)}"
        )
    return float(value)


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name nearest ``name``, or nothing."""
    close = difflib.get_close_matches(name, list(known), n=1) if isinstance(name, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_keyword(name: object, allowed: Iterable[str], where: str) -> str:
    """The one line for a keyword ``where`` does not take, with the nearest it does."""
    allowed = tuple(allowed)
    return (
        f"unknown keyword {short(name)}{did_you_mean(name, allowed)}; {where} takes only these keywords: "
        f"{', '.join(allowed)}"
    )


def check_keywords(keywords: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """A ``UsageError`` naming the first keyword not in ``allowed`` (``where``: who takes them)."""
    allowed = tuple(allowed)
    for name in keywords:
        if name not in allowed:
            raise UsageError(f"{where}: {unknown_keyword(name, allowed, where)}")


def optional_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int | None:
    """``check_int``, or None."""
    return None if value is None else check_int(name, value, minimum, maximum)


def text_items(text: str) -> list[object]:
    """The items of a list given as text, as the options and the marker give counts ("1,2,4" or
    "1 2 4"): each whole number as an int, anything else as the string it is (for the message)."""
    return [
        int(p) if re.fullmatch(r"[+-]?\d{1,30}", p) else p for p in re.split(r"[,\s]+", text.strip()) if p
    ]


def int_list(
    name: str, values: Any, minimum: int = 1, what: str = "", maximum: int | None = None
) -> list[int]:
    """A non-empty iterable of integers >= ``minimum`` (and <= ``maximum``), sorted and without
    repeats; ``what`` says what they are, in the message. At most ``MAX_ITEMS`` items are read."""
    bound = f" and <= {maximum}" if maximum is not None else ""
    expected = (
        f"{name} must be a non-empty list of integers >= {minimum}{bound}{f' ({what})' if what else ''}"
    )
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise UsageError(f"{expected}; got {short(values)}")
    items = list(islice(values, MAX_ITEMS + 1))
    if len(items) > MAX_ITEMS:
        raise UsageError(f"{expected}; got more than {MAX_ITEMS} of them")
    if not items or not all(is_int(v) and v >= minimum and (maximum is None or v <= maximum) for v in items):
        raise UsageError(f"{expected}; got {short(items)}")
    return sorted(set(items))
