"""The checks ``verify`` runs, registered in one place.

A ``Check`` says what it compares, when it applies and what bug it finds,
and holds the function that runs it. The built-in checks are registered
here the way a downstream suite registers its own (``verify(...,
extra_checks=[...])``, or the ``pytest_cudagraph_checks`` hook in a
``conftest.py``): the engine knows no check by name but one, ``capture_safety``,
under which it reports a descriptor whose capture failed.

A check runs in one of four places of a verification:

- ``"before_capture"``: ``run(ctx, descriptors) -> list[Outcome]``, on every
  selected descriptor before anything is captured. A descriptor it fails is
  not captured (``capture_safety``: an op a graph cannot hold).
- ``"descriptor"``: ``run(ctx, descriptor) -> Outcome | None``, once for each
  captured descriptor.
- ``"module"``: ``run(ctx, descriptors) -> Outcome | None``, once, after the
  descriptor checks, with every captured descriptor.
- ``"after_release"``: ``run(ctx, descriptors) -> list[Outcome]``, once the
  graphs are released, with every captured descriptor: questions about eager
  alone that need memory the graphs held (``padded_size``'s float64
  reference). Its peak memory is reported apart.

``prepare(ctx)``, if given, runs before the capture (a check that compares
what capture and replay did with what was there before records it then).
A check function returns ``None`` when it passed, or an ``Outcome``; the
helpers ``passed``, ``failed`` and ``skipped`` build one without restating
the check's name and descriptor, which the engine fills in. A check that
raises is reported as failed, with the exception: a check that cannot run
never passes in silence.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal

from ..plan.validate import MAX_ITEMS, UsageError, did_you_mean, short
from .report import Finding, Outcome

__all__ = [
    "SCOPES",
    "Check",
    "CheckRegistry",
    "check_list",
    "failed",
    "passed",
    "skipped",
]

Scope = Literal["before_capture", "descriptor", "module", "after_release"]
SCOPES: tuple[Scope, ...] = ("before_capture", "descriptor", "module", "after_release")

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Check:
    """One check: its name, what it compares, when it applies, the bug it finds, and its code.

    ``compares`` and ``catches`` are the two columns of the checks table
    (docs/checks.md is generated from them); ``applies`` says when the check
    has nothing to do, which it then reports as skipped with the reason.
    ``default``: run when ``checks=`` is not given (a check only a few
    modules need can be registered with False and selected by name).
    """

    name: str
    run: Callable[..., Any]
    compares: str
    catches: str = ""
    applies: str = "every captured descriptor"
    scope: Scope = "descriptor"
    prepare: Callable[[Any], None] | None = None
    default: bool = True
    doc: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise UsageError(
                f"a check's name must be lower_snake_case letters, digits and '_' (it is selected with "
                f"checks=... and shown in reports); got {self.name!r}"
            )
        if self.scope not in SCOPES:
            raise UsageError(
                f"check {self.name!r}: scope must be one of {', '.join(SCOPES)}; got {self.scope!r}"
            )
        if not callable(self.run):
            raise UsageError(
                f"check {self.name!r}: run must be a function ({_SIGNATURES[self.scope]}); "
                f"got {type(self.run).__name__}"
            )
        if self.prepare is not None and not callable(self.prepare):
            raise UsageError(f"check {self.name!r}: prepare must be a function (ctx) -> None or None")
        if not isinstance(self.compares, str) or not self.compares.strip():
            raise UsageError(
                f"check {self.name!r}: compares must say, in a sentence, what the check compares"
            )
        if not self.doc:
            object.__setattr__(self, "doc", inspect.getdoc(self.run) or self.compares)

    def outcome(self, result: Any, descriptor: Any) -> Outcome:
        """``result`` of ``run`` (None or an Outcome) as this check's outcome on ``descriptor``."""
        if result is None:
            return Outcome(self.name, descriptor, True)
        if not isinstance(result, Outcome):
            raise TypeError(
                f"check {self.name!r} returned {type(result).__name__}; a check returns None (passed) or an "
                "Outcome (build one with pytest_cudagraph.checks.passed/failed/skipped)"
            )
        if result.check and result.check != self.name:
            raise TypeError(f"check {self.name!r} returned an outcome of check {result.check!r}")
        result.check = self.name
        if result.descriptor is None:
            result.descriptor = descriptor
        return result


_SIGNATURES = {
    "before_capture": "(ctx, descriptors) -> list[Outcome]",
    "descriptor": "(ctx, descriptor) -> Outcome | None",
    "module": "(ctx, descriptors) -> Outcome | None",
    "after_release": "(ctx, descriptors) -> list[Outcome]",
}


def passed(message: str = "", **figures: Any) -> Outcome:
    """A passing outcome; the engine fills in the check and the descriptor."""
    return Outcome("", None, True, message, figures=figures)


def failed(message: str, finding: Finding | None = None, **figures: Any) -> Outcome:
    """A failing outcome: ``message`` says what differs and what to do; ``finding`` where it shows."""
    if not isinstance(message, str) or not message:
        raise ValueError("failed() needs a message that says what was wrong")
    return Outcome("", None, False, message, finding or Finding(), figures=figures)


def skipped(reason: str, detail: str = "") -> Outcome:
    """The check had nothing to do here; ``reason`` says why in one line of at most ``REASON_LIMIT``
    (160) characters (reports list it, the terminal summary counts it), ``detail`` what more there is
    to say (the JSON report and ``-v`` show it). A longer reason is cut to its first clauses that
    fit, its whole text kept in the detail (``report.fitted_reason``)."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("skipped() needs the reason the check could not apply")
    if not isinstance(detail, str):
        raise ValueError(f"skipped()'s detail must be a string; got {type(detail).__name__}")
    return Outcome("", None, True, reason, skipped=True, detail=detail)


def check_list(checks: Check | Iterable[Any] | None, *, what: str = "extra_checks") -> list[Any]:
    """``checks`` as a list: None is none, one ``Check`` is itself (its items are not checked here:
    ``CheckRegistry.register`` refuses what is not a ``Check``). ValueError, naming ``what``, on a
    string or a non-iterable."""
    if checks is None:
        return []
    if isinstance(checks, Check):
        return [checks]
    if isinstance(checks, (str, bytes, Mapping)) or not isinstance(checks, Iterable):
        raise UsageError(f"{what} must be a list of pytest_cudagraph.checks.Check; got {short(checks)}")
    items = list(islice(checks, MAX_ITEMS + 1))  # an endless iterable is refused, never read whole
    if len(items) > MAX_ITEMS:
        raise UsageError(f"{what} must be a list of pytest_cudagraph.checks.Check; got more than {MAX_ITEMS}")
    return items


class CheckRegistry:
    """Checks by name, in the order they run (registration order within each scope)."""

    def __init__(self, checks: Iterable[Check] = ()) -> None:
        self._checks: dict[str, Check] = {}
        for check in checks:
            self.register(check)

    def register(self, check: Check) -> Check:
        if not isinstance(check, Check):
            raise UsageError(
                f"register a pytest_cudagraph.checks.Check (name, run, compares, ...); got {type(check).__name__}"
            )
        if check.name in self._checks:
            raise UsageError(f"a check named {check.name!r} is already registered; give yours another name")
        self._checks[check.name] = check
        return check

    def extended(self, extra: Iterable[Check] | None) -> CheckRegistry:
        """A copy with ``extra`` registered after these (the built-ins stay first)."""
        registry = CheckRegistry(self._checks.values())
        for check in extra or ():
            registry.register(check)
        return registry

    def __iter__(self) -> Iterator[Check]:
        # In the order of their scopes, as the engine runs them.
        for scope in SCOPES:
            yield from (c for c in self._checks.values() if c.scope == scope)

    def __contains__(self, name: object) -> bool:
        return name in self._checks

    def __getitem__(self, name: str) -> Check:
        return self._checks[name]

    def __len__(self) -> int:
        return len(self._checks)

    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self)

    def select(self, checks: Iterable[str] | str | None) -> tuple[str, ...]:
        """The names ``checks=`` chooses, in run order; None: every default check. A name with a
        leading ``-`` deselects it (``"-determinism"``: every default check but that one;
        ``"real_batches,-real_batches"``: none, an error). ValueError on a bad name."""
        if checks is None:
            return tuple(c.name for c in self if c.default)
        if isinstance(checks, str):
            checks = [c.strip() for c in checks.split(",") if c.strip()]
        given = list(checks)
        known = self.names()
        bad = [c for c in given if not isinstance(c, str)]
        if bad:
            raise UsageError(f"checks must be check names (strings); got {short(bad[0])}")
        dropped = [c[1:] for c in given if c.startswith("-")]
        chosen = [c for c in given if not c.startswith("-")]
        unknown = [c for c in (*chosen, *dropped) if c not in self._checks]
        if unknown:
            raise UsageError(
                f"unknown check(s) {unknown}{did_you_mean(unknown[0], known)}; the checks are {', '.join(known)} "
                "(a leading '-' deselects one)"
            )
        if not chosen and dropped:
            chosen = [c.name for c in self if c.default]
        chosen = [c for c in chosen if c not in dropped]
        if not chosen:
            raise UsageError(f"checks must name at least one of {', '.join(known)}; got {short(given)}")
        return tuple(c for c in known if c in chosen)

    def markdown_table(self) -> str:
        """The table of docs/checks.md: one row per check."""
        rows = [
            "| check | runs | what it proves | the bug class it finds | skipped when |",
            "|---|---|---|---|---|",
        ]
        runs = {
            "before_capture": "each descriptor, before capture",
            "descriptor": "each descriptor",
            "module": "once",
            "after_release": "each descriptor, after the graphs are released",
        }
        for c in self:
            cells = [f"`{c.name}`", runs[c.scope], c.compares, c.catches, c.applies]
            rows.append(
                "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"
            )
        return "\n".join(rows)
