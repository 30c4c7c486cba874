"""Human-readable figures for reports (no torch, so the plugin can use it)."""

from __future__ import annotations

__all__ = ["counted", "format_bytes", "format_seconds"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun, singular for one (``1 token``, ``5 tokens``, ``1 real row``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def format_bytes(n: float) -> str:
    """``n`` bytes with one decimal in the largest unit up to GiB it reaches (``1.5 MiB``, ``2048.0 GiB``);
    whole bytes below a KiB (``512 B``). The one formatter of byte figures: reports, refusals, the planner."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_seconds(seconds: float) -> str:
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"
