"""The built-in checks, registered as a downstream suite registers its own.

The words here are the checks table of docs/checks.md
(``scripts/refresh_docs.py`` writes it from ``BUILTIN.markdown_table()``).
"""

from __future__ import annotations

from typing import Any

from . import functions, padded_size
from .registry import Check, CheckRegistry

__all__ = ["BUILTIN", "CAPTURE_CHECK", "DISPATCH_CHECK"]

#: Property-tests the manager's dispatch; runs in exhaustive verification.
DISPATCH_CHECK = "dispatch"
#: Where a failed capture is reported: the one check the engine names, since
#: a capture is the engine's own step, not a check's.
CAPTURE_CHECK = "capture_safety"


def _dispatch(ctx: Any, descs: Any) -> Any:
    """Every dispatch property, for generated real batches, against the manager's dispatch."""
    from .dispatch import dispatch_check  # hypothesis is imported only when the check runs

    return dispatch_check(ctx, descs)


BUILTIN = CheckRegistry(
    [
        Check(
            CAPTURE_CHECK,
            functions.capture_safety,
            scope="before_capture",
            compares="every op of each descriptor's capture goes through a guard that stops at the first op a graph "
            "cannot hold, before the device runs it; a descriptor it stops is then run eagerly under the "
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
        ),
        Check(
            "replay_matches_eager",
            functions.replay_matches_eager,
            compares="on the very inputs a graph was captured with, replay equals eager bit for bit (NaN equals NaN, "
            "-0.0 differs from 0.0; shape, dtype and strides too)",
            catches="Python state changed by every forward (named: `inner.calls: 3 -> 4`), nondeterministic eager "
            "(said so instead)",
            applies="never",
        ),
        Check(
            "fresh_inputs",
            functions.fresh_inputs,
            compares="after capture, new inputs give replay equal to eager. Where `make_inputs` returns the same "
            "values on every call (`torch.ones`, `arange`), the harness makes its own: fresh floating "
            "values in the observed range, or integer rows permuted (then drawn) within it",
            catches="tensors computed at warm-up and memoised (by identity, say), stale buffers, values frozen at "
            "capture",
            applies="never: where no input can be changed (no tensor input, or only integers of one value), the "
            "check fails saying it could not run",
        ),
        Check(
            "real_batches",
            functions.real_batches,
            compares="the smallest and the largest real batch a descriptor serves (every batch of a trace with "
            "`--cudagraph-trace`), run through the graph, return real rows equal bit for bit to eager at the "
            "graph's padded shape on the inputs the graph read (the same program); whether eager at the padded "
            "shape computes the real rows as eager on the real batch does is left to `padded_size`, in float64. "
            "Where the module cannot run in float64 (or `padded_size` is deselected), the real rows are held to "
            "eager on the *unpadded* batch: within the dtype's tolerance, else within the measured floor "
            "(eager at the graph's padded shape against eager on the unpadded batch; a few multiples are "
            "allowed), failing a systematic difference (a scale, an offset per feature, a scale per row) and "
            "one beyond what rounding at the products' precision can do (bit for bit with "
            "`batch_invariant=True`); both figures are reported",
            catches="a graph that serves a padded real batch otherwise than eager at its shape does (values frozen "
            "at capture, a stale buffer the real batch reads); where no float64 reference runs, computations that "
            "depend on the padded batch size: statistics over the whole batch, padded rows included; a Python "
            "branch on the token count, or a scale computed from it, down to a few percent on bf16 logits; "
            "outputs cut wrongly; a module that computes something else when it is captured (attention metadata "
            "planned per request count and shared by decode graphs of several query lengths), named as such when "
            "eager on its capture path differs from eager as users run it",
            applies="no real batch dispatches to the descriptor; the module draws random numbers, told by its use "
            "of a generator (the `rng` check covers them). With the float64 reference it runs each descriptor's "
            "smallest real batch only: its largest, a batch of the graph's own size, is what `fresh_inputs` holds",
        ),
        Check(
            padded_size.CHECK,
            padded_size.padded_size,
            scope="after_release",
            prepare=padded_size.prepare_reference,
            compares="after the graphs are released, eager at each descriptor's padded shape, cut to the real "
            "rows, against eager on the real batch (the most padded batch `real_batches` ran), both in float64: "
            "every float16, bfloat16 and float32 op of the forward raised as it runs, weights converted as "
            "they are read (no copy of the model), float32 with TF32 off for an op with no float64 kernel. "
            "Held to 64 times the reference's floor, measured with the module at one shape (the same forward "
            "with noise of one unit roundoff at every op), so a computation of another shape cannot hide in "
            "it; the report gives the precision, the floor, the limit and the stage's peak memory apart",
            catches="computations that depend on the padded batch size at any size above float64's rounding: a "
            "scale, table or cache made for the padded size (a rotary table of another length), a branch on the "
            "token count inside the stack, statistics over padded rows, an output cut wrongly; a module that "
            "computes something else when it is captured; named with the first divergent submodule",
            applies="the module cannot run in float64 (an op with neither a float64 nor a float32 kernel, a "
            "dtype check of its own: said so, and `real_batches` keeps the floor of the module's own "
            "precision); it draws random numbers; `batch_invariant=True`",
        ),
        Check(
            "padding_isolation",
            functions.padding_isolation,
            compares="real-row outputs and module state are identical whether padded rows of floating inputs hold "
            "zeros, random values or large finite values, as padded rows of an engine do (stale rows, "
            "hidden states of pad tokens); with `nonfinite_padding=True` (marker keyword, "
            "`--cudagraph-nonfinite-padding`, ini `cudagraph_nonfinite_padding`) also NaN and inf, a "
            "strictness whose failures say so. Padded rows of integer inputs (ids, positions, indices) hold "
            "the largest value `make_inputs` gives, then other values in its range; inputs whose padding "
            "is declared semantics in `pad_values` (a reserved slot, a square mask) are not filled",
            catches="attention that reads padded keys (bidirectional over the padded sequence), pooling over padded "
            "rows, batch statistics (a BatchNorm in train mode is named), padded rows writing into state "
            "(an expert load counted by the pad id; allow a scratch region with `scratch_state`); strict: "
            "masking by multiplication (`0 * NaN = NaN`)",
            applies="no real batch of the descriptor leaves padded rows; no input has padded rows that can hold "
            "other values",
        ),
        Check(
            "state",
            functions.state,
            compares="what forwards write (module buffers, parameters written in place), and inputs that eager "
            "mutates in place, end in the same state after `run()` as after eager at the captured shape (what "
            "forwards write is snapshot and restored around each comparison, so a graph-safe counter buffer "
            "passes; nothing else is copied); and, where forwards write module state, after the smallest "
            "real batch as after eager on its real rows (bit for bit where those wrote nothing, the "
            "measured floor where they wrote)",
            catches="in-place writes to inputs (the graph writes its static copy, never the caller's tensor); "
            "padded rows writing where no real row does (a count of the pad id, a live KV slot)",
            applies="never",
        ),
        Check(
            "side_outputs",
            functions.side_outputs,
            compares="a tensor that `forward` stores on a plain attribute on every call (`self.hidden = h`) holds "
            "after `run()` what eager leaves there, with the attributes as capture left them",
            catches="side outputs kept on the module (hidden states for a drafter): after replay the attribute is "
            "the capture-time tensor, padded and in graph memory that later replays overwrite; named with "
            "its shape and the fix (return it, or copy into a registered buffer)",
            applies="never (a module that stores nothing passes)",
        ),
        Check(
            "determinism",
            functions.determinism,
            compares="two replays of the same inputs, from the same state and seed, are bit-identical; and no "
            "forward reads memory nobody wrote: an op seen reading what `torch.empty` (or kin) handed back "
            "before anything wrote it, confirmed by two eager runs with that memory poisoned two ways, is "
            "named with the op that made it (and every other failure of the module says so first); and "
            "replays with the graphs' free pool memory (their intermediates between replays) poisoned one "
            "way, twice, then the other way, all agree: which finds a replay reading what "
            "nobody wrote where no op the dispatcher sees does (an extension's own buffer)",
            catches="state kept outside registered buffers, nondeterministic kernels, a split-K sum into "
            "`torch.empty`, in eager or only in the graph",
            applies="never",
        ),
        Check(
            "rng",
            functions.rng,
            compares="with a seeded generator, replay draws equal eager draws, and successive replays draw fresh "
            "values; a module is random when its forwards use a generator (seen op by op), never because "
            "two runs differ (Python state, put back between runs, and unwritten memory do that)",
            catches="seeding inside `forward`, generators a graph does not advance",
            applies="eager itself is not reproducible under one seed (the `determinism` and replay checks say why)",
        ),
        Check(
            "output_lifetime",
            functions.output_lifetime,
            scope="module",
            compares="outputs returned by `run()` keep their values after a later run, on the graph path and on the "
            "eager path (a batch larger than every graph)",
            catches="outputs that alias a buffer the module rewrites",
            applies="never",
        ),
        Check(
            "address_stability",
            functions.address_stability,
            scope="module",
            prepare=functions.record_addresses,
            compares="static buffers and every module parameter and buffer keep their addresses (and stay the same "
            "tensor objects) through capture, replays and eager runs",
            catches="buffers rebound in `forward` (`self.x = self.x * a + b`): graphs keep reading the old memory",
            applies="never",
        ),
        Check(
            DISPATCH_CHECK,
            _dispatch,
            scope="module",
            compares="the manager's dispatch, property-tested with hypothesis over the graphs captured: every real "
            "batch goes to the smallest captured graph that can serve it, or runs eagerly",
            catches="a dispatcher that picks a graph too small, of the wrong mode or LoRA case, or none where one "
            "serves",
            applies="quick verification (`exhaustive=False`) or a subset of the plan captured; in a verification "
            "split by descriptor it runs in the item of the plan's first descriptor",
        ),
    ]
)
