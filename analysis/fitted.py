"""Formulas in a symbol the model's code pins, fitted from traces with it fixed.

Where the model's own code ties a size to its example value (a Python loop over the time steps
of a recurrent scan, an RNN's C++ loop), no symbolic trace holds in that symbol. The analysis
then goes on without it: the step is traced with that symbol fixed at a few sizes (each trace
exact at its size and symbolic in the others), and the figures in that symbol are the
polynomial through them (degree ``len(sizes) - 1``, quadratic by default: memory in a sequence
length is at most quadratic in the models seen), **checked** against one more traced size
before any figure is given. Where memory is piecewise in the symbol (the optimizer step's peak
at short sequences, the activations' at long ones), the window of sizes moves up until a fit
holds; sizes below it are traced when asked for. :meth:`FittedReport.at` evaluates the fit,
checking it again at the point's other sizes (a miss traces the size asked for);
:meth:`FittedReport.for_point` traces the size asked for (exact there).

>>> import torch
>>> class Scan(torch.nn.Module):           # a loop over time steps pins S
...     def __init__(self):
...         super().__init__()
...         self.w = torch.nn.Parameter(torch.ones(8))
...     def forward(self, x):              # x: (B, S, 8)
...         h = torch.zeros_like(x[:, 0])
...         for t in range(x.shape[1]):
...             h = torch.tanh(h * self.w + x[:, t])
...         return h
>>> from memsim.analysis import analyze
>>> r = analyze(Scan(), {"x": ("float32", ["B", "S", 8])}, device="cpu")
>>> r.fit.symbol, r.fit.sizes, r.fit.check
('S', (7, 14, 21), 28)
>>> r.at(B=4, S=100)["train"]["peak"] == r.for_point({"B": 4, "S": 100})[0].at(B=4)["train"]["peak"]
True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Mapping

import sympy

from memsim.tracer import OutOfRangeError, SpecializationError

from .memory import PeakPoint
from .peak import Candidate
from .explore import Retracer, cross_guards
from .report import TRAIN_FIELDS, Report

DEGREE = 2  # the fit's polynomial degree: quadratic in the pinned symbol


@dataclass(frozen=True)
class Fit:
    """How the formulas in ``symbol`` were obtained.

    Attributes
    ----------
    symbol : str
        The symbol the model's code pins.
    sizes : tuple of int
        Sizes traced (with ``symbol`` fixed) that the polynomial passes through.
    check : int
        One more size traced, where the polynomial was checked against the trace.
    reason : str
        Why the symbol could not stay symbolic (the pinning op and source line).
    reports : dict of int to Report
        The traces, by size (a cache: each size asked for by :meth:`FittedReport.for_point`
        is added once traced).
    """

    symbol: str
    sizes: tuple[int, ...]
    check: int
    reason: str
    reports: dict = field(default_factory=dict, repr=False, compare=False)
    # modelling CUDA: the allocator's 512-byte blocks are not a polynomial in the size, so the
    # fitted formula is approximate and every figure asked for comes from a trace at its size
    traced_only: bool = False

    def describe(self) -> str:
        if self.traced_only:
            return (f"{self.symbol} is pinned by the model's code ({self.reason}): every "
                    f"figure is traced at the {self.symbol} asked for (CUDA's 512-byte blocks "
                    f"are no polynomial in {self.symbol}); the formulas shown in "
                    f"{self.symbol} are an approximation, fitted through traces at "
                    f"{self.symbol}={', '.join(map(str, self.sizes))} and checked at "
                    f"{self.symbol}={self.check}")
        return (f"{self.symbol} is pinned by the model's code ({self.reason}): the formulas in "
                f"{self.symbol} are fitted (degree {len(self.sizes) - 1}) through traces at "
                f"{self.symbol}={', '.join(map(str, self.sizes))} and checked at "
                f"{self.symbol}={self.check}; a size asked for with --at is traced exactly")


def _lagrange(xs, x):
    """The Lagrange basis at ``x`` (Fractions, or sympy expressions for a symbol)."""
    out = []
    for i, xi in enumerate(xs):
        term = Fraction(1) if not isinstance(x, sympy.Basic) else sympy.Integer(1)
        for j, xj in enumerate(xs):
            if j != i:
                term = term * (x - xj) / (xi - xj) if isinstance(x, sympy.Basic) else \
                    term * Fraction(x - xj, xi - xj)
        out.append(term)
    return out


def _figures(report: Report, point: Mapping[str, int]) -> dict:
    shown, at = report.for_point(dict(point))
    if isinstance(shown, FittedReport):
        return shown.at(**at)
    out = {}
    for name, fields in (("train", TRAIN_FIELDS), ("inference", ("peak",))):
        step = getattr(shown, name)
        if step is not None:
            step.check_point(at)
            out[name] = {f: step.value(f, at) for f in fields}
    return out


@dataclass(frozen=True)
class FittedReport(Report):
    """A :class:`Report` whose formulas in one symbol (:attr:`fit`) are fitted from traces with
    it fixed. Its own ``train``/``inference`` are the trace at the first fitted size."""

    fit: Fit | None = None

    @property
    def basis(self) -> str:
        return f"fitted in {self.fit.symbol}"

    @property
    def ranges(self) -> dict[str, tuple[int, int | None]]:
        out = dict(self.traced(self.fit.sizes[0]).ranges)
        out[self.fit.symbol] = (self.fit.sizes[0], self._limit)
        return out

    @property
    def _limit(self) -> int | None:
        return self.retracer.config.limits.get(self.fit.symbol) if self.retracer else None

    def limit(self, name: str) -> int | None:
        return self._limit if name == self.fit.symbol else super().limit(name)

    def traced(self, size: int) -> Report:
        """The analysis traced with the fitted symbol fixed at ``size`` (cached)."""
        reports = self.fit.reports
        if size not in reports:
            reports[size] = self.retracer({self.fit.symbol: size}, self.fixed)
        return reports[size]

    def needs_retrace(self, point: Mapping[str, int]) -> dict[str, int]:
        x = point.get(self.fit.symbol)
        return {} if x is None else {self.fit.symbol: x}

    def for_point(self, point: Mapping[str, int]) -> tuple[Report, dict[str, int]]:
        """The trace at the point's size of the fitted symbol (**traces** a size not traced
        yet: exact there), and the point in its symbols."""
        name = self.fit.symbol
        if name not in point:
            return self, dict(point)
        if point[name] < 1:
            raise OutOfRangeError(f"{name}={point[name]}: sizes start at 1")
        sub = self.traced(point[name])
        return sub.for_point({k: v for k, v in point.items() if k != name})

    def at(self, **point: int) -> dict:
        """Every figure at ``point``: from the fit, checked at :attr:`Fit.check`; from a trace
        at a size traced already or below the fit's first size (**traces** that size once;
        other sizes below their formulas' ranges are traced too, as :meth:`Report.for_point`
        does)."""
        name = self.fit.symbol
        if name not in point:
            raise OutOfRangeError(f"the point lacks {name}",
                                  hint=f"symbols: {', '.join(self.symbols)}")
        x = point[name]
        rest = {k: v for k, v in point.items() if k != name}
        if x in self.fit.reports:
            return _figures(self.fit.reports[x], rest)
        lo, hi = self.ranges[name]
        step = self.config.multiples.get(name, 1)
        if 1 <= x < lo or x % step:
            # below the fit (another piece of the step's memory), or off the step the fit's
            # sizes were traced at (the model pads there): traced
            return _figures(self.traced(x), rest)
        if x < 1 or (hi is not None and x > hi):
            raise OutOfRangeError(
                f"{name}={x} is outside the range the fit holds for ({lo} <= {name}"
                + (f" <= {hi}" if hi is not None else "") + ")",
                hint=f"report.for_point({dict(point)!r}) traces that size (exact)")
        fitted = self._fitted(rest, x)
        # where the fit misses its check at these other sizes: trace this size (exact)
        return fitted if fitted is not None else _figures(self.traced(x), rest)

    def holds(self, **point: int) -> bool:
        """Whether the fit holds at its check size at ``point``'s other sizes (:meth:`at`
        answers there from the fit rather than by tracing)."""
        rest = {k: v for k, v in point.items() if k != self.fit.symbol}
        return self._fitted(rest, self.fit.check) is not None

    def _fitted(self, rest: Mapping[str, int], x: int) -> dict | None:
        """Every figure at size ``x`` of the fitted symbol from the fit, the other sizes at
        ``rest``; None where the fit misses its check there or gives a fraction of a byte, and
        at every size not traced when the fit is for display only (:attr:`Fit.traced_only`)."""
        if self.fit.traced_only and x not in self.fit.reports:
            return None
        values = {s: _figures(self.traced(s), rest) for s in (*self.fit.sizes, self.fit.check)}
        out: dict = {}
        for step, figs in values[self.fit.sizes[0]].items():
            out[step] = {}
            for f in figs:
                ys = [values[s][step][f] for s in self.fit.sizes]
                v = self._interpolate(ys, x)
                if (self._interpolate(ys, self.fit.check) != values[self.fit.check][step][f]
                        or v.denominator != 1):
                    return None
                out[step][f] = int(v)
        return out

    def view(self) -> "FittedReport":
        """This report with the fitted formulas (:meth:`formula`) in place of the first trace's,
        for display: one peak candidate, reached where the fit's traces reach theirs."""
        steps = {}
        for name in ("train", "inference"):
            step = getattr(self, name)
            if step is None:
                steps[name] = None
                continue
            vals = {f: self.formula(name, f) for f in TRAIN_FIELDS}
            trace = replace(step.trace, symbols=dict(self.symbols), ranges=self.ranges)
            label = PeakPoint(f"fitted in {self.fit.symbol}", "-", None)
            steps[name] = replace(step, trace=trace, candidates=[Candidate(vals["peak"], -1,
                                                                           label)],
                                  activation_candidates=[], **vals)
        return replace(self, **steps)

    def _interpolate(self, ys, x) -> Fraction:
        return sum((Fraction(y) * w for y, w in zip(ys, _lagrange(self.fit.sizes, x))),
                   Fraction(0))

    def formula(self, step: str, name: str) -> sympy.Expr:
        """Figure ``name`` of ``step`` (``"train"``/``"inference"``) as a formula in every
        symbol: the fitted polynomial with the traces' formulas as its values."""
        sym = self.symbols[self.fit.symbol]
        exprs = [r.formula(step, name) if isinstance(r, FittedReport) else
                 getattr(getattr(r, step), name) for r in map(self.traced, self.fit.sizes)]
        total = sum((e * w for e, w in zip(exprs, _lagrange(self.fit.sizes, sym))),
                    sympy.Integer(0))
        return sympy.expand(total) if all(e.is_polynomial() for e in exprs) else total


def _round_point(report: "FittedReport", at: dict, fitted_name: str) -> dict[str, int]:
    """``at`` with each symbol but the fitted one moved up to a multiple of 64 within its
    range, where there is one (512-byte blocks: see :func:`fitted`)."""
    out = dict(at)
    for k, v in at.items():
        if k == fitted_name:
            continue
        lo, hi = report.ranges.get(k, (1, None))
        r = -(-max(v, lo) // 64) * 64
        if hi is None or r <= hi:
            out[k] = r
    return out


def example(report: Report) -> dict[str, int]:
    """The example size of each of ``report``'s symbols (a fitted one: its first size)."""
    if isinstance(report, FittedReport):
        return {**example(report.traced(report.fit.sizes[0])),
                report.fit.symbol: report.fit.sizes[0]}
    return dict((report.train or report.inference).trace.hints)


# The sizes tried, as multiples of the symbol's example size: growing by about 1.5x, so that
# a window of four lies within one piece of memory that is piecewise in the symbol (the
# optimizer step's peak at short sequences, the activations' at long ones).
MULTIPLES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def fit_windows(hint: int, taken, limit: int | None, step: int = 1):
    """Each candidate fit in turn: ``DEGREE + 1`` consecutive sizes of ``hint * MULTIPLES``
    (past other symbols' example sizes, on the symbol's step, within the model's limit),
    then the next to check."""
    sizes = []
    for m in MULTIPLES:
        v = hint * m
        while v in taken:
            v += step
        if limit is not None and v > limit:
            break
        sizes.append(v)
    for i in range(len(sizes) - DEGREE - 1):
        yield tuple(sizes[i:i + DEGREE + 1]), sizes[i + DEGREE + 1]


def fitted(analyze, model, inputs, config, error: SpecializationError, hint: int, taken, *,
           fixed=None, explore: bool = True, original: Exception | None = None,
           **options) -> FittedReport:
    """The analysis of ``model`` with ``error.symbol`` fitted (see the module docstring):
    ``analyze(model, inputs, config, **options)`` traced with that symbol fixed at the sizes of
    :func:`fit_windows`, the fit checked at the example sizes of the others. Where the memory is
    piecewise in the symbol, the window moves to larger sizes until a fit holds
    (:func:`fit_windows`); sizes below the fit's are traced when asked for. None holding,
    ``error`` is raised with the misses (``original``, the trace's own error, where it was
    not a pinned symbol but a kernel taking no symbolic sizes)."""
    from memsim.tracer.spec import symbol

    name = error.symbol
    retracer = Retracer(analyze, model, inputs, config, dict(options))
    already = dict(fixed or {})
    where = ", ".join(p for p in (f"module '{error.module or '<root>'}'" if error.module
                                  is not None else None, error.source) if p)
    misses = []
    # modelling CUDA, every size is the allocator's 512-byte blocks, and a block count is a
    # polynomial in the size only where the sizes are round: the fit's sizes are multiples of
    # 8, and it is checked where the other symbols are multiples of 64. Even so a size between
    # them can miss by a few blocks with its check still holding (LLaVA at B = 12, S = 64:
    # 1,792 B), so the fit is for display only and every size asked for is traced
    # (Fit.traced_only)
    cuda = config.device == "cuda"
    if cuda:
        hint = 8
    windows = list(fit_windows(hint, set(taken), config.limits.get(name),
                               config.multiples.get(name, 1)))
    # every size the windows may trace, in order: the next one not traced yet is traced in a
    # forked process beside this one's trace (two CPUs or more), across windows too (a window
    # that misses needs one more size); one that no window needs in the end is stopped
    order = list(dict.fromkeys(s for sizes, check in windows for s in (*sizes, check)))
    for sizes, check in windows:
        fit = Fit(name, sizes, check, where or error.message, traced_only=cuda)
        window = (*sizes, check)
        for s in window:
            if retracer.traced_ahead({name: s}):
                # a child traces s: meanwhile this process traces the window's next size
                here = next((x for x in window[window.index(s) + 1:]
                             if not retracer.started({name: x})), None)
                if here is not None:
                    retracer({name: here}, already)
            elif not retracer.started({name: s}):
                # this process traces s: meanwhile a child traces the next size of any window
                ahead = next((x for x in order[order.index(s) + 1:]
                              if not retracer.started({name: x})), None)
                if ahead is not None:
                    retracer.ahead({name: ahead}, already)
            fit.reports[s] = retracer({name: s}, already)  # cached across windows
        if explore and not isinstance(fit.reports[sizes[0]], FittedReport):
            # the other symbols followed past guards of the code path, as a plain report's
            fit.reports[sizes[0]] = cross_guards(fit.reports[sizes[0]])
        base = fit.reports[sizes[0]]
        report = FittedReport(config, {**base.symbols, name: symbol(name)}, base.train,
                              base.inference, base.modules, base.other_ops, fixed=already,
                              notes=(fit.describe(), *base.notes), regimes=base.regimes,
                              checked=base.checked, retracer=retracer, fit=fit)
        at = example(base)
        if cuda:
            at = _round_point(report, at, name)
        if not report.holds(**at):
            misses.append(f"{name}={', '.join(map(str, sizes))}: misses {name}={check}")
            continue
        retracer.cancel_ahead()
        return report
    limit = config.limits.get(name)
    why = ("; no fit in it held either (" + "; ".join(misses) + ")" if misses else
           f"; the model's limit {name} <= {limit} leaves too few sizes for a fit from "
           f"{name}={hint}" if limit is not None else "")
    if original is not None and not isinstance(original, SpecializationError):
        # a kernel that takes no symbolic sizes: --at traces every symbol at the point
        raise type(original)(original.message + why, module=original.module, op=original.op,
                             source=original.source,
                             hint="give every size with --at (traced exactly there)")
    raise SpecializationError(
        error.message + why, symbol=name, module=error.module, op=error.op,
        source=error.source, hint=f"give {name} a fixed size (--at {name}=N traces that size "
                                  "exactly)")


