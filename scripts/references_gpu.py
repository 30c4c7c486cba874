"""The example of kernels that run only in bf16 (examples/references) verified on a GPU, with its
references: the correct model and the two 0.1 % errors on the padded sizes, with the attention op
alone and with the Triton norm too. Writes each run's verdict, seconds, summary and the JSON
report's ``references`` to the file named (docs/data/references_h200_issue56.json is one such run).

    PYTHONPATH=. python scripts/references_gpu.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from examples.references.kernels import attention, attention_reference, rms_norm, rms_norm_reference
from examples.references.model import CAPTURE_SIZES, MAX_NUM_REQS, build, inputs
from pytest_cudagraph import verify


def main(out: Path) -> None:
    dev = torch.device("cuda")
    runs = []
    for norm in ("torch", "triton"):
        refs: dict[object, object] = {attention: attention_reference}
        if norm == "triton":
            refs[rms_norm] = rms_norm_reference
        for bug in ({}, {"logit_error": 1e-3}, {"mlp_error": 1e-3}):
            started = time.perf_counter()
            report = verify(
                build(device=dev, norm=norm, **bug),
                inputs(dev),
                capture_sizes=CAPTURE_SIZES,
                max_num_reqs=MAX_NUM_REQS,
                references=refs,
                progress=False,
            )
            runs.append(
                {
                    "norm": norm,
                    "bug": bug,
                    "ok": report.ok,
                    "seconds": time.perf_counter() - started,
                    "summary": report.summary(),
                    "failures": sorted({o.check for o in report.failures}),
                    "references": report.references,
                }
            )
            print(norm, bug, "passed" if report.ok else f"failed {runs[-1]['failures']}")
    out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="the JSON file each run's verdict is written to"
    )
    main(parser.parse_args().out)
