"""``capture_safety``: ops a graph cannot hold, named before the device runs them (the engine runs
its guard in the capture).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import faults
from ...context import running
from ...guard import ModuleTracker, Violation, find_violations
from ...guard.host import device_path_fix
from ...plan import Batch, BatchDescriptor
from ..registry import Check
from ..report import Finding, Outcome
from ..verify_context import VerifyContext

#: Where a failed capture is reported: the one check the engine names, since a capture is the
#: engine's own step, not a check's.
CAPTURE_CHECK = "capture_safety"


_KEEP_ON_DEVICE = (
    "keep the value on the device: compute with it as a tensor (torch.where(cond, a, b) instead of a Python "
    "if on a tensor, a 0-dim tensor instead of a Python number), or move the read out of forward: into "
    "make_inputs, or before the graph runs, passing the result in as an input"
)
_FIXED_SIZE = (
    "give the op a size that does not depend on values: compute over the whole padded tensor and select with "
    "torch.where or a mask (not nonzero or boolean indexing), pass output_size= to repeat_interleave; or move "
    "it out of forward, before the graph"
)
_MAKE_ON_DEVICE = (
    "make the value on the device inside forward (torch.full/torch.arange with device=, fill_ from a device "
    "tensor), keep it in a registered buffer updated on the device, or pass it in as an input from make_inputs"
)
_REFUSED = (
    "move the op out of forward (before the graph, its result passed in as an input), replace it by one a "
    "graph holds (the reason names the argument that decides, where one does), or run its submodule eagerly"
)


def fix_of(violation: Violation) -> str:
    """How to fix an op a graph cannot hold, by the kind of its reason."""
    reason = violation.reason
    if reason.startswith("a library's CUDA path"):
        return device_path_fix(violation.op) or _REFUSED
    if "num_classes" in reason:
        return "pass num_classes= (the number of classes make_inputs can give), so no label is read back"
    if reason.startswith("sparse"):
        return "keep the graph's tensors dense, or verify on a GPU, whose capture decides"
    if reason.startswith(("host sync", "device-to-host")):
        return _KEEP_ON_DEVICE
    if "data-dependent" in reason:
        return _FIXED_SIZE
    if reason.startswith(("host-to-device", "host tensor", "CPU tensor")):
        return _MAKE_ON_DEVICE
    return _REFUSED


def capture_safety(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> list[Outcome]:
    """Run each descriptor's shape eagerly under the guard and list every op a graph cannot hold."""
    outcomes = []
    manager = ctx.manager
    tracker = ModuleTracker(ctx.module)
    for desc in descs:
        reqs = manager.capture_reqs(desc)
        batch = ctx.exact_batch(desc)
        with ctx.preserved_state() as state0:

            def run(first_only: bool, desc: BatchDescriptor = desc, batch: Batch = batch) -> list[Violation]:
                kwargs = ctx.load(desc, ctx.make(batch), batch)

                def forward() -> None:
                    with ctx.phase("eager", desc), torch.no_grad(), running(desc):
                        ctx.module(**kwargs)

                return find_violations(
                    forward,
                    tracker,
                    manager.device,
                    exempt=manager.eager_modules(desc),
                    first_only=first_only,
                )

            try:
                violations = run(first_only=False)
            except Exception as exc:
                if faults.is_sticky(exc):
                    raise  # the process's CUDA context is gone: verify tells it, no check can go on
                finding = Finding(submodule=tracker.failed_path)
                why = (
                    f"the module fails eagerly at this shape (tokens={desc.num_tokens}, reqs={reqs}): "
                    f"{faults.described(exc, manager.device)}"
                )
                # Every op ran, so the op that failed may be one a graph cannot hold (on a GPU, a CPU
                # tensor as a device op's operand fails eagerly too): run again from the same state,
                # stopping before the first such op, to name it.
                ctx.restore(state0)
                try:
                    met = run(first_only=True)
                except Exception as again:
                    if faults.is_sticky(again):
                        raise
                    met = []  # no such op before it fails: the failure is eager's own
                if met:
                    why += f"; on its way it meets an op a graph cannot hold: {met[0].describe()}"
                    finding = Finding(
                        submodule=met[0].module_path, ops=[met[0].describe()], fix=fix_of(met[0])
                    )
                outcomes.append(Outcome("capture_safety", desc, False, why, finding))
                continue
        if violations:
            first = violations[0]
            outcomes.append(
                Outcome(
                    "capture_safety",
                    desc,
                    False,
                    f"{len(violations)} op(s) cannot be captured in a graph; the first is {first.describe()}",
                    Finding(
                        submodule=first.module_path, ops=[v.describe() for v in violations], fix=fix_of(first)
                    ),
                )
            )
        else:
            outcomes.append(Outcome("capture_safety", desc, True))
    return outcomes


CAPTURE_SAFETY = Check(
    CAPTURE_CHECK,
    capture_safety,
    scope="before_capture",
    compares="every op of each descriptor's capture goes through a guard that stops at the first op a graph "
    "cannot hold, before the device runs it (on CUDA the sequence's first capture; a later one goes through "
    "the guard without its rules, and an op the device refuses fails it, named by that op and by the eager "
    "run below); a descriptor it stops is then run eagerly under the "
    "guard, which lists every such op with its submodule and its call site (`file:line in "
    "function`, the first frame outside torch and this plugin). The guard asks first the table of "
    "what a CUDA capture holds, op by op and by the kinds of its arguments, learned on a GPU from "
    "PyTorch's OpInfo samples (`scripts/capturability.py`), and for five ops where sizes or values "
    "decide, a value rule held to the GPU (`scripts/value_rules.py`); on the emulator an op it does not cover "
    "is named in a NOTE as not known. On CUDA an op that fails the capture itself is named with "
    "CUDA's error. A descriptor whose capture fails fails here and the others are still captured "
    "and verified",
    catches="host syncs (`.item()`, `bool(t)`, `int(t)`), data-dependent shapes (`nonzero`, boolean-mask "
    "indexing, `repeat_interleave` without `output_size`), device-to-host copies, CPU tensors on the "
    "CUDA path; values made on the host inside `forward` and written into or moved to the graph's "
    "device (`t[0] = float(n)`, `torch.tensor(data, device=...)`, `torch.arange(n).to(x.device)`), "
    "which the emulator tells by where they were made; ops whose CUDA code syncs or copies from "
    "pageable memory (`torch.linalg.inv`'s error check, `cholesky`, `isin` of many test values, LU of a "
    "non-square matrix, `one_hot` without `num_classes`, `linspace` with tensor ends, `masked_fill` with a 0-dim device value); sparse tensors on the emulator. "
    "Not flagged, because a real capture holds them: `t[mask] = 0.0` (a `masked_fill_`), indexing "
    "with a boolean mask made on the host, `torch.tensor([], device=...)` (a copy of nothing), a "
    "0-dim CPU tensor as an operand",
    applies="never",
)
