"""Per test of a --cudagraph-report JSON: descriptors, and how each check fared on them.

python scripts/summarize_report.py report.json [--match decoder]
python scripts/summarize_report.py --smoke   # a tiny verification on the CPU emulator, summarised
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any


def smoke_report(folder: Path) -> Path:
    """A report as --cudagraph-report writes its records: one ``verify`` of a small Linear on the
    emulator (capture sizes 1 and 2), recorded by the plugin's own ``make_record``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from pytest_cudagraph.checks import verify
    from pytest_cudagraph.plugin.report import make_record

    torch.manual_seed(0)
    report = verify(
        torch.nn.Linear(8, 8).eval(),
        lambda t, r: {"input": torch.randn(t, 8)},
        capture_sizes=(1, 2),
        max_num_reqs=2,
        backend="emulate",
    )
    record = make_record(report.to_dict(), {"capture_sizes": (1, 2), "backend": "emulate"})
    data: dict[str, Any] = {
        "tests": {"smoke.py::test_linear": {"outcome": "passed", "verifications": [record]}}
    }
    path = folder / "report.json"
    path.write_text(json.dumps(data))
    return path


def summarize(report: Path, match: str) -> None:
    data = json.loads(report.read_text())
    for name, test in data["tests"].items():
        if match not in name:
            continue
        for v in test["verifications"]:
            r = v["report"]
            counts: dict[str, Counter[str]] = {}
            for o in r["outcomes"]:
                state = "skipped" if o["skipped"] else "passed" if o["passed"] else "FAILED"
                counts.setdefault(o["check"], Counter())[state] += 1
            labels = sorted({o["descriptor"]["label"] for o in r["outcomes"] if o.get("descriptor")})
            print(
                f"{name}: {r['backend']} {r['device']} {r['mode']}, {len(r['descriptors'])} descriptors "
                f"({', '.join(labels)})"
            )
            for check, c in counts.items():
                print(f"  {check}: " + ", ".join(f"{n} {k}" for k, n in sorted(c.items())))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", nargs="?")
    parser.add_argument("--match", default="")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="summarise a tiny verification's report made here (no file needed)",
    )
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as folder:
            summarize(smoke_report(Path(folder)), args.match)
        return
    if args.report is None:
        parser.error("the report is required (or --smoke)")
    summarize(Path(args.report), args.match)


if __name__ == "__main__":
    main()
