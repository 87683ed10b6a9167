"""Memory against one size: the budget's total as the batch or the sequence grows.

For one report (a configuration) and one symbol, the total of the budget
(:func:`memsim.analysis.budget.against`'s terms: the exact allocated peak, the replayed reserve on
CUDA, the fixed overheads) at sizes spread over the symbol's range, the others held at the
point; the regimes of the peak (where the op that reaches it changes, exactly, from the
formula's candidates); and for each capacity, the largest size that fits (the budget's solver).
Pictures are the front door's (``memsim.plots``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .budget import Overheads, TotalModel, largest_fitting
from .gpus import GPU


@dataclass
class Curve:
    """One configuration's total against ``symbol``.

    Attributes
    ----------
    label : str
    symbol : str
    sizes : list of int
    totals : list of int
        The budget's total at each size (bytes), with no capacity: what it would take.
    allocated : list of int
        The allocated peak at each size.
    regimes : list of (int, str)
        Where the peak's regime starts (the first size) and where it is reached.
    fits : dict of str to int or None
        Per capacity label: the largest size whose total fits (None: every size up to the
        model's limit; 0: none).
    at : int or None
        The point's size of ``symbol``.
    limit : int or None
        The largest size the model takes (its positions), where it has one.
    """

    label: str
    symbol: str
    sizes: list[int]
    totals: list[int]
    allocated: list[int]
    regimes: list[tuple[int, str]] = field(default_factory=list)
    fits: dict = field(default_factory=dict)
    at: int | None = None
    limit: int | None = None


def sizes_for(report, symbol: str, point: dict[str, int], n: int = 12) -> list[int]:
    """Sizes to draw ``symbol`` at: powers of two over its range around the point (the point
    itself included), at most ``n``."""
    lo, hi = report.extent.get(symbol, (1, None))
    at = point[symbol]
    top = hi if hi is not None else max(at * 8, 2 ** max(at.bit_length() + 2, 4))
    vals = {v for v in (2 ** k for k in range(0, 40)) if lo <= v <= top} | {lo, at, top}
    vals = sorted(v for v in vals if v >= max(lo, 1))
    while len(vals) > n:   # thin out, keeping the ends and the point
        keep = {vals[0], vals[-1], at}
        vals = [v for i, v in enumerate(vals) if i % 2 == 0 or v in keep]
    return vals


def curve(report, point: dict[str, int], symbol: str, *, label: str = "",
          sizes: list[int] | None = None, capacities: dict[str, GPU] | None = None,
          gpu: GPU | None = None, overheads: Overheads | None = None,
          margin: float = 0.10) -> Curve:
    """``report``'s total against ``symbol`` (others at ``point``), with ``gpu``'s overheads
    (or a generic GPU's); ``capacities`` maps a label to a GPU to solve the largest fitting size
    for, with its own overheads and ``margin`` of it kept free."""
    step = "train" if report.train is not None else "inference"
    sizes = sizes or sizes_for(report, symbol, point)
    # no capacity for the curve itself: what each size would take, past any card's memory
    model = TotalModel(report, step, overheads or Overheads(), gpu.family if gpu else "unknown")
    totals, allocated = [], []
    for v in sizes:
        pt = {**point, symbol: v}
        allocated.append(model.allocated(pt))
        totals.append(model.total(pt))
    regimes = []
    sub, spt = report.for_point(point)
    sm = sub.train if step == "train" else sub.inference
    if symbol in sm.trace.symbols:
        regimes = [(v, str(c.label)) for v, c in sm.regimes(symbol, spt)]
    fits = {}
    for name, g in (capacities or {}).items():
        usable = int(g.bytes * (1 - margin))
        m = TotalModel(report, step, overheads or Overheads(), g.family, usable)
        fits[name] = largest_fitting(m, report, point, symbol, usable, [])
    return Curve(label, symbol, sizes, totals, allocated, regimes, fits, point.get(symbol),
                 report.extent.get(symbol, (1, None))[1])
