"""The causes a failure names, each in one sentence with its fix, for every check that finds it.

A cause is said the same way wherever it shows (``replay_matches_eager``, ``fresh_inputs``,
``real_batches``, ``padded_size``, ``rng``), so that a reader who met it once knows it again and a
test can hold each sentence. A check says a cause only where it confirmed it: the value put back
to what the graph holds gives eager the graph's result, or two eager runs show the host numbers
move while the graph's stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..plan.validate import short

__all__ = [
    "HostNumbers",
    "attributes_changed",
    "held_python_input",
    "host_numbers",
    "python_state_per_forward",
]


def held_python_input(
    label: str, changed: Mapping[str, tuple[Any, Any]], *, explains: bool | None, per_shape: bool
) -> str:
    """A Python input that changes with the batch, frozen into the graph at capture, decides the
    result. ``changed``: name -> (the value the graph was captured with, the batch's). ``explains``:
    whether eager with the batch's own value agrees where the graph's did not (None: not asked).
    ``per_shape``: make_inputs gives the same value at one shape (a max_seq_len), so one value for
    every size can serve; else (a temperature drawn per batch) only a tensor can."""
    plural = len(changed) > 1
    names = ", ".join(f"'{n}'" for n in changed)
    held = ", ".join(f"{n}={short(a)}" for n, (a, _) in changed.items())
    given = ", ".join(f"{n}={short(b)}" for n, (_, b) in changed.items())
    said = (
        f"input{'s' if plural else ''} {names} {'are Python values' if plural else 'is a Python value'}, "
        f"which a graph holds at the value its capture was given: {label} holds {held}, this batch has "
        f"{given}, and the graph's result depends on it (eager at the graph's shape computes other values "
        "with the batch's value)"
    )
    if explains is False:
        said += (
            "; with the batch's own value eager at the graph's shape still differs from the real batch, "
            "so something else depends on the padded size too"
        )
    fix = "Pass it as a tensor input (the graph then reads each batch's value from its static buffer)"
    if per_shape:
        fix += ", or give it one value for every size (the largest, as engines pass max_seq_len)"
    else:
        fix += ": make_inputs gives it another value at the same shape, which no one value can serve"
    return f"{said}. {fix}"


@dataclass(frozen=True)
class HostNumbers:
    """An op (or a kernel launch) handed Python numbers that moved between two eager runs of the same
    inputs from the same state: ``op``, its call site, and per argument position (before, after)."""

    op: str
    site: str
    moved: tuple[tuple[str, Any, Any], ...]  # (argument, value in the first run, in the second)
    attributes: tuple[str, ...] = ()  # the module's Python attributes that moved with them

    def describe(self) -> str:
        args = ", ".join(f"{arg}: {short(a)} -> {short(b)}" for arg, a, b in self.moved)
        at = f" at {self.site}" if self.site else ""
        kept = f", kept in {', '.join(self.attributes)}" if self.attributes else ""
        return f"{self.op}{at} ({args}{kept})"


def host_numbers(found: Sequence[HostNumbers]) -> str:
    """Random draws seeded from host numbers that move on every call (a seed or offset kept in Python)."""
    first = found[0]
    more = f" (and {len(found) - 1} more op(s))" if len(found) > 1 else ""
    return (
        f"{first.describe()}{more} is handed host numbers that change on every forward (a seed or an "
        "offset kept in Python and incremented per call): a graph freezes them at capture, so every "
        "replay repeats the draw made at capture while eager draws anew. Keep the counter in a device "
        "tensor the kernel reads and advances in place, or draw through torch's generator "
        "(torch.rand(..., generator=...)), which graphs advance on every replay"
    )


def python_state_per_forward(name: str, before: Any, after: Any, where: str) -> str:
    """A Python attribute that forward itself changes on every call."""
    return (
        f"Python state changes on every forward ({name}: {before!r} -> {after!r}), but a graph runs Python "
        f"only at capture, so replay keeps the capture-time value ({where}); keep such state in a "
        "registered buffer updated in place"
    )


def attributes_changed(
    label: str,
    changed: Mapping[str, tuple[Any, Any]],
    *,
    confirmed: bool,
    outside: Mapping[str, str] | None = None,
) -> str:
    """Python attributes of the module that something other than forward changed since ``label`` was
    captured (make_inputs, a weight refit, a scheduler). ``confirmed``: put back to their values at
    capture, eager gives the graph's result. ``outside``: those of ``changed`` that forward reads from
    outside the module, each with what it is and the line that read it (``Outside.describe``)."""
    if outside:
        return _outside_changed(label, changed, outside, confirmed=confirmed)
    values = ", ".join(f"{n}: {short(a)} at capture, {short(b)} now" for n, (a, b) in changed.items())
    if confirmed:
        return (
            f"Python attribute(s) changed since {label} was captured ({values}), by something other "
            "than forward (make_inputs, a refit, a scheduler); the graph holds the capture-time value, and "
            "with it put back eager gives the graph's result. Keep it in a registered buffer updated in "
            "place (copy_), which replays read, or capture again after it changes"
        )
    return (
        f"Python attribute(s) changed since {label} was captured ({values}), by something other than "
        "forward; the graph holds the capture-time value, but putting it back does not give eager the "
        "graph's result, so it is not known to be the cause"
    )


def _outside_changed(
    label: str, changed: Mapping[str, tuple[Any, Any]], outside: Mapping[str, str], *, confirmed: bool
) -> str:
    """Values forward reads from outside the module (a forward context, a module-level dict, a class
    attribute) that changed since ``label`` was captured: a Python value the graph holds as it was, a
    tensor put in place of the one it reads."""
    from .outside import HeldTensor

    replaced = {
        n: v for n, v in changed.items() if isinstance(v[0], HeldTensor) and isinstance(v[1], HeldTensor)
    }
    values = {n: v for n, v in changed.items() if n not in replaced}
    said = []
    if values:
        listed = "; ".join(
            f"{outside.get(n, n)}: {short(a)} at capture, {short(b)} now" for n, (a, b) in values.items()
        )
        said.append(
            f"Python value(s) forward reads from outside the module changed since {label} was captured "
            f"({listed}); the graph holds the capture-time value"
        )
    for n, (a, b) in replaced.items():
        said.append(
            f"{outside.get(n, n)} holds another tensor than when {label} was captured ({a!r} then, {b!r} "
            "now): the graph reads the tensor it captured, never one put in its place"
        )
    text = "; ".join(said)
    if not confirmed:
        return (
            f"{text}, but putting it back does not give eager the graph's result, so it is not known to be "
            "the cause"
        )
    fixes = []
    if replaced:
        first = next(iter(replaced))
        fixes.append(
            f"copy into the captured tensor instead ({first}.copy_(new)), so that every replay reads the "
            "step's values"
        )
    if values:
        fixes.append(
            "keep such a value in a tensor the runner copies into each step (a persistent buffer, as "
            "vLLM's attention metadata builders keep theirs for graphs), or pass it to forward as a "
            "tensor input"
        )
    return f"{text}; with it put back eager gives the graph's result. Fix: {'; and '.join(fixes)}"
