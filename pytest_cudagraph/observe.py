"""What a forward does to its module, seen op by op.

Two things the checks need and cannot read off the module itself:

- **Which parameters and buffers a forward writes.** Verification restores
  the module between runs and compares its state; copying every parameter
  for that would double an 8B model's memory. Only what a forward writes
  (a KV cache, a counter, running statistics) needs a copy, and every write
  passes through the dispatcher as an op whose schema marks the argument it
  writes (``alias_info.is_write``), so a dispatch mode sees each one.
- **The precision its arithmetic runs at.** Eager runs of different batch
  shapes round differently (another GEMM tiling, another reduction order),
  and how far is set by the coarsest precision the matrix products and
  convolutions run at: bf16, or TF32 for fp32 tensors on a GPU that allows
  it, whatever dtype the output has.

The observer is fed by the capture guard (every op of a checked capture and
of the guarded eager runs) and by ``observing`` for eager forwards of its
own (a learning pass, the probes). ``restoring`` runs forwards whose effect
must not stay: it copies each tensor just before its first write and puts the
copies back afterwards, so a forward that writes nothing costs no copy.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from .errors import InternalError
from .faults import cuda_error_code

__all__ = [
    "MODULE_INTERNALS",
    "ForwardObserver",
    "bit_sums",
    "buffers_restored",
    "draws_random",
    "fingerprint",
    "internal_error",
    "module_tensors",
    "named_tensors",
    "observing",
    "outside_forward",
    "plain_parts",
    "poisoned",
    "quantizes",
    "restoring",
    "unit_roundoff",
]


class DispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A ``TorchDispatchMode`` that is never compiled: without ``_should_skip_dynamo``, torch wraps every
    call of ``__torch_dispatch__`` (each op of a forward) in a guard against Dynamo, which costs
    more than the bookkeeping of most of the modes here. Every dispatch mode of the package derives
    from it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


aten = torch.ops.aten

#: The unit roundoff (half the gap between 1 and the next value) of each floating dtype.
_UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.complex128: 2.0**-53,
    torch.complex64: 2.0**-24,
}
for _name, _u in (
    ("float8_e4m3fn", 2.0**-4),
    ("float8_e4m3fnuz", 2.0**-4),
    ("float8_e5m2", 2.0**-3),
    ("float8_e5m2fnuz", 2.0**-3),
):
    if hasattr(torch, _name):
        _UNIT_ROUNDOFF[getattr(torch, _name)] = _u
#: TensorFloat-32: fp32's range with fp16's 10-bit mantissa.
TF32 = 2.0**-11


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype``; 0.0 for integers and bool (exact)."""
    return _UNIT_ROUNDOFF.get(dtype, 0.0)


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# Where the bulk of a forward's rounding happens: long reductions whose
# order the kernel picks by shape. Elementwise ops round once per element,
# the same way at every shape.
_MATMUL = _packets(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "addmv",
    "mv",
    "dot",
    "vdot",
    "matmul",
    "linear",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_scaled_dot_product_attention_math",
)
_CONV = _packets(
    "convolution",
    "_convolution",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "mkldnn_convolution",
    "convolution_overrideable",
    "_slow_conv2d_forward",
    "conv2d",
    "conv1d",
    "conv3d",
)


def _fp32_roundoff(device: torch.device, conv: bool) -> float:
    """What an fp32 product or convolution rounds at on ``device`` under torch's current settings."""
    try:
        if conv:
            return TF32 if device.type == "cuda" and _tf32_convolutions() else 2.0**-24
        return _fp32_products(device)
    except (RuntimeError, AttributeError):
        # torch refuses to say (its legacy and new precision settings were mixed): the looser
        # reading, so that rounding is never taken for a bug.
        return TF32 if device.type == "cuda" else 2.0**-24


def _tf32_convolutions() -> bool:
    """Whether cuDNN may run fp32 convolutions in TF32 (on by default)."""
    setting = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    if setting in ("tf32", "ieee"):
        return bool(setting == "tf32")
    return bool(torch.backends.cudnn.allow_tf32)


def _fp32_products(device: torch.device) -> float:
    """The unit roundoff fp32 matrix products run at on ``device``."""
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return 2.0**-8  # fp32 products may run in bf16
    if device.type != "cuda":
        return 2.0**-24
    return TF32 if (torch.backends.cuda.matmul.allow_tf32 or precision == "high") else 2.0**-24


# func -> the positions (ints) and keyword names (strs) of the arguments it writes
_WRITES: dict[Any, tuple[int | str, ...]] = {}

# Ops that write arguments their schema does not mark: batch norm updates its
# running statistics (positions 3 and 4) in place; c10d's in-place
# collectives write the tensors they are given.
_UNMARKED: dict[Any, tuple[int | str, ...]] = {
    p: (3, 4, "running_mean", "running_var")
    for p in _packets(
        "native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_impl_index", "batch_norm"
    )
}
_COLLECTIVE_NAMESPACES = frozenset({"c10d"})


def _written_arguments(func: Any) -> tuple[int | str, ...]:
    found = _WRITES.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        places: list[int | str] = list(_UNMARKED.get(getattr(func, "overloadpacket", None), ()))
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            places.append(0)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    places.append(arg.name if arg.kwarg_only else i)
                    if not arg.kwarg_only:
                        places.append(arg.name)  # also given by name
        found = _WRITES[func] = tuple(places)
    return found


def written_tensors(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors ``func`` writes (its schema's write marks, batch norm's unmarked statistics)."""
    found = []
    for place in _written_arguments(func):
        t = args[place] if isinstance(place, int) and place < len(args) else kwargs.get(place)
        if isinstance(t, torch.Tensor):
            found.append(t)
    return found


_VIEWS: dict[Any, bool] = {}


def _is_view(func: Any) -> bool:
    found = _VIEWS.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = _VIEWS[func] = schema is not None and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
    return found


def data_read(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors whose values ``func`` reads: every tensor argument but those it only writes
    (the target of ``copy_``, an ``out=``), and none for a view (it reads no values)."""
    if _is_view(func):
        return []
    written = {id(t) for t in written_tensors(func, args, kwargs)}
    flat, _ = tree_flatten((args, kwargs))
    return [t for t in flat if isinstance(t, torch.Tensor) and id(t) not in written]


# Ops that draw from a generator, in every overload (those without a generator argument draw
# from the default one): the random factories and samplers, and dropout's own kernels.
_DRAWS_BY_NAME = _packets(
    "native_dropout",
    "_fused_dropout",
    "fused_dropout",
    "rrelu_with_noise",
    "feature_dropout",
    "alpha_dropout",
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "bernoulli_",
    "normal",
    "normal_",
    "uniform_",
    "multinomial",
    "poisson",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "random_",
    "binomial",
    "_standard_gamma",
    "_sample_dirichlet",
)
_DRAWS: dict[Any, bool] = {}


def draws_random(func: Any) -> bool:
    """Whether ``func`` draws from a random generator: its schema takes one, or it is dropout's."""
    found = _DRAWS.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = getattr(func, "overloadpacket", None) in _DRAWS_BY_NAME or (
            schema is not None and any("Generator" in str(a.type) for a in schema.arguments)
        )
        _DRAWS[func] = found
    return found


# Ops that hand back memory as the allocator left it.
_ALLOCATES = _packets(
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"
)
# Ops that overwrite their first argument without reading it.
_OVERWRITES = _packets(
    "copy_",
    "fill_",
    "zero_",
    "uniform_",
    "normal_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "set_",
    "resize_",
)


def plain_parts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``t`` as the plain tensors that hold its data, by name: ``t`` itself, or for a wrapper
    subclass (torchao's quantized weights, a DTensor) its inner tensors (``__tensor_flatten__``),
    each as ``name.attr``, recursively. A wrapper holds no storage of its own and implements few
    ops, so its address, its bits and its copies are those of its parts."""
    if not is_traceable_wrapper_subclass(t):
        return [(name, t)]
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    parts: list[tuple[str, torch.Tensor]] = []
    for attr in attrs:
        inner = getattr(t, attr)
        if isinstance(inner, torch.Tensor):
            parts.extend(plain_parts(f"{name}.{attr}", inner))
    return parts


def named_tensors(
    module: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` as it holds them, by name, tied ones under each of
    their names (lazy ones and wrapper subclasses included): ``named_parameters`` then
    ``named_buffers``, with ``remove_duplicate=False``, in their order.

    ``modules``: ``module.named_modules(remove_duplicate=False)`` read once before (an observer
    keeps it), so that a walk reads each submodule's tables as they are now without walking the
    tree again: this runs around every ``make_inputs`` call, hundreds of times a verification."""
    if modules is None:
        modules = list(module.named_modules(remove_duplicate=False))
    items: list[tuple[str, torch.Tensor]] = []
    append = items.append
    for table in ("_parameters", "_buffers"):
        for prefix, sub in modules:
            for key, value in getattr(sub, table).items():
                if value is not None:
                    append((f"{prefix}.{key}" if prefix else key, value))
    return items


def module_tensors(
    module: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` as plain tensors (``plain_parts``), by name, tied
    ones under each of their names; lazy ones (``nn.LazyLinear`` before its first forward) left out,
    as they hold nothing yet. ``modules`` as ``named_tensors`` takes it."""
    lazy = torch.nn.parameter.is_lazy
    wrapper = is_traceable_wrapper_subclass
    found: list[tuple[str, torch.Tensor]] = []
    for name, t in named_tensors(module, modules):
        if lazy(t):
            continue
        if wrapper(t):
            found.extend(plain_parts(name, t))
        else:
            found.append((name, t))
    return found


def quantizes(t: Any, dtype: Any) -> bool:
    """Whether casting ``t`` to ``dtype`` quantizes: floating values to an integer or float8 dtype."""
    return (
        isinstance(dtype, torch.dtype)
        and dtype != torch.bool
        and (not (dtype.is_floating_point or dtype.is_complex) or dtype.itemsize == 1)
        and isinstance(t, torch.Tensor)
        and t.is_floating_point()
    )


# Reductions a per-tensor scale is taken with (absmax, min and max).
_REDUCTIONS = frozenset(getattr(aten, n) for n in ("amax", "amin", "max", "min", "aminmax"))


def _over_every_element(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether a reduction of ``_REDUCTIONS`` runs over every element of a floating tensor of more
    than one element (``max()`` with no dimension, ``amax`` over all of them)."""
    t = args[0] if args else None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() < 2:
        return False
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dim" not in names:
        return True  # max(), min(): no dimension to keep
    at = names.index("dim")
    dim = args[at] if len(args) > at else (kwargs or {}).get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return True
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return len({int(d) % max(t.dim(), 1) for d in dims}) >= t.dim()


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse, meta, and the like: no storage to write
        return None


# What ``ForwardObserver`` notes of an op, decided once per op (it runs for every op of a forward):
# bits of the kinds below, 0 for an op with nothing to note (most of them).
_K_WRITES, _K_PRODUCT, _K_CONV, _K_TO_COPY, _K_REDUCTION, _K_RANDOM, _K_ALLOCATES = (1 << i for i in range(7))
_OBSERVED: dict[Any, int] = {}


def _observed_kind(func: Any) -> int:
    packet = getattr(func, "overloadpacket", None)
    kind = _K_WRITES if _written_arguments(func) else 0
    if packet in _MATMUL or packet in _CONV:
        kind |= _K_PRODUCT | (_K_CONV if packet in _CONV else 0)
    elif packet is aten._to_copy:
        kind |= _K_TO_COPY
    elif packet in _REDUCTIONS:
        kind |= _K_REDUCTION
    elif draws_random(func):
        kind |= _K_RANDOM
    if packet in _ALLOCATES:
        kind |= _K_ALLOCATES
    _OBSERVED[func] = kind
    return kind


class ForwardObserver:
    """What the forwards it sees do to ``module``: the parameters and buffers
    they write (``written``, by dotted name, in the order first written) and
    the coarsest unit roundoff of their matrix products and convolutions
    (``roundoff``; 0.0 until one is seen)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.written: dict[str, None] = {}
        self.roundoff = 0.0
        #: Ops seen drawing random numbers (by name): the module's randomness, told by its use of a
        #: generator rather than by two runs that differ (Python state or uninitialized memory differ too).
        self.random_ops: dict[str, None] = {}
        #: Memory handed back as the allocator left it (``torch.empty`` and kin) and not yet written:
        #: storage address -> the op that made it. Entries leave with their tensors.
        self._fresh: dict[int, str] = {}
        #: The first op seen reading such memory: (the op that read, the op that made it), or None.
        self.unwritten_read: tuple[str, str] | None = None
        # storage address -> the (name, tensor) pairs that live there; made on first use
        self._owners: dict[int, list[tuple[str, torch.Tensor]]] | None = None
        # the submodules by name, read once until refresh(): see tensors()
        self._modules: list[tuple[str, torch.nn.Module]] | None = None
        # copies taken before first writes, one dict per open ``restoring`` block
        self._open: list[dict[str, torch.Tensor]] = []
        #: Called with the names of the module tensors ``make_inputs`` wrote (a weight sync in place),
        #: after each call that wrote any: what the module's forwards start from, not what they write.
        self.on_outside_writes: list[Callable[[list[str]], None]] = []
        #: The dtypes forwards cast floating values to, quantizing (int8, float8_e4m3fn), by name.
        self.quantized: dict[str, None] = {}
        #: The first reduction seen over every element of a floating tensor (``x.abs().amax()``, a
        #: per-tensor scale), by op name; "" until one is seen. Where the tensor holds the batch's
        #: rows, padded rows take part in it.
        self.whole_reduction = ""
        #: Called with the names of the module tensors ``make_inputs`` rebound to new memory
        #: (``param.data = new``): graphs captured before keep reading the old memory.
        self.on_outside_rebinds: list[Callable[[list[str]], None]] = []

    def refresh(self) -> None:
        """Read the module's tensors again (after parameters or buffers, or submodules, were replaced)."""
        self._owners = None
        self._modules = None

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and buffer as plain tensors by name (``module_tensors``: a quantized
        weight as its inner tensors), tied ones under each of their names: each submodule's tables
        read now, the submodules as the last ``refresh`` found them."""
        if self._modules is None:
            self._modules = list(self.module.named_modules(remove_duplicate=False))
        return module_tensors(self.module, self._modules)

    def _owner_map(self) -> dict[int, list[tuple[str, torch.Tensor]]]:
        if self._owners is None:
            owners: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for name, t in self.tensors():
                key = _storage_key(t)
                if key is not None and t.numel():
                    owners.setdefault(key, []).append((name, t))
            self._owners = owners
        return self._owners

    def observe(self, func: Any, args: Any, kwargs: Any) -> None:
        """One op about to run (called before it runs, so a copy taken here holds the old value)."""
        if self._fresh:
            self._reads_fresh(func, args, kwargs)
        kind = _OBSERVED.get(func)
        if kind is None:
            kind = _observed_kind(func)
        if not kind:
            return  # most ops of a forward: nothing here to note
        if kind & _K_WRITES:
            for place in _written_arguments(func):
                value = (
                    args[place]
                    if isinstance(place, int) and place < len(args)
                    else kwargs.get(place)
                    if isinstance(place, str) and kwargs
                    else None
                )
                if isinstance(value, torch.Tensor):
                    self._wrote(value)
                elif isinstance(value, (list, tuple)):
                    for v in value:
                        if isinstance(v, torch.Tensor):
                            self._wrote(v)
        if kind & _K_PRODUCT:
            self._note_precision(args, conv=bool(kind & _K_CONV))
        elif kind & _K_TO_COPY:
            dtype = kwargs.get("dtype") if kwargs else None
            if quantizes(args[0] if args else None, dtype):
                self.quantized.setdefault(str(dtype).replace("torch.", ""), None)
        elif kind & _K_REDUCTION:
            if not self.whole_reduction and _over_every_element(func, args, kwargs):
                self.whole_reduction = str(func)
        elif kind & _K_RANDOM:
            self.random_ops.setdefault(str(func), None)

    def after(self, func: Any, out: Any) -> None:
        """One op that ran: memory it handed back unwritten (``torch.empty``) is watched for reads."""
        kind = _OBSERVED.get(func)
        if kind is None:
            kind = _observed_kind(func)
        if not kind & _K_ALLOCATES or not isinstance(out, torch.Tensor):
            return
        key = _storage_key(out)
        if key is None or not out.numel():
            return
        fresh = self._fresh
        fresh[key] = str(func)

        def forget(_: Any = None, key: int = key) -> None:
            fresh.pop(key, None)

        weakref.finalize(out, forget)

    def _reads_fresh(self, func: Any, args: Any, kwargs: Any) -> None:
        """Mark what ``func`` writes as written; the first read of memory nobody wrote is a finding.

        An argument the op writes (its schema says so, ``out=`` included) counts as written,
        unless the op is an in-place method that reads its ``self`` first (``add_``, not
        ``copy_``). Views and ops that read only a tensor's metadata (``empty_like``) read nothing.
        A write to part of the memory counts for all of it: a partial write followed by a read of
        the rest is not told, while nothing that writes is ever taken for a read."""
        if _reads_nothing(func):
            return
        packet = getattr(func, "overloadpacket", None)
        written = _written_arguments(func)
        in_place = (
            getattr(getattr(func, "_schema", None), "name", "").endswith("_") and packet not in _OVERWRITES
        )
        places: list[tuple[int | str, Any]] = list(enumerate(args))
        if kwargs:
            places.extend(kwargs.items())
        for place, value in places:
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                key = _storage_key(t)
                if key is None or key not in self._fresh:
                    continue
                if place in written and not (place == 0 and in_place):
                    del self._fresh[key]  # written, not read
                elif self.unwritten_read is None:
                    self.unwritten_read = (str(func), self._fresh[key])

    def _wrote(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None:
            return
        for name, tensor in self._owner_map().get(key, ()):
            self.written.setdefault(name, None)
            for copies in self._open:
                if name not in copies:
                    copies[name] = tensor.detach().clone()

    def _note_precision(self, args: Any, *, conv: bool) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
                u = unit_roundoff(a.dtype)
                if a.dtype in (torch.float32, torch.complex64):
                    u = _fp32_roundoff(a.device, conv)
                self.roundoff = max(self.roundoff, u)
                return

    def written_items(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters and buffers seen written, by name."""
        if not self.written:
            return []
        return [(name, t) for name, t in self.tensors() if name in self.written]


# Ops that read a tensor's shape, dtype and device, never its values.
_METADATA_ONLY = _packets(
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "new_ones",
    "new_full",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "detach",
    "lift_fresh",
    "_has_same_storage_numel",
)
_NOTHING_READ: dict[Any, bool] = {}


def internal_error(step: str, exc: Exception, tensor: str | None = None) -> NoReturn:
    """Raise ``exc``, which the harness's own bookkeeping raised, as an ``InternalError`` saying
    ``step``: never as the user's code failing, though it ran inside their make_inputs or forward.
    A CUDA error or an out-of-memory error goes up as it is (the device's state, told by faults),
    and so does an ``InternalError`` already told."""
    if isinstance(exc, (InternalError, torch.OutOfMemoryError)) or cuda_error_code(exc) is not None:
        raise exc
    raise InternalError(step, exc, tensor) from exc


def _written_name(observer: ForwardObserver, func: Any, args: Any, kwargs: Any) -> str | None:
    """The module tensor ``func`` writes, by name, for an error message: None when it writes none
    or finding it fails too. Only read after a failure, never per op."""
    try:
        for t in written_tensors(func, args, kwargs or {}):
            key = _storage_key(t)
            for name, _ in observer._owner_map().get(key, ()) if key is not None else ():
                return name
    except Exception:
        return None
    return None


class _WritesOutside(DispatchMode):
    """Names the module tensors the block's ops write, without copying or changing anything."""

    def __init__(self, observer: ForwardObserver) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.observer = observer
        self.names: dict[str, None] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            for place in _written_arguments(func):
                value = args[place] if isinstance(place, int) and place < len(args) else kwargs.get(place)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    key = _storage_key(t) if isinstance(t, torch.Tensor) else None
                    for name, _ in self.observer._owner_map().get(key, ()) if key is not None else ():
                        self.names.setdefault(name, None)
        except Exception as exc:  # ours, not make_inputs': said so
            internal_error(
                f"observing make_inputs' writes to the module (at {func})",
                exc,
                _written_name(self.observer, func, args, kwargs),
            )
        return func(*args, **kwargs)  # make_inputs' own op: what it raises is make_inputs'


@contextlib.contextmanager
def outside_forward(observer: ForwardObserver) -> Iterator[None]:
    """Code that is not a forward (``make_inputs``): the module tensors it writes in place are told to
    ``observer.on_outside_writes`` when the block ends, so that they are not taken for a forward's;
    those it rebinds to new memory (``param.data = new``) to ``observer.on_outside_rebinds``.

    A rebinding is told by the storage each tensor had before the block, held until it ends: the
    allocator cannot hand that memory to the new tensor, so a new address is a new storage.
    What this bookkeeping raises is an ``InternalError``; what the block raises goes up as it is."""
    name: str | None = None
    held: dict[str, Any] = {}
    try:
        for name, t in observer.tensors():
            if t.numel():
                held[name] = t.untyped_storage()
    except Exception as exc:
        internal_error("reading the module's tensors before make_inputs", exc, name)
    watch = _WritesOutside(observer)
    with watch:
        yield
    moved: list[str] = []
    name = None
    try:
        for name, t in observer.tensors():
            if name in held and t.untyped_storage().data_ptr() != held[name].data_ptr():
                moved.append(name)
    except Exception as exc:
        internal_error(
            "reading the module's tensors after make_inputs (to tell the ones it rebound)", exc, name
        )
    del held
    try:
        if moved:
            observer.refresh()
            for rebound in list(observer.on_outside_rebinds):
                rebound(moved)
        if watch.names:
            for listener in list(observer.on_outside_writes):
                listener(list(watch.names))
    except Exception as exc:
        internal_error(
            f"telling the harness which module tensors make_inputs changed ({[*moved, *watch.names]})", exc
        )


def _reads_nothing(func: Any) -> bool:
    """Whether ``func`` reads no tensor's values: a view (its result aliases an argument) or a
    metadata op."""
    found = _NOTHING_READ.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        view = schema is not None and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        found = _NOTHING_READ[func] = view or getattr(func, "overloadpacket", None) in _METADATA_ONLY
    return found


class _Observing(DispatchMode):
    def __init__(self, observer: ForwardObserver) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.observer = observer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            self.observer.observe(func, args, kwargs)
        except Exception as exc:  # ours, not the forward's: said so
            internal_error(
                f"observing the forward's op {func}", exc, _written_name(self.observer, func, args, kwargs)
            )
        out = func(*args, **kwargs)  # the forward's own op: what it raises is the forward's
        try:
            self.observer.after(func, out)
        except Exception as exc:
            internal_error(f"observing what the forward's op {func} returned", exc)
        return out


class _Poisoning(DispatchMode):
    """Fills the memory ``torch.empty`` and kin hand back with a value of its own."""

    def __init__(self, which: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.which = which

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            getattr(func, "overloadpacket", None) in _ALLOCATES
            and isinstance(out, torch.Tensor)
            and out.numel()
        ):
            out.fill_(_POISON[self.which](out.dtype))
        return out


def _poison_value(first: bool) -> Callable[[torch.dtype], Any]:
    def value(dtype: torch.dtype) -> Any:
        if dtype == torch.bool:
            return first
        if dtype.is_floating_point or dtype.is_complex:
            return 1234.5 if first else -2345.25  # finite, and far from what a forward computes
        return 0x5A if first else 0x25

    return value


_POISON = (_poison_value(True), _poison_value(False))


@contextlib.contextmanager
def poisoned(which: int) -> Iterator[None]:
    """Every ``torch.empty`` (and kin) the block makes holds poison ``which`` (0 or 1): a forward that
    reads memory nobody wrote gives other results under the two."""
    with _Poisoning(which):
        yield


@contextlib.contextmanager
def observing(observer: ForwardObserver) -> Iterator[None]:
    """Feed every op run in the block to ``observer``."""
    with _Observing(observer):
        yield


@contextlib.contextmanager
def restoring(observer: ForwardObserver) -> Iterator[dict[str, torch.Tensor]]:
    """Run forwards for what they show, not for their effect: every parameter
    or buffer the block writes is copied just before its first write and put
    back, in place, when the block ends. Yields the copies."""
    copies: dict[str, torch.Tensor] = {}
    observer._open.append(copies)
    try:
        with _Observing(observer):
            yield copies
    finally:
        observer._open.remove(copies)
        if copies:
            name: str | None = None
            try:
                live = dict(observer.tensors())
                with torch.no_grad():
                    for name, saved in copies.items():
                        if name in live:
                            live[name].copy_(saved)
            except Exception as exc:  # ours: the forwards ran, putting the module back failed
                internal_error("putting back the module tensors the forwards wrote", exc, name)


#: nn.Module's own bookkeeping attributes: what is not the module's state (the manager's walk over
#: tensors a module holds, and the side_outputs check, skip them).
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """``restoring`` with an observer of its own: forwards run in the block (to
    learn shapes or memory) leave the module's tensors as they found them."""
    with restoring(ForwardObserver(module)):
        yield


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODULUS = 65521  # the largest prime below 2**16: weights 1..65521 never line up with a power-of-two layout
#: Rows of ``_MODULUS`` elements summed per step (``bit_sums``): 4.2 M elements, a 32 MiB int64 copy.
_ROWS = 64


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two sums over ``t``'s bit patterns, plain and weighted by position: a
    change to any element (or two elements swapped) changes one of them, short
    of a contrived collision. Costs one read of the tensor and a few chunks of
    scratch memory, never a copy of it, and one synchronization."""
    plain, weighted = bit_sums(t).tolist()
    return int(plain), int(weighted)


def bit_sums(t: torch.Tensor) -> torch.Tensor:
    """``fingerprint``'s two sums as a tensor on ``t``'s device, not read: queued work, no
    synchronization (prints of many tensors are read at once).

    The weighted sum is ``sum((i mod M + 1) * bits[i])``: the bits viewed as rows of M, summed down
    their columns (each element read once, in its own width, accumulated in int64), then weighted
    by column, and the last partial row apart. The integer copies and position weights of every
    element that a direct sum makes cost 20 times the reads at real size (a Llama-8B's 15 GiB of
    weights fingerprinted in about 200 ms on an H200, instead of 10 ms). int64 sums wrap, the same
    way in any order."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    ints = (
        flat.view(_INT_OF_SIZE[size])
        if size in _INT_OF_SIZE and flat.dtype not in _INT_OF_SIZE.values()
        else flat
    )
    rows = ints.numel() // _MODULUS
    weights = torch.arange(1, _MODULUS + 1, device=ints.device, dtype=torch.int64)
    total = torch.zeros(2, dtype=torch.int64, device=ints.device)
    if rows:
        # A sum in int64 of narrower integers copies them to int64 first: a few rows at a time, so
        # the copy stays small (a whole embedding table's would be 3.9 GiB at 8B).
        matrix = ints[: rows * _MODULUS].view(rows, _MODULUS)
        columns = matrix[:_ROWS].sum(dim=0, dtype=torch.int64)
        for lo in range(_ROWS, rows, _ROWS):
            columns += matrix[lo : lo + _ROWS].sum(dim=0, dtype=torch.int64)
        total[0] += columns.sum()
        total[1] += weights.mul_(columns).sum()
        weights = torch.arange(1, _MODULUS + 1, device=ints.device, dtype=torch.int64)
    tail = ints[rows * _MODULUS :].to(torch.int64)
    total[0] += tail.sum()
    total[1] += weights[: tail.numel()].mul_(tail).sum()
    return total
