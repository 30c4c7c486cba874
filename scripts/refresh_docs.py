"""Rewrite the outputs that README.md and docs/ show, from real runs, so they cannot drift.

    python scripts/refresh_docs.py              # run every command, rewrite every block
    python scripts/refresh_docs.py --only NAME  # one block (repeatable)
    python scripts/refresh_docs.py --check      # run them, exit 1 where a block drifted
    python scripts/refresh_docs.py --check --output NAME=FILE  # NAME's output is FILE's (CI's run)
    python scripts/refresh_docs.py --list       # the registered blocks and their files

A block lies between two markers in a Markdown file::

    <!-- refresh: NAME -->
    (a caption: the date, the machine and the versions of the run)

    ```
    (the output)
    ```
    <!-- /refresh -->

and everything between them is rewritten. Each NAME is registered in BLOCKS
below with the command that produces it and how its lines are chosen. The
blocks are CPU runs (the emulator); outputs from a GPU (the H200 blocks) are
not marked and stay as they are, with their dates.

``--check`` compares the outputs with timings, memory addresses, random
values and hypothesis's own wording masked: it catches counts, names and
messages that changed (a check count, ``calls: 6 -> 7``), not a slower run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = re.compile(r"^<!-- refresh: ([\w.-]+) -->$")
END = "<!-- /refresh -->"
DOC_GLOBS = ("README.md", "docs/*.md", "docs/**/*.md")

# Lines of pytest's header that name this machine, not the run.
_MACHINE_LINES = (
    "platform ",
    "benchmark:",
    "rootdir:",
    "configfile:",
    "plugins:",
    "cachedir:",
    "hypothesis profile",
    "Using --randomly",
)


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    command: tuple[str, ...]  # shown in the caption; run with this Python as "python"
    select: Callable[[str], list[str]]  # the run's output -> the block's lines
    caption: str  # formatted with {when}, {versions}, {cores} and {threads} (OMP_NUM_THREADS of the run)
    setup: Callable[[Path], None] | None = None  # writes files into a temporary directory to run in
    #: Markdown made in this process (no command, no fences): a table generated from the code.
    generate: Callable[[], list[str]] | None = None


def _checks_table() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from pytest_cudagraph.checks import BUILTIN

    return BUILTIN.markdown_table().splitlines()


def _runner_checks_table() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from pytest_cudagraph.runner import RUNNER_CHECKS

    return RUNNER_CHECKS.markdown_table().splitlines()


def _report_fields() -> list[str]:
    """docs/reports.md's table of the JSON report's fields, from the schema the package ships."""
    sys.path.insert(0, str(ROOT))
    from pytest_cudagraph.plugin.report import REPORT_SCHEMA

    schema = json.loads(REPORT_SCHEMA.read_text())
    rows = ["| field | type | what it holds |", "|---|---|---|"]

    def kind(node: dict) -> str:
        if "const" in node:
            return f"`{node['const']}`"
        if "enum" in node:
            return " or ".join("null" if v is None else f"`{v}`" for v in node["enum"])
        found = node.get("type", "")
        return " or ".join(found) if isinstance(found, list) else found

    def walk(node: dict, path: str) -> None:
        for name, child in node.get("properties", {}).items():
            where = f"{path}.{name}" if path else name
            text = str(child.get("description", "")).replace("|", "\\|")
            rows.append(f"| `{where}` | {kind(child)} | {text} |")
            nested = (
                child.get("additionalProperties")
                if isinstance(child.get("additionalProperties"), dict)
                else None
            )
            items = child.get("items") if isinstance(child.get("items"), dict) else None
            if nested and nested.get("properties"):
                walk(nested, f"{where}.<key>")
            elif items and items.get("properties") and name in ("verifications", "outcomes"):
                walk(items, f"{where}[]")
            elif child.get("properties") and name in ("machine", "commit", "report"):
                walk(child, where)

    walk(schema, "")
    return rows


# -- choosing lines ----------------------------------------------------------------------------
def _session(out: str) -> list[str]:
    """A whole pytest session, less the lines that describe the machine."""
    return [ln for ln in out.rstrip("\n").splitlines() if not ln.startswith(_MACHINE_LINES)]


def _last_lines(n: int) -> Callable[[str], list[str]]:
    def select(out: str) -> list[str]:
        return [ln for ln in out.splitlines() if ln.strip()][-n:]

    return select


README_RUN_IT_TESTS = (
    "examples/real_models/test_hf_models.py::test_llama_causal_lm:",
    "examples/test_decoder.py::test_decoder_graphs[full-and-piecewise-q4]:",
    "examples/test_lora.py::test_lora_graphs:",
    "examples/test_mlp.py::test_mlp_graphs_match_eager:",
    "examples/test_moe.py::test_moe_graphs:",
)


def _readme_run_it(out: str) -> list[str]:
    lines = out.splitlines()
    chosen = [ln for ln in lines if ln.startswith("cudagraph: backend=")][:1]
    chosen += [ln for ln in lines if ln.startswith(README_RUN_IT_TESTS)]
    chosen += [ln for ln in lines if re.match(r"^=+ .*\b(passed|failed)\b.* in [\d.]+s", ln)][-1:]
    return chosen


def _readme_test_it(out: str) -> list[str]:
    """The suite's counts from its closing line: passed, failed, skipped and the like, not its warnings
    (their count moves with the installed packages' deprecations) nor its time."""
    closing = [ln for ln in out.splitlines() if re.match(r"^=+ .*\b(passed|failed)\b.* in [\d.]+s", ln)][-1:]
    counts = re.findall(
        r"\d+ (?:passed|failed|skipped|xfailed|xpassed|errors?)\b", closing[0] if closing else ""
    )
    return [", ".join(counts)] if counts else []


def _short_example(out: str) -> list[str]:
    """The report's first line and its first failure, as the test's failure shows them."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(r"^\w+ on emulate \(cpu\)", ln))
    fails = [i for i in range(start + 1, len(lines)) if lines[i].startswith("FAIL ")]
    end = (
        fails[1]
        if len(fails) > 1
        else next(i for i in range(start + 1, len(lines)) if lines[i].startswith("====="))
    )
    return [*lines[start:end], "..."]


def _dispatch_failure(out: str) -> list[str]:
    """The property's error and the shrunk example hypothesis reports (up to the call's ")")."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("E") and "DispatchPropertyError:" in ln)
    end = next(i for i in range(start, len(lines)) if re.match(r"^E\s+\)$", lines[i]))
    return [re.sub(r" object at 0x[0-9a-f]+>", " object at 0x...>", ln) for ln in lines[start : end + 1]]


# -- what the blocks run in --------------------------------------------------------------------
def _readme_python_block(path: Path, marker: str) -> str:
    """The last ```python block before ``marker``: the code whose output the block shows."""
    text = path.read_text()
    before = text[: text.index(f"<!-- refresh: {marker} -->")]
    blocks = re.findall(r"```python\n(.*?)```", before, flags=re.S)
    return blocks[-1]


def _write_short_example(tmp: Path) -> None:
    (tmp / "test_short_example.py").write_text(
        _readme_python_block(ROOT / "README.md", "readme-short-example")
    )


def _write_downstream(tmp: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.test_dispatch_properties import DOWNSTREAM

    (tmp / "test_downstream.py").write_text(DOWNSTREAM)


# docs/dispatch.md's plan: its descriptors in capture order, then the graph that serves each batch.
_DISPATCH_PLAN = """\
from pytest_cudagraph import CaptureConfig
from pytest_cudagraph.plan.capture_plan import CapturePlan

config = CaptureConfig(
    capture_sizes=(1, 2, 4, 8), max_num_reqs=4, mode="FULL_AND_PIECEWISE",
    decode_query_len=4, decode_query_lens=(1, 2, 3, 4),
)
plan = CapturePlan(config)
for d in plan.capture_order:
    print(d)
print()
for reqs, each in [(4, 1), (2, 2), (1, 4), (2, 3), (3, 2), (2, 4), (4, 2)]:
    served = plan.dispatch(num_reqs=reqs, num_tokens=reqs * each, uniform_token_count=each, max_query_len=each)
    print(f"{reqs} request(s) of {each} token(s) -> {served}")
"""

_CPU = (
    "Output on {cores} CPU cores with the emulator, run with `OMP_NUM_THREADS={threads}` ({when}, {versions}; "
    "written by `scripts/refresh_docs.py`):"
)

BLOCKS: dict[str, Block] = {
    "readme-run-it": Block(
        "README.md",
        ("python", "-m", "pytest", "--cudagraph-verify", "examples/"),
        _readme_run_it,
        "Output from this repo on {cores} CPU cores, run with `OMP_NUM_THREADS={threads}` "
        "({when}, {versions}; abridged, written by `scripts/refresh_docs.py`):",
    ),
    "readme-test-it": Block(
        "README.md",
        ("python", "-m", "pytest", "-n", "2"),
        _readme_test_it,
        "The counts it gives on {cores} CPU cores with `OMP_NUM_THREADS={threads}` ({when}, {versions}; the "
        "`cuda` tests skip; written by `scripts/refresh_docs.py`):",
    ),
    "readme-short-example": Block(
        "README.md",
        ("python", "-m", "pytest", "-p", "no:cacheprovider", "test_short_example.py"),
        _short_example,
        "`pytest` fails it and names the bug (real output, CPU emulator, quick mode; {when}, {versions}; "
        "written by `scripts/refresh_docs.py`):",
        setup=_write_short_example,
    ),
    "dispatch-broken-lora": Block(
        "docs/dispatch.md",
        ("python", "-m", "pytest", "-p", "no:cacheprovider", "test_downstream.py"),
        _dispatch_failure,
        "Real output ({when}, {versions}, which shrank the batch; written by `scripts/refresh_docs.py`):",
        setup=_write_downstream,
    ),
    "dispatch-plan": Block(
        "docs/dispatch.md",
        ("python", "-c", _DISPATCH_PLAN),
        lambda out: out.rstrip("\n").splitlines(),
        "Printed by `CapturePlan` (pure Python: no device; {cores} CPU cores, {when}, {versions}; written by "
        "`scripts/refresh_docs.py`):",
    ),
    "examples-mlp": Block(
        "docs/examples/mlp.md",
        ("python", "-m", "pytest", "--cudagraph-verify", "examples/test_mlp.py"),
        _session,
        _CPU,
    ),
    "examples-decoder": Block(
        "docs/examples/decoder.md",
        ("python", "-m", "pytest", "--cudagraph-verify", "examples/test_decoder.py"),
        _session,
        _CPU,
    ),
    "examples-lora": Block(
        "docs/examples/lora.md",
        ("python", "-m", "pytest", "--cudagraph-verify", "examples/test_lora.py"),
        _session,
        _CPU,
    ),
    "examples-moe": Block(
        "docs/examples/moe.md",
        ("python", "-m", "pytest", "--cudagraph-verify", "examples/test_moe.py"),
        _session,
        _CPU,
    ),
    "examples-buggy": Block(
        "docs/examples/buggy.md",
        ("python", "-m", "pytest", "--cudagraph-verify", "examples/buggy", "-q"),
        _last_lines(3),
        "Output (last lines; {cores} CPU cores, emulator, {when}, {versions}; written by `scripts/refresh_docs.py`):",
    ),
    # Markdown the code makes, not a run's output: no command, no caption.
    "checks-table": Block("docs/checks.md", (), lambda out: [], "", generate=_checks_table),
    "runner-checks-table": Block("docs/runners.md", (), lambda out: [], "", generate=_runner_checks_table),
    "report-fields": Block("docs/reports.md", (), lambda out: [], "", generate=_report_fields),
}


# -- markers -----------------------------------------------------------------------------------
def doc_files() -> list[Path]:
    files: set[Path] = set()
    for pattern in DOC_GLOBS:
        files.update(ROOT.glob(pattern))
    return sorted(files)


def markers(path: Path) -> list[tuple[str, int, int]]:
    """(name, begin line, end line) of each block in ``path``; raises on unbalanced markers."""
    found: list[tuple[str, int, int]] = []
    open_: tuple[str, int] | None = None
    for i, line in enumerate(path.read_text().splitlines()):
        m = BEGIN.match(line.strip())
        if m:
            if open_ is not None:
                raise ValueError(f"{path}:{i + 1}: block {m.group(1)!r} starts inside {open_[0]!r}")
            open_ = (m.group(1), i)
        elif line.strip() == END:
            if open_ is None:
                raise ValueError(f"{path}:{i + 1}: {END} without a start")
            found.append((open_[0], open_[1], i))
            open_ = None
    if open_ is not None:
        raise ValueError(f"{path}:{open_[1] + 1}: block {open_[0]!r} is not closed")
    return found


def all_markers() -> dict[str, list[Path]]:
    where: dict[str, list[Path]] = {}
    for path in doc_files():
        for name, _, _ in markers(path):
            where.setdefault(name, []).append(path)
    return where


# -- running -----------------------------------------------------------------------------------
def _versions(names: tuple[str, ...]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in names:
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(parts)


def run(name: str, given: Path | None = None) -> tuple[str, list[str]]:
    """Run block ``name``'s command (or read ``given``, the output of a run of it made
    elsewhere: CI's "Run it" in a fresh venv); return its caption and lines."""
    block = BLOCKS[name]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        COLUMNS="80",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("CI", None)  # the default hypothesis profile, as a user's run has it
    argv = [sys.executable, *block.command[1:]]
    if given is not None:
        out = given.read_text()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            cwd = ROOT
            if block.setup is not None:
                block.setup(Path(tmp))
                cwd = Path(tmp)
            proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        out = proc.stdout + proc.stderr
    try:
        lines = block.select(out)
    except StopIteration:
        raise SystemExit(
            f"refresh_docs: {name}: the output of {_shown(block)} lacks the expected lines:\n{out}"
        ) from None
    names = ("torch", "transformers") if name != "dispatch-broken-lora" else ("hypothesis",)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    caption = block.caption.format(
        when=when, versions=_versions(names), cores=os.cpu_count(), threads=env["OMP_NUM_THREADS"]
    )
    return caption, lines


def _shown(block: Block) -> str:
    """The command, a script given to ``python -c`` shown as ``'...'``."""
    return " ".join("'...'" if "\n" in arg else arg for arg in block.command)


def render(caption: str, lines: list[str]) -> list[str]:
    return [caption, "", "```", *lines, "```"]


_MASKS = (
    (re.compile(r"(in \d+\.\d+s) \(\d+:\d\d:\d\d\)"), r"\1"),  # pytest adds (h:mm:ss) past a minute
    # timings, random values (either sign), sizes; a figure like 2e-16 has no point
    (re.compile(r"-?\b\d+(\.\d+(e[-+]?\d+)?|e[-+]?\d+)"), "<f>"),
    (re.compile(r"capture \d+ ms"), "capture <t> ms"),
    (re.compile(r"max ULP \d+"), "max ULP <n>"),
    (re.compile(r"0x[0-9a-f.]+"), "0x<a>"),
    (re.compile(r"^(E\s+)[A-Z][\w ]*: (test_\w+\()$"), r"\1<example>: \2"),  # hypothesis's wording
    (re.compile(r"=+"), "="),
    (re.compile(r" +"), " "),
)


def normalise(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        for pattern, repl in _MASKS:
            line = pattern.sub(repl, line)
        out.append(line.rstrip())
    return out


def code_lines(block_lines: list[str]) -> list[str]:
    """The lines of the first fenced code block."""
    fences = [i for i, ln in enumerate(block_lines) if ln.startswith("```")]
    return block_lines[fences[0] + 1 : fences[1]] if len(fences) >= 2 else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="report drift, write nothing")
    parser.add_argument("--only", action="append", choices=sorted(BLOCKS), help="this block only")
    parser.add_argument("--list", action="store_true", help="list the blocks")
    parser.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="take FILE as the output of block NAME's command instead of running it (a run made elsewhere)",
    )
    args = parser.parse_args(argv)
    given: dict[str, Path] = {}
    for item in args.output:
        name, _, file = item.partition("=")
        if name not in BLOCKS or BLOCKS[name].generate is not None or not file:
            parser.error(f"--output {item!r}: expected NAME=FILE, NAME a block with a command")
        if not Path(file).is_file():
            parser.error(f"--output {item!r}: {file} is not a file")
        given[name] = Path(file)

    where = all_markers()
    unknown = sorted(set(where) - set(BLOCKS))
    missing = sorted(n for n, b in BLOCKS.items() if ROOT / b.file not in where.get(n, []))
    if unknown or missing:
        print(f"refresh_docs: markers without a command: {unknown}; blocks without a marker: {missing}")
        return 1
    if args.list:
        for name, block in BLOCKS.items():
            print(f"{name:24} {block.file:26} {_shown(block) or '(generated from the code)'}")
        return 0

    drifted = []
    for name in args.only or list(BLOCKS):
        block = BLOCKS[name]
        path = ROOT / block.file
        text = path.read_text().splitlines()
        ((begin, end),) = [(b, e) for n, b, e in markers(path) if n == name]
        if block.generate is not None:
            print(f"refresh_docs: {name}: generated from the code", flush=True)
            lines = block.generate()
            if text[begin + 1 : end] != lines:
                if args.check:
                    drifted.append(name)
                    continue
                text[begin + 1 : end] = lines
                path.write_text("\n".join(text) + "\n")
            continue
        shown = f"the output in {given[name]}" if name in given else _shown(block)
        print(f"refresh_docs: {name}: {shown}", flush=True)
        caption, lines = run(name, given.get(name))
        if args.check:
            old, new = normalise(code_lines(text[begin + 1 : end])), normalise(lines)
            if old != new:
                drifted.append(name)
                import difflib

                print(
                    "\n".join(
                        difflib.unified_diff(old, new, f"{block.file} ({name})", "this run", lineterm="")
                    )
                )
            continue
        text[begin + 1 : end] = render(caption, lines)
        path.write_text("\n".join(text) + "\n")
    if drifted:
        print(f"refresh_docs: drifted: {', '.join(drifted)} (run python scripts/refresh_docs.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
