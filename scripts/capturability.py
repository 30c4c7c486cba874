"""Learn which ATen ops a CUDA graph capture holds, from PyTorch's OpInfo samples.

    python scripts/capturability.py learn --out cases.jsonl [--jobs 8] [--samples 4]   # on a GPU
    python scripts/capturability.py table cases.jsonl [--out pytest_cudagraph/data/capturability.json]
    python scripts/capturability.py agree cases.jsonl [--before]                       # the emulator, on the CPU

OpInfo needs ``expecttest`` (``pip install expecttest``).

``learn`` runs every OpInfo's float32 samples (function and in-place
variants; the first ``--samples`` of each) on the GPU: eagerly once, then
captured into a raw ``torch.cuda.CUDAGraph`` under a dispatch mode that
records every ATen op and the pattern of its arguments
(``pytest_cudagraph.capturability.pattern``). A capture that fails names the
op it was running. A function variant that captured is replayed on refilled
inputs and compared with eager on them. Each case is one JSON line; workers
run slices of the ops side by side, and a worker that dies (a sticky CUDA
error) is started again after the op it died in.

``table`` turns the cases into the shipped table; ``agree`` captures the same
samples with the emulator (its guard as the package ships it, or with
``--before`` without the table) and prints how often it agrees with CUDA on
capture and on replay.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import json
import os
import re
import subprocess
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_cudagraph.capturability import DEPENDS, HELD, REFUSED, TABLE_PATH, Table, Verdict, pattern


def _op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def _variants(info: Any) -> list[tuple[str, Any]]:
    found = [("function", info.op)]
    if getattr(info, "inplace_variant", None) is not None:
        found.append(("inplace", info.inplace_variant))
    return found


def _dtypes(info: Any, device: str) -> list[torch.dtype]:
    """float32 where the op takes it (else the first of a few others), and bool where it takes it:
    a boolean tensor is a mask to some ops and plain data to others."""
    supported = info.supported_dtypes(device)
    first = next(
        (
            d
            for d in (torch.float32, torch.int64, torch.int32, torch.bfloat16, torch.float16)
            if d in supported
        ),
        None,
    )
    return [
        d
        for d in (first, torch.bool)
        if d is not None and d in supported and (d is not torch.bool or first is not torch.bool)
    ]


def _unseeded() -> None:
    """OpInfo's random ops call torch.manual_seed inside the call (``wrapper_set_seed``), which a
    capture refuses: what is learned is the op's, so the wrapper calls the op alone."""
    from torch.testing._internal import common_methods_invocations as cmi

    cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)


def _samples(info: Any, device: str, limit: int, dtype: torch.dtype = torch.float32) -> list[Any]:
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = []
            for sample in info.sample_inputs(device, dtype, requires_grad=False):
                out.append(sample)
                if len(out) >= limit:
                    break
            return out
    except Exception:
        return []


def _call(fn: Any, sample: Any) -> Any:
    return fn(sample.input, *sample.args, **sample.kwargs)


def _signature(sample: Any) -> str:
    """Shapes and dtypes of a sample's tensors: which samples of two torch versions are the same."""
    parts = []
    for v in tree_flatten((sample.input, sample.args, sample.kwargs))[0]:
        if isinstance(v, torch.Tensor):
            parts.append(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
        elif isinstance(v, (bool, int, float, complex)):
            parts.append(repr(v))
    return ";".join(parts)


class _Seen(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every ATen op and its pattern; ``running`` is the innermost op not yet returned."""

    def __init__(self, is_host: Any = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.is_host = is_host
        self.ops: list[tuple[str, str]] = []
        self.running: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        key = (str(func), pattern(args, kwargs, self.is_host))
        self.ops.append(key)
        self.running.append(key)
        out = func(*args, **kwargs)
        self.running.pop()
        return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _floats(sample: Any) -> list[torch.Tensor]:
    return [
        t
        for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
    ]


def _refill(sample: Any, seed: int) -> None:
    """New values of the same signs and scale: a small random stretch of each element."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for t in _floats(sample):
        stretch = 1 + 0.1 * torch.rand(t.shape, generator=gen)
        t.copy_((t.cpu() * stretch).to(t.device))


def _same(a: Any, b: Any) -> bool:
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_floating_point() or x.is_complex():
                if not torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True):
                    return False
            elif not torch.equal(x, y):
                return False
        elif x != y and not (isinstance(x, float) and x != x and y != y):
            return False
    return True


def _copy_out(out: Any) -> Any:
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in tree_flatten(out)[0]]


# -- learn (GPU) ---------------------------------------------------------------------
def _recover(stream: torch.cuda.Stream) -> None:
    """After a failed capture: the generator leaves capture mode through an empty capture."""
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        empty = torch.cuda.CUDAGraph()
        with torch.cuda.graph(empty, stream=stream):
            pass


def _cuda_case(fn: Any, sample: Any, variant: str, stream: torch.cuda.Stream) -> dict[str, Any]:
    tensors = [
        v for v in tree_flatten((sample.input, sample.args, sample.kwargs))[0] if isinstance(v, torch.Tensor)
    ]
    case: dict[str, Any] = {
        "signature": _signature(sample),
        "host_positions": [i for i, t in enumerate(tensors) if t.device.type == "cpu"],
    }
    try:
        with torch.no_grad():
            _call(fn, sample)
        torch.cuda.synchronize()
    except Exception as exc:
        case["eager_error"] = _first_line(exc)
        return case
    seen = _Seen(lambda t: t.device.type == "cpu")
    graph = torch.cuda.CUDAGraph()
    error: BaseException | None = None
    out = None
    torch.cuda.synchronize()
    with torch.no_grad(), torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with seen:
                out = _call(fn, sample)
        except Exception as exc:
            error = exc
        try:
            graph.capture_end()
        except Exception as exc:
            error = error or exc
    case["ops"] = sorted(set(seen.ops))
    case["captured"] = error is None
    if error is not None:
        case["error"] = _first_line(error)
        # OpInfo's random ops call torch.manual_seed inside the call (wrapper_set_seed), which a
        # capture refuses: the sample's doing, not the op's.
        case["reseeds"] = "set_current_seed" in case["error"]
        case["failed_op"] = seen.running[-1] if seen.running else None
        del graph
        _recover(stream)
        return case
    if variant == "function":
        case.update(_replayed(fn, sample, graph.replay, lambda: out, torch.cuda.synchronize))
    return case


def _replayed(fn: Any, sample: Any, replay: Any, output: Any, synchronize: Any = None) -> dict[str, Any]:
    """Replay on refilled inputs against eager on them: ``{"replay_ok": ...}`` or the error."""
    try:
        _refill(sample, 1)
        replay()
        if synchronize is not None:
            synchronize()
        got = _copy_out(output())
        with torch.no_grad():
            want = _copy_out(_call(fn, sample))
        return {"replay_ok": _same(got, want)}
    except Exception as exc:
        return {"replay_error": _first_line(exc)}


def _cpu_ops(fn: Any, sample: Any) -> list[tuple[str, str]] | None:
    """The ops the same call runs on the CPU (a CPU kernel may be another overload)."""
    seen = _Seen()
    try:
        with torch.no_grad(), seen:
            _call(fn, sample.transform(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t))
    except Exception:
        return None
    return sorted(set(seen.ops))


def _worker(start: int, stop: int, out: Path, samples: int) -> None:
    _unseeded()
    db = _op_db()
    stream = torch.cuda.Stream()
    with out.open("a") as sink:
        for index in range(start, min(stop, len(db))):
            info = db[index]
            sink.write(json.dumps({"start": index}) + "\n")
            sink.flush()
            for dtype in _dtypes(info, "cuda"):
                for number, sample in enumerate(_samples(info, "cuda", samples, dtype)):
                    for variant, fn in _variants(info):
                        case = {
                            "op": info.name,
                            "variant_test_name": info.variant_test_name,
                            "variant": variant,
                            "dtype": str(dtype).removeprefix("torch."),
                            "sample": number,
                        }
                        case.update(_cuda_case(fn, sample, variant, stream))
                        try:
                            torch.cuda.synchronize()
                        except Exception:
                            # A sticky error: this process learns nothing more; the driver goes on after this op.
                            sink.write(json.dumps({**case, "sticky": True}) + "\n")
                            sink.flush()
                            os._exit(3)
                        if "ops" in case:
                            case["cpu_ops"] = _cpu_ops(fn, sample)
                        sink.write(json.dumps(case) + "\n")
                        sink.flush()
            sink.write(json.dumps({"done": index}) + "\n")
            sink.flush()


def _extras(device: str) -> list[tuple[str, Any, Any]]:
    """Calls models make that OpInfo's samples miss (4-D attention, which takes the CPU's fused
    kernel; indexing by integer and boolean tensors; scans of masks), as (name, fn, sample)."""
    from torch.nn import functional as F
    from torch.testing._internal.opinfo.core import SampleInput

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, device=device) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool, device=device).tril()
    x = torch.randn(5, 4, device=device)
    ids = torch.randint(0, 5, (3,), device=device)
    mask = x[:, 0] > 0
    host_mask = torch.tensor([True, False, True, False, True])
    return [
        ("extra.sdpa", F.scaled_dot_product_attention, SampleInput(q, args=(k, v))),
        (
            "extra.sdpa_causal",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            SampleInput(q, args=(k, v)),
        ),
        (
            "extra.sdpa_bool_mask",
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            SampleInput(q, args=(k, v, causal)),
        ),
        (
            "extra.sdpa_float_mask",
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            SampleInput(q, args=(k, v, torch.zeros(6, 6, device=device).masked_fill(~causal, float("-inf")))),
        ),
        ("extra.index_int", lambda x, i: x[i], SampleInput(x, args=(ids,))),
        ("extra.index_int_2d", lambda x, i: x[i, i % x.shape[1]], SampleInput(x, args=(ids,))),
        ("extra.index_bool", lambda x, m: x[m], SampleInput(x, args=(mask,))),
        ("extra.index_host_bool", lambda x, m: x[m], SampleInput(x, args=(host_mask,))),
        (
            "extra.index_put_int",
            lambda x, i: x.index_put((i,), x[i] * 2),
            SampleInput(x.clone(), args=(ids,)),
        ),
        (
            "extra.index_put_bool",
            lambda x, m: x.index_put((m,), x[:1] * 0 + 1),
            SampleInput(x.clone(), args=(mask,)),
        ),
        ("extra.cumsum_bool", lambda m: m.cumsum(0), SampleInput(mask)),
        ("extra.cumsum_int", lambda i: i.cumsum(0), SampleInput(ids)),
        ("extra.embedding", F.embedding, SampleInput(ids, args=(x,))),
        ("extra.tril_bool", lambda m: m.tril(), SampleInput(causal)),
        (
            "extra.arange_device",
            lambda x: torch.arange(x.shape[0], device=x.device) + x[:, 0],
            SampleInput(x),
        ),
    ]


def _worker_extras(out: Path) -> None:
    stream = torch.cuda.Stream()
    with out.open("a") as sink:
        for name, fn, sample in _extras("cuda"):
            case = {"op": name, "variant_test_name": "", "variant": "function", "sample": 0}
            case.update(_cuda_case(fn, sample, "function", stream))
            if "ops" in case:
                case["cpu_ops"] = _cpu_ops(fn, sample)
            sink.write(json.dumps(case) + "\n")
            sink.flush()


def learn(out: Path, jobs: int, samples: int, limit_s: float) -> None:
    """Run the workers, each on a slice of op_db, restarting one after the op it died in."""
    total = len(_op_db())
    step = -(-total // jobs)
    parts = [out.with_suffix(f".{j}.jsonl") for j in range(jobs)]
    for part in parts:
        part.unlink(missing_ok=True)
    todo = {j: (j * step, min(total, (j + 1) * step)) for j in range(jobs)}
    started = time.monotonic()
    extras = out.with_suffix(".extras.jsonl")
    extras.unlink(missing_ok=True)
    subprocess.run([sys.executable, __file__, "extras", str(extras)], check=False)
    parts.append(extras)
    running: dict[int, subprocess.Popen[bytes]] = {}
    died: list[int] = []
    while todo or running:
        for j, (start, stop) in list(todo.items()):
            if start < stop:
                running[j] = subprocess.Popen(
                    [sys.executable, __file__, "worker", str(start), str(stop), str(parts[j]), str(samples)]
                )
            del todo[j]
        time.sleep(1)
        for j, proc in list(running.items()):
            if proc.poll() is None and time.monotonic() - started < limit_s:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            del running[j]
            if proc.returncode == 0:
                continue
            # Died (or ran past the limit) in the op it started last: go on after it.
            last = -1
            for line in parts[j].read_text().splitlines():
                last = max(last, json.loads(line).get("start", -1))
            died.append(last)
            _, stop = j * step, min(total, (j + 1) * step)
            if time.monotonic() - started < limit_s and last + 1 < stop:
                todo[j] = (last + 1, stop)
    with out.open("w") as sink:
        for part in parts:
            for line in part.read_text().splitlines():
                record = json.loads(line)
                if "op" in record:
                    sink.write(line + "\n")
            part.unlink()
        sink.write(
            json.dumps(
                {
                    "meta": {
                        "torch": torch.__version__,
                        "cuda": torch.version.cuda,
                        "device": torch.cuda.get_device_name(0),
                        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                        "ops_died_in": [_op_db()[i].name for i in died if i >= 0],
                        "seconds": round(time.monotonic() - started, 1),
                    }
                }
            )
            + "\n"
        )


# -- table -----------------------------------------------------------------------------
#: What CUDA, cuBLAS or cuSOLVER say when a capture refuses an op; any other error (an in-place
#: variant's second call on an input the first one reshaped) says nothing of capture.
_CAPTURE_ERRORS = ("captur", "CUDA error", "cusolver", "cublas", "CUBLAS", "CUSOLVER")


# A verdict learned from samples that disagreed names its counts ("refused by 10 of 20 samples").
_MIXED = re.compile(r"refused by \d+ of \d+ samples")


def _is_capture_error(error: str) -> bool:
    return any(marker in error for marker in _CAPTURE_ERRORS)


def _read(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cases, meta = [], {}
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        record = json.loads(line)
        if "meta" in record:
            meta = record["meta"]
        elif "op" in record:
            cases.append(record)
    return cases, meta


def table(cases_path: Path, out: Path) -> Table:
    cases, meta = _read(cases_path)
    held: dict[tuple[str, str], int] = Counter()
    refused: dict[tuple[str, str], list[str]] = defaultdict(list)
    learned = 0
    # Every op a GPU ran in some capture, held or not.
    gpu_ops = {op for case in cases for op, _ in case.get("ops") or ()}
    for case in cases:
        if "captured" not in case or case.get("reseeds"):
            continue
        learned += 1
        if case["captured"]:
            for op, letters in case["ops"]:
                held[(op, letters)] += 1
            # What the CPU runs instead (its own kernels' overloads): held with the call that held.
            cuda_ops = {op for op, _ in case["ops"]}
            for op, letters in case.get("cpu_ops") or ():
                if op not in cuda_ops:
                    held[(op, letters)] += 1
        elif case.get("failed_op") and _is_capture_error(case["error"]):
            op, letters = case["failed_op"]
            refused[(op, letters)].append(case["error"])
            # The ops before it in the capture held up to there. What the CPU runs instead of
            # CUDA's kernels for the op itself (ctc_loss's own CPU op, aten._ctc_loss, where CUDA
            # takes cuDNN's path and copies the lengths to the host) is refused with it, where no
            # GPU ran it. Only the op's own: the ops after the failure never ran on the GPU (a
            # corrcoef refused at its `equal` says nothing of the `clamp` after it).
            own = case["op"].rpartition(".")[2].strip("_")
            for op, letters in case.get("cpu_ops") or ():
                if op not in gpu_ops and own and own in op.split(".")[1]:
                    refused[(op, letters)].append(case["error"])
    ops: dict[str, dict[str, Verdict]] = defaultdict(dict)
    for key in set(held) | set(refused):
        op, letters = key
        if key in refused:
            reason = Counter(refused[key]).most_common(1)[0][0]
            n_held, n_refused = held.get(key, 0), len(refused[key])
            # Shapes or values decide (an empty matrix, tensors of two sizes): the usual answer where
            # it is clear, else not known.
            if n_refused >= n_held:
                kind = REFUSED
            elif n_held >= 9 * n_refused:
                kind = HELD
            else:
                kind = DEPENDS
            counts = f"refused by {n_refused} of {n_held + n_refused} samples" if n_held else ""
            ops[op][letters] = Verdict(kind, f"{reason} ({counts})" if counts else reason)
        else:
            ops[op][letters] = Verdict(HELD, f"held by {held[key]} sample(s)")
    result = Table(
        str(meta.get("torch", "?")),
        str(meta.get("device", "?")),
        str(meta.get("date", "?")),
        learned,
        dict(ops),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.to_json(), indent=0, sort_keys=False) + "\n")
    kinds = Counter(v.kind for patterns in result.ops.values() for v in patterns.values())
    print(
        f"{learned} cases -> {len(result.ops)} ops, {sum(kinds.values())} patterns: {dict(kinds)}; wrote {out}"
    )
    return result


# -- agree (CPU) -----------------------------------------------------------------------
def _emulated_case(fn: Any, sample: Any, variant: str, use_table: bool, host: Any = ()) -> dict[str, Any]:
    from pytest_cudagraph import guard as guard_module
    from pytest_cudagraph.backends.emulate import EmulateBackend
    from pytest_cudagraph.guard import CaptureGuard, ModuleTracker

    case: dict[str, Any] = {}
    try:
        with torch.no_grad():
            _call(fn, sample)
    except Exception as exc:
        case["eager_error"] = _first_line(exc)
        return case
    found: list[Any] = []

    def stop(violation: Any) -> None:
        found.append(violation)
        raise RuntimeError(violation.describe())

    backend = EmulateBackend(torch.device("cpu"))
    tracker = ModuleTracker(torch.nn.Module())
    guard = CaptureGuard(tracker, torch.device("cpu"), on_violation=stop)
    # What the GPU's sample kept on the CPU is, to the emulator, made on the host.
    tensors = [
        v for v in tree_flatten((sample.input, sample.args, sample.kwargs))[0] if isinstance(v, torch.Tensor)
    ]
    for position in host:
        guard.mark_host(tensors[position])
    table_off = contextlib.nullcontext() if use_table else guard_module.no_capturability_table()
    try:
        with table_off:
            graph = backend.capture(lambda: _call(fn, sample), guard)
    except Exception as exc:
        case["captured"] = False
        case["error"] = found[0].describe() if found else _first_line(exc)
        return case
    case["captured"] = True
    case["not_known"] = sorted(tracker.not_known)
    if variant == "function":
        case.update(_replayed(fn, sample, graph.replay, lambda: graph.output))
    return case


def agree(cases_path: Path, use_table: bool, show: int, ops: frozenset[str] = frozenset()) -> None:
    truth, meta = _read(cases_path)
    _unseeded()
    by_key = {
        (c["op"], c["variant_test_name"], c["variant"], c.get("dtype", "float32"), c["sample"]): c
        for c in truth
        if "captured" in c and (not ops or c["op"] in ops)
    }
    counts: Counter[str] = Counter()
    disagree: list[str] = []
    for info, dtype in (
        (i, d)
        for i in _op_db()
        for d in (torch.float32, torch.bool, torch.int64, torch.int32, torch.bfloat16, torch.float16)
    ):
        dname = str(dtype).removeprefix("torch.")
        wanted = [k for k in by_key if k[0] == info.name and k[1] == info.variant_test_name and k[3] == dname]
        if not wanted:
            continue
        samples = _samples(info, "cpu", 1 + max(k[4] for k in wanted), dtype)
        for number, sample in enumerate(samples):
            for variant, fn in _variants(info):
                cuda = by_key.get((info.name, info.variant_test_name, variant, dname, number))
                if cuda is None or cuda["signature"] != _signature(sample):
                    continue
                if cuda.get("reseeds"):
                    counts["reseeding samples left out"] += 1
                    continue
                emu = _emulated_case(fn, sample, variant, use_table, cuda.get("host_positions", ()))
                if "captured" not in emu:
                    continue
                counts["cases"] += 1
                name = (
                    f"{info.name}{'.' + info.variant_test_name if info.variant_test_name else ''} "
                    f"({variant}, {dname})"
                )
                if emu["captured"] == cuda["captured"]:
                    counts["capture agrees"] += 1
                else:
                    side = (
                        "CUDA refuses, the emulator captures" if emu["captured"] else "the emulator refuses"
                    )
                    if _MIXED.search(emu.get("error", "")):
                        # CUDA itself answered both ways for this op and pattern (values decide).
                        counts["capture differs where CUDA's samples of the pattern differ"] += 1
                    disagree.append(f"capture: {name}: {side}: {cuda.get('error') or emu.get('error')}")
                if emu.get("not_known"):
                    counts["not known named"] += 1
                if emu["captured"] and cuda["captured"] and "replay_ok" in cuda:
                    counts["both replayed"] += 1
                    if emu.get("replay_ok") == cuda["replay_ok"]:
                        counts["replay agrees"] += 1
                    else:
                        disagree.append(
                            f"replay: {name}: CUDA {cuda['replay_ok']}, emulator "
                            f"{emu.get('replay_ok', emu.get('replay_error'))}"
                        )
    print(
        f"truth: {meta.get('device')}, torch {meta.get('torch')}, {meta.get('date')}; emulator: torch "
        f"{torch.__version__}, {'with' if use_table else 'without'} the table"
    )
    n, r = counts["cases"], counts["both replayed"]
    print(
        f"cases both sides have: {n}; capture agrees: {counts['capture agrees']} "
        f"({100 * counts['capture agrees'] / max(n, 1):.1f} %); replay agrees: {counts['replay agrees']} of {r} "
        f"({100 * counts['replay agrees'] / max(r, 1):.1f} %); captured with an op named not known: "
        f"{counts['not known named']}"
    )
    mixed = counts["capture differs where CUDA's samples of the pattern differ"]
    print(
        f"of the {n - counts['capture agrees']} capture disagreements, {mixed} are cases of an op and pattern that "
        "CUDA captured for some samples and refused for others (the table keeps the answer of most; values decide)"
    )
    if counts["reseeding samples left out"]:
        print(
            f"left out: {counts['reseeding samples left out']} samples that call torch.manual_seed inside the "
            "call (OpInfo's wrapper for random ops, in cases learned before the wrapper was set aside)"
        )
    for line in disagree[:show]:
        print("  " + line)
    if len(disagree) > show:
        print(f"  ... and {len(disagree) - show} more")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "extras":
        _worker_extras(Path(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _, _, start, stop, out, samples = sys.argv
        _worker(int(start), int(stop), Path(out), int(samples))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("learn")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--limit-s", type=float, default=480)
    p = sub.add_parser("table")
    p.add_argument("cases", type=Path)
    p.add_argument("--out", type=Path, default=TABLE_PATH)
    p = sub.add_parser("agree")
    p.add_argument("cases", type=Path)
    p.add_argument("--before", action="store_true", help="the emulator without the table")
    p.add_argument("--show", type=int, default=40)
    p.add_argument("--ops", default="", help="only these OpInfo names, comma-separated (equal,isin)")
    args = parser.parse_args()
    if args.command == "learn":
        learn(args.out, args.jobs, args.samples, args.limit_s)
    elif args.command == "table":
        table(args.cases, args.out)
    else:
        agree(args.cases, not args.before, args.show, frozenset(filter(None, args.ops.split(","))))


if __name__ == "__main__":
    main()
