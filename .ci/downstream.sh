#!/usr/bin/env bash
# CI stage: another project can depend on the plugin. Builds the sdist and the
# wheel of this repository (the wheel from the sdist, so the sdist is proved
# complete too), installs the wheel -- not the source tree -- into a fresh venv
# outside the repository (PyTorch's CPU build first, as everywhere here), copies
# the downstream project .ci/downstream/ out of the repository and runs its
# suite there with `python -m pytest`: the plugin loaded by its pytest11 entry
# point, its fixtures, marker, ini options, strategies and JSON report.
# Run alone: OMP_NUM_THREADS=1 bash .ci/downstream.sh (.ci/run calls it).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
start=$(date +%s)

fail() { echo "CI: FAILED: downstream: $*" >&2; exit 1; }

TMP=$(mktemp -d) || fail "mktemp"
TMP=$(cd "$TMP" && pwd -P)
case "$TMP/" in "$REPO"/*) fail "the temporary folder $TMP is inside the repository" ;; esac
# KEEP_TMP=1 keeps the folder (venvs, dist, project, report) to look into after a failure.
trap '[ -n "${KEEP_TMP:-}" ] && echo "downstream: kept $TMP" || rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
unset PYTHONPATH PYTEST_PLUGINS PYTEST_ADDOPTS PYTHONSTARTUP

# --- 1. the sdist and the wheel ------------------------------------------------
# A venv of its own for the build front end; `build` makes an isolated
# environment with the build backend (setuptools) from pyproject.toml.
python3 -m venv "$TMP/build-venv" || fail "creating the build venv"
"$TMP/build-venv/bin/python" -m pip install -q build || fail "installing build"
"$TMP/build-venv/bin/python" -m build --outdir "$TMP/dist" "$REPO" > "$TMP/build.log" 2>&1 \
    || { tail -30 "$TMP/build.log" >&2; fail "python -m build (log above)"; }
shopt -s nullglob
sdists=("$TMP"/dist/pytest_cudagraph-*.tar.gz)
wheels=("$TMP"/dist/pytest_cudagraph-*-py3-none-any.whl)
shopt -u nullglob
[ "${#sdists[@]}" -eq 1 ] || fail "expected one sdist in $TMP/dist: $(ls "$TMP/dist")"
[ "${#wheels[@]}" -eq 1 ] || fail "expected one pure-Python wheel in $TMP/dist: $(ls "$TMP/dist")"
WHEEL=${wheels[0]}
echo "downstream: built $(basename "${sdists[0]}") and $(basename "$WHEEL")"
# What a user's install needs: the pytest11 entry point, the typing marker, the package data.
"$TMP/build-venv/bin/python" - "$WHEEL" <<'EOF' || fail "the wheel lacks files a user needs"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
ok = entry and "cudagraph = pytest_cudagraph.plugin" in zipfile.ZipFile(sys.argv[1]).read(entry[0]).decode()
for needed in ("pytest_cudagraph/plugin/__init__.py", "pytest_cudagraph/strategies.py", "pytest_cudagraph/py.typed"):
    ok = ok and needed in names
ok = ok and any(n.startswith("pytest_cudagraph/data/") and n.endswith(".json") for n in names)
ok = ok and not any(n.startswith(("tests/", "examples/", "scripts/")) for n in names)
sys.exit(0 if ok else 1)
EOF

# --- 2. a fresh venv outside the repository, the wheel installed ---------------
python3 -m venv "$TMP/venv" || fail "creating the downstream venv"
# shellcheck disable=SC1091
. "$TMP/venv/bin/activate" || fail "activating the downstream venv"
[ "$(command -v python)" = "$TMP/venv/bin/python" ] || fail "python is not the downstream venv's"
# PyTorch's CPU build first (a local wheel here), or pip resolves torch to a CUDA build of several GB.
python -m pip install -q torch==2.13.0 || fail "installing the CPU build of torch"
python -m pip install -q "$WHEEL" || fail "installing the wheel $WHEEL"
python -c "import hypothesis" 2>/dev/null || python -m pip install -q hypothesis || fail "installing hypothesis"
python -c "import sys, torch; sys.exit(0 if torch.__version__.endswith('+cpu') else 1)" \
    || fail "the wheel's install replaced the CPU build of torch"

# --- 3. the downstream project, out of the repository --------------------------
PROJECT="$TMP/project"
cp -r "$REPO/.ci/downstream" "$PROJECT" || fail "copying .ci/downstream"
cd "$PROJECT" || fail "cd $PROJECT"
# pytest_cudagraph must come from the venv's site-packages, not from the repository.
python - "$REPO" <<'EOF' || fail "pytest_cudagraph does not resolve to the downstream venv's site-packages"
import pathlib, sys, sysconfig
import pytest_cudagraph
where = pathlib.Path(pytest_cudagraph.__file__).resolve()
site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
repo = pathlib.Path(sys.argv[1]).resolve()
print("downstream: pytest_cudagraph", pytest_cudagraph.__version__, "from", where)
sys.exit(0 if where.is_relative_to(site) and not where.is_relative_to(repo) else 1)
EOF

# No -p: pytest loads the plugin through its entry point (the conftest checks it).
CUDAGRAPH_REPO="$REPO" python -m pytest --cudagraph-report=cudagraph-report.json
rc=$?
[ "$rc" -eq 5 ] && fail "pytest collected no tests (exit 5)"
[ "$rc" -eq 0 ] || fail "python -m pytest in the downstream project (exit $rc)"

# --- 4. the JSON report --------------------------------------------------------
[ -s cudagraph-report.json ] || fail "--cudagraph-report wrote no cudagraph-report.json"
python - <<'EOF' || fail "cudagraph-report.json does not say the run passed"
import json, sys
data = json.load(open("cudagraph-report.json"))
tests = data.get("tests", {})
expected = ("tests/test_verify.py::test_mlp_graphs_match_eager", "tests/test_verify.py::test_ini_capture_sizes",
            "tests/test_dispatch.py::test_drawn_plans_dispatch")
missing = [t for t in expected if t not in tests]
print(f"downstream: report passed={data.get('passed')} complete={data.get('complete')} "
      f"outcomes={data.get('outcomes')} backend={data.get('settings', {}).get('backend')}")
sys.exit(0 if data.get("passed") is True and data.get("complete") is True and not missing else 1)
EOF

echo "downstream: passed in $(( $(date +%s) - start )) s"
