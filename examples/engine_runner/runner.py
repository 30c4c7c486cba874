"""An engine-style CUDA-graph runner for the tiny decoder, in miniature.

This is the shape of vLLM's, SGLang's and nano-vllm's model runners, without
the plugin's ``GraphManager``: the runner owns static input buffers (per token:
``input_ids``, ``positions``, ``slot_mapping``, ``token_req``, ``is_padding``;
per request: ``req_base``, ``seq_lens``, ``query_start_loc``) sized for its
largest capture size, dispatches each real batch itself to the smallest
capture size that holds it, copies the batch's rows into the buffers, pads the
rest, replays that size's graph and hands back clones of the real rows.
Batches larger than the largest capture size run the model eagerly.

Padding follows the decoder's rules: padded tokens write the KV cache at
``PAD_SLOT`` (a slot no request reads), are marked ``is_padding``, and read
request 0 at position 0; padded requests are empty (``query_start_loc``
repeats the batch's end) with harmless table entries.

On CUDA, ``capture()`` warms each size up on a side stream and captures one
``torch.cuda.CUDAGraph`` per capture size, largest first, into one shared
memory pool; a call replays. On the CPU (the emulator's terms) ``capture()``
records nothing, and a call runs the model eagerly on the same static buffers,
padded, with its outputs copied into per-size static output buffers, as graph
outputs are. So every runner bug about buffers, padding, dispatch and output
ownership shows on the CPU too; only a graph that was never captured (see
``buggy.SilentEagerRunner``) needs CUDA to be seen.

The model and the runner share state: the model's KV caches (buffers of its
attention layers) are written by the runner's calls, padded rows included,
which is why padded rows must write only ``PAD_SLOT``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from examples.decoder import MAX_REQS, PAD_SLOT, make_inputs

#: Per-token inputs of the decoder's forward, and what padded tokens hold.
TOKEN_PAD: dict[str, int | bool] = {
    "input_ids": 0,  # any valid id: the model zeroes padded rows' embeddings
    "positions": 0,  # position 0 of request 0 is always visible: no empty attention row
    "slot_mapping": PAD_SLOT,  # the one slot padded tokens may write
    "token_req": 0,  # a real request: every batch has at least one
    "is_padding": True,
}
#: Per-request tables (``query_start_loc`` is handled apart: it has one more row).
REQ_PAD: dict[str, int] = {
    "req_base": 0,  # request 0's slots: read by no padded token, but valid indices
    "seq_lens": 1,  # a non-empty context, should anything read a padded request
}
#: Which outputs follow the tokens and which the requests.
OUTPUT_ROWS: dict[str, str] = {"logits": "tokens", "sampled": "reqs"}

WARMUP_RUNS = 2  # cuBLAS and the allocator settle before capture, as engines do


def make_engine_inputs(
    num_tokens: int,
    num_reqs: int,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """The decoder's real batch, with the ``is_padding`` mask its forward takes (all False: nothing is padded).

    The eager reference calls the model on exactly these inputs, so they must
    be complete for ``forward``; the runner accepts them with or without the mask.
    """
    inputs = make_inputs(num_tokens, num_reqs, device=device, generator=generator)
    inputs["is_padding"] = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    return inputs


class EngineRunner:
    """Static buffers, dispatch, padding, capture and replay for ``examples.decoder.TinyDecoder``."""

    token_pad: ClassVar[dict[str, int | bool]] = TOKEN_PAD
    req_pad: ClassVar[dict[str, int]] = REQ_PAD

    def __init__(
        self,
        model: nn.Module,
        capture_sizes: Iterable[int],
        *,
        device: str | torch.device,
        max_num_reqs: int = MAX_REQS,
    ) -> None:
        sizes = sorted({int(s) for s in capture_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture sizes must be positive token counts, got {sizes}")
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be at least 1, got {max_num_reqs}")
        self.model = model
        self.capture_sizes: tuple[int, ...] = tuple(sizes)
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        max_tokens = sizes[-1]
        max_reqs = self.reqs_for(max_tokens)
        # Allocated once, at the largest size: graphs read these addresses forever.
        # They start as padding, so a warm-up or capture run writes only PAD_SLOT.
        self.token_buffers: dict[str, torch.Tensor] = {
            name: torch.full(
                (max_tokens,),
                value,
                device=self.device,
                dtype=torch.bool if name == "is_padding" else torch.int64,
            )
            for name, value in self.token_pad.items()
        }
        self.req_buffers: dict[str, torch.Tensor] = {
            name: torch.full((max_reqs,), value, dtype=torch.int64, device=self.device)
            for name, value in self.req_pad.items()
        }
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int64, device=self.device)
        self.forward_args: dict[int, dict[str, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_outputs: dict[int, dict[str, torch.Tensor]] = {}
        self.captured = False

    # -- shapes and dispatch ---------------------------------------------------

    def reqs_for(self, size: int) -> int:
        """Requests a graph of ``size`` tokens holds: at most one per token, at most the engine's limit."""
        return min(size, self.max_num_reqs)

    def dispatch(self, num_tokens: int) -> int | None:
        """The smallest capture size that holds ``num_tokens``; None (run eagerly) past the largest."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def make_forward_args(self, size: int) -> dict[str, torch.Tensor]:
        """What the model is called with at ``size``: views of the static buffers, so later copies reach it."""
        reqs = self.reqs_for(size)
        args = {name: buf[:size] for name, buf in self.token_buffers.items()}
        args.update({name: buf[:reqs] for name, buf in self.req_buffers.items()})
        args["query_start_loc"] = self.query_start_loc[: reqs + 1]
        return args

    # -- capture ---------------------------------------------------------------

    @torch.no_grad()
    def capture(self) -> None:
        """Fixes every size's forward arguments; on CUDA also captures one graph per size (largest first)."""
        self.reset_buffers()
        self.graphs.clear()
        self.static_outputs.clear()
        self.forward_args = {size: self.make_forward_args(size) for size in self.capture_sizes}
        if self.device.type == "cuda":
            # One pool for all graphs: graphs replay one at a time, so a smaller
            # graph may reuse what the larger one's intermediates freed.
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.capture_sizes):
                graph = self.capture_graph(size, pool)
                if graph is not None:
                    self.graphs[size] = graph
            torch.cuda.synchronize(self.device)
        self.captured = True

    def capture_graph(self, size: int, pool: Any) -> torch.cuda.CUDAGraph | None:
        """Warms ``size`` up on a side stream, then captures it; its outputs become that size's static outputs."""
        args = self.forward_args[size]
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.model(**args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.static_outputs[size] = self.model(**args)
        return graph

    def reset_buffers(self) -> None:
        """Every static row back to padding."""
        for name, buf in self.token_buffers.items():
            buf.fill_(self.token_pad[name])
        for name, buf in self.req_buffers.items():
            buf.fill_(self.req_pad[name])
        self.query_start_loc.zero_()

    # -- one step --------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.captured:
            raise RuntimeError("EngineRunner: call capture() before running batches")
        num_tokens = inputs["input_ids"].shape[0]
        num_reqs = inputs["req_base"].shape[0]
        if not 1 <= num_reqs <= min(num_tokens, self.max_num_reqs):
            raise ValueError(
                f"{num_reqs} requests for {num_tokens} tokens (at most {self.max_num_reqs} requests)"
            )
        size = self.dispatch(num_tokens)
        if size is None:
            return self.run_eager(inputs)
        self.load(size, inputs)
        return self.real_rows(self.run_size(size), num_tokens, num_reqs)

    def run_eager(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fallback past the largest graph: the model on the caller's tensors (fresh outputs, the caller's)."""
        if "is_padding" not in inputs:
            inputs = {**inputs, "is_padding": torch.zeros_like(inputs["input_ids"], dtype=torch.bool)}
        out: dict[str, torch.Tensor] = self.model(**inputs)
        return out

    def load(self, size: int, inputs: dict[str, torch.Tensor]) -> None:
        """Copies the batch's rows into the static buffers and pads the rest of ``size``'s rows."""
        num_tokens = inputs["input_ids"].shape[0]
        num_reqs = inputs["req_base"].shape[0]
        for name, buf in self.token_buffers.items():
            if name == "is_padding" and name not in inputs:
                buf[:num_tokens].fill_(False)
            else:
                buf[:num_tokens].copy_(inputs[name])
        self.pad_tokens(size, num_tokens)
        reqs = self.reqs_for(size)
        for name, buf in self.req_buffers.items():
            buf[:num_reqs].copy_(inputs[name])
            buf[num_reqs:reqs].fill_(self.req_pad[name])
        self.query_start_loc[: num_reqs + 1].copy_(inputs["query_start_loc"])
        # Padded requests are empty: they start and end where the batch ends.
        self.query_start_loc[num_reqs + 1 : reqs + 1].fill_(num_tokens)

    def pad_tokens(self, size: int, num_tokens: int) -> None:
        """Rewrites every padded token row of this step: a larger earlier step left real values there."""
        for name, buf in self.token_buffers.items():
            buf[num_tokens:size].fill_(self.token_pad[name])

    def run_size(self, size: int) -> dict[str, torch.Tensor]:
        """Replays ``size``'s graph, or (no graph: the CPU) runs the model on the static buffers."""
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            return self.static_outputs[size]
        out: dict[str, torch.Tensor] = self.model(**self.forward_args[size])
        # Outputs live in per-size static buffers, as a graph's do, so that
        # output ownership behaves alike on both backends.
        static = self.static_outputs.get(size)
        if static is None:
            self.static_outputs[size] = out
            return out
        for name, value in out.items():
            static[name].copy_(value)
        return static

    def real_rows(
        self, out: dict[str, torch.Tensor], num_tokens: int, num_reqs: int
    ) -> dict[str, torch.Tensor]:
        """The real rows, cloned: the static outputs are overwritten by the next call of that size."""
        rows = {"tokens": num_tokens, "reqs": num_reqs}
        return {name: value[: rows[OUTPUT_ROWS[name]]].clone() for name, value in out.items()}
