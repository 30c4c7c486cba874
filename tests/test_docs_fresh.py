"""The outputs README.md and docs/ show are written by scripts/refresh_docs.py from real runs.

Cheap checks only (the runs themselves take minutes; ``python scripts/refresh_docs.py --check``
runs them, and CI does): every marked block has a registered command, every registered command
has its block, markers are balanced, and each block holds a caption and one code block.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("refresh_docs", ROOT / "scripts" / "refresh_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("refresh_docs", module)
    spec.loader.exec_module(module)
    return module


refresh = _load()


def test_every_marker_has_a_command_and_every_command_a_marker() -> None:
    where = refresh.all_markers()
    assert set(where) == set(refresh.BLOCKS)
    for name, block in refresh.BLOCKS.items():
        assert where[name] == [ROOT / block.file], (name, where[name])


@pytest.mark.parametrize("name", sorted(refresh.BLOCKS))
def test_each_block_holds_a_caption_and_one_code_block(name: str) -> None:
    block = refresh.BLOCKS[name]
    path = ROOT / block.file
    lines = path.read_text().splitlines()
    ((begin, end),) = [(b, e) for n, b, e in refresh.markers(path) if n == name]
    inner = lines[begin + 1 : end]
    if block.generate is not None:  # a table generated from the code: exactly what the code makes now
        assert inner == block.generate()
        return
    assert sum(ln.startswith("```") for ln in inner) == 2, inner
    assert inner[0].strip() and not inner[0].startswith("```"), "a caption first"
    assert refresh.code_lines(inner), "an empty block"


@pytest.mark.parametrize("name", sorted(n for n, b in refresh.BLOCKS.items() if b.generate is None))
def test_each_caption_is_what_the_script_writes(name: str) -> None:
    """A caption says the date, the machine and the threads of its run, in the script's own words."""
    block = refresh.BLOCKS[name]
    path = ROOT / block.file
    ((begin, end),) = [(b, e) for n, b, e in refresh.markers(path) if n == name]
    caption = path.read_text().splitlines()[begin + 1]
    fields = {"when": r"\d{4}-\d\d-\d\d", "versions": r"[\w.+-]+ [\w.+-]+(, [\w.+-]+ [\w.+-]+)*"}
    fields |= {"cores": r"\d+", "threads": r"\d+"}
    literal = re.split(r"\{(\w+)\}", block.caption)
    pattern = "".join(fields[part] if i % 2 else re.escape(part) for i, part in enumerate(literal))
    assert re.fullmatch(pattern, caption), (caption, block.caption)
    shown = refresh.code_lines(path.read_text().splitlines()[begin + 1 : end])
    # Where the output names the variable ("threads=1 (OMP_NUM_THREADS)"), the caption says its value.
    if any("(OMP_NUM_THREADS)" in line for line in shown):
        assert "{threads}" in block.caption, block.caption


def test_the_readme_commands_are_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    run_it = 'python -m pip install -e ".[examples]" && python -m pytest --cudagraph-verify examples/'
    test_it = 'python -m pip install -e ".[test]" && python -m pytest -n 2'
    for command in (run_it, test_it):
        assert f"```bash\n{command}\n```" in readme
        # As the README has it: alone on its line, or its output kept by tee.
        assert re.search(rf"^{re.escape(command)}( \| tee \S+)?$", ci, flags=re.M), command
    # "Run it" runs first, in the fresh venv that holds torch only: the packages its own extra
    # installs are all there is (under "Test it"'s, a missing one would not show).
    assert ci.index(run_it) < ci.index(test_it)
    assert "--output readme-run-it=" in ci  # its counts held to the README's block


def test_the_run_it_extra_installs_what_the_examples_import() -> None:
    """Every package an example skips without is in the extra README "Run it" installs."""
    tomllib = pytest.importorskip("tomllib", reason="the TOML reader of Python 3.11 and later")

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        """The distributions an extra installs, through the extras of this package it names."""
        found: set[str] = set()
        for requirement in extras[extra]:
            match = re.match(r"([\w.-]+)(?:\[([\w,]+)\])?", requirement)
            assert match is not None, requirement
            if match.group(1) == "pytest-cudagraph":
                for inner in match.group(2).split(","):
                    found |= names(inner)
            else:
                found.add(match.group(1))
        return found

    skipped_without: set[str] = set()
    for path in (ROOT / "examples").rglob("*.py"):
        skipped_without |= set(re.findall(r'importorskip\(\s*"([\w.]+)"', path.read_text()))
    assert skipped_without >= {"transformers", "peft", "triton", "torchao"}, skipped_without
    assert skipped_without <= names("examples"), skipped_without - names("examples")
    assert names("examples") <= names("test")  # "Test it" runs the examples too


def test_check_masks_timings_and_hypothesis_wording_but_not_counts() -> None:
    norm = refresh.normalise
    assert norm(["x: 4/4 captured, 35 checks passed, capture 65 ms, graph memory 12.0 KiB"]) == norm(
        ["x: 4/4 captured, 35 checks passed, capture 71 ms, graph memory 13.5 KiB"]
    )
    assert norm(["graph gave -3.83, eager gave 6.7e-05"]) == norm(["graph gave 1.51, eager gave -2.16"])
    assert norm(["E           Falsifying example: test_x("]) == norm(
        ["E           Failing test case: test_x("]
    )
    assert norm(["= 85 passed, 16 skipped in 48.81s ="]) == norm(
        ["= 85 passed, 16 skipped in 64.02s (0:01:04) ="]
    )
    assert norm(["38 checks passed"]) != norm(["34 checks passed"])
    assert norm(["(calls: 6 -> 7)"]) != norm(["(calls: 8 -> 9)"])


def test_unbalanced_markers_are_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.md"
    bad.write_text("<!-- refresh: a -->\ntext\n")
    with pytest.raises(ValueError, match="not closed"):
        refresh.markers(bad)
    bad.write_text("text\n<!-- /refresh -->\n")
    with pytest.raises(ValueError, match="without a start"):
        refresh.markers(bad)


def test_the_architecture_page_names_every_module() -> None:
    """docs/architecture.md stays true: a module added to the package has a row (or its folder does)."""
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "architecture.md").read_text()
    package = root / "pytest_cudagraph"
    unnamed = [
        str(p.relative_to(package))
        for p in sorted(package.rglob("*.py"))
        if p.name != "__init__.py"
        and not any(
            f"`{name}`" in page for name in (p.name, p.relative_to(package).as_posix(), f"{p.parent.name}/")
        )
    ]
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"


def test_every_option_is_in_the_usage_pages_table(pytester: pytest.Pytester) -> None:
    """docs/usage.md's options table names every --cudagraph- option and its ini twin."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    config = pytester.parseconfig()
    options = [o for o in config._parser.getgroup("cudagraph").options]
    missing = [o.names()[0] for o in options if f"`{o.names()[0]}" not in page or f"`{o.dest}`" not in page]
    assert len(options) >= 12 and not missing, missing


def test_check_holds_a_block_to_an_output_made_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--output NAME=FILE: CI's "Run it" (in a fresh venv) is held to the README without a second run."""
    path = ROOT / "README.md"
    ((begin, end),) = [(b, e) for n, b, e in refresh.markers(path) if n == "readme-run-it"]
    shown = refresh.code_lines(path.read_text().splitlines()[begin + 1 : end])
    out = tmp_path / "run-it.txt"
    out.write_text("\n".join(["collected 185 items", "", *shown]) + "\n")
    argv = ["--check", "--only", "readme-run-it", "--output", f"readme-run-it={out}"]
    assert refresh.main(argv) == 0
    fewer = [re.sub(r"\d+ passed", "142 passed", line) for line in shown]
    out.write_text("\n".join(fewer) + "\n")
    assert refresh.main(argv) == 1
    assert "drifted: readme-run-it" in capsys.readouterr().out
