"""``cudagraph-plan``: capture sizes from a trace of real batches.

    cudagraph-plan TRACE [--capture-sizes 1,2,4,...] [--max-num-reqs R] [--mode FULL_AND_PIECEWISE]
                   [--max-graphs N] [--json OUT] [--plot OUT.png]

(also ``python -m pytest_cudagraph.plan_trace``). Dispatches every batch of
the trace with the real ``CapturePlan`` and prints, per mode, the batches
served by a graph, the padded tokens per real token, the batches that run
eagerly and why, and the sizes that pad the most. With ``--max-graphs N`` it
finds the ladder of at most N capture sizes that pads the fewest tokens over
the trace while every batch a graph can serve stays served (exact), and
prints the plan before and after. Torch is imported only for
``--estimate-memory``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import UsageError
from .files import atomic_write_text, check_output_path
from .plan import CaptureConfig, CapturePlan, GraphMode
from .plan.config import MAX_CAPTURE_TOKENS
from .plan.trace import Analysis, Trace, TraceError, analyse, assumed, read_trace, suggest
from .units import format_bytes

__all__ = ["DEFAULT_CAPTURE_SIZES", "main"]

#: vLLM's default ladder (max_cudagraph_capture_size 512): 1, 2, 4, then
#: every 8 tokens to 256, then every 16 to 512.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


def _counts(minimum: int, what: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: integers >= ``minimum`` separated by commas."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"expected {what} >= {minimum} separated by commas, e.g. {example}; got {text!r}"
            )
        return values

    return parse


_sizes = _counts(1, "token counts", "1,2,4,8")


def _positive(text: str) -> int:
    """An argparse type: an integer from 1 to ``MAX_CAPTURE_TOKENS`` (a count of requests, tokens a
    request, graphs or rows: beyond it a number is a typo, as the plan says of larger counts)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_CAPTURE_TOKENS:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_CAPTURE_TOKENS}; got {text!r}")
    return value


def _output(text: str) -> Path:
    """An argparse type: a path to write, not empty (an empty one would name the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file path, such as out.json")
    return Path(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cudagraph-plan",
        description="Capture sizes from real traffic: how a plan serves a trace of batches (coverage, padding, "
        "eager fallbacks), and the best ladder of at most N graphs.",
        epilog="TRACE: JSON Lines or CSV (with a header), optionally .gz, one batch a line: num_tokens, num_reqs, "
        "and optionally uniform_token_count, max_query_len, num_active_loras. Exit status: 0, or 2 when "
        "the arguments or the trace are wrong.",
    )
    p.add_argument("trace", metavar="TRACE", help="the trace of batch shapes")
    p.add_argument(
        "--capture-sizes",
        type=_sizes,
        default=None,
        metavar="1,2,4,...",
        help="the plan's capture sizes (default: vLLM's default ladder, 1 to 512)",
    )
    p.add_argument(
        "--max-num-reqs",
        type=_positive,
        default=None,
        metavar="R",
        help="the most requests a batch may hold (default: the most the trace has)",
    )
    p.add_argument(
        "--mode",
        default="FULL_AND_PIECEWISE",
        type=str.upper,
        choices=[m.name for m in GraphMode],
        help="graph mode (default: FULL_AND_PIECEWISE, vLLM's)",
    )
    p.add_argument(
        "--decode-query-len",
        type=_positive,
        default=1,
        metavar="Q",
        help="tokens a request of a uniform decode batch (1 + speculative tokens; default 1)",
    )
    p.add_argument(
        "--decode-query-lens",
        type=_counts(1, "query lengths", "1,2,3,4"),
        default=None,
        metavar="1,2,...",
        help="dynamic speculative decoding: the query lengths uniform decode graphs "
        "are captured for, each at most Q (default: Q alone)",
    )
    p.add_argument("--varlen-decode", action="store_true", help="decode graphs take 1..Q tokens a request")
    p.add_argument(
        "--lora-cases",
        type=_counts(0, "counts", "0,1,4"),
        default=(0,),
        metavar="0,1,...",
        help="active-adapter counts graphs are captured for (default 0: no LoRA)",
    )
    p.add_argument(
        "--max-graphs",
        type=_positive,
        default=None,
        metavar="N",
        help="suggest the ladder of at most N capture sizes that pads least",
    )
    p.add_argument(
        "--top", type=_positive, default=5, metavar="K", help="worst-padded sizes shown (default 5)"
    )
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="leave out lines that are not batches (listed with their numbers) instead of stopping",
    )
    p.add_argument("--json", type=_output, default=None, metavar="OUT", help="write the results as JSON")
    p.add_argument(
        "--plot",
        type=_output,
        default=None,
        metavar="OUT.png",
        help="draw padding against tokens for both ladders (needs matplotlib: the 'plot' extra)",
    )
    group = p.add_argument_group("graph memory (imports torch)")
    group.add_argument(
        "--estimate-memory",
        action="store_true",
        help="estimate the graph memory of both ladders for --module",
    )
    group.add_argument("--module", metavar="PKG.MOD:FACTORY", help="a callable returning the nn.Module")
    group.add_argument(
        "--make-inputs", metavar="PKG.MOD:FN", help="make_inputs(num_tokens, num_reqs) -> dict"
    )
    group.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "cuda", "emulate"),
        help="where to estimate (default auto: CUDA when there is a GPU)",
    )
    return p


# -- printing ------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _table(analysis: Analysis) -> list[str]:
    total = analysis.batches
    lines = [
        f"  {'':<12}{'batches':>12}{'share':>10}{'real tokens':>15}{'padded tokens':>15}{'padded/real':>13}"
    ]

    def row(name: str, batches: int, real: int, padded: int | None) -> str:
        share = _pct(batches / total) if total else "-"
        pad = f"{padded:>15,}" if padded is not None else f"{'-':>15}"
        waste = f"{padded / real:>13.4f}" if padded is not None and real else f"{'-':>13}"
        return f"  {name:<12}{batches:>12,}{share:>10}{real:>15,}{pad}{waste}"

    for mode in ("FULL", "PIECEWISE"):
        stats = analysis.by_mode.get(mode)
        if stats is not None:
            lines.append(row(mode, stats.batches, stats.real_tokens, stats.padded_tokens))
    served = analysis.served
    lines.append(row("all graphs", served.batches, served.real_tokens, served.padded_tokens))
    lines.append(row("eager", analysis.eager.batches, analysis.eager.real_tokens, None))
    return lines


def _fallbacks(analysis: Analysis) -> list[str]:
    if not analysis.fallbacks:
        return ["eager fallbacks: none"]
    lines = [f"eager fallbacks ({analysis.eager.batches:,} batches):"]
    lines += [f"  {count:>12,}  {reason}" for reason, count in analysis.fallbacks.most_common()]
    return lines


def _worst(analysis: Analysis, top: int) -> list[str]:
    rows = analysis.worst_padded(top)
    if not rows:
        return ["worst-padded sizes: no graph-served batch is padded"]
    lines = [
        "worst-padded sizes (by padded tokens in all):",
        f"  {'mode':<12}{'tokens':>8}{'graph':>8}{'batches':>12}{'padded tokens':>15}",
    ]
    lines += [f"  {mode:<12}{t:>8}{g:>8}{count:>12,}{padded:>15,}" for mode, t, g, count, padded in rows]
    return lines


def _ladder_text(sizes: Sequence[int]) -> str:
    return ",".join(str(s) for s in sizes)


def _compare(before: Analysis, after: Analysis, memory: tuple[str, str] | None) -> list[str]:
    rows = [
        ("capture sizes", f"{len(before.capture_sizes)}", f"{len(after.capture_sizes)}"),
        ("coverage", _pct(before.coverage), _pct(after.coverage)),
        ("padding waste", f"{before.padding_waste:.4f}", f"{after.padding_waste:.4f}"),
        ("padded tokens", f"{before.served.padded_tokens:,}", f"{after.served.padded_tokens:,}"),
        ("eager batches", f"{before.eager.batches:,}", f"{after.eager.batches:,}"),
    ]
    if memory is not None:
        rows.append(("graph memory", *memory))
    lines = [f"  {'':<16}{'current':>16}{'suggested':>16}"]
    lines += [f"  {name:<16}{a:>16}{b:>16}" for name, a, b in rows]
    return lines


# -- graph memory -----------------------------------------------------------------


def _load(spec: str, what: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise _UsageError(f"{what} must be PKG.MOD:NAME; got {spec!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise _UsageError(f"cannot load {what} {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise _UsageError(f"{what} {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def _estimates(args: argparse.Namespace, configs: Sequence[CaptureConfig]) -> tuple[list[int | None], str]:
    """The graph memory of each config's plan for --module, and where it was estimated."""
    if not (args.module and args.make_inputs):
        raise _UsageError("--estimate-memory needs --module PKG.MOD:FACTORY and --make-inputs PKG.MOD:FN")
    sys.path.insert(0, str(Path.cwd()))
    factory = _load(args.module, "--module")
    make_inputs = _load(args.make_inputs, "--make-inputs")
    import torch

    from .manager import GraphManager
    from .manager.devices import default_device, follow_device
    from .manager.estimate import estimate_capture

    try:
        module = factory()
    except Exception as exc:
        raise _UsageError(f"--module {args.module}: calling it raised {type(exc).__name__}: {exc}") from None
    if not isinstance(module, torch.nn.Module):
        raise _UsageError(
            f"--module {args.module} must return a torch.nn.Module; it returned {type(module).__name__}"
        )
    if args.backend == "cuda" and not torch.cuda.is_available():
        raise _UsageError(
            "--backend cuda asks for real CUDA graphs, but torch.cuda.is_available() is False here; use "
            "--backend emulate (or auto) to estimate on the CPU emulator"
        )
    device = default_device(args.backend)
    # On a GPU the module and its inputs move there, as the fixtures do.
    make = follow_device(module, make_inputs, device)
    found: list[int | None] = []
    where = ""
    for config in configs:
        manager = GraphManager(module, make, config, backend=args.backend, device=device, progress=False)
        try:
            estimate = estimate_capture(manager, manager.plan.capture_order)
            found.append(estimate.graph_bytes if estimate is not None else None)
            where = f"{manager.backend} on {manager.device}"
        finally:
            manager.release()
    return found, where


# -- plotting ---------------------------------------------------------------------


def _plot(path: Path, before: Analysis, after: Analysis | None, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _UsageError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for analysis, label in ((before, "current"), (after, "suggested")):
        if analysis is None:
            continue
        per_size: dict[int, list[int]] = {}
        for (_, t, g), count in analysis.padding.items():
            pad, n = per_size.get(t, [0, 0])
            per_size[t] = [pad + (g - t) * count, n + count]
        xs = sorted(per_size)
        ax.step(
            xs,
            [per_size[x][0] / per_size[x][1] for x in xs],
            where="post",
            label=f"{label} ({len(analysis.capture_sizes)} sizes, waste {analysis.padding_waste:.4f})",
        )
    ax.set_xlabel("real tokens in the batch")
    ax.set_ylabel("padded tokens per batch (mean)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------


def _writable(path: Path, option: str) -> None:
    """A usage error, not a traceback, when an output's folder does not exist, or the path is one
    the command must not replace (a folder, a device, a FIFO: ``files.check_output_path``)."""
    try:
        check_output_path(path)
    except UsageError as exc:
        raise _UsageError(f"{option}: {exc}") from None
    if not path.parent.is_dir():
        raise ValueError(f"{option} {path}: the folder {path.parent} does not exist; create it first")


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything ``main`` does but parsing and exiting: prints with ``out`` and returns the JSON document."""
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        if path is not None:  # before any work: an output that cannot be written is said first
            _writable(path, option)
    trace: Trace = read_trace(args.trace, skip_bad=args.skip_bad_lines)
    max_reqs = args.max_num_reqs or max(b.num_reqs for b in trace.counts)
    sizes = args.capture_sizes or DEFAULT_CAPTURE_SIZES
    config = CaptureConfig(
        capture_sizes=sizes,
        max_num_reqs=max_reqs,
        mode=args.mode,
        decode_query_len=args.decode_query_len,
        varlen_decode=args.varlen_decode,
        lora_cases=args.lora_cases,
        decode_query_lens=args.decode_query_lens,
    )
    plan = CapturePlan(config)
    before = analyse(plan, trace)
    out(
        f"trace {trace.path}: {trace.batches:,} batches, {len(trace.counts):,} distinct shapes, "
        f"{trace.real_tokens:,} tokens"
    )
    if trace.skipped:
        shown = "; ".join(str(b) for b in trace.skipped[:5])
        out(
            f"  skipped {len(trace.skipped):,} bad line(s): {shown}{' ...' if len(trace.skipped) > 5 else ''}"
        )
    if trace.ignored_fields:
        out(f"  ignored fields: {', '.join(trace.ignored_fields)}")
    if trace.missing_fields:
        out(f"  fields not found: {', '.join(trace.missing_fields)}; assumed:")
        for line in assumed(config, trace.missing_fields):
            out(f"    {line}")
    defaults = " (the trace's most)" if args.max_num_reqs is None else ""
    out(
        f"plan: {config.mode.name}, {len(config.capture_sizes)} capture sizes "
        f"{min(config.capture_sizes)}..{max(config.capture_sizes)}{' (default ladder)' if args.capture_sizes is None else ''}, "
        f"max_num_reqs {max_reqs}{defaults}, decode_query_len {config.decode_query_len}"
        f"{'' if config.query_lens == (config.decode_query_len,) else f' (lengths {list(config.query_lens)})'}"
        f"{', varlen decode' if config.varlen_decode else ''}, {len(plan.descriptors)} graphs"
    )
    out("")
    for line in (*_table(before), "", *_fallbacks(before), "", *_worst(before, args.top)):
        out(line)
    doc: dict[str, Any] = {
        "trace": {
            "path": trace.path,
            "batches": trace.batches,
            "distinct_shapes": len(trace.counts),
            "real_tokens": trace.real_tokens,
            "skipped_lines": [b.line for b in trace.skipped],
            "ignored_fields": list(trace.ignored_fields),
        },
        "config": config.to_dict(),
        "coverage": before.coverage,
        "padding_waste": before.padding_waste,
        "current": before.to_dict(),
    }
    after: Analysis | None = None
    found = suggest(config, trace, args.max_graphs) if args.max_graphs is not None else None
    if found is not None and not found[0].capture_sizes:
        out("")
        out(
            f"no ladder to suggest: under {config.mode.name} no batch of the trace can be served by a graph "
            "of any size (the eager fallbacks above say why)"
        )
        found = None
    if found is not None:
        joint, by_mode = found
        suggested = config.replace(capture_sizes=joint.capture_sizes, max_capture_size=None)
        after = analyse(CapturePlan(suggested), trace)
        memory = None
        if args.estimate_memory:
            (mem_before, mem_after), where = _estimates(args, [config, suggested])
            memory = (
                format_bytes(mem_before) if mem_before is not None else "unknown",
                format_bytes(mem_after) if mem_after is not None else "unknown",
            )
            doc["graph_memory"] = {"where": where, "current_bytes": mem_before, "suggested_bytes": mem_after}
        out("")
        out(
            f"suggested ladder of at most {args.max_graphs} capture sizes (exact over the trace's sizes"
            f"{'; ' + joint.restricted if joint.restricted else ''}):"
        )
        out(f"  --capture-sizes {_ladder_text(joint.capture_sizes)}")
        out("")
        for line in _compare(before, after, memory):
            out(line)
        if memory is not None:
            out(f"  (graph memory estimated for {args.module}, {doc['graph_memory']['where']})")
        if by_mode:
            out("")
            out("each routine with a ladder of its own (decode and mixed batches are captured separately):")
            for mode, ladder in by_mode.items():
                out(
                    f"  {mode:<10} {_ladder_text(ladder.capture_sizes)}  (padding waste {ladder.padding_waste:.4f} over its "
                    f"{ladder.batches:,} batches)"
                )
        out("")
        for line in _table(after):
            out(line)
        doc.update(
            {
                "suggested_capture_sizes": list(joint.capture_sizes),
                "suggested_coverage": after.coverage,
                "suggested_padding_waste": after.padding_waste,
                "suggested": after.to_dict(),
                "suggested_restricted": joint.restricted,
                "suggested_by_mode": {
                    m: {
                        "capture_sizes": list(ld.capture_sizes),
                        "padded_tokens": ld.padded_tokens,
                        "batches": ld.batches,
                        "padding_waste": ld.padding_waste,
                    }
                    for m, ld in by_mode.items()
                },
            }
        )
    if args.plot is not None:
        _writable(args.plot, "--plot")  # again: something may have taken the path meanwhile
        _plot(args.plot, before, after, f"{Path(trace.path).name}: {config.mode.name}")
        out(f"\nplot written to {args.plot}")
    if args.json is not None:
        _writable(args.json, "--json")
        try:
            atomic_write_text(args.json, json.dumps(doc, indent=2) + "\n")
        except OSError as exc:
            raise ValueError(f"cannot write {args.json} (--json): {exc.strerror or exc}") from None
        out(f"JSON written to {args.json}")
    return doc


class _UsageError(Exception):
    """A command line that cannot run as given (a missing companion option, an extra that is not
    installed): told in one line, exit status 2, as argparse's own usage errors are."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.estimate_memory and args.max_graphs is None:
        parser.error(
            "--estimate-memory compares the current ladder with a suggested one: give --max-graphs N"
        )
    lines: list[str] = []
    try:
        # Printed once everything is done: the JSON and the plot are written
        # even when the reader of the output stops early (``| head``).
        run(args, out=lines.append)
    except (TraceError, ValueError, _UsageError) as exc:  # ValueError: a configuration CaptureConfig refuses
        if lines:  # what was found before the error still helps
            print("\n".join(lines), flush=True)
        print(f"cudagraph-plan: error: {exc}", file=sys.stderr)
        return 2
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # the reader closed the pipe: what it read is all it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
