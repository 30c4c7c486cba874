"""Staging a capture's sample: ``make_inputs`` at a descriptor's own shape, checked against the
layout and loaded into the static buffers through the runtime's own copy-in, so that a graph is
captured on exactly the buffers it will replay from (``Capture`` composes it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..observe import outside_forward
from ..plan import BatchDescriptor
from .layout import MakeInputsError, call_make_inputs
from .runtime import Runtime

if TYPE_CHECKING:
    from .state import ManagerState

__all__ = ["Staging"]


class Staging:
    """``make_inputs`` checked, and each descriptor's sample staged (see the module's docstring)."""

    def __init__(self, state: ManagerState, runtime: Runtime) -> None:
        self.state = state
        self.runtime = runtime

    @property
    def make_inputs(self) -> Callable[[int, int], Mapping[str, Any]]:
        """``make_inputs``, checked: a call whose keys differ from the layout's raises ``ValueError``."""
        return self._checked_make_inputs

    def _checked_make_inputs(self, num_tokens: int, num_reqs: int) -> dict[str, Any]:
        # A make_inputs that syncs weights in place (an RL engine's weight sync) writes the module
        # outside any forward: told to the observer, so that nothing takes it for a forward's write.
        with outside_forward(self.state.observer):
            inputs = call_make_inputs(self.state.user_make_inputs, num_tokens, num_reqs)
        if inputs.keys() != self.state.inputs.keys():
            missing = sorted(n for n in self.state.inputs if n not in inputs)
            extra = sorted(n for n in inputs if n not in self.state.inputs)
            raise MakeInputsError(
                f"make_inputs(num_tokens={num_tokens}, num_reqs={num_reqs}) returned inputs {sorted(inputs)}, "
                f"but at the probe and largest shapes it returned {sorted(self.state.inputs)} "
                f"(missing {missing}, new {extra}); make_inputs must return the same keys at every shape"
            )
        return inputs

    def stage_sample(self, desc: BatchDescriptor) -> tuple[dict[str, Any], dict[str, Any]]:
        """``make_inputs`` at ``desc``'s own shape, loaded into the static buffers:
        (the sample, the keyword inputs a forward of that shape reads).

        Captures run on valid data of their very shape (indices in range, say):
        a prefix of the largest shape's inputs need not be valid.
        """
        reqs = self.runtime.capture_reqs(desc)
        sample = self._checked_make_inputs(desc.num_tokens, reqs)
        if self.state.value_names:
            # Python values that change with the batch: the graph holds what its own sample gave.
            self.state.values_at[desc.num_tokens, reqs] = {n: sample[n] for n in self.state.value_names}
        kwargs = self.runtime.forward_inputs(desc.num_tokens, reqs)
        self._load_sample(desc, reqs, sample, kwargs)
        return sample, kwargs

    def _load_sample(
        self, desc: BatchDescriptor, reqs: int, sample: Mapping[str, Any], kwargs: Mapping[str, Any]
    ) -> None:
        """Copy ``desc``'s own sample into the static buffers.

        A sample of the descriptor's exact shape (what ``make_inputs`` gives at
        that shape) fills the windows the forward reads, ``kwargs``, as they
        are: each tensor is copied straight in and no load plan is built, since
        nothing is padded. Anything else (a key, dtype, device or shape off the
        layout) goes through ``batch_of`` and ``load_inputs``, which say what
        is wrong or pad what is short.
        """
        if sample.keys() == self.state.run_names:
            index = self.state.device_index
            exact = True
            for name, spec in self.state.tensor_specs:
                value = sample[name]
                if not (
                    isinstance(value, torch.Tensor)
                    and value.dtype == spec.dtype
                    and value.shape == kwargs[name].shape
                    and (value.is_cpu if index < 0 else value.get_device() == index)
                ):
                    exact = False
                    break
            if exact:
                with torch.no_grad():
                    for name, _ in self.state.tensor_specs:
                        kwargs[name].copy_(sample[name])
                    if self.state.is_padding is not None:
                        kwargs["is_padding"].fill_(False)
                return
        batch = self.runtime.batch_of(sample, num_reqs=reqs)
        if batch.num_tokens != desc.num_tokens:
            raise MakeInputsError(
                f"make_inputs(num_tokens={desc.num_tokens}, num_reqs={reqs}) returned a batch of "
                f"{batch.num_tokens} tokens; make_inputs must return exactly num_tokens tokens (a rank or a "
                "call that adds its own makes another batch than its peers')"
            )
        self.runtime.load_inputs(desc, sample, batch)
