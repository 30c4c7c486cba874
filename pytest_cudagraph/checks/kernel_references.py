"""Each reference the user handed in, held against its kernel before it stands in for it.

A reference that does not compute what its kernel computes would hold the module to another
computation: a false alarm where it differs at some shapes, a missed bug where it hides one. So
before ``padded_size`` lets it stand in, one forward of the module in its own precision (at the
largest capture size: a kernel at one token can hide a wrong scale or mask) records the first
``CALLS_HELD`` calls of each kernel, their arguments and results, and the reference is run on the
same arguments in float64 (its ops raised as in the reference run). The kernel's result must be
within its own precision's rounding of it: ``AGREEMENT_CAP`` times the floor measured by running
the reference with noise of one unit roundoff of the kernel's precision at every op (the same
measure ``padded_size``'s floor takes), never less than that unit roundoff. What the kernel wrote
into its arguments (an output buffer, a cache) is held the same way.

A kernel never called in that forward is said so: its reference neither was held nor stands in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import faults
from ..manager import tree
from ..observe import unit_roundoff
from ..precision import raised
from ..references import Entry, References, redirected
from ..units import counted
from .compare import leaves
from .module_state import clone_tree
from .reference import LeafDifference, leaf_differences
from .report import Outcome

__all__ = [
    "AGREEMENT_CAP",
    "CALLS_HELD",
    "CHECK",
    "NO_FLOAT64_QUESTION",
    "Agreement",
    "KernelCall",
    "held",
    "hold",
    "outcome",
    "spied",
    "summarized",
]

#: The note of a verification that asks no float64 question (``verify_runner``, ``verify_training``).
NO_FLOAT64_QUESTION = (
    "{where} asks no float64 question (it holds {what} to eager in the module's own precision): the references "
    "handed in were held against their kernels, and stand in for nothing"
)

#: The outcomes' check name: not a selectable check, the precondition of ``padded_size``'s references.
CHECK = "references"
#: Calls of each kernel held against its reference (the first ones of the forward).
CALLS_HELD = 4
#: How far a kernel's result may be from its reference's, in floors of the kernel's own precision.
#: The correct references sit well inside it (2026-12-05): bf16 causal attention 1.5e-3 off its
#: SDPA reference against a floor of 6.7e-3 on the CPU and 6.9e-3 on an H200's fused kernel; a bf16
#: Triton RMSNorm 3.3e-3 against 7.1e-3 in Triton's interpreter (which rounds its store toward zero)
#: and 1.7e-3 against 7.7e-3 compiled on the H200. A reference off by twice the limit (about 3 % on
#: these kernels) is caught and one off by an eighth of it passes (tests/test_references.py).
AGREEMENT_CAP = 2.0


@dataclass
class KernelCall:
    """One call of a kernel in the module's own forward: its arguments as they were, its result, and
    the arguments it wrote, as it left them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    #: Where each argument the kernel wrote sits ("args[2]", "kwargs['out']"), with its value after.
    written: dict[str, torch.Tensor] = field(default_factory=dict)


def _tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    found = [(f"args[{i}]", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return found + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


def _changed(
    before: list[tuple[str, torch.Tensor]], after: list[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    out = {}
    for (where, b), (_, a) in zip(before, after, strict=True):
        if a.shape == b.shape and a.dtype == b.dtype and not torch.equal(a.detach(), b):
            out[where] = a.detach().clone()
    return out


class _Recorder:
    def __init__(self) -> None:
        self.calls: dict[str, list[KernelCall]] = {}

    def call(
        self, entry: Entry, kernel: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        held = self.calls.setdefault(entry.name, [])
        if len(held) >= CALLS_HELD:
            return kernel(*args, **kwargs)
        before_args, before_kwargs = clone_tree(tuple(args)), clone_tree(dict(kwargs))
        out = kernel(*args, **kwargs)
        written = _changed(_tensors_in(before_args, before_kwargs), _tensors_in(tuple(args), dict(kwargs)))
        held.append(KernelCall(before_args, before_kwargs, clone_tree(out), written))
        return out


class _Spy(TorchDispatchMode):
    """Records the calls of the custom ops ``references`` names as the dispatcher hands them over."""

    def __init__(self, references: References, recorder: _Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.references, self.recorder = references, recorder
        self._found: dict[Any, Entry | None] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._found:
            entry = self._found[func]
        else:
            entry = self._found[func] = self.references.for_op(func)
        if entry is None:
            return func(*args, **kwargs)
        return self.recorder.call(entry, func, tuple(args), dict(kwargs))


def spied(references: References, run: Callable[[], Any]) -> dict[str, list[KernelCall]]:
    """``run()`` (a forward in the module's own precision) with the first calls of each kernel
    ``references`` names recorded, by the kernel's name."""
    recorder = _Recorder()
    spy = _Spy(references, recorder) if references.ops else contextlib.nullcontext()
    with redirected(references.functions, recorder.call), spy:
        run()
    return recorder.calls


@dataclass
class Agreement:
    """How one kernel's calls compared with its reference's results in float64."""

    entry: Entry
    calls: int = 0
    #: The largest relative rms of a result leaf off the reference, its floor and limit there.
    relative: float = 0.0
    floor: float = 0.0
    limit: float = 0.0
    #: Where it was worst: the call, its arguments' shapes, the leaf; and why it cannot pass ("" if it can).
    where: str = ""
    why: str = ""
    precision: str = ""
    #: The worst leaf's difference (its index and the two values there).
    largest: LeafDifference | None = None

    @property
    def ok(self) -> bool:
        return not self.why and self.relative <= self.limit

    def figures(self) -> dict[str, Any]:
        return {
            "op": self.entry.name,
            "reference": self.entry.fn_name,
            "calls": self.calls,
            "relative_rms": self.relative,
            "floor": self.floor,
            "limit": self.limit,
            "precision": self.precision,
        }


def _shapes(call: KernelCall) -> str:
    return ", ".join(
        f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
        for _, t in _tensors_in(call.args, call.kwargs)
    )


def _results(
    fn: Callable[..., Any], call: KernelCall, *, noise: float, seed: int
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The reference on the call's arguments (copies) in float64, and the arguments it wrote where the
    kernel wrote."""
    args, kwargs = clone_tree(call.args), clone_tree(call.kwargs)
    with raised(noise=noise, seed=seed):
        out = fn(*args, **kwargs)
    placed = dict(_tensors_in(args, kwargs))
    return out, {where: placed[where] for where in call.written}


def _lowest(call: KernelCall) -> torch.dtype | None:
    """The least precise floating dtype among the kernel's results and what it wrote."""
    dtypes = [
        t.dtype
        for t in (*tree.leaves(call.out), *call.written.values())
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return max(dtypes, key=unit_roundoff, default=None)


def hold(entry: Entry, calls: list[KernelCall], seed: int) -> Agreement:
    """``entry``'s reference against the kernel's recorded ``calls`` (see the module's docstring)."""
    found = Agreement(entry, calls=len(calls))
    for i, call in enumerate(calls):
        at = f"call {i + 1} of {len(calls)} held, arguments {_shapes(call)}"
        dtype = _lowest(call)
        u = unit_roundoff(dtype) if dtype is not None else 0.0
        found.precision = str(dtype).replace("torch.", "") if dtype is not None else "exact"
        try:
            exact, exact_written = _results(entry.fn, call, noise=0.0, seed=seed)
            noisy, noisy_written = (
                _results(entry.fn, call, noise=u, seed=seed) if u else (exact, exact_written)
            )
        except Exception as exc:
            first = faults.described(exc).strip().splitlines()[0]  # "ValueError: ...", out of memory told
            found.where, found.why = at, f"the reference raises on the kernel's arguments ({first})"
            return found
        pairs = [("the result", call.out, exact, noisy)] + [
            (
                f"{where} as the kernel wrote it",
                call.written[where],
                exact_written[where],
                noisy_written[where],
            )
            for where in call.written
        ]
        for what, kernel_out, ref_out, ref_noisy in pairs:
            shape_why = _shape_mismatch(kernel_out, ref_out)
            if shape_why:
                found.where, found.why = f"{at}, {what}", shape_why
                return found
            floors = {d.path: d.relative for d in leaf_differences(ref_noisy, ref_out)}
            for d in leaf_differences(kernel_out, ref_out):
                leaf = f"{what}{d.path and ' ' + d.path}"
                if d.why:
                    found.where, found.why = f"{at}, {leaf}", d.why
                    return found
                floor = max(floors.get(d.path, 0.0), u)
                limit = AGREEMENT_CAP * floor
                if found.limit == 0.0 or d.relative / limit > found.relative / found.limit:
                    found.relative, found.floor, found.limit, found.where = (
                        d.relative,
                        floor,
                        limit,
                        f"{at}, {leaf}",
                    )
                    found.largest = d
    return found


def _shape_mismatch(kernel_out: Any, ref_out: Any) -> str:
    kernel_leaves, ref_leaves = dict(leaves(kernel_out)), dict(leaves(ref_out))
    for path, k in kernel_leaves.items():
        r = ref_leaves.get(path)
        if not isinstance(k, torch.Tensor):
            continue
        if not isinstance(r, torch.Tensor):
            return f"the reference returns {type(r).__name__} where the kernel returns a tensor{path and ' at ' + path}"
        if tuple(k.shape) != tuple(r.shape):
            return f"the reference returns shape {list(r.shape)} where the kernel returns {list(k.shape)}{path and ' at ' + path}"
    return ""


def outcome(agreement: Agreement, tokens: int) -> Outcome:
    """The agreement as an outcome of ``references`` (no descriptor: it concerns the module)."""
    entry = agreement.entry
    forward = f"one forward of {counted(tokens, 'token')} in the module's own precision"
    if not agreement.calls:
        return Outcome(
            CHECK,
            None,
            True,
            f"the module did not call {entry.name} in {forward}, so its reference was not held against it",
            skipped=True,
            figures={"op": entry.name, "reference": entry.fn_name, "calls": 0},
            detail=f"the reference {entry.fn_name} stands in for {entry.name} only where the module calls it; "
            "check that the key names what the module calls (a custom op by object, packet, overload or "
            "'ns::name'; a Python function the module reaches)",
        )
    figures = agreement.figures()
    if agreement.ok:
        return Outcome(CHECK, None, True, figures=figures)
    if agreement.why:
        how = agreement.why
    else:
        how = (
            f"differs by {agreement.relative:.2g} (relative rms, the kernel's {agreement.precision} result against "
            f"the reference's in float64), where {agreement.precision}'s rounding moves it by {agreement.floor:.2g} "
            f"(the floor: the reference with noise of one unit roundoff of {agreement.precision} at every op); "
            f"the limit is {AGREEMENT_CAP:g}x that, {agreement.limit:.2g}"
        )
    largest = agreement.largest
    at = ""
    if largest is not None and largest.index is not None and not agreement.why:
        at = f"; largest at index {list(largest.index)}: the kernel {largest.got:.6g}, the reference {largest.expected:.6g}"
    message = (
        f"the reference for {entry.name} ({entry.fn_name}) disagrees with the kernel: on the verification's "
        f"inputs ({forward}; {agreement.where}) it {how}{at}. A reference must compute what the kernel computes "
        "(its arguments, its results, what it writes): fix it, or the kernel; padded_size does not run with it"
    )
    return Outcome(CHECK, None, False, message, figures=figures)


def held(references: References, run: Callable[[], Any], tokens: int, seed: int) -> list[Outcome]:
    """Each of ``references`` held against its kernel on the calls ``run()`` (one forward of
    ``tokens`` tokens in the module's own precision) makes: an outcome of ``references`` each."""
    calls = spied(references, run)
    return [outcome(hold(e, calls.get(e.name, []), seed), tokens) for e in references.entries]


def summarized(
    references: References, outcomes: list[Outcome], stood_in: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Each reference as the JSON report gives it: the kernel, the reference, how it held against
    the kernel (``outcomes``), whether it stood in for it in the float64 reference (``stood_in``)."""
    by_op = {o.figures["op"]: o for o in outcomes if o.check == CHECK}
    out = []
    for entry in references.entries:
        found = by_op.get(entry.name)
        status = (
            "not held"
            if found is None
            else "skipped"
            if found.skipped
            else "agrees"
            if found.passed
            else "disagrees"
        )
        figures = dict(found.figures) if found is not None else {}
        out.append(
            {
                **figures,
                "op": entry.name,
                "reference": entry.fn_name,
                "held": status,
                "stood_in": entry.name in stood_in,
            }
        )
    return out
