"""``output_lifetime``: outputs ``run()`` returned keep their values after later runs."""

from __future__ import annotations

from collections.abc import Sequence

from ...plan import Batch, BatchDescriptor, GraphMode
from ...plan.selection import select_descriptors
from ..compare import first_difference
from ..registry import Check
from ..report import Outcome
from ..verify_context import VerifyContext, clone_tree
from .common import finding_of, where_of


def _lifetime(ctx: VerifyContext, desc: BatchDescriptor, batch: Batch) -> Outcome | None:
    """None when an output returned by run() kept its values through a later run."""
    inputs, later = ctx.make(batch), ctx.make(batch)
    with ctx.preserved_state():
        first = ctx.run(inputs, batch)
        kept = clone_tree(first)
        ctx.run(later, batch)  # a later batch of the same shape rewrites whatever it aliases
        ctx.manager.synchronize()
    diff = first_difference(first, kept)
    if diff is None:
        return None
    path = "graph" if desc.mode is not GraphMode.NONE else "eager (NONE)"
    return Outcome(
        "output_lifetime",
        desc,
        False,
        f"an output returned by run() on the {path} path changed when later batches ran ({where_of(diff)}): "
        "it aliases memory the module or the graph reuses; return a fresh tensor",
        finding_of(diff, batch),
    )


def output_lifetime(ctx: VerifyContext, descs: Sequence[BatchDescriptor]) -> Outcome:
    """Outputs of run() keep their values after later runs, on the graphs and on the eager path.

    On the graph path run() copies the real rows out, so this guards the
    manager's contract: one code path for every graph, held on the smallest
    and the largest graph of each mode (an exact batch and a padded one; a
    batch's rows are cut per graph, copied the same way), not on each of a
    plan's 67, whose replays cost what their graphs do. On the eager path (a
    batch larger than every graph) the module's own outputs are returned, and
    a module returning a buffer it rewrites fails here.
    """
    manager = ctx.manager
    graphs = select_descriptors(descs, exhaustive=False)
    for desc in graphs:
        failed = _lifetime(ctx, desc, ctx.padded_batch(desc) or ctx.exact_batch(desc))
        if failed is not None:
            return failed
    n = manager.max_tokens + 1
    batch = Batch(num_tokens=n, num_reqs=min(manager.config.max_num_reqs, max(1, (n + 1) // 2)))
    eager_desc = manager.dispatch_batch(batch)
    if eager_desc.mode is GraphMode.NONE:
        failed = _lifetime(ctx, eager_desc, batch)
        if failed is not None:
            return failed
    return Outcome("output_lifetime", None, True, figures={"graphs": len(graphs), "eager_path": True})


OUTPUT_LIFETIME = Check(
    "output_lifetime",
    output_lifetime,
    scope="module",
    compares="outputs returned by `run()` keep their values after a later run, on the graph path (the "
    "smallest and the largest graph of each mode: the copy out is one code path for every graph) and on "
    "the eager path (a batch larger than every graph)",
    catches="outputs that alias a buffer the module rewrites",
    applies="never",
)
