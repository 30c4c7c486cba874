"""``VerifyOptions``: how a verification runs, one frozen object built and validated in one place.

``verify``'s keywords (besides the capture plan's, which ``CaptureConfig``
holds), the ``cudagraph`` marker's keywords and signature, the fixtures'
keywords, ``verify_runner``'s (the fields marked for runners) and the report's
record of them all derive from the fields below: a new keyword is one field
here. Pure Python: importing this module does not import torch (the plugin's
settings read it when pytest starts).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .plan.batch import Batch
from .plan.properties import invalid_reason

__all__ = ["BACKENDS", "RUN_SETTINGS", "RunOption", "VerifyOptions", "concrete_backend"]

BACKENDS: tuple[str, ...] = ("auto", "cuda", "emulate")
#: Fields the run sets (``--cudagraph-verify``), not a test's marker.
RUN_SETTINGS: tuple[str, ...] = ("exhaustive",)


def concrete_backend(name: str) -> str:
    """'auto' -> 'cuda' where ``torch.cuda.is_available()``, else 'emulate'; others unchanged.

    Imports torch (on first call) only for 'auto'.
    """
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "emulate"


#: The mark of a field ``verify_runner`` takes too.
_RUNNER = {"runner": True}


@dataclass(frozen=True)
class RunOption:
    """A field a whole test run can set: ``--cudagraph-<name>`` on the command line and
    ``cudagraph_<name>`` in the ini file (``name`` with ``-`` for ``_`` on the command line), below a
    marker's and a call's keyword. The plugin builds both from this, and the field's own
    validation checks what they give."""

    #: What the option does, for ``--help``.
    help: str
    #: The option's name where it is not the field's (``exhaustive`` is ``--cudagraph-verify``).
    name: str = ""
    #: What ``--help`` shows as the value (None: a flag, for a bool field).
    metavar: str | None = None


def _run_option(help: str, *, name: str = "", metavar: str | None = None, runner: bool = False) -> Any:
    """The metadata of a field a run sets (see ``RunOption``)."""
    return {"option": RunOption(help, name, metavar), **(_RUNNER if runner else {})}


_CHECK_NAME = re.compile(r"-?[a-z][a-z0-9_]*")


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """How ``verify`` runs: everything but the module, its inputs and the capture plan."""

    #: 'auto' (CUDA where available), 'cuda' or 'emulate'.
    backend: str = field(
        default="auto",
        metadata=_run_option(
            "graph backend: cuda (real CUDA graphs), emulate (CPU emulation) or auto (cuda where available). "
            "Default auto",
            metavar="auto|cuda|emulate",
        ),
    )
    #: The device (default: the backend's: the current CUDA device, or the CPU).
    device: Any = field(default=None, metadata=_RUNNER)
    #: Check names to run (a leading '-' deselects one); default: every default check.
    checks: tuple[str, ...] | None = field(
        default=None,
        metadata=_run_option(
            "the checks every verification runs: names select (real_batches,capture_safety), names with a "
            "leading '-' deselect from the default checks (-determinism). A marker's or a call's checks= wins",
            metavar="NAME,-NAME",
            runner=True,
        ),
    )
    #: ``Check``s of your own, run after the built-ins and selectable by name.
    extra_checks: Any = field(default=None, metadata=_RUNNER)
    #: Tolerances (default: the dtype's, and the floor measured across shapes).
    rtol: float | None = field(default=None, metadata=_RUNNER)
    atol: float | None = field(default=None, metadata=_RUNNER)
    #: Real rows must equal unpadded eager bit for bit.
    batch_invariant: bool = field(default=False, metadata=_RUNNER)
    #: Every descriptor (False: the smallest and largest of each mode).
    exhaustive: bool = field(
        default=True,
        metadata=_run_option(
            "verify every descriptor with every check (exhaustive); without it, a quick mode verifies the "
            "smallest and largest descriptor of each mode, and asks padded_size's cross-shape question of "
            "eager at every other size (its most padded real batch, nothing captured)",
            name="verify",
        ),
    )
    #: The value padded rows of each input hold.
    pad_values: Mapping[str, Any] | None = None
    #: State regions the module may leave changed.
    scratch_state: Mapping[str, Any] | None = field(default=None, metadata=_RUNNER)
    #: Submodules PIECEWISE graphs run eagerly, between graph segments.
    eager_submodules: Any = None
    #: Descriptor labels to verify (default: the selection).
    descriptors: tuple[str, ...] | None = None
    #: The seed every run starts from.
    seed: int = field(default=0, metadata=_RUNNER)
    #: padding_isolation also pads with NaN and inf.
    nonfinite_padding: bool = field(
        default=False,
        metadata=_run_option(
            "padding_isolation also fills padded rows with NaN and inf, beyond the finite fills (zeros, "
            "random, large) engines leave there: a strictness that fails causal attention (0 * NaN)"
        ),
    )
    #: Input name -> the dimension that follows the batch.
    batch_dims: Mapping[str, int] | None = None
    #: A progress bar per descriptor (None: on a terminal, when the checks are slow).
    progress: bool | None = None
    #: The real batches to run (a trace's shapes) in place of the sweep of every token count.
    batches: tuple[Batch, ...] | None = None

    def __post_init__(self) -> None:
        # Normalised here, so that every consumer sees one form.
        if not isinstance(self.backend, str) or self.backend.strip().lower() not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        object.__setattr__(self, "backend", self.backend.strip().lower())
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
            ):
                raise ValueError(f"{name} must be a number >= 0 or None (dtype default); got {value!r}")
        for name in ("batch_invariant", "exhaustive", "nonfinite_padding"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                if value in (0, 1):  # numpy and torch booleans, 0 and 1
                    object.__setattr__(self, name, bool(value))
                else:
                    raise ValueError(f"{name} must be True or False; got {value!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ValueError(f"progress must be True, False or None; got {self.progress!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int; got {self.seed!r}")
        object.__setattr__(self, "checks", _check_names(self.checks))
        object.__setattr__(self, "descriptors", _labels(self.descriptors))
        object.__setattr__(self, "batches", _batches(self.batches))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def runner_field_names(cls) -> tuple[str, ...]:
        """The fields ``verify_runner`` takes too."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("runner"))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def run_options(cls) -> tuple[tuple[str, RunOption, Any], ...]:
        """(field, its ``RunOption``, its default) of each field a whole run can set, in field order."""
        return tuple(
            (f.name, f.metadata["option"], f.default)
            for f in dataclasses.fields(cls)
            if "option" in f.metadata
        )


def _check_names(checks: Iterable[str] | str | None) -> tuple[str, ...] | None:
    """``checks`` as a tuple of names: a string splits at commas and spaces ('real_batches,-determinism');
    whether each names a check is the registry's to say, with the list of checks."""
    if checks is None:
        return None
    items = [p for p in re.split(r"[,\s]+", checks.strip()) if p] if isinstance(checks, str) else None
    if items is None:
        if not isinstance(checks, Iterable) or isinstance(checks, bytes):
            raise ValueError(
                f"checks must be check names, such as ['real_batches', '-determinism']; got {checks!r}"
            )
        items = list(checks)
    if not items or not all(isinstance(c, str) and _CHECK_NAME.fullmatch(c) for c in items):
        raise ValueError(
            "checks must be check names separated by commas, a leading '-' to deselect one, such as "
            f"capture_safety,real_batches or -determinism; got {checks!r}"
        )
    return tuple(items)


def _labels(descriptors: Iterable[str] | str | None) -> tuple[str, ...] | None:
    if descriptors is None:
        return None
    if isinstance(descriptors, str):
        return (descriptors,)  # one label, not its characters
    labels = tuple(descriptors)
    if not labels or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"descriptors must be descriptor labels such as 'FULL-T8-R4'; got {descriptors!r}")
    return labels


def _batches(batches: Iterable[Batch] | None) -> tuple[Batch, ...] | None:
    """``batches`` checked: real batches dispatch answers (``invalid_reason``), without repeats."""
    if batches is None:
        return None
    if isinstance(batches, (str, bytes, Batch)) or not isinstance(batches, Iterable):
        raise ValueError(
            f"batches must be an iterable of pytest_cudagraph.plan.Batch (a trace's shapes: "
            f"read_trace(path).shapes); got {type(batches).__name__}"
        )
    found: dict[Batch, None] = {}
    for batch in batches:
        if not isinstance(batch, Batch):
            raise ValueError(f"batches must hold pytest_cudagraph.plan.Batch objects; got {batch!r}")
        reason = invalid_reason(batch)
        if reason is not None or batch.num_tokens == 0:
            raise ValueError(f"batches: {batch} is not a real batch: {reason or 'it holds no token'}")
        found[batch] = None
    return tuple(found)
