"""Engine runners with one bug each, as engines have hit them; the twin of each is ``EngineRunner``.

Each class overrides one method of ``EngineRunner``; the method it overrides,
as ``EngineRunner`` has it, is the fix. ``BUGS`` names the check of
``pytest_cudagraph.verify_runner`` that catches each one.

1. ``StaleTableRunner`` (caught by ``state``): the per-token slot table
   (``slot_mapping``) is copied for the real rows only. The padded rows keep
   what the previous, larger step of the same graph left there, real slots of
   its requests, so this step's padded tokens overwrite live KV-cache entries
   (engines that "only copy ``[:num_tokens]``" into a persistent block or slot
   table hit this once a graph serves a shrinking batch).
2. ``LiveSlotPaddingRunner`` (caught by ``state``): padded tokens get slot 0
   instead of the padding slot. Slot 0 belongs to request 0, so every padded
   step scribbles over its first cached key and value (the classic
   ``slot_mapping`` padded with zeros instead of ``PAD_SLOT_ID = -1``).
3. ``StaleContextRunner`` (caught by ``real_batches``, and ``fresh_inputs``):
   the forward context's ``seq_lens`` is a tensor the metadata builder made
   at capture instead of a view of the persistent buffer. Each step still
   copies its ``seq_lens`` into the buffer, but the graph reads the tensor it
   was captured with, so every replay attends over the capture-time context
   lengths (an attention backend that allocates its metadata in ``build()``
   rather than slicing the runner's buffers).
4. ``SmallGraphRunner`` (caught by ``real_batches``): the dispatcher picks
   the largest capture size that is at most the batch (``bisect_right - 1``
   where ``bisect_left`` was meant), a graph too small: the batch is cut to
   the graph and the tokens past it are dropped.
5. ``ViewOutputRunner`` (caught by ``output_lifetime``): the runner returns
   views of the graph's static output instead of clones; the next replay of
   that graph overwrites what the caller (a sampler, a logits processor
   still holding the previous step) reads.
6. ``SilentEagerRunner`` (caught by ``graph_coverage``, on CUDA only): capture
   "succeeds" but skips the sizes above 2 (a capture list filtered by a
   stale limit, or a failed capture swallowed); those batches run eagerly on
   the static buffers, correct but slow. Only counting replays tells, so on
   the CPU, where no graph exists, the check reports that it could not run.
"""

from __future__ import annotations

import bisect
from typing import Any, ClassVar

import torch

from .runner import TOKEN_PAD, EngineRunner


class StaleTableRunner(EngineRunner):
    def pad_tokens(self, size: int, num_tokens: int) -> None:
        # The bug: the slot table's padded rows are left as the last step wrote them.
        for name, buf in self.token_buffers.items():
            if name != "slot_mapping":
                buf[num_tokens:size].fill_(self.token_pad[name])


class LiveSlotPaddingRunner(EngineRunner):
    # The bug: slot 0 is request 0's first cache slot, not a scratch slot.
    token_pad: ClassVar[dict[str, int | bool]] = {**TOKEN_PAD, "slot_mapping": 0}


class StaleContextRunner(EngineRunner):
    def make_forward_args(self, size: int) -> dict[str, torch.Tensor]:
        args = super().make_forward_args(size)
        # The bug: a tensor of its own, holding the capture-time values, which
        # no later copy into the runner's seq_lens buffer reaches.
        args["seq_lens"] = args["seq_lens"].clone()
        return args


class SmallGraphRunner(EngineRunner):
    def dispatch(self, num_tokens: int) -> int | None:
        # The bug: the largest size <= num_tokens (a graph too small), not the smallest >= it.
        i = bisect.bisect_right(self.capture_sizes, num_tokens) - 1
        return self.capture_sizes[i] if i >= 0 else None

    def load(self, size: int, inputs: dict[str, torch.Tensor]) -> None:
        # What such a runner then does: fits the batch to the graph, losing the rows past it.
        reqs = min(inputs["req_base"].shape[0], self.reqs_for(size))
        cut = {name: value[:size] for name, value in inputs.items() if name in self.token_buffers}
        cut.update({name: inputs[name][:reqs] for name in self.req_buffers})
        cut["query_start_loc"] = inputs["query_start_loc"][: reqs + 1].clamp(max=size)
        super().load(size, cut)


class ViewOutputRunner(EngineRunner):
    def real_rows(
        self, out: dict[str, torch.Tensor], num_tokens: int, num_reqs: int
    ) -> dict[str, torch.Tensor]:
        # The bug: views of the static outputs, which the next call of this size overwrites.
        return {"logits": out["logits"][:num_tokens], "sampled": out["sampled"][:num_reqs]}


class SilentEagerRunner(EngineRunner):
    #: The largest size it really captures.
    capture_limit = 2

    def capture_graph(self, size: int, pool: Any) -> torch.cuda.CUDAGraph | None:
        # The bug: larger sizes are skipped without a word; their batches run
        # eagerly on the static buffers (run_size's path without a graph).
        if size > self.capture_limit:
            return None
        return super().capture_graph(size, pool)


#: Each buggy runner and the check that catches it (SilentEagerRunner's on CUDA only).
BUGS: dict[type[EngineRunner], str] = {
    StaleTableRunner: "state",
    LiveSlotPaddingRunner: "state",
    StaleContextRunner: "real_batches",
    SmallGraphRunner: "real_batches",
    ViewOutputRunner: "output_lifetime",
    SilentEagerRunner: "graph_coverage",
}
