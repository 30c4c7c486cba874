"""Comparing results of different batch shapes: against the measured floor, not bit for bit.

A graph padded to N rows and eager on the n real rows are different
programs: another GEMM tiling, another reduction order, so the last bits
move, and in bf16 through 32 layers they move a lot (0.3 on the logits of an
8B Llama, for a correct model). Bit for bit holds only where the program is
the same (replay against eager at the captured shape; the other checks).
Across shapes, the graph's real rows ``G`` are held to eager on the real
batch ``E`` this way:

1. Within the dtype's tolerance (at least the tolerance of the precision the
   products ran at: bf16, or TF32 for fp32 on a GPU): passed, nothing more run.
2. Otherwise the floor is measured: ``P``, eager at the graph's padded shape
   on the path a capture takes, cut to the real rows, is how far eager is
   from itself across these two shapes. The graph fails where
   - it is further from ``E`` than a small multiple of the floor (max and
     rms), plus the tolerance;
   - its difference is systematic: rounding is random in sign, so little of
     it is a global scale or offset, a scale per row, or one offset shared by
     every row of a feature. A computation that depends on the padded size
     (a Python branch on the token count, a scale computed from it,
     statistics over the padded rows) moves values that way. The part the
     fit explains must be most of the difference and exceed the tolerance
     somewhere, so that a few-percent scale on bf16 logits is caught and
     rounding is not;
   - it is further from ``E`` than rounding at that precision can take it
     (``CAP`` unit roundoffs, relative rms), floor or not: the floor itself
     then holds the shape-dependent computation, not rounding.
   Integer outputs (token ids) may differ only where eager at the padded
   shape differs too, and at no more than a quarter of the elements.

Everything is computed in pieces of rows, in float64, so that the
comparison of 512 x 128256 logits needs tens of MiB, not gigabytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import peers
from ..observe import unit_roundoff
from .compare import CHUNK, Difference, default_tolerance, first_difference, largest_difference, leaves

__all__ = [
    "CAP",
    "FLOOR_MAX",
    "FLOOR_RMS",
    "SYSTEMATIC",
    "Verdict",
    "across_shapes",
    "compute_dtype",
    "cut_leaf",
    "cut_to",
    "given",
]

#: The graph may be this many times the floor from unpadded eager (largest
#: element, and rms), plus the tolerance. The graph runs the program the floor
#: was measured with, so it is normally the floor exactly.
FLOOR_MAX = 3.0
FLOOR_RMS = 2.0
#: The share of the difference a systematic fit may explain before it is a
#: finding (rounding: under 0.1 % on the logits of 1B and 8B Llamas; a 3 %
#: scale: over 20 %, measured on an H200, docs/scale.md).
SYSTEMATIC = 0.25
#: A fit family counts only while chance alone explains less than 1/CHANCE of
#: random noise (a per-feature offset over 2 rows explains half of any noise).
CHANCE = 4.0
#: Rounding at unit roundoff u moves a result by at most CAP * u, relative rms
#: (measured: 5 u for a 1B Llama in bf16, 13 u for an 8B one, under 1 u for
#: a resnet18 in TF32).
CAP = 64.0
#: Integer outputs may differ from unpadded eager at no more than this share of elements.
INT_SHARE = 0.25

_DTYPE_OF_ROUNDOFF = {
    2.0**-53: torch.float64,
    2.0**-24: torch.float32,
    2.0**-11: torch.float16,
    2.0**-8: torch.bfloat16,
}
_PRECISION_NAME = {
    2.0**-53: "float64",
    2.0**-24: "float32",
    2.0**-11: "float16 or TF32",
    2.0**-8: "bfloat16",
    2.0**-4: "float8",
    2.0**-3: "float8",
}


def cut_to(padded: Any, like: Any) -> Any:
    """``padded`` (an output at a padded shape) cut to ``like``'s shapes: each tensor leaf narrowed
    along every dimension where it is larger (the padded rows, in whichever dimensions)."""
    from ..manager import tree

    flat, structure = tree.flatten(padded)
    shapes = [leaf.shape if isinstance(leaf, torch.Tensor) else None for leaf in tree.leaves(like)]
    out = []
    for i, leaf in enumerate(flat):
        target = shapes[i] if i < len(shapes) else None
        cut = cut_leaf(leaf, target) if isinstance(leaf, torch.Tensor) and target is not None else None
        out.append(leaf if cut is None else cut)
    return structure.unflatten(out)


def cut_leaf(padded: torch.Tensor, shape: Sequence[int]) -> torch.Tensor | None:
    """``padded`` narrowed to ``shape`` along each dimension where it is larger (the padded rows);
    None where it cannot hold the same value at another padding (another rank, a dimension smaller)."""
    if tuple(padded.shape) == tuple(shape):
        return padded
    if padded.dim() != len(shape) or any(n < m for n, m in zip(padded.shape, shape, strict=True)):
        return None
    for d, (n, m) in enumerate(zip(padded.shape, shape, strict=True)):
        if n > m:
            padded = padded.narrow(d, 0, m)
    return padded


def compute_dtype(roundoff: float) -> torch.dtype | None:
    """The dtype whose tolerance fits products run at ``roundoff`` (TF32: float16's), or None."""
    return _DTYPE_OF_ROUNDOFF.get(roundoff, torch.bfloat16 if roundoff > 2.0**-8 else None)


@dataclass
class Verdict:
    """Graph against unpadded eager, across shapes."""

    passed: bool
    diff: Difference | None = None  # where it first shows
    why: str = ""  # the failure, in a sentence; "" when passed
    floor_used: bool = False  # whether eager at the padded shape had to run
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Sums:
    """Running float64 sums over one leaf, piece by piece."""

    n: int = 0
    d: float = 0.0
    dd: float = 0.0
    e: float = 0.0
    ee: float = 0.0
    de: float = 0.0
    ff: float = 0.0
    max_d: float = 0.0
    max_f: float = 0.0
    rows: list[torch.Tensor] = field(default_factory=list)  # per row: n, d, e, ee, de
    cols: torch.Tensor | None = None  # per column: sum of d
    cols_n: int = 0


def _rows_cols(t: torch.Tensor, rows_ndim: int) -> tuple[int, int]:
    if t.dim() == 0:
        return 1, 1
    rows = 1
    for size in t.shape[: max(rows_ndim, 0)]:
        rows *= size
    return rows, max(t.numel() // max(rows, 1), 1)


def _sums(g: torch.Tensor, e: torch.Tensor, p: torch.Tensor, rows_ndim: int) -> _Sums:
    r, c = _rows_cols(e, rows_ndim)
    g2, e2, p2 = g.reshape(r, c), e.reshape(r, c), p.reshape(r, c)
    # Differences of values of 32 bits or fewer are exact in float32, and its pairwise sums are
    # close enough for shares of energy; float64 data stays float64.
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    s = _Sums()
    step = max(1, CHUNK // c)
    cols = torch.zeros(c, dtype=torch.float64, device=e.device)
    acc = torch.zeros(9, dtype=torch.float64, device=e.device)
    rows: list[torch.Tensor] = []
    for start in range(0, r, step):
        gd, ed, pd = (x[start : start + step].to(wide) for x in (g2, e2, p2))
        ok = torch.isfinite(gd) & torch.isfinite(ed) & torch.isfinite(pd)
        d = torch.where(ok, gd - ed, 0.0)
        f = torch.where(ok, pd - ed, 0.0)
        ez = torch.where(ok, ed, 0.0)
        count = ok.sum(1, dtype=wide)
        row_d, row_e, row_ee, row_de = d.sum(1), ez.sum(1), (ez * ez).sum(1), (d * ez).sum(1)
        rows.append(torch.stack([count, row_d, row_e, row_ee, row_de], 1).double())
        acc[:7] += torch.stack(
            [count.sum(), row_d.sum(), (d * d).sum(), row_e.sum(), row_ee.sum(), row_de.sum(), (f * f).sum()]
        ).double()
        acc[7] = torch.maximum(acc[7], d.abs().max().double())
        acc[8] = torch.maximum(acc[8], f.abs().max().double())
        cols += d.sum(0).double()
    n, sd, sdd, se, see, sde, sff, max_d, max_f = acc.tolist()
    s.n, s.d, s.dd, s.e, s.ee, s.de, s.ff, s.max_d, s.max_f = int(n), sd, sdd, se, see, sde, sff, max_d, max_f
    s.rows, s.cols, s.cols_n = rows, cols, r
    return s


def _affine(
    n: torch.Tensor, sd: torch.Tensor, se: torch.Tensor, see: torch.Tensor, sde: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least squares of d on (1, e), per entry, from sums: (offset, scale, energy of the fit)."""
    mean_e = se / n
    var = see - n * mean_e * mean_e
    scale = torch.where(var > 1e-300, (sde - sd * mean_e) / var.clamp_min(1e-300), torch.zeros_like(var))
    offset = sd / n - scale * mean_e
    energy = n * offset * offset + 2 * offset * scale * se + scale * scale * see
    return offset, scale, energy


@dataclass
class _Fit:
    """One systematic family fitted to the difference: per row an offset and a scale of the
    eager value, plus per column an offset (what the family does not use is zero)."""

    family: str
    share: float  # of the difference's energy that the fit explains
    describe: str
    row_offset: torch.Tensor
    row_scale: torch.Tensor
    col_offset: torch.Tensor | None = None

    def part(self, e: torch.Tensor, start: int) -> torch.Tensor:
        """The fitted part for the rows ``start:`` whose eager values are ``e``."""
        rows = slice(start, start + e.shape[0])
        out = self.row_offset[rows, None] + self.row_scale[rows, None] * e
        return out + self.col_offset if self.col_offset is not None else out


def _fits(s: _Sums, rows: int, cols: int) -> list[_Fit]:
    """Each systematic family the difference could be, simplest first: its share of the
    difference's energy, and the fit."""
    fits: list[_Fit] = []
    if s.n < 2 or s.dd <= 0 or not s.rows:
        return fits
    per_row = torch.cat(s.rows)
    zeros = torch.zeros(per_row.shape[0], dtype=torch.float64, device=per_row.device)
    if 2 * CHANCE / s.n < 1:
        total = per_row.sum(0)
        offset, scale, energy = _affine(*(total[i] for i in range(5)))
        a, b = float(offset), float(scale)
        # The offset is named only where it carries a share of its own.
        words = f"a scale of {b * 100:+.2f}%" + (
            f" and an offset of {a:+.3g}" if s.n * a * a > 0.05 * s.dd else ""
        )
        fits.append(_Fit("global", float(energy) / s.dd, words, zeros + a, zeros + b))
    if s.cols is not None and rows > 1 and CHANCE * cols / s.n < 1:
        mean_c = s.cols / rows
        share = float((mean_c * mean_c).sum()) * rows / s.dd
        fits.append(
            _Fit(
                "column",
                share,
                "one offset per feature, the same in every row (statistics over the rows of the batch)",
                zeros,
                zeros,
                mean_c,
            )
        )
    if CHANCE * 2 * rows / s.n < 1 and cols > 1:
        rn, rd, re, ree, rde = (per_row[:, i] for i in range(5))
        offset_r, scale_r, energy_r = _affine(rn.clamp_min(1), rd, re, ree, rde)
        typical = float(scale_r.abs().median()) if scale_r.numel() else 0.0
        fits.append(
            _Fit(
                "row",
                float(energy_r.sum()) / s.dd,
                f"a scale of each row (about {typical * 100:.2f}%) with an offset of its own",
                offset_r,
                scale_r,
            )
        )
    return fits


def _material(fit: _Fit, e: torch.Tensor, rows_ndim: int, rtol: float, atol: float) -> bool:
    """Whether the fitted part exceeds the tolerance at some element (else it is too small to matter)."""
    r, c = _rows_cols(e, rows_ndim)
    e2 = e.reshape(r, c)
    step = max(1, CHUNK // c)
    for start in range(0, r, step):
        ed = e2[start : start + step].double()
        ok = torch.isfinite(ed)
        part = fit.part(torch.where(ok, ed, 0.0), start)
        if bool(((part.abs() > atol + rtol * ed.abs()) & ok).any()):
            return True
    return False


def _rms(energy: float, n: int) -> float:
    return (energy / n) ** 0.5 if n else 0.0


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _percent(x: float) -> str:
    """``x`` as a percentage that keeps two figures where it is small (0.0028%, not 0.0%)."""
    return f"{x:.1%}" if x >= 0.001 else f"{x * 100:.2g}%"


def given(value: Any) -> Callable[[], Any]:
    """``value`` as the thunk ``across_shapes`` takes, for a floor already at hand."""
    return lambda: value


def across_shapes(
    got: Any,
    expected: Any,
    padded: Callable[[], Any] | None,
    *,
    rtol: float | None,
    atol: float | None,
    roundoff: float,
    rows_ndim: Sequence[int] | None = None,
) -> Verdict:
    """``got`` (the graph's real rows) against ``expected`` (eager on the unpadded
    batch), with ``padded()`` (eager at the graph's shape, cut to the real rows)
    run only when the tolerance alone does not settle it (None from it: no floor
    can be measured, and the tolerance decides). ``roundoff``: the coarsest unit
    roundoff of the forward's products (0: not known; each output's dtype then).
    ``rows_ndim``: per output leaf, how many leading dimensions make its rows
    (default 1)."""
    compute = compute_dtype(roundoff) if roundoff else None
    diff = first_difference(got, expected, rtol=rtol, atol=atol, compute=compute, figures=False)
    measures = diff is not None and not diff.opaque and diff.index is not None and padded is not None
    # On a rank of several, the floor's forward runs where any rank measures one (its collectives
    # pair with the peers'), and counts only where this rank's comparison asked for it.
    if peers.any_rank([measures])[0] and not measures and padded is not None:
        padded()
    if diff is None:
        return Verdict(True, figures=_largest(got, expected))
    if diff.opaque or diff.index is None or padded is None:
        return Verdict(False, _with_figures(diff, got, expected), _tolerance_words(diff))
    reference = padded()
    if reference is None:  # no floor here (an eager fallback, inputs that cannot be padded)
        return Verdict(False, diff, _tolerance_words(diff))
    got_leaves, exp_leaves, pad_leaves = leaves(got), leaves(expected), leaves(reference)
    if [p for p, _ in pad_leaves] != [p for p, _ in exp_leaves]:
        return Verdict(
            False,
            diff,
            _tolerance_words(diff) + " (eager at the padded shape returns another "
            "structure, so no floor could be measured)",
            floor_used=True,
        )
    figures: dict[str, Any] = {}
    worst: Verdict | None = None
    for i, ((path, g), (_, e), (_, p)) in enumerate(zip(got_leaves, exp_leaves, pad_leaves, strict=True)):
        if not isinstance(g, torch.Tensor) or not isinstance(e, torch.Tensor):
            continue
        found = _leaf(
            path,
            g,
            e,
            p,
            rtol=rtol,
            atol=atol,
            roundoff=roundoff,
            compute=compute,
            rows_ndim=rows_ndim[i] if rows_ndim is not None and i < len(rows_ndim) else 1,
            figures=figures,
        )
        if found is not None and worst is None:
            worst = found
    if worst is not None:
        worst.floor_used = True
        worst.figures.update(figures)
        return worst
    return Verdict(True, floor_used=True, figures=figures)


def _largest(got: Any, expected: Any) -> dict[str, Any]:
    """The largest differences over every floating leaf (the figures a passing comparison reports)."""
    max_abs = 0.0
    for (_, g), (_, e) in zip(leaves(got), leaves(expected), strict=False):
        if (
            isinstance(g, torch.Tensor)
            and isinstance(e, torch.Tensor)
            and g.shape == e.shape
            and g.dtype == e.dtype
            and g.is_floating_point()
        ):
            max_abs = max(max_abs, largest_difference(g, e, ulp=False)[0])
    return {"max_abs": max_abs}


def _with_figures(diff: Difference, got: Any, expected: Any) -> Difference:
    """``diff`` with the largest differences of its leaf filled in (a failure reports them)."""
    if diff.index is None or diff.max_abs is not None:
        return diff
    for (path, g), (_, e) in zip(leaves(got), leaves(expected), strict=False):
        if (
            path == diff.path
            and isinstance(g, torch.Tensor)
            and isinstance(e, torch.Tensor)
            and g.shape == e.shape
            and g.dtype == e.dtype
            and g.is_floating_point()
        ):
            diff.max_abs, diff.max_ulp = largest_difference(g, e)
            break
    return diff


def _tolerance_words(diff: Difference) -> str:
    path = diff.path or "the output"
    return f"real rows differ from eager on the unpadded batch ({path}: {diff.reason})"


def _leaf(
    path: str,
    g: torch.Tensor,
    e: torch.Tensor,
    p: Any,
    *,
    rtol: float | None,
    atol: float | None,
    roundoff: float,
    compute: torch.dtype | None,
    rows_ndim: int,
    figures: dict[str, Any],
) -> Verdict | None:
    where = path or "the output"
    own = first_difference(g, e, rtol=rtol, atol=atol, compute=compute, figures=False)
    if own is None:
        return None
    verdict = _leaf_verdict(
        path,
        where,
        own,
        g,
        e,
        p,
        rtol=rtol,
        atol=atol,
        roundoff=roundoff,
        compute=compute,
        rows_ndim=rows_ndim,
        figures=figures,
    )
    if (
        verdict is not None
        and verdict.diff is not None
        and verdict.diff.max_abs is None
        and verdict.diff.index is not None
        and g.is_floating_point()
    ):
        verdict.diff.max_abs, verdict.diff.max_ulp = largest_difference(g, e)
    return verdict


def _leaf_verdict(
    path: str,
    where: str,
    own: Difference,
    g: torch.Tensor,
    e: torch.Tensor,
    p: Any,
    *,
    rtol: float | None,
    atol: float | None,
    roundoff: float,
    compute: torch.dtype | None,
    rows_ndim: int,
    figures: dict[str, Any],
) -> Verdict | None:
    if not isinstance(p, torch.Tensor) or p.shape != e.shape or p.dtype != e.dtype:
        return Verdict(
            False,
            own,
            f"real rows differ from eager on the unpadded batch ({where}: {own.reason}); "
            "eager at the padded shape gives another shape there, so no floor could be measured",
        )
    if not (g.is_floating_point() or g.is_complex()):
        return _integers(where, own, g, e, p.to(g.device))
    if g.is_complex():
        g, e, p = (torch.view_as_real(x) for x in (g, e, p.to(g.device)))
    p = p.to(g.device)
    r_default, a_default = default_tolerance(g.dtype, compute)
    r = r_default if rtol is None else rtol
    a = a_default if atol is None else atol
    finite_g, finite_e = torch.isfinite(g), torch.isfinite(e)
    if not torch.equal(finite_g, finite_e):
        bad = (finite_g != finite_e).reshape(-1).nonzero()[0, 0]
        index = tuple(int(i) for i in torch.unravel_index(bad, g.shape))
        return Verdict(
            False,
            Difference(path, "values differ", index, g[index].item(), e[index].item()),
            f"real rows hold non-finite values where eager on the unpadded batch is finite, or the "
            f"other way round ({where}); rounding never does that",
        )
    s = _sums(g, e, p, rows_ndim)
    rms_d, rms_f, rms_e = _rms(s.dd, s.n), _rms(s.ff, s.n), _rms(s.ee, s.n)
    u = roundoff or unit_roundoff(g.dtype)
    figures[path or "output"] = {
        "graph_max": s.max_d,
        "graph_rms": rms_d,
        "floor_max": s.max_f,
        "floor_rms": rms_f,
        "roundoff": u,
    }
    both = (
        f"graph vs unpadded eager: max {_fmt(s.max_d)}, rms {_fmt(rms_d)}; eager vs itself across shapes "
        f"(at the graph's padded shape): max {_fmt(s.max_f)}, rms {_fmt(rms_f)}"
    )
    beyond = first_difference(g, e, rtol=r, atol=a + FLOOR_MAX * s.max_f, figures=False)
    tol_rms = a + r * rms_e
    if beyond is not None or rms_d > FLOOR_RMS * rms_f + tol_rms:
        return Verdict(
            False,
            beyond or own,
            f"real rows differ from eager on the unpadded batch by more than eager differs from itself "
            f"across batch shapes ({where}; {both}; allowed: {FLOOR_MAX:g}x the max and "
            f"{FLOOR_RMS:g}x the rms, plus the dtype's tolerance)",
        )
    rows, cols = _rows_cols(e, rows_ndim)
    # The simplest family that explains the difference names it: a global scale before one per row.
    for fit in _fits(s, rows, cols):
        chance = {"global": 2 / s.n, "row": 2 * rows / s.n, "column": cols / s.n}[fit.family]
        if fit.share > max(SYSTEMATIC, CHANCE * chance) and _material(fit, e, rows_ndim, r, a):
            return Verdict(
                False,
                own,
                f"real rows are off systematically: {fit.share:.0%} of their difference from eager on "
                f"the unpadded batch is {fit.describe} ({where}; {both}). Rounding across batch "
                f"shapes is random in sign; a systematic difference comes from a computation that "
                f"depends on the padded batch size (a Python branch on the token count, a scale "
                f"computed from it, statistics over the padded rows)",
            )
    if rms_e > 0 and rms_d > CAP * u * rms_e + tol_rms:
        name = _PRECISION_NAME.get(u, f"unit roundoff {u:.3g}")
        return Verdict(
            False,
            own,
            f"real rows differ from eager on the unpadded batch by {_percent(rms_d / rms_e)} (relative rms), "
            f"more than rounding at {name} precision moves a result ({CAP * u:.3g}; {both}): the "
            f"difference comes from a computation that depends on the padded batch size, not from "
            f"rounding",
        )
    return None


def _integers(
    where: str, own: Difference, g: torch.Tensor, e: torch.Tensor, p: torch.Tensor
) -> Verdict | None:
    """Integer outputs (token ids): a flip is rounding only where eager at the padded shape flipped too."""
    off = g != e
    unexplained = off & (g != p)
    share = float(off.double().mean())
    if bool(unexplained.any()):
        index = tuple(int(i) for i in torch.unravel_index(unexplained.reshape(-1).nonzero()[0, 0], g.shape))
        return Verdict(
            False,
            Difference(own.path, "values differ", index, g[index].item(), e[index].item()),
            f"real rows differ from eager on the unpadded batch ({where}: integer values that eager at "
            f"the graph's padded shape does not give either)",
        )
    if share > INT_SHARE:
        return Verdict(
            False,
            own,
            f"real rows differ from eager on the unpadded batch at {share:.0%} of the "
            f"integer values of {where}, as eager at the padded shape does: more than rounding flips "
            f"(at most {INT_SHARE:.0%}); the computation depends on the padded batch size",
        )
    return None
