"""The manager's runtime part: what happens to a real batch once graphs exist.

It owns the path of a batch from the caller to its outputs: validating the
inputs against the static buffers and reading the batch's shape
(``batch_of``), dispatching it (``dispatch``), copying it into the static
buffers with its padding (load plans, built by ``load_plans.py``),
replaying the graph and cutting the outputs to the real rows, the eager
path for a batch no graph serves, and the hot-path cache (``_hot``) that
lets a batch shape seen before skip all of that but the copy, the replay
and the cut.

It reads the graphs the capture part made (``_entries``: descriptor ->
``Entry``) and never makes or drops one. Every attribute below is set by
``GraphManager.__init__``; the capture part fills ``_entries`` and clears
``_hot`` when the graphs change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..context import running
from ..plan import Batch, BatchDescriptor, GraphMode
from .load_plans import new_load_plan, padding_views
from .state import ManagerState
from .types import Entry, HotPath, LoadPlan, OutCut, cut_leaf, cut_to_real

__all__ = ["Runtime"]

# run_batch's keyword defaults; its hot path keys other values apart.
_DEFAULT_BATCH_ARGS = (None, None, 0, None, 1)


class Runtime:
    """Validation, dispatch, copy-in, replay and cut of real batches (see the module's docstring)."""

    def __init__(self, state: ManagerState) -> None:
        self.state = state
        # What the hot path reads on every run(), bound once (an attribute hop through the state
        # costs a few percent of a small batch's host time): none of these is rebound after the
        # manager is built; the hot-path cache is cleared in place.
        self._hot = state.hot
        self._specs = state.tensor_specs
        self._names = state.run_names
        self._index = state.device_index
        self._views = state.output_views

    # -- shapes ---------------------------------------------------------
    def capture_reqs(self, desc: BatchDescriptor) -> int:
        """Request rows a descriptor is captured with (PIECEWISE: as many as fit)."""
        if desc.num_reqs is not None:
            return desc.num_reqs
        return min(desc.num_tokens, self.state.config.max_num_reqs)

    def forward_inputs(self, num_tokens: int, num_reqs: int) -> dict[str, Any]:
        """The keyword inputs a graph of that shape reads: views of the static buffers."""
        kwargs: dict[str, Any] = {}
        held = self.state.values_at.get((num_tokens, num_reqs), {})
        for name, spec in self.state.inputs.items():
            if spec.is_python:  # a "value" as the graph of that shape was captured with it
                kwargs[name] = held.get(name, spec.value)
            else:  # the whole buffer when fixed, else its window for this shape
                kwargs[name] = spec.window(num_tokens, num_reqs)
        if self.state.is_padding is not None:
            kwargs["is_padding"] = self.state.is_padding[:num_tokens]
        return kwargs

    # -- dispatch -------------------------------------------------------
    def dispatch(
        self,
        *,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> BatchDescriptor:
        """The plan's answer, or ``NONE`` when that descriptor has no live graph
        (``dispatch_batch`` with the batch's fields as keywords)."""
        return self.dispatch_batch(
            Batch(
                num_tokens=num_tokens,
                num_reqs=num_reqs,
                uniform_token_count=uniform_token_count,
                num_active_loras=num_active_loras,
                max_query_len=max_query_len,
                num_ubatches=num_ubatches,
            )
        )

    def dispatch_batch(self, batch: Batch) -> BatchDescriptor:
        """The descriptor whose live graph serves ``batch``, or a ``NONE`` one
        (the plan has none, or its capture failed or was released)."""
        desc = self.state.plan.dispatch_batch(batch)
        if desc.mode is GraphMode.NONE or desc in self.state.entries:
            return desc
        return BatchDescriptor(
            mode=GraphMode.NONE,
            num_tokens=batch.num_tokens,
            num_reqs=batch.num_reqs,
            num_active_loras=self.state.plan.effective_loras(batch.num_active_loras),
            num_ubatches=batch.num_ubatches,
        )

    # -- running --------------------------------------------------------
    def run(self, **inputs: Any) -> Any:
        """Run one real batch given as keyword inputs; see ``run_batch``."""
        # run_batch's hot path, inlined: this is the call a serving loop makes.
        try:
            hot = self._hot.get(tuple([inputs[name].shape for name, _ in self._specs]))
        except (KeyError, AttributeError):
            hot = None
        if hot is not None and inputs.keys() == self._names and self._same_kind(inputs):
            return self._replay_hot(hot, inputs)
        if not self.state.capture_called:
            raise self._not_captured("run()")
        return self.run_batch(inputs)

    def run_batch(
        self,
        inputs: Mapping[str, Any],
        batch: Batch | None = None,
        *,
        num_reqs: int | None = None,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> Any:
        """Dispatch a real batch, replay its graph (or run eagerly), return real rows.

        What dispatch needs beyond the inputs' shapes comes as a ``Batch``
        (whose token count must be the inputs') or as keywords: ``num_reqs``
        defaults to what request-shaped inputs say, or to the token count
        (capped at ``max_num_reqs``) when there are none. Before the first
        ``capture()`` it raises ``RuntimeError`` (no graph could serve the
        batch; ``eager()`` runs eagerly on purpose); after a failed or
        released capture, batches run eagerly until the next capture.
        """
        if not self.state.capture_called:
            raise self._not_captured("run_batch()")
        args = (num_reqs, uniform_token_count, num_active_loras, max_query_len, num_ubatches)
        tokens: int | None = None
        if batch is not None:
            if args != _DEFAULT_BATCH_ARGS:
                raise TypeError("run_batch takes a Batch or its keywords, not both")
            args = (
                batch.num_reqs,
                batch.uniform_token_count,
                batch.num_active_loras,
                batch.max_query_len,
                batch.num_ubatches,
            )
            tokens = batch.num_tokens
        key: tuple[Any, ...] | None = None
        if inputs.keys() == self._names:
            # The hot path: a batch of input shapes and arguments seen before
            # replays what validation and dispatch decided then. Shapes are the
            # key; dtype and device, which a copy into the static buffers would
            # silently convert, are checked on every call.
            try:
                key = tuple([inputs[name].shape for name, _ in self._specs])
                if tokens is not None:
                    key = (args, tokens, key)  # the Batch's token count is checked once, below
                elif args != _DEFAULT_BATCH_ARGS:
                    key = (args, key)
                hot = self._hot.get(key)
            except (AttributeError, TypeError):  # not tensors, or unhashable: the slow path says why
                key = hot = None
            if hot is not None and self._same_kind(inputs):
                return self._replay_hot(hot, inputs)
        real = self.batch_of(
            inputs,
            num_reqs=args[0],
            uniform_token_count=args[1],
            num_active_loras=args[2],
            max_query_len=args[3],
            num_ubatches=args[4],
        )
        if tokens is not None and tokens != real.num_tokens:
            raise ValueError(f"the Batch says {tokens} tokens, but the inputs hold {real.num_tokens}")
        desc = self.dispatch_batch(real)
        if desc.mode is GraphMode.NONE:
            return self._run_eager(inputs, real, desc)  # not remembered: capture() may add its graph
        hot = self._make_hot(desc, real)
        if key is not None:
            self._hot[key] = hot
        return self._replay_hot(hot, inputs)

    def _not_captured(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"GraphManager.{what} was called before capture(): no graph exists yet, so the batch would run "
            "eagerly and nothing graph-related would be exercised; call manager.capture() first "
            "(manager.eager(**inputs) runs the module eagerly on purpose)"
        )

    def _same_kind(self, inputs: Mapping[str, Any]) -> bool:
        # What the shape key leaves out and a copy into the static buffers
        # would silently convert: dtype and device. Checked on every call.
        index = self._index
        for name, spec in self._specs:
            value = inputs[name]
            if value.dtype != spec.dtype:
                return False
            if (not value.is_cpu) if index < 0 else value.get_device() != index:
                return False
        return True

    def _make_hot(self, desc: BatchDescriptor, batch: Batch) -> HotPath:
        entry = self.state.entries[desc]
        return HotPath(entry, self._load_plan(desc, batch), self._cut_views(entry, batch))

    def _replay_hot(self, hot: HotPath, inputs: Mapping[str, Any]) -> Any:
        # Static buffers and graph outputs never require grad, so autograd has
        # nothing to record unless an input does; entering no_grad costs as
        # much as a kernel launch on this path, so only then.
        if torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values()
        ):
            with torch.no_grad():
                return self._replay_hot(hot, inputs)
        hot.load.apply(inputs)
        hot.entry.graph.replay()
        self.state.replays += 1
        return self._owned(hot.entry, hot.cut)

    # -- validation -----------------------------------------------------
    def batch_of(
        self,
        inputs: Mapping[str, Any],
        *,
        num_reqs: int | None = None,
        uniform_token_count: int | None = None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ) -> Batch:
        """Validate ``inputs`` against the static buffers and read the batch shape."""
        if inputs.keys() != self._names:  # fast path: exactly the tensor inputs (and Python numbers)
            self._check_names(inputs)
        num_tokens = -1
        token_input = ""
        from_inputs: int | None = None
        reqs_input = ""
        for name, spec in self._specs:
            value = inputs[name]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"input '{name}' must be {spec.expected()}; got {type(value).__name__}")
            if value.dtype != spec.dtype:
                raise ValueError(f"input '{name}' has dtype {value.dtype}; expected {spec.expected()}")
            # Cheaper than comparing torch.device objects, on the replay path.
            on_device = value.is_cpu if self._index < 0 else value.get_device() == self._index
            if not on_device:
                raise ValueError(
                    f"input '{name}' is on {value.device}; the graphs read it from {self.state.device}: "
                    f"move it with .to('{self.state.device}')"
                )
            shape = value.shape
            assert spec.buffer is not None  # every tensor input has its buffer
            full = spec.buffer.shape
            if spec.kind == "fixed":
                if shape != full:
                    raise ValueError(f"input '{name}' has shape {tuple(shape)}; expected {spec.expected()}")
                continue
            following = spec.following
            if len(shape) != len(full) or any(
                n != m for d, (n, m) in enumerate(zip(shape, full, strict=True)) if d not in following
            ):
                raise ValueError(f"input '{name}' has shape {tuple(shape)}; expected {spec.expected()}")
            for d, kind, offset in spec.dims:
                count = shape[d] - offset
                # Which input (and, past the first, which dimension) said so.
                said = f"'{name}'" if d == 0 else f"'{name}' (dimension {d})"
                if kind == "tokens":
                    if num_tokens >= 0 and count != num_tokens:
                        raise ValueError(
                            f"inputs disagree on num_tokens: {token_input} says {num_tokens}, "
                            f"{said} says {count}"
                        )
                    num_tokens, token_input = count, said
                else:
                    if from_inputs is not None and count != from_inputs:
                        raise ValueError(
                            f"inputs disagree on num_reqs: {reqs_input} says {from_inputs}, "
                            f"{said} says {count}"
                        )
                    from_inputs, reqs_input = count, said
        if num_tokens < 0:
            raise ValueError("no input follows num_tokens, so the batch's token count is unknown")
        if from_inputs is not None:
            if num_reqs is not None and num_reqs != from_inputs:
                raise ValueError(f"num_reqs={num_reqs} but request-shaped inputs hold {from_inputs} rows")
            num_reqs = from_inputs
        elif num_reqs is None:
            num_reqs = min(num_tokens, self.state.config.max_num_reqs)
        if num_tokens < 1:
            raise ValueError(f"the batch has {num_tokens} tokens; a batch needs at least one")
        if num_reqs > self.state.config.max_num_reqs:
            raise ValueError(
                f"the batch has {num_reqs} requests, above max_num_reqs={self.state.config.max_num_reqs}"
            )
        batch = Batch(
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            uniform_token_count=uniform_token_count,
            num_active_loras=num_active_loras,
            max_query_len=max_query_len,
            num_ubatches=num_ubatches,
        )
        self.state.plan.dispatch_batch(
            batch
        )  # validates the counts (num_reqs <= num_tokens, non-negative, ...)
        return batch

    def _check_names(self, inputs: Mapping[str, Any]) -> None:
        """Every tensor input and every Python value that changes with the batch given, nothing
        unknown, and Python values of one value as captured. A "value" may be anything: the graph
        replays with the one its capture was given (the checks hold that to eager)."""
        missing = [n for n, _ in self._specs if n not in inputs]
        missing += [n for n in self.state.value_names if n not in inputs]
        unknown = [n for n in inputs if n not in self.state.inputs]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing input(s) {missing}")
            if unknown:
                parts.append(f"unknown input(s) {unknown}")
            raise ValueError(f"{' and '.join(parts)}; the module's inputs are {list(self.state.inputs)}")
        for name, value in inputs.items():
            spec = self.state.inputs[name]
            if spec.kind == "const" and value is not spec.value and value != spec.value:
                raise ValueError(
                    f"input '{name}' is {value!r}, but the graphs froze it at {spec.value!r} "
                    "during capture (a Python value is not read on replay); pass it as a tensor"
                )

    # -- eager ----------------------------------------------------------
    def eager_kwargs(self, inputs: Mapping[str, Any], num_tokens: int) -> dict[str, Any]:
        """Keyword arguments for an eager forward on an unpadded batch: the
        inputs, the Python values frozen into the graphs, and an all-False
        ``is_padding`` mask when the manager passes one."""
        kwargs = dict(inputs)
        for name, spec in self.state.inputs.items():
            if spec.is_python and name not in kwargs:
                kwargs[name] = spec.value
        if self.state.is_padding is not None:
            kwargs["is_padding"] = torch.zeros(num_tokens, dtype=torch.bool, device=self.state.device)
        return kwargs

    def _run_eager(self, inputs: Mapping[str, Any], batch: Batch, desc: BatchDescriptor) -> Any:
        kwargs = self.eager_kwargs(inputs, batch.num_tokens)
        with torch.no_grad(), running(desc):
            return self.state.module(**kwargs)

    def eager(self, **inputs: Any) -> Any:
        """Run the module eagerly on a real batch, as ``run`` would without graphs."""
        batch = self.batch_of(inputs)
        desc = BatchDescriptor(mode=GraphMode.NONE, num_tokens=batch.num_tokens, num_reqs=batch.num_reqs)
        return self._run_eager(inputs, batch, desc)

    def synchronize(self) -> None:
        """Wait for the device work queued so far (a no-op on the emulator)."""
        self.state.backend.synchronize()

    def poison_free(self, which: int) -> bool:
        """Fill the graphs' free pool memory (their intermediates between replays) with poison
        ``which`` (0 or 1); False where the backend cannot."""
        return self.state.backend.poison_free(which)

    # -- copy-in --------------------------------------------------------
    def load_inputs(self, desc: BatchDescriptor, inputs: Mapping[str, Any], batch: Batch) -> None:
        """Copy a real batch into the static buffers and pad the rest of ``desc``'s rows."""
        missing = [n for n, _ in self._specs if n not in inputs]
        if missing:
            raise ValueError(f"missing input(s) {missing}; the module's inputs are {list(self.state.inputs)}")
        with torch.no_grad():
            self._load_plan(desc, batch).apply(inputs)

    def _load_plan(self, desc: BatchDescriptor, batch: Batch) -> LoadPlan:
        reqs = self.capture_reqs(desc)
        key = (desc.num_tokens, reqs, batch.num_tokens, batch.num_reqs)
        plan = self.state.plans.get(key)
        if plan is None:
            plan = self.state.plans[key] = new_load_plan(
                self._specs, self.state.is_padding, desc.num_tokens, reqs, batch
            )
        return plan

    def padding_views(self, desc: BatchDescriptor, batch: Batch) -> list[tuple[str, torch.Tensor]]:
        """See ``load_plans.padding_views``: the padded part of each buffer when ``batch`` runs under ``desc``."""
        return padding_views(self._specs, desc.num_tokens, self.capture_reqs(desc), batch)

    # -- replay and cut -------------------------------------------------
    def replay(self, desc: BatchDescriptor) -> Any:
        """Replay ``desc``'s graph on whatever the static buffers hold; return its full output.

        The output tensors are graph memory: the next replay overwrites them.
        """
        graph = self.state.entries[desc].graph
        graph.replay()
        self.state.replays += 1
        return graph.output

    def real_rows(self, desc: BatchDescriptor, batch: Batch) -> Any:
        """The last replay's outputs of ``desc``, cut to the batch's real rows."""
        with torch.no_grad():
            entry = self.state.entries[desc]
            return self._owned(entry, self._cut_views(entry, batch))

    def output_dims(self, desc: BatchDescriptor) -> list[OutCut]:
        """How each leaf of ``desc``'s output is cut to a batch's real rows."""
        return list(self.state.entries[desc].out_dims)

    def cut_output(self, desc: BatchDescriptor, output: Any, batch: Batch) -> Any:
        """An output of ``desc``'s shape (an eager run of its program, say) cut to ``batch``'s
        real rows exactly as the graph's output is."""
        return cut_to_real(output, self.state.entries[desc].out_dims, batch)

    @staticmethod
    def _cut_views(entry: Entry, batch: Batch) -> list[Any]:
        """The output leaves cut to the batch's real rows: views, made once per batch shape."""
        key = (batch.num_tokens, batch.num_reqs)
        cut = entry.cuts.get(key)
        if cut is None:
            cut = [
                cut_leaf(leaf, dims, batch) for leaf, dims in zip(entry.leaves, entry.out_dims, strict=False)
            ]
            entry.cuts[key] = cut
        return cut

    def _owned(self, entry: Entry, cut: list[Any]) -> Any:
        """The cut outputs in the forward's structure: copies the caller owns, or views with output_views."""
        if not self._views:
            cut = [t.clone() if isinstance(t, torch.Tensor) else t for t in cut]
        if entry.single:
            return cut[0]
        return entry.structure.unflatten(list(cut))
