"""Where shapes and values decide whether a CUDA capture holds an op: the GPU's answers.

The capturability table keys a verdict on an op and the kinds of its arguments. For a few ops
CUDA's answer turns on more than kinds: ``torch.equal`` returns early on tensors of two shapes
and reads its answer back otherwise; ``isin`` sorts (and syncs) or compares by brute force
after a size heuristic; LU takes cuSOLVER or MAGMA by shape and batch; ``one_hot`` reads its
class count from the data when it is not given; ``segment_reduce`` syncs on lengths but not on
offsets. The guard's value rules (``capturability.VALUE_RULES``) say which; this script holds
them to the GPU::

    python scripts/value_rules.py probe --out docs/data/capturability_h200_value_rules.json   # on a GPU

runs every call of ``CALLS`` eagerly and then under a raw ``torch.cuda.CUDAGraph`` capture
and writes whether the capture held. ``tests/test_capturability.py`` runs the same calls on
the emulator and requires its answers to be the GPU's, call for call.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CALLS", "build"]

Build = Callable[[torch.device], tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]


def _floats(*shape: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(shape, generator=gen).to(device)


def _equal(a: tuple[int, ...], b: tuple[int, ...] | None, dtype: torch.dtype = torch.float32) -> Build:
    """``torch.equal`` of two tensors of shapes ``a`` and ``b`` (None: the same tensor twice)."""

    def build(device: torch.device) -> Any:
        x = _floats(*a, device=device).gt(0) if dtype == torch.bool else _floats(*a, device=device)
        y = x if b is None else (x.clone() if b == a else torch.zeros(b, dtype=dtype, device=device))
        return torch.equal, (x, y), {}

    return build


def _isin(n: int | None, k: int | None, assume_unique: bool = False) -> Build:
    """``torch.isin`` of ``n`` elements in ``k`` test elements (None: a Python number)."""

    def build(device: torch.device) -> Any:
        elements: Any = 3 if n is None else torch.arange(n, device=device) % 7
        tests: Any = 3 if k is None else torch.arange(k, device=device) * 2
        return torch.isin, (elements, tests), {"assume_unique": assume_unique}

    return build


def _lu(fn: Callable[..., Any], *shape: int) -> Build:
    def build(device: torch.device) -> Any:
        a = _floats(*shape, device=device) + 3 * torch.eye(shape[-2], shape[-1], device=device)
        return fn, (a,), {}

    return build


def _one_hot(shape: tuple[int, ...], num_classes: int) -> Build:
    def build(device: torch.device) -> Any:
        labels = (torch.arange(shape[0] if shape else 1, device=device) % 4).reshape(shape)
        return torch.nn.functional.one_hot, (labels, num_classes), {}

    return build


def _segment_reduce(by: str, unsafe: bool, reduce: str = "sum", rows: int = 5) -> Build:
    def build(device: torch.device) -> Any:
        data = _floats(rows, device=device)
        lengths = torch.tensor([2, 0, rows - 3, 1], device=device)
        given = lengths if by == "lengths" else torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return torch.segment_reduce, (data, reduce), {by: given, "unsafe": unsafe}

    return build


#: Every call the GPU answers for the value rules: a label and how to build it on a device.
CALLS: dict[str, Build] = {
    "equal [5] [5]": _equal((5,), (5,)),
    "equal [5] itself": _equal((5,), None),
    "equal [] []": _equal((), ()),
    "equal bool [] []": _equal((), (), torch.bool),
    "equal bool [5] []": _equal((5,), (), torch.bool),
    "equal [5] []": _equal((5,), ()),
    "equal [2, 3] [3, 2]": _equal((2, 3), (3, 2)),
    "equal [0] [0]": _equal((0,), (0,)),
    **{
        f"isin {n} in {k}{' unique' if u else ''}": _isin(n, k, u)
        for n, k, u in (
            (20, 5, False),
            (5, 20, False),
            (5, 20, True),
            (100, 18, False),
            (100, 19, False),
            (1, 9, False),
            (1, 10, False),
            (0, 30, False),
            (None, 9, False),
            (None, 10, False),
            (20, None, False),
        )
    },
    **{
        f"{fn.__name__} {list(shape)}": _lu(fn, *shape)
        for fn in (torch.linalg.lu_factor_ex, torch.linalg.lu)
        for shape in (
            (5, 5),
            (3, 5),
            (6, 5),
            (2, 5, 5),
            (16, 16),
            (17, 16, 16),
            (2, 17, 17),
            (16, 17, 17),
            (17, 17, 17),
            (16, 128, 128),
            (2, 129, 129),
            (600, 600),
        )
    },
    "one_hot [5] 10": _one_hot((5,), 10),
    "one_hot [5] -1": _one_hot((5,), -1),
    "one_hot [] 10": _one_hot((), 10),
    "one_hot [] -1": _one_hot((), -1),
    **{
        f"segment_reduce {by}{' unsafe' if unsafe else ''} {reduce}": _segment_reduce(by, unsafe, reduce)
        for by in ("lengths", "offsets")
        for unsafe in (False, True)
        for reduce in ("sum", "max")
    },
}


def build(label: str, device: torch.device) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The call ``label`` names, with its tensors on ``device``."""
    return CALLS[label](device)


def _learning_script() -> Any:
    """scripts/capturability.py, whose way out of a failed capture (``_recover``) and wording of an
    error (``_first_line``) the probe shares."""
    spec = importlib.util.spec_from_file_location(
        "capturability_script", Path(__file__).with_name("capturability.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _captured_on_cuda(label: str, stream: torch.cuda.Stream, learning: Any) -> dict[str, Any]:
    fn, args, kwargs = build(label, torch.device("cuda"))
    with torch.no_grad():
        try:
            fn(*args, **kwargs)
            torch.cuda.synchronize()
        except Exception as exc:
            return {"eager_error": learning._first_line(exc)}
        graph = torch.cuda.CUDAGraph()
        error: BaseException | None = None
        with torch.cuda.stream(stream):
            graph.capture_begin()
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                error = exc
            try:
                graph.capture_end()
            except Exception as exc:
                error = error or exc
    if error is None:
        return {"captured": True}
    del graph
    learning._recover(stream)
    return {"captured": False, "error": learning._first_line(error)}


def probe(out: Path) -> None:
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    learning = _learning_script()
    results = {label: _captured_on_cuda(label, stream, learning) for label in CALLS}
    record = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "calls": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    for label, result in results.items():
        print(f"{label:40} {result}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("probe").add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    probe(args.out)


if __name__ == "__main__":
    main()
