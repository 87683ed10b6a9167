"""A model's step analysed, as a value: the :class:`Report` (immutable) and the
:class:`Regime` of each other code path. It holds figures and evaluates them
(:meth:`Report.at`); making one is :mod:`memsim.analysis.build` (:func:`~memsim.analysis.analyze`),
tracing again for a point it does not cover is :mod:`memsim.analysis.explore`.

>>> import torch
>>> from memsim.analysis import analyze
>>> from memsim.tracer import StepConfig
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> r = analyze(model, {"input": ("float32", ["B", 16])}, StepConfig(device="cpu"))
>>> r.train.peak            # three regimes: backward of the ReLU, of the first Linear, the step
Max(80*B + 14932, 208*B + 10840, 464*B + 8664)
>>> r.at(B=4)["train"]["peak"]
15252
>>> r.at(B=1)
Traceback (most recent call last):
...
memsim.tracer.errors.OutOfRangeError: B=1 is outside the range the formulas hold for (2 <= B)
  hint: report.for_point({'B': 1}) traces that case (one more symbolic run): size-1 dimensions and other code paths differ in PyTorch
>>> sub, pt = r.for_point({"B": 1})
>>> sub.fixed, sub.at(**pt)["train"]["peak"]
({'B': 1}, 15012)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import sympy

from memsim.tracer import OutOfRangeError, StepConfig

from .memory import ModuleSaved, StepMemory

if TYPE_CHECKING:
    from .explore import Retracer

TRAIN_FIELDS = ("peak", "activation_peak", "saved_activations", "parameters", "gradients",
                "optimizer_states")


@dataclass(frozen=True)
class Regime:
    """Sizes ``lo..hi`` of one symbol where the step takes another code path than the report's
    own (past a guard of its trace: a kernel choice, a sliding window), with other formulas:
    ``report``, traced with that symbol's example size ``hint`` in the range."""

    symbol: str
    lo: int
    hi: int | None
    hint: int
    report: "Report" = field(repr=False)


@dataclass(frozen=True)
class Report:
    """What one step of a model takes on one device. Immutable: a strategy wraps it
    (:class:`memsim.strategies.StrategyReport`), nothing edits it.

    Attributes
    ----------
    config : StepConfig
        The step analysed (device, precision, optimizer, loop...).
    symbols : dict of str to sympy.Symbol
    train, inference : StepMemory or None
    modules : tuple of ModuleSaved
        Bytes saved for backward per module, largest first (at the example sizes).
    other_ops : dict of str to int
        Ops outside ATen/prims (custom ops) that ran, with their counts: their memory comes from
        their fake kernel and was not checked against a real run.
    fixed : dict of str to int
        Symbols of the user's inputs that this report was traced with fixed (see
        :meth:`for_point`).
    notes : tuple of str
    regimes : tuple of Regime
        Where a symbol's sizes past a guard of the trace take another code path with other
        formulas (:func:`cross_guards`); :meth:`for_point` answers there from the regime's report.
    checked : dict of str to tuple of int
        Example sizes each symbol was traced at whose formulas equal these (across guards of
        the code path that change nothing), so that the ranges reach past those guards.
    sides : tuple of Report
        The other side of a trace condition on one symbol's residues (``Ne(Mod(B, 2), 0)``:
        DTensor shards a dimension evenly or not), where its formulas differ from these
        (:func:`cross_conditions`); :meth:`for_point` answers there from it.
    retracer : memsim.analysis.explore.Retracer or None
        How to trace again with sizes fixed (:meth:`for_point`); None: this report cannot.
    """

    config: StepConfig
    symbols: dict[str, sympy.Symbol]
    train: StepMemory | None
    inference: StepMemory | None
    modules: tuple[ModuleSaved, ...] = ()
    other_ops: Mapping[str, int] = field(default_factory=dict)
    fixed: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    regimes: tuple[Regime, ...] = ()
    checked: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    sides: tuple["Report", ...] = field(default=(), repr=False)
    retracer: "Retracer | None" = field(default=None, repr=False, compare=False)

    @property
    def device(self):
        return self.config.device

    @property
    def precision(self):
        return self.config.precision

    @property
    def accumulate(self) -> int:
        return self.config.accumulate

    @property
    def compiled(self) -> bool:
        return self.config.compiled

    @property
    def strategy(self) -> dict:
        """The strategy as plain data (empty: none; see :class:`memsim.strategies.StrategyReport`)."""
        return {}

    @property
    def ranks(self) -> tuple:
        """Groups of ranks with equal memory, where ranks differ (empty: none)."""
        return ()

    @property
    def basis(self) -> str:
        """How the figures were obtained: ``"exact"`` (the trace alone)."""
        return "exact"

    @property
    def ranges(self) -> dict[str, tuple[int, int | None]]:
        """Range per symbol where every formula holds (intersection over the runs)."""
        out: dict[str, tuple[int, int | None]] = {}
        for step in (self.train, self.inference):
            if step is None:
                continue
            for n, (lo, hi) in step.ranges.items():
                plo, phi = out.get(n, (lo, hi))
                his = [h for h in (hi, phi) if h is not None]
                out[n] = (max(lo, plo), min(his) if his else None)
        return out

    def limit(self, name: str) -> int | None:
        """The model's own upper limit on symbol ``name`` (given, or a Hugging Face model's
        positions), or None."""
        lims = [st.trace.limits[name] for st in (self.train, self.inference)
                if st is not None and name in st.trace.limits]
        return min(lims) if lims else None

    @property
    def extent(self) -> dict[str, tuple[int, int | None]]:
        """Range per symbol that this report answers for, its regimes included."""
        out = dict(self.ranges)
        for r in self.regimes:
            lo, hi = out[r.symbol]
            out[r.symbol] = (min(lo, r.lo), None if hi is None or r.hi is None else
                             max(hi, r.hi))
        return out

    def needs_retrace(self, point: Mapping[str, int]) -> dict[str, int]:
        """The sizes of ``point`` that this report's formulas do not cover and that
        :meth:`for_point` traces: sizes below a symbol's range or past a guard of its code path
        (not past the model's own limit), or, failing those, the symbols of a trace condition
        that is false at ``point``. Empty: covered."""
        out = {}
        for n, v in point.items():
            if n not in self.symbols or not isinstance(v, int):
                continue
            lo, hi = self.ranges.get(n, (2, None))
            limit = self.limit(n)
            if 0 < v < lo or (hi is not None and v > hi and (limit is None or v <= limit)):
                out[n] = v
        if not out:
            for step in (self.train, self.inference):
                for cond in step.violated(point) if step is not None else ():
                    out.update({x.name: point[x.name] for x in cond.free_symbols})
        return out

    def for_point(self, point: Mapping[str, int]) -> tuple["Report", dict[str, int]]:
        """The report that covers ``point``, and the point in its symbols. **May trace
        again**: :func:`memsim.analysis.explore.for_point` (this method is its shorthand; the
        value holds the figures, the exploring is there)."""
        from .explore import for_point
        return for_point(self, point)

    def side_for(self, point: Mapping[str, int]) -> "Report | None":
        """The side of this report (:attr:`sides`, theirs in turn) whose formulas cover
        ``point``, or None."""
        todo = list(self.sides)
        while todo:
            side = todo.pop(0)
            if not side.needs_retrace(point):
                return side
            todo += side.sides
        return None

    def counterpart(self, other: "Report") -> "Report":
        """``other`` (an analysis traced again) as this report stands for it: itself here; a
        strategy's report answers with its rank's group."""
        return other

    def inside(self, name: str, v: int) -> bool:
        lo, hi = self.ranges.get(name, (2, None))
        return lo <= v and (hi is None or v <= hi)

    def at(self, **point: int) -> dict:
        """Every figure evaluated at ``point`` (plain ints), from this report's formulas.

        A point they do not cover (below a symbol's range, past a guard of the code path, or
        where a trace condition is false) is an :class:`OutOfRangeError` naming
        :meth:`for_point`, which traces it."""
        fix = self.needs_retrace(point) if self.retracer is not None else {}
        side = self.side_for(point) if fix else None
        if side is not None:
            return self.counterpart(side).at(**point)
        if fix:
            where = ", ".join(f"{k}={v}" for k, v in fix.items())
            outside = [f"{lo} <= {n}" + (f" <= {hi}" if hi is not None else "")
                       for n, (lo, hi) in self.ranges.items() if n in fix
                       and not self.inside(n, fix[n])]
            false = [str(c) for step in (self.train, self.inference) if step is not None
                     for c in step.violated(point)]
            why = (f"{where} is outside the range the formulas hold for ({', '.join(outside)})"
                   if outside else f"at {where} a condition of the trace is false "
                   f"({'; '.join(false)}): the formulas do not cover that point")
            raise OutOfRangeError(
                why,
                hint=f"report.for_point({dict(point)!r}) traces that case (one more symbolic "
                     "run): size-1 dimensions and other code paths differ in PyTorch")
        out: dict = {}
        if self.train is not None:
            self.train.check_point(point)
            out["train"] = {f: self.train.value(f, point) for f in TRAIN_FIELDS}
        if self.inference is not None:
            self.inference.check_point(point)
            out["inference"] = {"peak": self.inference.value("peak", point)}
        return out
