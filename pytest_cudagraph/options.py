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
from itertools import islice
from typing import Any

from .plan.batch import Batch
from .plan.config import CaptureConfig
from .plan.properties import invalid_reason
from .plan.validate import MAX_ITEMS, UsageError, check_tolerance, did_you_mean, short, unknown_keyword

__all__ = [
    "BACKENDS",
    "BUILTIN_CHECKS",
    "MAX_SECONDS",
    "MAX_WORLD_SIZE",
    "RUN_SETTINGS",
    "SEED_RANGE",
    "RunOption",
    "VerifyOptions",
    "capture_config",
    "check_named",
    "concrete_backend",
    "split_keywords",
    "verify_keyword_names",
]

BACKENDS: tuple[str, ...] = ("auto", "cuda", "emulate")
#: The built-in checks' names, in the order they run: what ``--help`` lists under
#: ``--cudagraph-checks`` without importing torch. ``checks/builtin`` registers the checks themselves,
#: and tests/test_registry.py holds that registry to this table (the same names, in the same order).
BUILTIN_CHECKS: tuple[str, ...] = (
    "capture_safety",
    "replay_matches_eager",
    "fresh_inputs",
    "real_batches",
    "padding_isolation",
    "state",
    "side_outputs",
    "determinism",
    "rng",
    "output_lifetime",
    "address_stability",
    "dispatch",
    "padded_size",
)
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
#: The most ranks a distributed verification runs: a process each, on this one host (on CUDA a GPU
#: each). Beyond it a number is a typo (10**6), whose processes alone would take the machine.
MAX_WORLD_SIZE = 64
#: The longest a setting in seconds may be: a week. Beyond it a number is a typo (1e300), which the
#: timers it sets would overflow.
MAX_SECONDS = 7 * 24 * 3600.0
#: The seeds torch's generators take (``torch.manual_seed``): beyond them it overflows.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


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
            "leading '-' deselect from the default checks (-determinism). A marker's or a call's checks= wins. "
            f"The checks: {', '.join(BUILTIN_CHECKS)}, and those a conftest's pytest_cudagraph_checks hook adds",
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
    #: Kernel -> a plain-torch function that stands in for it in the float64 reference (a custom op
    #: or the Python function around a Triton kernel that takes bf16 alone); held against the kernel
    #: first. Normalised to ``precision.references.References``.
    references: Any = field(default=None, metadata=_RUNNER)

    def __post_init__(self) -> None:
        # Normalised here, so that every consumer sees one form. Every refusal is a UsageError: one
        # line that the fixtures fail a test with, before anything runs.
        if not isinstance(self.backend, str) or self.backend.strip().lower() not in BACKENDS:
            hint = (
                did_you_mean(self.backend.strip().lower(), BACKENDS) if isinstance(self.backend, str) else ""
            )
            raise UsageError(f"backend must be one of {', '.join(BACKENDS)}; got {short(self.backend)}{hint}")
        object.__setattr__(self, "backend", self.backend.strip().lower())
        # rtol above 1 (100 %) lets any result pass: no comparison. atol's scale is the outputs'.
        object.__setattr__(self, "rtol", check_tolerance("rtol", self.rtol, maximum=1.0))
        object.__setattr__(self, "atol", check_tolerance("atol", self.atol))
        for name in ("batch_invariant", "exhaustive", "nonfinite_padding"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                if _bool_like(value):  # numpy and torch booleans, 0 and 1
                    object.__setattr__(self, name, bool(value))
                else:
                    raise UsageError(f"{name} must be True or False; got {short(value)}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise UsageError(f"progress must be True, False or None; got {short(self.progress)}")
        low, high = SEED_RANGE
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not low <= self.seed <= high:
            raise UsageError(
                f"seed must be an integer from -2**63 to 2**64 - 1, as torch takes it; got {short(self.seed)}"
            )
        for name in ("pad_values", "scratch_state", "batch_dims"):
            check_named(name, getattr(self, name))
        for name, dim in (self.batch_dims or {}).items():
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise UsageError(
                    f"batch_dims['{name}'] must be an int, the one dimension of '{name}' that follows "
                    f"num_tokens or num_reqs; got {short(dim)}"
                )
        object.__setattr__(self, "checks", _check_names_of_checks(self.checks))
        object.__setattr__(self, "descriptors", _labels(self.descriptors))
        object.__setattr__(self, "batches", _batches(self.batches))
        if self.references is not None:
            # Keys are torch ops and functions: read where they are given, which imports torch
            # (a test that gives them has imported it already).
            from .references import normalized

            object.__setattr__(self, "references", normalized(self.references))

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


def _bool_like(value: object) -> bool:
    """numpy's and torch's booleans, 0 and 1: read as True or False (a comparison that raises is not)."""
    try:
        return bool(value in (0, 1))
    except Exception:
        return False


#: What each keyword that maps names says it maps, for its message.
_MAPS = {
    "pad_values": "input names to the value their padded rows hold, such as {'mask': False}",
    "batch_dims": "input names to the one dimension that follows the batch, e.g. {'input_ids': 1}",
    "scratch_state": "module state names to the region forward may leave changed",
}


def check_named(name: str, value: object) -> None:
    """``value`` is None or maps input (or state) names, strings, to something."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise UsageError(f"{name} must map {_MAPS.get(name, 'names to values')}; got {short(value)}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise UsageError(f"{name} must be keyed by name (a string); got the key {short(bad[0])}")


def _check_names_of_checks(checks: Iterable[str] | str | None) -> tuple[str, ...] | None:
    """``checks`` as a tuple of names: a string splits at commas and spaces ('real_batches,-determinism');
    whether each names a check is the registry's to say, with the list of checks."""
    if checks is None:
        return None
    items = [p for p in re.split(r"[,\s]+", checks.strip()) if p] if isinstance(checks, str) else None
    if items is None:
        if not isinstance(checks, Iterable) or isinstance(checks, (bytes, Mapping)):
            raise UsageError(
                f"checks must be check names, such as ['real_batches', '-determinism']; got {short(checks)}"
            )
        items = list(islice(checks, MAX_ITEMS + 1))
    if (
        not items
        or len(items) > MAX_ITEMS
        or not all(isinstance(c, str) and _CHECK_NAME.fullmatch(c) for c in items)
    ):
        raise UsageError(
            "checks must be check names separated by commas, a leading '-' to deselect one, such as "
            f"capture_safety,real_batches or -determinism; got {short(checks)}"
        )
    return tuple(items)


def _labels(descriptors: Iterable[str] | str | None) -> tuple[str, ...] | None:
    if descriptors is None:
        return None
    if isinstance(descriptors, str):
        return (descriptors,)  # one label, not its characters
    expected = f"descriptors must be descriptor labels such as 'FULL-T8-R4'; got {short(descriptors)}"
    if isinstance(descriptors, (bytes, Mapping)) or not isinstance(descriptors, Iterable):
        raise UsageError(expected)
    labels = tuple(islice(descriptors, MAX_ITEMS + 1))
    if not labels or len(labels) > MAX_ITEMS or not all(isinstance(label, str) for label in labels):
        raise UsageError(expected)
    return labels


def _batches(batches: Iterable[Batch] | None) -> tuple[Batch, ...] | None:
    """``batches`` checked: real batches dispatch answers (``invalid_reason``), without repeats."""
    if batches is None:
        return None
    if isinstance(batches, (str, bytes, Batch, Mapping)) or not isinstance(batches, Iterable):
        raise UsageError(
            f"batches must be an iterable of pytest_cudagraph.plan.Batch (a trace's shapes: "
            f"read_trace(path).shapes); got {type(batches).__name__}"
        )
    found: dict[Batch, None] = {}
    for batch in batches:
        if not isinstance(batch, Batch):
            raise UsageError(f"batches must hold pytest_cudagraph.plan.Batch objects; got {short(batch)}")
        reason = invalid_reason(batch)
        if reason is not None or batch.num_tokens == 0:
            raise UsageError(f"batches: {batch} is not a real batch: {reason or 'it holds no token'}")
        found[batch] = None
    if not found:
        # Every check that runs real batches would have none, and pass having seen nothing.
        raise UsageError(
            "batches is empty: the checks that run real batches would run none; give the trace's shapes, "
            "or leave batches out for the sweep of every token count"
        )
    return tuple(found)


def verify_keyword_names() -> tuple[str, ...]:
    """Every keyword ``verify`` takes besides the module and ``make_inputs``: ``config``,
    ``options``, ``VerifyOptions``' fields, then ``CaptureConfig``'s."""
    return ("config", "options", *VerifyOptions.field_names(), *CaptureConfig.field_names())


def split_keywords(
    keywords: Mapping[str, Any], where: str = "verify()"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``verify``'s keywords as (``CaptureConfig``'s, ``VerifyOptions``'), those given as None
    dropped (a default); a ``UsageError`` with the nearest known name for one it does not take."""
    known = verify_keyword_names()
    fields = set(VerifyOptions.field_names())
    config: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for name, value in keywords.items():
        if name not in known or name in ("config", "options"):
            raise UsageError(f"{where}: {unknown_keyword(name, known[2:], where)}")
        if value is not None:
            (options if name in fields else config)[name] = value
    return config, options


def capture_config(
    config: CaptureConfig | Mapping[str, Any] | None, keywords: Mapping[str, Any]
) -> CaptureConfig:
    """The capture configuration: ``config``, or ``CaptureConfig``'s keywords given to ``verify``
    (``max_num_reqs`` defaults to the largest capture size). A ``UsageError`` for what it refuses."""
    fields = CaptureConfig.field_names()
    unknown = [name for name in keywords if name not in fields]
    if unknown:
        raise UsageError(unknown_keyword(unknown[0], fields, "CaptureConfig"))
    if config is not None:
        if keywords:
            raise UsageError(f"pass config or its keywords ({', '.join(sorted(keywords))}), not both")
        if isinstance(config, CaptureConfig):
            return config
        if not isinstance(config, Mapping):
            raise UsageError(
                f"config must be a CaptureConfig or a dict of its keywords; got {type(config).__name__}"
            )
        bad = [name for name in config if name not in fields]
        if bad:
            raise UsageError(f"config: {unknown_keyword(bad[0], fields, 'CaptureConfig')}")
        keywords = config
    keywords = {k: v for k, v in keywords.items() if v is not None}
    if "capture_sizes" not in keywords:
        raise UsageError(
            "verify() needs capture_sizes (the token counts to capture a graph for), or a config"
        )
    if "max_num_reqs" not in keywords:
        # As many requests as the largest graph has tokens: every decode batch has a graph. Read
        # from the sizes as CaptureConfig checks them (an endless range is refused, not read).
        sizes = CaptureConfig(capture_sizes=keywords["capture_sizes"], max_num_reqs=1).capture_sizes
        keywords["capture_sizes"], keywords["max_num_reqs"] = sizes, max(sizes)
    return CaptureConfig(**keywords)
