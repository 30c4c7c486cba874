"""Capture sizes from a trace: reading it, dispatching it, the best ladder, the CLI and --cudagraph-trace."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_cudagraph.plan import Batch, CaptureConfig, CapturePlan
from pytest_cudagraph.plan.trace import TraceError, analyse, best_ladder, fallback_reason, read_trace, suggest
from pytest_cudagraph.plan_trace import main

from .conftest import isolate_plugins

ROOT = Path(__file__).resolve().parent.parent

LINES = [
    {"num_tokens": 1, "num_reqs": 1, "uniform_token_count": 1, "max_query_len": 1},
    {"num_tokens": 3, "num_reqs": 3, "uniform_token_count": 1, "max_query_len": 1},
    {"num_tokens": 3, "num_reqs": 3, "uniform_token_count": 1, "max_query_len": 1},
    {"num_tokens": 7, "num_reqs": 2, "max_query_len": 6},
    {"num_tokens": 20, "num_reqs": 1},
]


def _jsonl(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# -- reading ----------------------------------------------------------------------


def test_jsonl_csv_and_gzip_read_alike(tmp_path: Path) -> None:
    jsonl = read_trace(_jsonl(tmp_path / "t.jsonl", LINES))
    rows = ["num_tokens,num_reqs,uniform_token_count,max_query_len,num_active_loras"]
    rows += [
        f"{d['num_tokens']},{d['num_reqs']},{d.get('uniform_token_count', '')},{d.get('max_query_len', '')},"
        for d in LINES
    ]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
        f.write((tmp_path / "t.jsonl").read_text())
    assert jsonl.batches == 5 and len(jsonl.counts) == 4 and jsonl.real_tokens == 34
    assert jsonl.counts[Batch(num_tokens=3, num_reqs=3, uniform_token_count=1, max_query_len=1)] == 2
    assert read_trace(tmp_path / "t.csv").counts == jsonl.counts
    assert read_trace(tmp_path / "t.jsonl.gz").counts == jsonl.counts


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not an object"),
        ('{"num_reqs": 1}', "num_tokens is missing"),
        ('{"num_tokens": 2.5, "num_reqs": 1}', "num_tokens must be an integer"),
        ('{"num_tokens": true, "num_reqs": 1}', "num_tokens must be an integer"),
        ('{"num_tokens": 2, "num_reqs": 3}', "exceeds num_tokens"),
        ('{"num_tokens": 0, "num_reqs": 0}', "num_tokens must be >= 1"),
        ('{"num_tokens": 5, "num_reqs": 2, "uniform_token_count": 2}', "not num_tokens 5"),
        ('{"num_tokens": 9, "num_reqs": 2, "max_query_len": 4}', "fewer than num_tokens"),
        ('{"num_tokens": 4, "num_reqs": 2, "max_query_len": 4}', "num_tokens - num_reqs + 1"),
        ('{"num_tokens": 4, "num_reqs": 2, "num_active_loras": -1}', "num_active_loras must be >= 0"),
    ],
)
def test_a_bad_line_is_named_by_its_number(tmp_path: Path, line: str, words: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"num_tokens": 2, "num_reqs": 1}\n\n' + line + "\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert [b.line for b in info.value.bad] == [3]
    assert "line 3: " in str(info.value) and words in str(info.value)
    skipped = read_trace(path, skip_bad=True)  # left out, and listed
    assert skipped.batches == 1 and [b.line for b in skipped.skipped] == [3]


def test_csv_errors_and_ignored_fields(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("tokens,num_reqs\n1,1\n")
    with pytest.raises(TraceError, match="no column num_tokens"):
        read_trace(tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("num_tokens,num_reqs,timestamp\n1,1,0.5\n2\n4,x,1\n")
    with pytest.raises(TraceError) as info:
        read_trace(tmp_path / "b.csv")
    assert [(b.line, b.reason.split(" ")[0]) for b in info.value.bad] == [(3, "1"), (4, "num_reqs")]
    trace = read_trace(tmp_path / "b.csv", skip_bad=True)
    assert trace.ignored_fields == ("timestamp",) and trace.batches == 1
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no batch"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "missing.jsonl")


# -- dispatching a trace ----------------------------------------------------------


def test_analyse_counts_modes_padding_and_fallbacks(tmp_path: Path) -> None:
    trace = read_trace(_jsonl(tmp_path / "t.jsonl", LINES))
    plan = CapturePlan(CaptureConfig(capture_sizes=[1, 2, 4, 8], max_num_reqs=4, mode="FULL_AND_PIECEWISE"))
    a = analyse(plan, trace)
    # decode 1 -> FULL-T1 (no pad), decode 3 -> FULL-T4 (1 pad each, twice), mixed 7 -> PIECEWISE-T8 (1 pad),
    # 20 tokens -> eager
    assert (a.by_mode["FULL"].batches, a.by_mode["FULL"].padded_tokens) == (3, 2)
    assert (a.by_mode["PIECEWISE"].batches, a.by_mode["PIECEWISE"].padded_tokens) == (1, 1)
    assert a.eager.batches == 1 and a.coverage == 4 / 5
    assert a.padding_waste == pytest.approx(3 / 14)
    assert dict(a.fallbacks) == {"more tokens than the largest graph (8)": 1}
    assert a.worst_padded(1) == [("FULL", 3, 4, 2, 2)]


@pytest.mark.parametrize(
    ("config", "batch", "words"),
    [
        (
            {"mode": "FULL_DECODE_ONLY"},
            Batch(num_tokens=4, num_reqs=2),
            "FULL_DECODE_ONLY runs mixed batches eagerly",
        ),
        (
            {"mode": "FULL", "max_num_reqs": 2},
            Batch(num_tokens=4, num_reqs=3),
            "more requests than the graph",
        ),
        (
            {
                "mode": "FULL_AND_PIECEWISE",
                "varlen_decode": True,
                "decode_query_len": 2,
                "capture_sizes": [4],
            },
            Batch(num_tokens=2, num_reqs=1, max_query_len=2),
            None,
        ),  # served: a control
        (
            {"mode": "FULL_DECODE_ONLY", "varlen_decode": True, "decode_query_len": 2},
            Batch(num_tokens=4, num_reqs=1, max_query_len=4),
            "FULL_DECODE_ONLY runs mixed batches eagerly",
        ),
        (
            {"mode": "FULL_DECODE_ONLY", "max_num_reqs": 2},
            Batch(num_tokens=5, num_reqs=2),
            "FULL_DECODE_ONLY runs mixed batches eagerly",
        ),  # not "larger than the largest (decode) graph"
        (
            {"mode": "FULL", "lora_cases": (0,)},
            Batch(num_tokens=2, num_reqs=1, num_active_loras=2),
            "no graph for 2 active LoRA adapters",
        ),
        ({"mode": "NONE"}, Batch(num_tokens=2, num_reqs=1), "mode NONE"),
    ],
)
def test_fallback_reasons(config: dict[str, object], batch: Batch, words: str | None) -> None:
    keywords = {"capture_sizes": [1, 2, 4, 8], "max_num_reqs": 8, **config}
    plan = CapturePlan(CaptureConfig(**keywords))  # type: ignore[arg-type]
    served = plan.dispatch_batch(batch).is_graphed
    assert served is (words is None)
    if words is not None:
        assert words in fallback_reason(plan, batch)


# -- the best ladder --------------------------------------------------------------


def _brute(demand: dict[int, tuple[int, int]], n: int) -> int:
    xs = sorted(demand)
    best = None
    for k in range(1, min(n, len(xs)) + 1):
        for combo in itertools.combinations(xs[:-1], k - 1):
            ladder = [*combo, xs[-1]]
            cost = sum(next(s for s in ladder if s >= x) * c - t for x, (c, t) in demand.items())
            best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@settings(max_examples=300, deadline=None, database=None)
@given(
    demand=st.dictionaries(st.integers(1, 60), st.integers(1, 9), min_size=1, max_size=9),
    under=st.integers(0, 2),
    n=st.integers(1, 6),
)
def test_best_ladder_is_the_brute_force_optimum(demand: dict[int, int], under: int, n: int) -> None:
    # Each size's batches hold up to `under` tokens fewer than the size (a bucket of rounded sizes).
    d = {x: (c, x * c - min(under, x - 1) * c) for x, c in demand.items()}
    sizes, padded = best_ladder(d, n)
    assert padded == _brute(d, n)
    assert len(sizes) <= n and max(sizes) == max(d) and set(sizes) <= set(d)
    assert padded == sum(next(s for s in sizes if s >= x) * c - t for x, (c, t) in d.items())


def test_best_ladder_arguments() -> None:
    assert best_ladder({}, 3) == ((), 0)
    assert best_ladder({5: (2, 10), 9: (1, 9)}, 4) == ((5, 9), 0)  # enough graphs: every size
    with pytest.raises(ValueError, match="max_graphs must be an integer >= 1"):
        best_ladder({1: (1, 1)}, 0)


@st.composite
def _traces(draw: st.DrawFn, max_reqs: int, q: int) -> dict[Batch, int]:
    out: dict[Batch, int] = {}
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["uniform", "varlen", "mixed"]))
        r = draw(st.integers(1, max_reqs))
        if kind == "uniform":
            b = Batch(num_tokens=r * q, num_reqs=r, uniform_token_count=q, max_query_len=q)
        elif kind == "varlen":
            t = draw(st.integers(r, r * q))
            b = Batch(num_tokens=t, num_reqs=r, max_query_len=-(-t // r))
        else:
            t = draw(st.integers(r, 24))
            b = Batch(num_tokens=t, num_reqs=r)
        out[b] = out.get(b, 0) + draw(st.integers(1, 4))
    return out


@settings(max_examples=60, deadline=None, database=None)
@given(
    data=st.data(),
    mode=st.sampled_from(["FULL", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"]),
    q=st.sampled_from([1, 2, 3]),
    varlen=st.booleans(),
    n=st.integers(1, 3),
)
def test_suggested_ladder_is_optimal_under_the_real_plan(
    data: st.DataObject, mode: str, q: int, varlen: bool, n: int
) -> None:
    """Every ladder of at most n candidate sizes, dispatched by the real plan, pads no less than the suggestion."""
    max_reqs = 6
    counts = data.draw(_traces(max_reqs, q))
    config = CaptureConfig(
        capture_sizes=[1], max_num_reqs=max_reqs, mode=mode, decode_query_len=q, varlen_decode=varlen
    )
    joint, _ = suggest(config, counts, n)
    if not joint.capture_sizes:
        return  # no batch a graph can serve
    after = analyse(
        CapturePlan(config.replace(capture_sizes=joint.capture_sizes, max_capture_size=None)), counts
    )
    assert (after.served.batches, after.served.padded_tokens) == (joint.batches, joint.padded_tokens)
    step = q if joint.restricted else 1
    candidates = sorted({-(-b.num_tokens // step) * step for b in counts})
    for k in range(1, min(n, len(candidates)) + 1):
        for combo in itertools.combinations(candidates, k):
            other = analyse(CapturePlan(config.replace(capture_sizes=combo, max_capture_size=None)), counts)
            if other.served.batches == joint.batches:
                assert other.served.padded_tokens >= joint.padded_tokens, (combo, joint)


def test_split_modes_also_get_a_ladder_per_routine(tmp_path: Path) -> None:
    trace = read_trace(_jsonl(tmp_path / "t.jsonl", LINES))
    config = CaptureConfig(capture_sizes=[8], max_num_reqs=4, mode="FULL_AND_PIECEWISE")
    joint, by_mode = suggest(config, trace, 2)
    # {7, 20}: 1 -> 7 and 3 -> 7 twice pad 6 + 8; {3, 20} would pad 2 + 13, {1, 20} 34 + 13
    assert (joint.capture_sizes, joint.padded_tokens, joint.batches) == ((7, 20), 14, 5)
    assert by_mode["FULL"].capture_sizes == (1, 3) and by_mode["FULL"].padded_tokens == 0
    assert by_mode["PIECEWISE"].capture_sizes == (7, 20) and by_mode["PIECEWISE"].padded_tokens == 0
    q2 = CaptureConfig(capture_sizes=[8], max_num_reqs=4, mode="FULL_AND_PIECEWISE", decode_query_len=2)
    assert suggest(q2, {Batch(num_tokens=4, num_reqs=2, uniform_token_count=2, max_query_len=2): 1}, 1)[
        0
    ].restricted


# -- the command --------------------------------------------------------------------


def test_the_command_prints_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _jsonl(tmp_path / "t.jsonl", LINES)
    out = tmp_path / "out.json"
    code = main(
        [
            str(trace),
            "--capture-sizes",
            "1,2,4,8",
            "--max-num-reqs",
            "4",
            "--max-graphs",
            "2",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "more tokens than the largest graph (8)" in text and "--capture-sizes 7,20" in text
    doc = json.loads(out.read_text())
    assert doc["coverage"] == pytest.approx(4 / 5) and doc["padding_waste"] == pytest.approx(3 / 14)
    assert doc["suggested_capture_sizes"] == [7, 20]
    assert doc["suggested_coverage"] == 1.0
    # 1 -> 7 (6 pad), 3 -> 7 twice (8), 7 and 20 exact: 14 padded over 34 tokens
    assert doc["suggested_padding_waste"] == pytest.approx(14 / 34)
    assert doc["suggested_by_mode"]["FULL"]["capture_sizes"] == [1, 3]


def test_the_command_names_bad_lines_and_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"num_tokens": 2, "num_reqs": 1}\n{"num_tokens": 1, "num_reqs": 2}\n')
    assert main([str(trace)]) == 2
    assert "line 2: num_reqs (2) exceeds num_tokens (1)" in capsys.readouterr().err
    assert main([str(trace), "--skip-bad-lines"]) == 0
    assert "skipped 1 bad line(s): line 2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main([str(trace), "--capture-sizes", "1,x"])
    assert info.value.code == 2 and "expected token counts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(trace), "--estimate-memory"])  # needs --max-graphs
    assert "give --max-graphs" in capsys.readouterr().err


def test_the_command_estimates_graph_memory_of_both_ladders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _jsonl(tmp_path / "t.jsonl", LINES)
    out = tmp_path / "out.json"
    code = main(
        [
            str(trace),
            "--capture-sizes",
            "1,2,4,8",
            "--max-num-reqs",
            "4",
            "--max-graphs",
            "2",
            "--estimate-memory",
            "--module",
            "tests.models:MLP",
            "--make-inputs",
            "tests.test_trace:mlp_inputs",
            "--backend",
            "emulate",
            "--json",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr()
    memory = json.loads(out.read_text())["graph_memory"]
    assert memory["current_bytes"] > 0 and memory["suggested_bytes"] > 0
    # The suggestion's largest graph (20 tokens) holds more than the current one's (8).
    assert memory["suggested_bytes"] > memory["current_bytes"]
    assert "graph memory" in capsys.readouterr().out


def mlp_inputs(num_tokens: int, num_reqs: int) -> dict[str, object]:
    import torch

    return {"x": torch.randn(num_tokens, 32)}


def test_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = _jsonl(tmp_path / "t.jsonl", LINES)
    assert main([str(trace), "--max-graphs", "2", "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_python_dash_m_runs_the_command(tmp_path: Path) -> None:
    trace = _jsonl(tmp_path / "t.jsonl", LINES)
    done = subprocess.run(
        [sys.executable, "-m", "pytest_cudagraph.plan_trace", str(trace)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "5 batches, 4 distinct shapes" in done.stdout
    assert (
        "torch"
        not in subprocess.run(
            [sys.executable, "-c", "import sys, pytest_cudagraph.plan_trace; print(' '.join(sys.modules))"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        ).stdout.split()
    )


def test_the_shipped_trace_reads_and_the_generator_makes_it() -> None:
    from examples.traces.make_trace import batches

    shipped = read_trace(ROOT / "examples" / "traces" / "decode_heavy.jsonl.gz")
    assert shipped.batches == 50_000
    first = [json.loads(json.dumps(b)) for b in itertools.islice(batches(50_000, 0), 200)]
    with gzip.open(ROOT / "examples" / "traces" / "decode_heavy.jsonl.gz", "rt") as f:
        assert [json.loads(line) for line in itertools.islice(f, 200)] == first


# -- --cudagraph-trace -------------------------------------------------------------

LEAK = """
import torch
from pytest_cudagraph.plan import Batch


class MeanLeak(torch.nn.Module):
    # Each row gets the batch mean: padded rows leak into real ones.
    def forward(self, x):
        return x + x.mean(0, keepdim=True)


def make_inputs(t, r):
    return {"x": torch.randn(t, 4)}


def test_verify(cudagraph_verify):
    report = cudagraph_verify(MeanLeak(), make_inputs, capture_sizes=[2, 4], checks=["real_batches", "dispatch"])
    print("REAL", report.real_batches)
    assert report.ok, report.format()


def test_shapes(cudagraph_trace_batches):
    assert Batch(num_tokens=4, num_reqs=4) in cudagraph_trace_batches
"""


@pytest.mark.parametrize(
    ("rows", "caught"),
    [
        ("num_tokens,num_reqs\n2,2\n4,4\n4,4\n", False),  # every batch exactly a graph's size: nothing padded
        ("num_tokens,num_reqs\n2,2\n3,3\n4,4\n", True),  # 3 tokens in the graph of 4: the leak shows
    ],
)
def test_verification_runs_the_trace_shapes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None, rows: str, caught: bool
) -> None:
    isolate_plugins(monkeypatch)
    pytester.makepyfile(test_leak=LEAK)
    (pytester.path / "trace.csv").write_text(rows)
    result = pytester.runpytest(
        "--cudagraph-trace=trace.csv", "--cudagraph-backend=emulate", "--cudagraph-verify", "-s"
    )
    result.assert_outcomes(passed=1 if caught else 2, failed=1 if caught else 0)
    result.stdout.fnmatch_lines([f"*trace={pytester.path / 'trace.csv'} (*batch shapes)*"])
    if caught:
        result.stdout.fnmatch_lines(["*real_batches*", "*real rows*eager on the unpadded batch*"])
    else:
        result.stdout.fnmatch_lines(["*REAL 2*"])  # the two distinct shapes, one a graph each


def test_without_a_trace_the_sweep_runs_and_the_shapes_fixture_skips(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, verify_imported: None
) -> None:
    isolate_plugins(monkeypatch)
    pytester.makepyfile(test_leak=LEAK)
    result = pytester.runpytest("--cudagraph-backend=emulate")
    result.assert_outcomes(failed=1, skipped=1)  # the sweep has 3 tokens in the graph of 4


def test_a_bad_trace_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_plugins(monkeypatch)
    pytester.makepyfile(test_leak=LEAK)
    (pytester.path / "trace.csv").write_text("num_tokens,num_reqs\n2,2\n2,3\n")
    result = pytester.runpytest("--cudagraph-trace=trace.csv")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cudagraph-trace*line 3: num_reqs (3) exceeds num_tokens (2)*"])


def test_the_dispatch_check_holds_every_trace_batch_to_the_properties() -> None:
    from types import SimpleNamespace

    from pytest_cudagraph.checks.dispatch import dispatch_properties

    plan = CapturePlan(CaptureConfig(capture_sizes=[1, 2, 4, 8], max_num_reqs=8, mode="FULL_AND_PIECEWISE"))
    odd = Batch(num_tokens=5, num_reqs=3, max_query_len=3)

    def dispatch(**batch: object) -> object:
        desc = plan.dispatch(**batch)  # type: ignore[arg-type]
        # The bug: this one shape gets the graph of 4 tokens, too small for it.
        return plan.dispatch(num_reqs=3, num_tokens=4) if Batch(**batch) == odd else desc  # type: ignore[arg-type]

    manager = SimpleNamespace(plan=plan, captured_descriptors=plan.descriptors, dispatch=dispatch)
    assert dispatch_properties(manager, max_examples=1).passed  # type: ignore[arg-type]
    outcome = dispatch_properties(manager, max_examples=1, trace_batches=[odd])  # type: ignore[arg-type]
    assert not outcome.passed and "tokens=5" in outcome.message


def test_the_command_survives_a_reader_that_stops_early(tmp_path: Path) -> None:
    """``cudagraph-plan TRACE | head -3``: no traceback, and the JSON is written all the same."""
    trace = _jsonl(tmp_path / "t.jsonl", LINES)
    out = tmp_path / "out.json"
    done = subprocess.run(
        f"{sys.executable} -m pytest_cudagraph.plan_trace {trace} --max-graphs 2 --json {out} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.stdout.startswith("trace ") and done.stdout.count("\n") == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert json.loads(out.read_text())["suggested_capture_sizes"] == [7, 20]


def test_no_ladder_when_no_batch_can_be_graphed_and_a_bom_is_no_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_bytes("\ufeffnum_tokens,num_reqs\n5,2\n9,3\n".encode())  # Excel's "CSV UTF-8"
    assert read_trace(trace).batches == 2
    # FULL_DECODE_ONLY graphs no mixed batch: the analysis is printed, and no ladder is made up.
    assert main([str(trace), "--mode", "FULL_DECODE_ONLY", "--max-graphs", "2"]) == 0
    text = capsys.readouterr().out
    assert "FULL_DECODE_ONLY runs mixed batches eagerly" in text and "no ladder to suggest" in text
    broken = tmp_path / "t.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"num_tokens": 1, "num_reqs": 1}\n' * 50)[:-12] + b"garbage!")
    with pytest.raises(TraceError, match="cannot be read"):
        read_trace(broken)


SPEC_TRACE = Path(__file__).resolve().parents[1] / "examples" / "speculative_trace.csv"


def test_the_plan_command_takes_several_decode_query_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    base = [str(SPEC_TRACE), "--capture-sizes", "1,2,4,8", "--max-num-reqs", "4", "--decode-query-len", "4"]
    assert main(base) == 0
    one = capsys.readouterr().out
    assert main([*base, "--decode-query-lens", "1,2,3,4"]) == 0
    several = capsys.readouterr().out
    assert "(lengths [1, 2, 3, 4]), 14 graphs" in several and "6 graphs" in one

    def full(out: str) -> int:
        return int(next(line for line in out.splitlines() if line.strip().startswith("FULL")).split()[1])

    # Decode batches of shorter lengths now replay their own FULL graphs instead of PIECEWISE ones.
    assert full(several) > full(one)
    assert main([*base, "--decode-query-lens", "1,5"]) == 2
    assert (
        "decode_query_lens must hold query lengths between 1 and decode_query_len (4"
        in capsys.readouterr().err
    )


def test_a_decode_batch_of_a_length_not_captured_says_which_lengths_are() -> None:
    plan = CapturePlan(
        CaptureConfig(
            capture_sizes=(2, 4),
            max_num_reqs=2,
            mode="FULL_DECODE_ONLY",
            decode_query_len=4,
            decode_query_lens=(2, 4),
        )
    )
    reason = fallback_reason(plan, Batch(num_tokens=3, num_reqs=1, uniform_token_count=3, max_query_len=3))
    assert reason == (
        "a uniform decode batch of 3 tokens a request, a length the plan captures no decode graph "
        "for (decode_query_lens [2, 4])"
    )
    # A length it captures is served by its own graph.
    assert plan.dispatch_batch(
        Batch(num_tokens=4, num_reqs=2, uniform_token_count=2, max_query_len=2)
    ).is_graphed


def test_the_plan_command_says_which_fields_it_did_not_find_and_what_it_assumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("num_tokens,num_reqs\n4,4\n8,8\n3,1\n")
    assert main([str(trace), "--capture-sizes", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "fields not found: uniform_token_count, max_query_len, num_active_loras; assumed:" in out
    assert (
        "uniform_token_count: no batch is known to be a uniform decode batch; the FULL uniform decode graphs "
        "serve none of them, and PIECEWISE graphs serve them as mixed batches"
    ) in out
    assert read_trace(SPEC_TRACE).missing_fields == ("num_active_loras",)


def test_an_output_into_a_missing_folder_is_a_message_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(SPEC_TRACE), "--json", str(tmp_path / "nope" / "p.json")]) == 2
    err = capsys.readouterr().err
    assert f"--json {tmp_path / 'nope' / 'p.json'}: the folder {tmp_path / 'nope'} does not exist" in err


def test_every_usage_error_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """Usage errors exit 2 everywhere, argparse's and the command's own alike."""
    import builtins

    trace = _jsonl(tmp_path / "t.jsonl", LINES)
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "__import__", no_matplotlib)
        assert main([str(trace), "--max-graphs", "2", "--plot", str(tmp_path / "p.png")]) == 2
    assert "cudagraph-plan: error: --plot needs matplotlib" in capsys.readouterr().err
    assert main([str(trace), "--max-graphs", "2", "--estimate-memory"]) == 2
    assert "--estimate-memory needs --module" in capsys.readouterr().err
    assert (
        main(
            [str(trace), "--max-graphs", "2", "--estimate-memory", "--module", "nope", "--make-inputs", "x:y"]
        )
        == 2
    )
    assert "--module must be PKG.MOD:NAME" in capsys.readouterr().err
