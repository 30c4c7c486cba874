"""Per test of a --cudagraph-report JSON: descriptors, and how each check fared on them.

python scripts/summarize_report.py report.json [--match decoder]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("--match", default="")
    args = parser.parse_args()
    data = json.load(open(args.report))
    for name, test in data["tests"].items():
        if args.match not in name:
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


if __name__ == "__main__":
    main()
