"""What a raised forward did, and the words for it: ``Record`` (the precision its products ran at,
the ops that fell back to float32, the module's own lower-precision writes, computations outside
the dispatcher, the casts that quantize) with the sentence the reports show (``precision``), and
``NoReference``, raised where an op runs neither in float64 nor in float32."""

from __future__ import annotations

from dataclasses import dataclass, field

#: float32's unit roundoff: what an op that fell back to float32 (or a float8 product, which
#: accumulates in float32) holds.
_FLOAT32 = 2.0**-24


class NoReference(RuntimeError):
    """The forward cannot run in the raised precision: ``op`` fails there (``error``)."""

    def __init__(self, op: str, error: BaseException) -> None:
        self.op = op
        self.error = error
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"{op} runs neither in float64 nor in float32 ({type(error).__name__}: {first})")


@dataclass
class Record:
    """What a raised forward did: the precision its products ran at, and what could not be raised."""

    #: The coarsest unit roundoff of the products and convolutions seen (0.0: none seen).
    roundoff: float = 0.0
    #: Ops that ran in float32 for want of a float64 kernel, with the first line of the error.
    fell_back: dict[str, str] = field(default_factory=dict)
    #: Tensors of a lower precision the forward wrote (its own state), op by op: the values written
    #: there are rounded to that dtype, as the module rounds them.
    lower_writes: dict[str, str] = field(default_factory=dict)
    #: Computations torch's dispatcher does not see inside (a Triton kernel, memory an extension
    #: wrote), each with the precision its values hold (float32's where a kernel computes in
    #: float32 whatever it is handed): the floor takes that precision's rounding there.
    outside: dict[str, str] = field(default_factory=dict)
    #: The precision the block ran in: float64, or float32 for a forward that cannot run in float64.
    tier: str = "float64"
    #: The dtypes the forward quantized floating values to (int8, float8_e4m3fn), by name: casts that
    #: stay in the reference, so its result holds that quantization as the module computes it.
    quantized: dict[str, None] = field(default_factory=dict)
    #: Kernels a reference the user handed in stood in for (``references=``), by the kernel's name,
    #: with the reference's: the torch code around them is held at the reference's precision, their
    #: own cross-shape rounding is not (``real_batches`` holds that at the kernel's precision).
    stood_in: dict[str, str] = field(default_factory=dict)

    def merge(self, other: Record) -> None:
        self.roundoff = max(self.roundoff, other.roundoff)
        self.fell_back.update(other.fell_back)
        self.lower_writes.update(other.lower_writes)
        self.outside.update(other.outside)
        self.quantized.update(other.quantized)
        self.stood_in.update(other.stood_in)
        self.tier = other.tier

    @property
    def lower(self) -> list[str]:
        """The computations that held less than the reference's precision, in words (a kernel outside the
        dispatcher that kept the reference's own precision holds no less)."""
        lower = [
            f"{what}: {held}" for what, held in self.outside.items() if held != f"{self.tier}'s precision"
        ]
        return lower + [f"{op} ran in float32 (no {self.tier} kernel)" for op in self.fell_back]

    @property
    def standing_in(self) -> str:
        """ ", with references standing in for ns::op (its reference), ..." where any did; "" else."""
        if not self.stood_in:
            return ""
        each = "; ".join(f"{kernel} ({ref})" for kernel, ref in self.stood_in.items())
        return f", with references standing in for {each}"

    @property
    def described(self) -> str:
        """``precision`` with the kernels references stood in for."""
        return self.precision + self.standing_in

    @property
    def precision(self) -> str:
        """The precision the reference ran at, in words, with the computations that held less."""
        base = "float32 (TF32 off)" if self.tier == "float32" else "float64"
        lower = self.lower
        kept = (
            f", with the module's own quantization kept (its casts to {', '.join(self.quantized)})"
            if self.quantized
            else ""
        )
        if self.tier == "float64" and self.roundoff > 2.0**-53 and not lower:
            # A float8 product accumulates in float32: its products hold that precision.
            held = "float32 (TF32 off)" if self.roundoff <= _FLOAT32 else f"unit roundoff {self.roundoff:.3g}"
            return held + kept
        if not lower:
            return base + kept
        return f"{base}, except where it holds less ({'; '.join(lower)}){kept}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
