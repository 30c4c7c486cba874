"""The runner: copy the tree, apply a mutant, run pytest on the copy, print the table.

What it does and how to run it: ``scripts/mutants.py``'s docstring."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .common import MOVING, PACKAGE, PYTEST, REPO, WHOLE_SUITE, Mutant
from .tables import CUDA_MUTANTS, MUTANTS

DESCRIPTION = 'Mutation testing: does the suite notice when the code that says "equal" (or any check) lies?'


# -- running -------------------------------------------------------------------------------------------------
@dataclass
class Result:
    mutant: Mutant
    status: str  # killed | survived | invalid | stale | error
    by: str = ""
    seconds: float = 0.0
    located: str = ""  # the file the snippet was found in
    log: list[str] = field(default_factory=list)


class Stale(Exception):
    pass


_NOT_SOURCE = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".hypothesis"}


def tree_files(tree: Path) -> list[str]:
    """What git would commit: tracked files and untracked ones it does not ignore (files only:
    a tracked file deleted in the working tree is left out). Outside git: every file but caches."""
    proc = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=tree, capture_output=True
    )
    if proc.returncode == 0:
        names = proc.stdout.decode().split("\0")
    else:
        names = [
            str(p.relative_to(tree))
            for p in tree.rglob("*")
            if not _NOT_SOURCE & set(p.relative_to(tree).parts) and not p.name.endswith(".egg-info")
        ]
    return sorted({name for name in names if name and (tree / name).is_file()})


def copy_tree(tree: Path, files: Iterable[str], dest: Path) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / name, target)


def locate(copy: Path, mutant: Mutant) -> tuple[Path, str, str]:
    """(file, original, replacement) of the first variant whose snippet is found exactly once: in
    the file named, else (a mutant of code that moves, ``MOVING``) in exactly one file of the
    package. Elsewhere a snippet outside its file is stale: the table would name the wrong file."""
    named = copy / mutant.file
    sources = {p: p.read_text() for p in sorted((copy / PACKAGE).rglob("*.py"))}
    seen = []
    for original, replacement in mutant.variants:
        if named.is_file() and named.read_text().count(original) == 1:
            return named, original, replacement
        hits = [(p, text.count(original)) for p, text in sources.items() if original in text]
        if mutant.moving and len(hits) == 1 and hits[0][1] == 1:
            return hits[0][0], original, replacement
        where = ", ".join(f"{p.relative_to(copy)} x{n}" for p, n in hits) or "nowhere"
        seen.append(f"{original!r} found {where}")
    raise Stale(
        f"stale mutant {mutant.id}: snippet {'; '.join(seen)} (wanted once, in {mutant.file}"
        + (" or in one file of the package)" if mutant.moving else ")")
    )


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def import_error(copy: Path, module: str) -> str | None:
    """None when the package imports from ``copy`` (checked by its ``__file__``) with ``module`` in it."""
    code = f"import {PACKAGE}, importlib; importlib.import_module({module!r}); print({PACKAGE}.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit status {proc.returncode}"
    where = Path(proc.stdout.strip().splitlines()[-1]).resolve()
    if not where.is_relative_to(copy.resolve()):
        raise RuntimeError(
            f"{PACKAGE} imports from {where}, not from the copy {copy}: PYTHONPATH does not win"
        )
    return None


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (.+?)(?: - |$)", line)  # a test id may hold spaces in its brackets
        if m:
            return m.group(2)
    return ""


def pytest_run(copy: Path, args: Sequence[str], timeout: float) -> tuple[int | None, str]:
    """(exit status or None on timeout, the first failing test or the output's tail)."""
    try:
        proc = subprocess.run(
            [sys.executable, *PYTEST, *args],
            cwd=copy,
            env=_env(copy),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s"
    output = proc.stdout + proc.stderr
    first = _first_failure(output)
    if not first:
        tail = [line for line in output.strip().splitlines() if line.strip()]
        first = tail[-1] if tail else ""
    return proc.returncode, first


def module_name(path: Path, copy: Path) -> str:
    return ".".join(path.relative_to(copy).with_suffix("").parts)


def run_mutant(
    mutant: Mutant, tree: Path, files: list[str], *, fast: bool, timeout: float, keep: bool, scratch: Path
) -> Result:
    start = time.monotonic()
    copy = Path(tempfile.mkdtemp(prefix=f"{mutant.id}-", dir=scratch))
    try:
        copy_tree(tree, files, copy)
        try:
            target, original, replacement = locate(copy, mutant)
        except Stale as exc:
            return Result(mutant, "stale", str(exc), time.monotonic() - start)
        located = str(target.relative_to(copy))
        target.write_text(target.read_text().replace(original, replacement, 1))
        broken = import_error(copy, module_name(target, copy))
        if broken is not None:
            return Result(mutant, "invalid", f"does not import: {broken}", time.monotonic() - start, located)
        runs = [list(mutant.tests)] + ([] if fast else [[path] for path in WHOLE_SUITE])
        for args in runs:
            code, first = pytest_run(copy, args, timeout)
            if code is None:
                return Result(
                    mutant, "killed", f"{' '.join(args)}: {first}", time.monotonic() - start, located
                )
            if code in (1, 2, 3):  # tests failed, interrupted (collection), internal error
                return Result(mutant, "killed", first, time.monotonic() - start, located)
            if code != 0:  # usage error (a test id that does not exist), no tests collected
                return Result(
                    mutant,
                    "error",
                    f"pytest {' '.join(args)} exited {code}: {first}",
                    time.monotonic() - start,
                    located,
                )
        what = "targeted tests" if fast else "targeted tests, tests/ and examples/"
        return Result(mutant, "survived", f"{what} passed", time.monotonic() - start, located)
    finally:
        if keep:
            print(f"  kept {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def baseline(
    tree: Path, files: list[str], mutants: Sequence[Mutant], timeout: float, scratch: Path
) -> str | None:
    """None when the unmutated copy imports and passes every selected mutant's targeted tests."""
    copy = Path(tempfile.mkdtemp(prefix="baseline-", dir=scratch))
    try:
        copy_tree(tree, files, copy)
        for mutant in mutants:
            locate(copy, mutant)  # raises Stale
        broken = import_error(copy, f"{PACKAGE}.checks")
        if broken is not None:
            return f"the unmutated tree does not import: {broken}"
        tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
        code, first = pytest_run(copy, tests, timeout)
        if code != 0:
            return f"the unmutated tree fails the targeted tests (exit {code}): {first}"
        return None
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def table(results: Sequence[Result]) -> str:
    rows = [("id", "file", "result", "by", "s")]
    for r in results:
        name = r.located or r.mutant.file
        name = name.removeprefix(f"{PACKAGE}/") + (" *" if r.mutant.moving else "")
        rows.append((r.mutant.id, name, r.status, r.by, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        lines.append(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
            + "  "
            + row[4].rjust(6)
        )
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> str:
    count = {
        s: sum(r.status == s for r in results) for s in ("killed", "survived", "invalid", "stale", "error")
    }
    valid = count["killed"] + count["survived"]
    rate = f"{100 * count['killed'] / valid:.1f}%" if valid else "n/a"
    parts = [f"kill rate {count['killed']}/{valid} = {rate}"]
    parts += [f"{n} {s}" for s, n in count.items() if n and s not in ("killed",)]
    text = "; ".join(parts)
    survivors = [r.mutant.id for r in results if r.status == "survived"]
    if survivors:
        text += "\nsurvived: " + ", ".join(survivors)
    return (
        text
        + "\n(* = snippet looked for in the whole package if it moved: "
        + ", ".join(m.removeprefix(f"{PACKAGE}/") + ("*" if m.endswith("/") else "") for m in MOVING)
        + ")"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument(
        "--only", action="append", default=[], metavar="ID", help="run this mutant (repeatable)"
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="the mutants of code that runs only on CUDA, killed by CUDA tests (needs a GPU)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default 1)")
    parser.add_argument("--fast", action="store_true", help="targeted tests only, not the whole suite")
    parser.add_argument("--tree", type=Path, default=REPO, help="the repository to copy (default: this one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run (default 1800)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated baseline run")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies (paths on stderr)")
    args = parser.parse_args(argv)

    table = CUDA_MUTANTS if args.cuda else MUTANTS
    if args.cuda and not args.list:
        import torch

        if not torch.cuda.is_available():
            parser.error("--cuda runs CUDA tests: this machine has no CUDA device")
    ids = [m.id for m in [*MUTANTS, *CUDA_MUTANTS]]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        parser.error(f"duplicate mutant ids {sorted(duplicates)}")
    unknown = [i for i in args.only if i not in ids]
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; see --list")
    unknown = [i for i in args.only if i not in [m.id for m in table]]
    if unknown:
        parser.error(f"mutant(s) {unknown} are not in the {'CUDA' if args.cuda else 'CPU'} table; see --list")
    selected = [m for m in table if not args.only or m.id in args.only]
    if args.list:
        for m in selected:
            print(
                f"{m.id}{' *' if m.moving else ''}\n    {m.file}: {m.about}\n    tests: {' '.join(m.tests)}"
            )
        print(f"{len(selected)} mutants")
        return 0

    # Every copy lives under one folder, removed at the end, on Ctrl-C and on SIGTERM too.
    scratch = Path(tempfile.mkdtemp(prefix="mutants-"))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args, selected, scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, selected: Sequence[Mutant], scratch: Path) -> int:
    tree = args.tree.resolve()
    files = tree_files(tree)
    started = time.monotonic()
    if not args.no_baseline:
        try:
            problem = baseline(tree, files, selected, args.timeout, scratch)
        except Stale as exc:
            problem = str(exc)
        if problem is not None:
            print(f"baseline: {problem}", file=sys.stderr)
            return 2
        print(
            f"baseline: the unmutated copy of {tree} passes the targeted tests "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )

    def one(mutant: Mutant) -> Result:
        result = run_mutant(
            mutant, tree, files, fast=args.fast, timeout=args.timeout, keep=args.keep, scratch=scratch
        )
        print(f"  {result.status:8} {mutant.id} ({result.seconds:.1f} s) {result.by}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, selected))
    print()
    print(table(results))
    print()
    mode = (
        "targeted tests only (--fast)"
        if args.fast
        else "targeted tests, then tests/ and examples/ for survivors"
    )
    print(f"{len(results)} mutants of {tree}, {mode}, {time.monotonic() - started:.0f} s")
    print(summary(results))
    if any(r.status in ("stale", "error") for r in results):
        return 2
    return 1 if any(r.status == "survived" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
