"""The benchmark report for a CI job summary: a Markdown table, and a plot if matplotlib is there."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..files import atomic_write_text, check_output_path
from ..units import format_bytes

__all__ = ["write_bench_report"]


def _us(seconds: float | None) -> str:
    return "not timed" if seconds is None else f"{seconds * 1e6:,.1f} µs"


def write_bench_report(rows: Iterable[Mapping[str, Any]], path: Path) -> list[Path]:
    """Write the table to ``path`` (and ``path`` with ``.png``, a speedup plot, when it can)."""
    rows = list(rows)
    lines = [
        "| test | module | backend | descriptor | real tokens | eager | run() | replay | speedup | graph memory |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row.get("timed", True) is False:
            speedup = "not timed"
        else:
            speedup = "emulated" if row["emulated"] else f"{row['speedup']:.2f}x"
        lines.append(
            f"| {row['test']} | {row['module']} | {row['backend']} | {row['descriptor']} | {row['real_tokens']} | "
            f"{_us(row['eager_s'])} | {_us(row['run_s'])} | {_us(row['replay_s'])} | {speedup} | "
            f"{format_bytes(int(row['graph_memory_bytes']))} |"
        )
    tests = {row["test"]: row for row in rows if row.get("full_graphs")}
    if tests:
        lines.append("")
        lines.append(
            "| test | FULL graphs | measured (device) | vLLM's estimate (2 largest, extrapolated) | error "
            "| pool replica estimate | error |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        for test, row in tests.items():
            measured = int(row["full_graph_memory_measured_bytes"])
            cells = []
            for key in ("full_graph_memory_estimate_bytes", "full_graph_memory_replica_estimate_bytes"):
                estimate = row.get(key)
                cells.append(format_bytes(int(estimate)) if estimate is not None else "n/a")
                cells.append(
                    f"{(estimate - measured) / measured:+.0%}" if estimate is not None and measured else "n/a"
                )
            lines.append(
                f"| {test} | {row['full_graphs']} | {format_bytes(measured)} | {' | '.join(cells)} |"
            )
    if any(row["emulated"] for row in rows):
        lines.append("")
        lines.append("Rows on the `emulate` backend are CPU times of the emulator: no speedup is claimed.")
    if any(row.get("timed", True) is False for row in rows):
        lines.append("")
        lines.append(
            "Rows marked not timed ran with benchmarks disabled (pytest-benchmark under pytest-xdist, "
            "or --benchmark-disable): each graph ran once, untimed."
        )
    atomic_write_text(path, "\n".join(lines) + "\n")
    written = [path]
    plot = _plot(rows, path.with_suffix(".png"))
    if plot is not None:
        written.append(plot)
    return written


def _plot(rows: list[Mapping[str, Any]], path: Path) -> Path | None:
    graphed = [r for r in rows if not r["emulated"] and r["speedup"] is not None]
    if not graphed:
        return None
    try:
        check_output_path(path)
    except UsageError as exc:  # checked when the session started; something took the path since
        warnings.warn(f"cudagraph: the benchmark plot was not written: {exc}", RuntimeWarning, stacklevel=2)
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional: matplotlib (the plot extra)
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    # One line per test: parametrised tests of one module are separate series.
    for test in sorted({r["test"] for r in graphed}):
        mine = sorted((r for r in graphed if r["test"] == test), key=lambda r: r["tokens"])
        label = test.rsplit("::", 1)[-1]
        ax.plot([r["tokens"] for r in mine], [r["speedup"] for r in mine], marker="o", label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("tokens (descriptor)")
    ax.set_ylabel("speedup of run() over eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
