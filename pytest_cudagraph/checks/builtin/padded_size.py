"""``padded_size``: does eager compute the real rows the same at the graph's padded size? Bit for bit
where it can, in float64 where it must.

Since issue #67 the question is asked first by the fast route (``padded_fast``): both forwards in the
module's own precision under ``invariant`` (rows padded to one count at both sizes), held to each
other bit for bit and call for call. A batch they settle needs no float64 forward; float64 is asked at
the largest batch always and for every batch the fast route leaves open (``_float64`` below), and
only the first ``DIAGNOSED`` failures are diagnosed in full (``padded_diagnosis``). What follows
describes the float64 route.

A graph captured at N tokens serves real batches of n < N. That it serves
them right is two questions. The graph's real rows equal eager at the padded
shape: the same program, held bit for bit by ``real_batches``. And eager at
the padded shape, cut to the real rows, equals eager on the real batch: a
question about eager alone, which this check asks.

In the module's own precision that question drowns: two bf16 batch shapes of
a Llama-8B differ by several percent (another GEMM tiling, through 32
layers), and a floor measured by running the module at the padded shape holds
the very computation under test, so it grows with it. Here both forwards run
in float64 (``precision.raised``), after the graphs are released, where
rounding moves the logits by about 1e-13, and the limit is measured with the
module at one shape (the same forward with noise of one unit roundoff at every
op whose rounding can differ between shapes), which holds no computation of another shape.

Kernels the dispatcher does not see into (Triton, an extension called
directly) compute in float32 whatever they are handed: the reference finds
them (``launches``) and holds the floor to float32's rounding there. A module
that refuses float64 (a dtype assertion, an extension for float32 alone) runs
in float32 with TF32 off; one that runs in neither (a kernel for bf16 alone)
is said so in the report, and ``real_batches`` then holds it to eager on the
real batch within the floor of its own precision, unless the user hands in a
plain-torch reference for that kernel (``references=``): it stands in for the
kernel here, once ``kernel_references`` has held it against the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from ... import faults, peers
from ...manager import output_rows
from ...manager.types import OutCut, cut_to_real
from ...observe import unit_roundoff
from ...plan import Batch, BatchDescriptor
from ...precision import NoReference, Record, raised
from ...references import References, normalized, registered
from .. import kernel_references
from ..reference import (
    REFERENCE_CAP,
    PendingDifferences,
    Queued,
    Reference,
    leaf_differences,
    pending_differences,
)
from ..registry import Check
from ..report import Outcome
from ..verify_context import VerifyContext, clone_tree
from .padded_diagnosis import DIAGNOSED, _failure, _undiagnosed
from .padded_fast import ROUTE, Fast, fast_pair
from .padded_runs import CHECK, _attempt, _first_line, _limits, _Runs, _worst

__all__ = ["CHECK", "PADDED_SIZE", "padded_size", "prepare_reference", "queue_every_size"]


def prepare_reference(ctx: VerifyContext) -> None:
    """Before capture: whether the module runs in float64 (one forward at the plan's smallest
    shape), so that ``real_batches`` knows whether to leave its cross-shape question here."""
    ref = ctx.reference = Reference()
    # Read first, so that the report lists them ("not held") where no float64 question is asked.
    refs = ref.references = normalized(ctx.options.references).merged_over(registered())
    if ctx.batch_invariant:
        ref.why_not = (
            "batch_invariant=True: real_batches holds the graph to eager on the unpadded batch bit for bit"
        )
        return
    if ctx.observer.random_ops:
        ref.why_not = (
            "the module draws random numbers, which cannot match across shapes draw for draw (the rng check "
            "covers them)"
        )
        return
    if refs:
        ref.held = _hold_references(ctx, refs)
        wrong = [o for o in ref.held if not o.passed]
        if wrong:
            names = ", ".join(o.figures.get("op", "?") for o in wrong)
            ref.why_not = (
                f"the reference for {names} disagrees with its kernel (the references outcome says where and by how "
                "much): the float64 question does not run through a reference that computes something else"
            )
            return
    desc = min(ctx.manager.plan.capture_order, key=lambda d: d.num_tokens)
    batch = ctx.exact_batch(desc)
    refused: list[str] = []
    missing: list[str] = []  # the kernels no reference stood in for
    # float64 first; a forward that cannot run there (an extension that takes float32 alone, a
    # dtype check of its own) in float32 with TF32 off, which still holds bf16 and float16 far
    # below their rounding, and a float32 module to the floor of its own precision at one shape.
    for tier in (torch.float64, torch.float32):
        name = str(tier).replace("torch.", "")
        inputs = ctx.make(batch)
        with ctx.preserved_state():
            ctx.seed_all(ctx.seed)
            try:
                with raised(to=tier, references=refs) as record:
                    ctx.eager_real(inputs, batch, captured_path=False)
            except NoReference as exc:
                refused.append(f"in {name}: {exc}")
                missing.append(exc.op)
                continue
            except Exception as exc:  # the module's own refusal (a dtype check, a kernel for one dtype)
                if faults.is_sticky(exc):
                    raise
                refused.append(f"its forward raises in {name}: {_first_line(exc)}")
                raiser = _raising_function(exc)
                if raiser:
                    missing.append(raiser)
                continue
        ref.record.merge(record)
        ref.tier = name
        ref.float64_refused = "; ".join(refused)
        ref.ready = True
        if refused:
            ctx.notes.append(
                f"padded_size: the module cannot run in float64 ({ref.float64_refused}), so its reference runs "
                "in float32 with TF32 off, held to the floor of that precision at one shape"
            )
        return
    ref.why_not = _no_reference("; ".join(refused)) + _reference_hint(missing)


def _hold_references(ctx: VerifyContext, refs: References) -> list[Outcome]:
    """Each reference against its kernel, on the calls of one forward in the module's own precision
    at the largest capture size (``kernel_references``): outcomes of ``references``."""
    desc = max(ctx.manager.plan.capture_order, key=lambda d: d.num_tokens)
    batch = ctx.exact_batch(desc)
    inputs = ctx.make(batch)
    with ctx.preserved_state():
        ctx.seed_all(ctx.seed)
        return kernel_references.held(
            refs, lambda: ctx.eager_real(inputs, batch, captured_path=False), batch.num_tokens, ctx.seed
        )


def _raising_function(exc: BaseException) -> str:
    """Where the float64 forward raised, as "the Python function module.name": the innermost frame of
    the traceback outside torch and this package (a Triton wrapper's dtype check, say); "" where
    there is none."""
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if module and not module.startswith(("torch", "pytest_cudagraph", "triton")):
            code = tb.tb_frame.f_code
            found = f"the Python function {module}.{getattr(code, 'co_qualname', code.co_name)}"
        tb = tb.tb_next
    return found


def _reference_hint(ops: list[str]) -> str:
    """The sentence that says how to add a reference for each kernel the float64 run could not run."""
    hints = []
    for op in dict.fromkeys(ops):
        if "::" in op and " " not in op:
            key = f"'{op}'"
            what = op
        elif op.startswith("the Python function "):  # where the forward raised: a wrapper's dtype check
            name = op.removeprefix("the Python function ")
            key = name.rsplit(".", 1)[-1]
            what = f"{op} (where the float64 forward raised), if it launches a kernel for bf16 alone"
        else:  # a Triton kernel or memory an extension wrote: the key is the Python function around it
            key = "the Python function that launches it"
            what = op
        hints.append(
            f"for {what}, hand the harness a plain-torch reference (a function that takes the kernel's arguments "
            f"and returns what it returns): references={{{key}: fn}} on verify, the fixture or the cudagraph "
            f"marker, or pytest_cudagraph.register_reference({key}, fn) in a conftest; padded_size then asks its "
            "question in float64 through it"
        )
    return ". To keep the float64 question: " + "; ".join(hints) if hints else ""


def queue_every_size(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> list[BatchDescriptor]:
    """Quick mode's cross-shape question at the sizes it does not capture: for each of ``descs``,
    the most padded real batch it serves, queued for the reference with its padded inputs (one
    eager forward at the padded shape learns how its output is cut; nothing is captured). A
    branch, table or scale keyed on the token count between the smallest and largest size is
    then held to the reference like any other. Returns the descriptors queued; run while the
    static buffers are still there (before the graphs are released)."""
    ref = ctx.reference
    if ref is None or not ref.ready:
        return []
    manager = ctx.manager
    plan = manager.plan
    queued = []
    for desc in descs:
        reqs = manager.capture_reqs(desc)
        batch = next(
            (
                b
                for n in plan.candidate_range(desc)
                if (b := ctx._batch_for(desc, n, reqs)) is not None and plan.dispatch_batch(b) == desc
            ),
            None,
        )
        if batch is None:
            continue  # no real batch dispatches here
        inputs = ctx.make(batch)
        padded = ctx.load(desc, clone_tree(inputs), batch)
        fast, dims = _fast_learning_the_cut(ctx, desc, batch, inputs, padded)
        item = ref.queue(desc, batch, inputs, padded, dims, first=True)
        if item is not None:
            item.fast = fast
            item.outside = ctx.python.outside_now()
        queued.append(desc)
    return queued


def _fast_learning_the_cut(
    ctx: VerifyContext, desc: BatchDescriptor, batch: Batch, inputs: dict[str, Any], padded: dict[str, Any]
) -> tuple[Fast, list[OutCut]]:
    """The fast route's two forwards of a size quick mode does not capture, the padded one also
    learning how the output is cut (the one eager forward the size needed before the fast route)."""
    manager = ctx.manager
    reqs = manager.capture_reqs(desc)
    dims: list[OutCut] = []

    def cut(out: Any) -> Any:
        if not dims:
            dims.extend(
                output_rows.out_dims_like_captured(
                    manager.state.entries, out, desc.num_tokens, reqs, manager.state.probed_rows
                )
            )
        return cut_to_real(out, dims, batch)

    with ctx.preserved_state() as state0, faults.synchronizing(False):
        runs = _Runs(ctx, state0, Record())
        fast = fast_pair(
            runs.under_invariant(lambda: ctx.eager_real(clone_tree(inputs), batch, captured_path=True)),
            runs.under_invariant(lambda: cut(ctx.eager(clone_tree(padded), desc))),
        )
        if not dims:  # the real batch raised alone, before the padded run: learn the cut anyway
            ctx.restore(state0)
            ctx.seed_all(ctx.seed)
            cut(ctx.eager(clone_tree(padded), desc))
    return fast, dims


def padded_size(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> list[Outcome]:
    """Per descriptor: eager at its padded shape, cut to the real rows, against eager on the real
    batch, both in float64, on the real batches ``real_batches`` ran; held to 64 times the floor
    of the float64 reference (the same forward with noise of one unit roundoff at every op whose
    rounding can differ between shapes)."""
    ref = ctx.reference
    if ref is None or not ref.ready:
        why = ref.why_not if ref is not None else "the reference was not prepared"
        return [_skipped(desc, why) for desc in descs]
    if ctx.host_draws():
        why = (
            "the module hands a kernel host numbers that move on every call, so eager cannot match itself "
            "across shapes (the rng check names them)"
        )
        return [_skipped(desc, why) for desc in descs]
    items = [(desc, q) for desc in descs for q in ref.queued.get(desc, [])]
    if not items:
        return [
            _skipped(
                desc, "real_batches queued no real batch for it (it did not run, or no batch dispatches here)"
            )
            for desc in descs
        ]
    outcomes: list[Outcome] = []
    work = [q for desc in descs for q in ref.queued.get(desc, [])]
    with ctx.preserved_state() as state0:
        runs = _Runs(ctx, state0, ref.record)
        # The fast route first: each batch's two forwards in the module's own precision under
        # ``invariant``, bit for bit and call for call; what it settles needs no float64 forward.
        with ctx.phase("the fast route's forwards", None), faults.synchronizing(False):
            fast = {id(q): q.fast if q.fast is not None else runs.fast(q) for q in work}
        with ctx.phase("the fast route's results read", None):
            unsettled = {key: f.read() for key, f in fast.items()}
        # float64 for every batch the fast route did not settle, and for the largest batch always:
        # its floor is measured there, and a computation that the module's own precision rounds
        # away (a scale of 1.001 on bf16 logits) is seen there whatever the fast route saw.
        anchor = max(work, key=lambda q: (q.batch.num_tokens, q.desc.num_tokens))
        # On a rank of several, a batch any rank's fast route left open goes to float64 on every rank:
        # the float64 forwards' collectives pair with the peers'.
        wanted = peers.any_rank([bool(unsettled[id(q)]) or q is anchor for q in work])
        asked = [q for q, want in zip(work, wanted, strict=True) if want]
        deep = _float64(ctx, runs, ref, asked)
        if isinstance(deep, str):
            return [_skipped(desc, deep) for desc in descs]
        read, refused, limits, floors, roundoff, figures_all = deep
        diagnosed: list[str] = []
        for desc in descs:
            queued = ref.queued.get(desc, [])
            if not queued:
                outcomes.append(_skipped(desc, "real_batches queued no real batch for it"))
                continue
            worst_relative, compared, bit_for_bit = 0.0, 0, 0
            failed: Outcome | None = None
            why_not: list[str] = []
            escalated: list[str] = []
            for q in queued:
                if id(q) not in read and id(q) not in refused:
                    bit_for_bit += 1  # settled by the fast route
                    continue
                if unsettled[id(q)]:
                    escalated.append(unsettled[id(q)])
                found = refused.get(id(q)) or read[id(q)]
                if isinstance(found, str):
                    why_not.append(found)
                    continue
                compared += 1
                worst_relative = max([worst_relative, *(d.relative for d in found if not d.why)])
                bad = _worst(found, limits, roundoff)
                if bad is not None:
                    if len(diagnosed) < DIAGNOSED:
                        # The diagnosis compares the two runs with a third: made again, from the same
                        # state and seed (they were not kept while the other batches ran); on a rank of
                        # several, on this rank alone (no peer runs it).
                        with peers.alone():
                            expected, got = runs.real(q), runs.padded(q)
                            failed = _failure(ctx, runs, q, bad, expected, got, limits, floors, roundoff)
                        del expected, got
                        diagnosed.append(desc.label())
                    else:
                        failed = _undiagnosed(ctx, q, bad, limits, floors, roundoff, diagnosed)
                    break
            figures = {
                **(figures_all if compared else {}),
                "relative_rms": worst_relative,
                "batches": compared + bit_for_bit,
                "bit_for_bit": bit_for_bit,
                "float64": compared,
                "route": _route(bit_for_bit, compared, ref.tier),
            }
            if escalated:
                figures["why_float64"] = escalated[0]
            if failed is not None:
                failed.figures.update(figures)
                outcomes.append(failed)
            elif not compared and not bit_for_bit:
                outcomes.append(_skipped(desc, _refused_all({i: w for i, w in enumerate(why_not)})))
            else:
                outcomes.append(Outcome(CHECK, desc, True, figures=figures))
    return outcomes


def _route(bit_for_bit: int, compared: int, tier: str) -> str:
    """Which route the descriptor's verdict took, as the report names it."""
    if compared and bit_for_bit:
        return f"{ROUTE} and {tier}"
    return tier if compared else ROUTE


def _float64(
    ctx: VerifyContext, runs: _Runs, ref: Reference, asked: list[Queued]
) -> str | tuple[dict[int, Any], dict[int, str], dict[str, float], dict[str, float], float, dict[str, Any]]:
    """The float64 route over ``asked``: the floor at the largest batch eager runs, then every batch's
    two forwards; (read differences, refused, limits, floors, roundoff, figures) or why none ran."""
    # The floor, at the largest batch eager runs: the same forward with rounding-sized noise at every op.
    floor_at: Queued | None = None
    exact: Any = None
    refused: dict[int, str] = {}  # id(queued) -> why eager cannot run it
    for q in sorted(asked, key=lambda q: (-q.batch.num_tokens, -q.desc.num_tokens)):
        exact, why = _attempt(partial(runs.real, q), q)
        if why:
            refused[id(q)] = why
            continue
        floor_at = q
        break
    if floor_at is None:
        return _refused_all(refused)
    # The noise of the reference's own precision at every op; an op that holds less (one with no
    # kernel there, a float8 product, a kernel outside the dispatcher) gets its own precision's.
    base = unit_roundoff(getattr(torch, ref.tier))
    roundoff = max(ref.record.roundoff, base)
    noisy = runs.real(floor_at, noise=base)
    floors = {d.path: d.relative for d in leaf_differences(noisy, exact)}
    del noisy
    limits = _limits(floors, roundoff)
    if ref.record.lower or ref.record.quantized or ref.record.described != "float64":
        # Named once per verification, with the precision that holds at each.
        note = f"padded_size's reference: {ref.record.described}"
        if note not in ctx.notes:
            ctx.notes.append(note)
    figures_all = {
        "reference": ref.record.precision,
        "stood_in": list(ref.record.stood_in),
        "floor": max(floors.values(), default=0.0),
        "limit": max(limits.values(), default=REFERENCE_CAP * roundoff),
    }
    # Every batch's two forwards queued one after the other, nothing read off the device in
    # between (no phase waits for it either), so the next forward's Python runs while the device
    # still computes this one; the largest and smallest batches in turn, a forward whose
    # arithmetic outlasts its Python beside one whose Python outlasts its arithmetic. Read once
    # every forward is queued; a failure runs its batch again for the diagnosis.
    pending: dict[int, PendingDifferences | str] = {}
    with faults.synchronizing(False):
        for q in _alternating([q for q in asked if id(q) not in refused]):
            expected, why = (exact, "") if q is floor_at else _attempt(partial(runs.real, q), q)
            got, why = (None, why) if why else _attempt(partial(runs.padded, q), q, padded=True)
            pending[id(q)] = why or pending_differences(got, expected)
            del got, expected
    del exact
    with ctx.phase("the float64 reference's results read", None):
        read = {key: p if isinstance(p, str) else p.read() for key, p in pending.items()}
    return read, refused, limits, floors, roundoff, figures_all


def _alternating(items: list[Queued]) -> list[Queued]:
    """``items`` from the largest and the smallest in turn (by the tokens of their two forwards)."""
    ordered = sorted(items, key=lambda q: -(q.batch.num_tokens + q.desc.num_tokens))
    out = []
    while ordered:
        out.append(ordered.pop(0))
        if ordered:
            out.append(ordered.pop())
    return out


def _refused_all(refused: dict[int, str]) -> str:
    reasons = list(dict.fromkeys(refused.values()))
    return "; ".join(reasons) if reasons else "no real batch could be compared"


def _skipped(desc: BatchDescriptor, why: str) -> Outcome:
    return Outcome(CHECK, desc, True, why, skipped=True)


def _no_reference(why: str) -> str:
    return (
        f"the module cannot run in float64 nor in float32 ({why}), so no reference holds eager across shapes; real_batches "
        "held the graph to eager on the unpadded batch within the floor it measured in the module's own "
        "precision instead, which catches a shape-dependent error only where it is systematic or stands out "
        "of that precision's rounding across shapes (its figures: floor_max in real_batches' outcomes)"
    )


PADDED_SIZE = Check(
    CHECK,
    padded_size,
    scope="after_release",
    prepare=prepare_reference,
    compares="after the graphs are released, eager at each descriptor's padded shape, cut to the real "
    "rows, against eager on the real batch (the most padded batch `real_batches` ran). First by the fast "
    "route: both forwards in the module's own precision on the path a capture takes, every product, "
    "row-wise reduction and attention over queries and keys of one length given its rows padded to a "
    "multiple of 8 (`pytest_cudagraph.invariant`), so the two sizes run one program (a call it does not "
    "pad, `einsum`, a custom op, a Triton kernel, passes as it is); a batch whose outputs agree bit for "
    "bit, whose forwards made the same torch calls with the same float, bool and string arguments (a "
    "scale that rounds away in bf16 still adds a call) and whose padded calls kept their rows "
    "independent (each checked once per process with half its rows zeroed) is settled there. Then in "
    "float64, "
    "for the largest batch always (its floor is measured there) and every batch the fast route left open "
    "(the report gives the count of each and why a batch was asked): "
    "every float16, bfloat16 and float32 op of the forward raised as it runs, weights converted as "
    "they are read (no copy of the model), float32 with TF32 off for an op with no float64 kernel. "
    "Kernels outside torch's dispatcher are found and held to the precision they keep: a Triton launch "
    "runs on the raised tensors (in float32 where it takes no float64), memory an extension wrote is "
    "found when it is read, and what they wrote counts as float32's where its values hold no more. "
    "A forward that refuses float64 (an extension for float32 alone) runs in float32 with TF32 off. "
    "A kernel for bf16 alone (FlashAttention as a custom op, a Triton wrapper) runs as the plain-torch "
    "reference the user hands in (`references=`, `register_reference`), raised like the module's own ops, "
    "once that reference has held against the kernel on the verification's inputs (the `references` "
    "outcome). "
    "Held to 64 times the reference's floor, measured with the module at one shape (the same forward "
    "with noise of one unit roundoff of each op's own precision at every op whose rounding can differ between "
    "shapes: a product or reduction, and what is computed from one), so a computation of "
    "another shape cannot hide in it; the report gives the precision and where it holds less, the "
    "floor, the limit and the stage's peak memory apart",
    catches="computations that depend on the padded batch size at any size above float64's rounding: a "
    "scale, table or cache made for the padded size (a rotary table of another length), a branch on the "
    "token count inside the stack, statistics over padded rows, an output cut wrongly; a module that "
    "computes something else when it is captured; a Python number among the inputs (a max_seq_len) that "
    "decides the result, which each graph holds at its capture's value (named with both values); named "
    "with the first call whose results differ (its line in the user's code, a kernel's caller) and the "
    "first divergent submodule",
    applies="the module runs neither in float64 nor in float32 (an op or a kernel for bf16 alone with no "
    "reference: said so, with the sentence that adds one, and `real_batches` keeps the floor of the module's "
    "own precision); a reference handed in disagrees with its kernel (the `references` outcome fails); it draws random numbers, from "
    "a generator or from host numbers that move on every call (`rng` names those); `batch_invariant=True`",
)
