"""Every script in ``benchmarks/`` and ``scripts/`` runs here, in a smoke mode, so none can rot unseen.

The scripts are found by glob: a new one fails ``test_script_runs`` until ``SMOKE`` says how it is
smoked. Each runs as its users run it, ``python <script> ...`` from the repository root with the
root on ``PYTHONPATH`` and one thread, on tiny sizes (the CPU emulator or the CPU); a GPU-only
script answers ``--help`` (it imports and parses its arguments without a GPU). Its exit status
must be 0 and its output must say what the script itself says when it worked. The selected
scripts run two at a time, started together at the first one's test (most wait on imports and
subprocesses; the file stays well under two minutes on two cores). Shell scripts are
parsed with ``bash -n``, and the scripts they run must exist. Folders are no scripts:
``scripts/fault_suite/`` is the demo suite ``gpu_faults.sh`` runs with pytest, ``scripts/mutants/``
the package ``scripts/mutants.py`` runs. ``scripts/mutants.py`` only lists its
mutants: a real mutant copies the tree and runs pytest (minutes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "scripts")
#: Python files in those folders that are no scripts (never run as ``python <file>``).
NOT_SCRIPTS = {
    "benchmarks/__init__.py": "the package marker (tests import benchmarks.scale)",
    "benchmarks/test_bench_mlp.py": "a pytest-benchmark suite, run as pytest benchmarks/ (tests/test_bench.py)",
}
TIMEOUT_S = 180


@dataclass(frozen=True)
class Smoke:
    args: tuple[str, ...]  # "{tmp}" is replaced by a temporary folder
    expect: str  # a regular expression the output must match (multiline)
    needs: tuple[str, ...] = ()  # optional modules: the test is skipped without them


#: How each script is smoked. ``--help`` only: GPU-only scripts (they need CUDA to do anything).
SMOKE: dict[str, Smoke] = {
    "benchmarks/bench_dispatch.py": Smoke(("--smoke",), r"^dispatch median: [\d.]+ us/call"),
    "benchmarks/bench_replay.py": Smoke(("--smoke",), r'"replay_over_eager": [\d.]+'),
    "benchmarks/capture_phases.py": Smoke(
        ("--smoke",), r"^smoke: \d+ timer targets and \d+ variants resolve"
    ),
    "benchmarks/fault_probe.py": Smoke(("--help",), r"\{leaks,sticky\}.*--cycles"),
    "benchmarks/invariance.py": Smoke(
        ("--shapes", "tiny", "--errors", "logit_scale"),
        r"^tiny invariant +[\d.]+ s  same at 7/7",
        ("transformers",),
    ),
    "benchmarks/run_overhead.py": Smoke(("--smoke",), r"^run\(\): [\d.]+ us a call .*the hand-written loop"),
    "benchmarks/runner_cost.py": Smoke(("--help",), r"--rounds ROUNDS"),
    "benchmarks/scale.py": Smoke(
        ("--shapes", "tiny", "--parts", "quick"), r"^  quick .*passed; \d+ descriptors", ("transformers",)
    ),
    "benchmarks/startup.py": Smoke(("--runs", "1"), r"^with the plugin +median [\d.]+ s over 1 runs"),
    # Runs under torchrun alone (its ranks are the launcher's): the smoke reads its arguments.
    "benchmarks/collective_check.py": Smoke(("--help",), r"usage: collective_check.py"),
    "benchmarks/scale_profile.py": Smoke(("--help",), r"usage: scale_profile.py"),
    # Five quick verifications of tiny (transformers' import included, about 10 s): run by hand, with a GPU.
    "benchmarks/outside_cost.py": Smoke(("--help",), r"usage: outside_cost.py"),
    "benchmarks/tp_scale.py": Smoke(
        # one rank (gloo still set up): two cost twice the CPU
        ("--shape", "small", "--backend", "emulate", "--world-size", "1", "--sizes", "1", "--bugs", ""),
        r"^verify: TPLlama on emulate .*all checks passed",
    ),
    "benchmarks/training_step.py": Smoke(
        ("--cpu-smoke", "--model", "llama-1b"),
        r"^correct step: passed\n.*^bug \(loss over padded rows\): caught by \[.training_padding.",
    ),
    "scripts/bad_inputs.py": Smoke(("--smoke", "--quiet"), r"^(\d+) of \1 bad inputs handled right"),
    "scripts/capturability.py": Smoke(
        ("table", "docs/data/capturability_h200_cases.jsonl.gz", "--out", "{tmp}/table.json"),
        r"^\d+ cases -> \d+ ops, \d+ patterns: .*; wrote ",
    ),
    "scripts/check_agreement.py": Smoke(("--smoke",), r"^\| \w+ \(\w+\) \| yes \| yes \|"),
    "scripts/gallery_output.py": Smoke(("--smoke",), r"^    \w+ on emulate \(cpu\).*descriptors captured"),
    "scripts/mutants.py": Smoke(("--list",), r"^compare-all-any\n    .*^\d+ mutants$"),
    "scripts/refresh_docs.py": Smoke(("--list",), r"^[\w-]+ +[\w/]+\.md +python "),
    "scripts/references_gpu.py": Smoke(("--help",), r"--out OUT"),
    "scripts/optimizer_capture.py": Smoke(("--help",), r"--out OUT"),
    "scripts/summarize_report.py": Smoke(
        ("--smoke",), r"^smoke\.py::test_linear: emulate cpu .*\n  \w+: \d+ passed"
    ),
    "scripts/value_rules.py": Smoke(("--help",), r"\{probe\}"),
}


def _scripts(suffix: str) -> list[str]:
    found = (p.relative_to(ROOT).as_posix() for folder in FOLDERS for p in (ROOT / folder).glob(f"*{suffix}"))
    return sorted(name for name in found if name not in NOT_SCRIPTS)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def test_the_scripts_are_found() -> None:
    assert "benchmarks/capture_phases.py" in _scripts(".py")
    assert "scripts/gpu_session.sh" in _scripts(".sh")
    assert set(NOT_SCRIPTS) <= {p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").glob("*.py")}


def _missing(smoke: Smoke) -> list[str]:
    return [name for name in smoke.needs if importlib.util.find_spec(name) is None]


def _run(script: str, smoke: Smoke) -> tuple[list[str], int, str]:
    """(the arguments, the exit status, stdout and stderr) of one smoke run."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [a.replace("{tmp}", tmp) for a in smoke.args]
        proc = subprocess.run(
            [sys.executable, script, *args],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    return args, proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[tuple[list[str], int, str]]]]:
    """Every selected script's smoke run, started at once on two workers (those of ``SMOKE`` whose
    optional modules are here)."""
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_script_runs" and hasattr(item, "callspec")
    ]
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {
        script: pool.submit(_run, script, SMOKE[script])
        for script in selected
        if script in SMOKE and not _missing(SMOKE[script])
    }
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("script", _scripts(".py"))
def test_script_runs(script: str, smoke_runs: dict[str, Future[tuple[list[str], int, str]]]) -> None:
    smoke = SMOKE.get(script)
    if smoke is None:
        pytest.fail(f"{script} has no smoke run: give it a smoke mode (or --help) in SMOKE of {__file__}")
    missing = _missing(smoke)
    if missing:
        pytest.skip(f"{script} needs {', '.join(missing)} (not installed)")
    args, code, output = smoke_runs[script].result()
    assert code == 0, f"{script} {' '.join(args)} exited {code}:\n{output[-4000:]}"
    assert re.search(smoke.expect, output, re.MULTILINE | re.DOTALL), (
        f"{script} {' '.join(args)}: no {smoke.expect!r} in its output:\n{output[-4000:]}"
    )


@pytest.mark.parametrize("script", _scripts(".sh"))
def test_shell_script_parses_and_names_scripts_that_exist(script: str) -> None:
    proc = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"bash -n {script}:\n{proc.stderr}"
    text = (ROOT / script).read_text()
    named = re.findall(r"python (?:-m pytest )?((?:benchmarks|scripts)/[\w/.]+)", text)
    for path in named:
        assert (ROOT / path).exists(), f"{script} runs {path}, which does not exist"


def test_mutants_modules_stay_small() -> None:
    """``scripts/mutants.py`` is split along its seams (the runner, the tables by area)."""
    modules = [ROOT / "scripts" / "mutants.py", *sorted((ROOT / "scripts" / "mutants").rglob("*.py"))]
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in modules}
    assert len(sizes) > 3
    assert {name: n for name, n in sizes.items() if n > 600} == {}


def test_every_mutant_finds_its_snippet_in_the_tree() -> None:
    """A mutant whose snippet the code no longer holds is stale: it would mutate nothing, and only
    a real run (minutes) would say so. Each is located as ``scripts/mutants.py`` locates it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from mutants.runner import Stale, locate
        from mutants.tables import CUDA_MUTANTS, MUTANTS
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    stale = []
    for mutant in [*MUTANTS, *CUDA_MUTANTS]:
        try:
            locate(ROOT, mutant)
        except Stale as exc:
            stale.append(str(exc))
    assert stale == []
