"""Static input buffers: which dimension of each input follows the batch.

``make_inputs(num_tokens, num_reqs)`` builds one batch of keyword inputs. The
manager calls it at two probe shapes to learn, for each input, whether its
leading dimension is ``num_tokens + c``, ``num_reqs + c`` or fixed, then once
at the largest shape to allocate the static buffers. Buffers are allocated
once and never reallocated: graphs read them by address.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["PROBES", "InputSpec", "call_make_inputs", "infer_layout"]

Kind = Literal["tokens", "reqs", "fixed", "const"]
PadValue = int | float | bool | Literal["edge"]

# Two probe shapes: different token and request counts, none equal to another,
# so ``tokens + c``, ``reqs + c`` and "fixed" cannot be confused.
PROBES = ((7, 3), (11, 5))


@dataclass
class InputSpec:
    """One keyword input of the module and its static buffer."""

    name: str
    kind: Kind
    offset: int = 0  # leading dim = count + offset ("fixed": the size itself)
    dtype: torch.dtype | None = None
    trailing: tuple[int, ...] = ()
    pad: PadValue = 0
    buffer: torch.Tensor | None = None
    value: Any = None  # "const": the Python value frozen into every graph

    def rows(self, num_tokens: int, num_reqs: int) -> int:
        """Leading size of this input for a batch of that shape."""
        if self.kind == "tokens":
            return num_tokens + self.offset
        if self.kind == "reqs":
            return num_reqs + self.offset
        return self.offset

    def expected(self) -> str:
        if self.kind == "const":
            return f"the Python value {self.value!r}"
        lead = {
            "tokens": "num_tokens",
            "reqs": "num_reqs",
            "fixed": str(self.offset),
        }[self.kind]
        if self.kind != "fixed" and self.offset:
            lead += f" {'+' if self.offset > 0 else '-'} {abs(self.offset)}"
        shape = ", ".join([lead, *map(str, self.trailing)])
        return f"a {self.dtype} tensor of shape ({shape})"


def call_make_inputs(make_inputs: Callable[[int, int], Mapping[str, Any]], num_tokens: int, num_reqs: int) -> dict[str, Any]:
    try:
        inputs = make_inputs(num_tokens, num_reqs)
    except Exception as exc:  # the user's code: say which call failed
        raise ValueError(
            f"make_inputs(num_tokens={num_tokens}, num_reqs={num_reqs}) raised "
            f"{type(exc).__name__}: {exc}. make_inputs must build inputs for any "
            "1 <= num_reqs <= num_tokens (the manager probes small shapes to learn "
            "which dimension follows which count)"
        ) from exc
    if not isinstance(inputs, Mapping) or not all(isinstance(k, str) for k in inputs):
        raise ValueError(
            f"make_inputs must return a dict of keyword inputs for module.forward; "
            f"got {type(inputs).__name__}"
        )
    return dict(inputs)


def _classify(name: str, probes: list[Any]) -> tuple[Kind, int]:
    (t1, r1), (t2, r2) = PROBES
    d1, d2 = (p.shape[0] for p in probes)
    if d1 == d2:
        return "fixed", d1
    if d1 - t1 == d2 - t2:
        return "tokens", d1 - t1
    if d1 - r1 == d2 - r2:
        return "reqs", d1 - r1
    raise ValueError(
        f"input '{name}': its leading dimension is {d1} at (num_tokens={t1}, num_reqs={r1}) "
        f"and {d2} at (num_tokens={t2}, num_reqs={r2}), which is neither num_tokens + c, "
        "num_reqs + c nor fixed; the manager can only pad the leading dimension"
    )


def infer_layout(
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    *,
    max_tokens: int,
    max_reqs: int,
    device: torch.device,
    pad_values: Mapping[str, PadValue],
) -> dict[str, InputSpec]:
    """Learn each input's layout and allocate its static buffer."""
    probes = [call_make_inputs(make_inputs, t, r) for t, r in PROBES]
    full = call_make_inputs(make_inputs, max_tokens, max_reqs)
    names = list(full)
    for (t, r), probe in zip(PROBES, probes, strict=False):
        if list(probe) != names:
            raise ValueError(
                f"make_inputs returned inputs {sorted(probe)} at (num_tokens={t}, num_reqs={r}) "
                f"but {sorted(names)} at (num_tokens={max_tokens}, num_reqs={max_reqs}); "
                "it must return the same names for every shape"
            )
    unknown = set(pad_values) - set(names)
    if unknown:
        raise ValueError(
            f"pad_values names unknown input(s) {sorted(unknown)}; inputs are {names}"
        )
    specs: dict[str, InputSpec] = {}
    for name in names:
        values = [p[name] for p in probes] + [full[name]]
        pad = pad_values.get(name, 0)
        if not isinstance(values[-1], torch.Tensor):
            if any(isinstance(v, torch.Tensor) for v in values) or any(v != values[-1] for v in values):
                raise ValueError(
                    f"input '{name}' is a Python value that changes from batch to batch "
                    f"({values[0]!r} at 7 tokens, {values[1]!r} at 11); a graph freezes Python "
                    "values at capture. Pass it as a tensor, or read the padded shape from "
                    "pytest_cudagraph.current_descriptor()"
                )
            specs[name] = InputSpec(name, "const", value=values[-1], pad=pad)
            continue
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"input '{name}' is a tensor at some shapes and not at others")
        tensors: list[torch.Tensor] = values
        dtype = tensors[-1].dtype
        if any(t.dtype != dtype for t in tensors):
            raise ValueError(f"input '{name}' changes dtype with the batch shape: {[t.dtype for t in tensors]}")
        if tensors[-1].dim() == 0:
            kind: Kind = "fixed"
            offset = 0
            trailing: tuple[int, ...] = ()
        else:
            trailing = tuple(tensors[-1].shape[1:])
            if any(tuple(t.shape[1:]) != trailing for t in tensors):
                raise ValueError(
                    f"input '{name}': a dimension other than the first changes with the batch "
                    f"shape ({[tuple(t.shape) for t in tensors]}); only the leading dimension may "
                    "follow num_tokens or num_reqs"
                )
            kind, offset = _classify(name, tensors[:2])
            spec_rows = InputSpec(name, kind, offset).rows(max_tokens, max_reqs)
            if tensors[-1].shape[0] != spec_rows:
                raise ValueError(
                    f"input '{name}' has {tensors[-1].shape[0]} rows at (num_tokens={max_tokens}, "
                    f"num_reqs={max_reqs}) but the probes say {kind} + {offset} = {spec_rows}"
                )
        if pad == "edge" and kind not in ("tokens", "reqs"):
            raise ValueError(f"pad_values['{name}'] = 'edge' needs an input that follows tokens or requests")
        if pad != "edge" and not isinstance(pad, (bool, int, float)):
            raise ValueError(f"pad_values['{name}'] must be a number, a bool or 'edge'; got {pad!r}")
        # Contiguous and owned by the manager: graphs hold its address for life.
        buffer = tensors[-1].detach().to(device=device, copy=True).contiguous()
        specs[name] = InputSpec(
            name, kind, offset if kind != "fixed" else (buffer.shape[0] if buffer.dim() else 0),
            dtype, trailing if buffer.dim() else (), pad, buffer,
        )
    return specs
