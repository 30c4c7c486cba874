"""What the plugin costs a suite that does not use it: pytest's start-up with and without it.

    python benchmarks/startup.py [--runs 15]

Runs a one-test suite (in a temporary folder, no torch anywhere in it) as a fresh process, header
and all, with no thread count chosen (no ``OMP_NUM_THREADS``), with
the plugin loaded and with ``-p no:cudagraph``, alternating, and prints the median of each and
their ratio. Loading the plugin imports no torch, so the ratio should stay near 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "test_plain.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
        # As a user's shell has it: no thread count chosen (the plugin then plans torch's threads).
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        # The plugin as installed (its pytest11 entry point "cudagraph"), beside whatever else is.
        env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
        env.pop("PYTEST_PLUGINS", None)
        runs: dict[str, list[float]] = {"with the plugin": [], "-p no:cudagraph": []}
        for _ in range(args.runs):
            for label, extra in (("with the plugin", []), ("-p no:cudagraph", ["-p", "no:cudagraph"])):
                started = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *extra],
                    cwd=folder,
                    env=env,
                    check=True,
                    capture_output=True,
                )
                runs[label].append(time.perf_counter() - started)
    medians = {label: statistics.median(times) for label, times in runs.items()}
    for label, value in medians.items():
        print(f"{label:18} median {value:.3f} s over {args.runs} runs")
    print(f"ratio: {medians['with the plugin'] / medians['-p no:cudagraph']:.3f}")


if __name__ == "__main__":
    main()
