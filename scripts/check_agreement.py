"""The agreement table: every check's buggy/correct pair on every available backend.

    python scripts/check_agreement.py [--out table.md]
    python scripts/check_agreement.py --smoke   # the first pair alone, on the emulator: seconds

For each pair it runs ``verify`` on the buggy module and its correct twin and
records whether the pair's own check caught the bug (and which other checks
also failed), and whether the twin passed every check. A check may have more
than one pair (capture_safety has a host sync and a host value): each row
names its buggy module.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph.checks import verify
from tests.bugs import PAIRS, Pair


def run(cls: type, backend: str, pair: Pair) -> set[str]:
    device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    # The pair's own inputs and verify keywords (nonfinite_padding, say), as tests/test_checks.py passes them.
    report = verify(
        cls().to(device),
        pair.make_inputs(device),
        capture_sizes=(1, 2, 4, 8),
        max_num_reqs=4,
        backend=backend,
        device=device,
        **pair.kwargs,
    )
    return {o.check for o in report.failures}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="the first pair alone: proves the script runs")
    args = parser.parse_args()
    backends = ["emulate"] + (["cuda"] if torch.cuda.is_available() and not args.smoke else [])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    lines = [
        f"Agreement table, {datetime.date.today()}, torch {torch.__version__}, {device}",
        "",
        "| check (buggy module) | "
        + " | ".join(f"{b}: buggy caught | {b}: twin passes | {b}: also failed" for b in backends)
        + " |",
        "|---|" + "---|---|---|" * len(backends),
    ]
    for pair in PAIRS[:1] if args.smoke else PAIRS:
        cells = []
        for backend in backends:
            buggy = run(pair.buggy, backend, pair)
            correct = run(pair.correct, backend, pair)
            cells += [
                "yes" if pair.check in buggy else "NO",
                "yes" if not correct else "NO: " + ", ".join(sorted(correct)),
                ", ".join(sorted(buggy - {pair.check})) or "-",
            ]
        lines.append(f"| {pair.check} ({pair.buggy.__name__}) | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
