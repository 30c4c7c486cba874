"""The plugin's real output for every module of the bug gallery, as its docstring shows it.

    python scripts/gallery_output.py            # print each block
    python scripts/gallery_output.py --write    # refresh the docstrings in examples/buggy/
    python scripts/gallery_output.py --smoke    # the first module's block alone (seconds)

Each buggy module of ``tests/bugs.py`` (and the gallery's extra pair) is
verified as ``pytest --cudagraph-verify`` verifies it in
``examples/buggy/test_gallery.py`` (every descriptor, capture sizes 1, 2, 4, 8,
CPU emulator, the pair's own keywords); the block shows the summary line and
the first failure of the pair's check. In a docstring a block runs from the
line that starts with the module's class name and " on emulate" to the line
that starts with "(CPU emulator", both indented by four spaces.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.buggy.shape_branch import NoShapeBranch, ShapeBranch  # noqa: E402
from pytest_cudagraph.checks import verify  # noqa: E402
from tests.bugs import PAIRS, Pair  # noqa: E402

SIZES = (1, 2, 4, 8)


def block(pair: Pair) -> str:
    torch.manual_seed(0)
    report = verify(
        pair.buggy(),
        pair.make_inputs("cpu"),
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend="emulate",
        **pair.kwargs,
    )
    shown = next((o for o in report.failures if o.check == pair.check), None)
    if shown is None:
        raise SystemExit(f"{pair.buggy.__name__} was not caught by {pair.check}:\n{report.format()}")
    lines = [report.summary(), shown.headline(), f"     {shown.message}"]
    if shown.finding is not None:
        described = shown.finding.describe()
        if described:
            lines.append(f"     {described}")
        lines.extend(f"       - {op}" for op in shown.finding.ops)
    others = sorted({o.check for o in report.failures} - {pair.check})
    strict = "".join(f", {k}={v!r}" for k, v in pair.kwargs.items())
    note = (
        f"(CPU emulator, `pytest --cudagraph-verify`, capture sizes {', '.join(map(str, SIZES))}{strict}; "
        f"the {pair.check} failure shown" + (f"; also failed: {', '.join(others)}" if others else "") + ")"
    )
    return "\n".join(f"    {line}" if line else "" for line in [*lines, "", note])


def write(pair: Pair, text: str) -> Path:
    path = Path(inspect.getfile(pair.buggy))
    source = path.read_text()
    pattern = re.compile(
        rf"^    {re.escape(pair.buggy.__name__)} on emulate.*?^    \(CPU emulator[^\n]*$",
        re.MULTILINE | re.DOTALL,
    )
    if not pattern.search(source):
        raise SystemExit(f"{path}: no block for {pair.buggy.__name__} in its docstring")
    path.write_text(pattern.sub(lambda _: text, source, count=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="refresh the docstrings in examples/buggy/")
    parser.add_argument("--smoke", action="store_true", help="the first pair alone: proves the script runs")
    args = parser.parse_args()
    os.chdir(ROOT)  # call sites are named relative to the working directory
    torch.set_num_threads(1)
    pairs = [*PAIRS, Pair("real_batches", ShapeBranch, NoShapeBranch, "")]
    for pair in pairs[:1] if args.smoke else pairs:
        text = block(pair)
        if args.write:
            print(f"{write(pair, text).relative_to(ROOT)}: {pair.buggy.__name__}")
        else:
            print(f"# {pair.buggy.__name__} ({pair.check})\n{text}\n")


if __name__ == "__main__":
    main()
