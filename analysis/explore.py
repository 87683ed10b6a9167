"""Exploring a report: tracing the same analysis again where its formulas do not reach.

A :class:`~memsim.analysis.Report` keeps, in :attr:`~memsim.analysis.Report.retracer`, how it was
made (a :class:`Retracer`). From it this module follows each symbol past the guards of its code
path (:func:`cross_guards`) and across the conditions on its residues
(:func:`cross_conditions`) when an analysis is made, and answers a point the formulas do not
cover (:func:`for_point`, which :meth:`Report.for_point` is short for) by tracing there. Points
below the range can be traced beforehand in forked processes (:meth:`Retracer.beside`,
:mod:`memsim.tracer.fork`).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import sympy
import torch

from memsim.tracer import (OutOfRangeError, SpecializationError, StepConfig, TensorSpec,
                           TraceError, is_tensor_spec, make_spec)
from memsim.tracer.fork import abandon, forked, joined
from memsim.tracer.trace import is_bound

from .memory import StepMemory
from .peak import unevaluated_max
from .report import Regime, Report

__all__ = ["Retracer", "for_point", "across", "cross_guards", "cross_conditions", "probe_size",
           "fix_inputs"]


@dataclass(frozen=True)
class Retracer:
    """How a report was made, kept to trace the same analysis again with some symbols fixed.

    Calling it is one more symbolic run of the model (seconds for a small model, about a
    minute for a 7B one); each set of fixed sizes is traced once and cached here.
    ``analyze(model, inputs, config, **options)`` is :func:`analyze` or, under strategies,
    :func:`memsim.strategies.analyze`.
    """

    analyze: Callable
    model: torch.nn.Module = field(repr=False)
    inputs: Mapping
    config: StepConfig
    options: Mapping = field(default_factory=dict)
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __call__(self, fixed: Mapping[str, int], already: Mapping[str, int] | None = None):
        """The analysis with the symbols in ``fixed`` given as integers (``already``: those the
        report was traced with fixed before)."""
        key = _fixed_key(fixed)
        got = self.cache.get(key)
        if isinstance(got, _Beside):
            got = self.cache[key] = got.join(self._sub(fixed))
        if got is None:
            got = self.cache[key] = self._fixed(fixed, already)
        return got

    def moved(self, hints: Mapping[str, int], already: Mapping[str, int] | None = None):
        """The analysis traced at other example sizes (``hints`` over the config's): across a
        guard of the code path, the formulas of the other side. Where the code path there pins
        a symbol it raises :class:`~memsim.tracer.SpecializationError` (no fit: the callers
        trace past that size, or at the size asked for)."""
        key = ("hints",) + tuple(sorted(hints.items()))
        if key not in self.cache:
            self.cache[key] = self.analyze(
                self.model, self.inputs, self.config.replace(hints={**self.config.hints,
                                                                    **hints}),
                fixed=dict(already or {}), explore=False, fit=False, **self.options)
        return self.cache[key]

    def _sub(self, fixed: Mapping[str, int]) -> "Retracer":
        """The retracer of the analysis with ``fixed`` given (the one :meth:`_fixed` makes)."""
        return Retracer(self.analyze, self.model, fix_inputs(self.inputs, fixed),
                        self.config.fixing(fixed), dict(self.options))

    def _fixed(self, fixed: Mapping[str, int], already: Mapping[str, int] | None):
        return self.analyze(self.model, fix_inputs(self.inputs, fixed), self.config.fixing(fixed),
                            fixed={**(already or {}), **fixed}, explore=False, **self.options)

    def beside(self, points, already: Mapping[str, int] | None = None) -> int:
        """Start tracing, in forked processes beside the caller's own analysis, the sizes of
        ``points`` below every formula's range (a size of 1, which :meth:`Report.for_point`
        would trace afterwards); a later call for them takes the child's report. Where no
        process can be forked (:func:`memsim.tracer.fork.forked`) nothing starts and they are
        traced when asked. Returns how many started."""
        names = {d for v in self.inputs.values() if is_tensor_spec(v)
                 for d in make_spec("x", v).symbols} - set(already or {})
        started = 0
        for point in points or ():
            fixed = {n: v for n, v in point.items() if n in names and v == 1}
            if fixed:
                started += self.ahead(fixed, already)
        return started

    def ahead(self, fixed: Mapping[str, int], already: Mapping[str, int] | None = None) -> bool:
        """Start tracing the analysis with ``fixed`` in a forked process beside the caller's
        own trace (a fit's next size while this process traces the one before it); a later
        call with ``fixed`` takes the child's report. Whether it started (not where it is
        cached or started already, or no process can be forked: then it is traced when
        asked)."""
        key = _fixed_key(fixed)
        if key in self.cache:
            return False
        child = forked(lambda f=dict(fixed): _portable(self._fixed(f, already)))
        if child is None:
            return False
        self.cache[key] = _Beside(child)
        return True

    def traced_ahead(self, fixed: Mapping[str, int]) -> bool:
        """Whether ``fixed`` is being traced in a child (:meth:`ahead`), not yet joined."""
        return isinstance(self.cache.get(_fixed_key(fixed)), _Beside)

    def started(self, fixed: Mapping[str, int]) -> bool:
        """Whether ``fixed`` is traced already, or being traced in a child."""
        return _fixed_key(fixed) in self.cache

    def cancel_ahead(self) -> None:
        """Stop the children tracing ahead whose reports nobody took (:meth:`ahead`)."""
        for key, got in list(self.cache.items()):
            if isinstance(got, _Beside):
                got.cancel()
                del self.cache[key]


def _fixed_key(fixed: Mapping[str, int]) -> tuple:
    """The cache key of an analysis traced with ``fixed`` (:class:`Retracer`)."""
    return ("fixed",) + tuple(sorted(fixed.items()))


def _portable(report: "Report") -> bytes:
    """``report`` pickled without the retracers in it (they hold the model's transforms and
    loops, closures that do not pickle): :meth:`_Beside.join` gives it its own again."""
    buf = io.BytesIO()
    _NoRetracers(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(report)
    return buf.getvalue()


class _NoRetracers(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, (Retracer, _Beside)):
            return type(None), ()
        if isinstance(obj, (sympy.Max, sympy.Min)):
            # rebuilt as they are: sympy would compare every pair of a peak's hundreds of
            # candidates again (two minutes for Llama-2-7B's)
            return _unevaluated, (type(obj), obj.args)
        return NotImplemented


def _unevaluated(cls, args):
    if cls is sympy.Max:
        return unevaluated_max(args)
    return cls(*args, evaluate=False)


class _Beside:
    """A report being made in a forked child (:meth:`Retracer.beside`): joined when asked
    for, stopped and reaped when nobody asks (the retracer dropped, or the process ending)."""

    def __init__(self, child):
        import weakref

        self._child = child
        self._done = weakref.finalize(self, abandon, child)

    def cancel(self) -> None:
        """Stop the child now (its report is not wanted: a fit that held before the size it
        traced ahead), freeing its CPU."""
        self._done()

    def join(self, retracer: "Retracer"):
        """The child's report, or None (it failed: the caller traces it in-process and gets
        the error there, if any), with ``retracer`` for its own retraces."""
        self._done.detach()
        data = joined(self._child)
        if data is None:
            return None
        try:
            report = pickle.loads(data)
        except Exception:  # noqa: BLE001 - a report that does not load: traced here instead
            return None
        for r in [report] + [c.report for c in getattr(report, "rank_classes", ())]:
            if r.retracer is None:
                object.__setattr__(r, "retracer", retracer)
        return report


def for_point(report: Report, point: Mapping[str, int]) -> tuple[Report, dict[str, int]]:
    """The report that covers ``point``, and the point in its symbols. **May trace
    again.**

    A size of 1 (below every formula's range: size-1 dimensions broadcast and skip copies
    in PyTorch), or a point where one of the traces' conditions is false
    (``Eq(Mod(S, 2), 0)`` from an even example size, say), is traced on its own with those
    symbols fixed to the point's values. A size past a guard of the code path (a kernel
    choice, a sliding window: not the model's own limit) is answered by the regime that
    covers it (:attr:`Report.regimes`), else traced symbolically at an example size across
    the guard. Each retrace runs once, by the report's :class:`Retracer`, and is cached there.
    """
    need = report.needs_retrace(point) if report.retracer is not None else {}
    if not need:
        return report, dict(point)
    side = report.side_for(point)
    if side is not None:
        return report.counterpart(side), dict(point)
    steps = report.config.multiples
    # a size of a stepped symbol that is no multiple of its step, or below two steps, is
    # traced at that size (its padding is the model's own, on no formula)
    moved = {n: v for n, v in need.items() if v >= 2 and not report.inside(n, v)
             and not (n in steps and (v % steps[n] or v < report.ranges[n][0]))}
    sub = across(report, *next(iter(moved.items())), point) if moved else \
        report.retracer(need, report.fixed)
    sub = report.counterpart(sub)
    return sub.for_point({k: x for k, x in point.items() if k in sub.symbols})


def across(report: Report, name: str, v: int, point: Mapping[str, int] | None = None) -> Report:
    """The report for symbol ``name`` at size ``v``, past a guard of ``report``'s code path:
    a regime of it, or a trace at an example size across the guard. A regime with a
    condition false at ``point``, inside its ranges, is crossed first, once
    (:func:`cross_conditions`, as the report itself was: TP 8 + SP past B = 7 at an S
    that 8 divides)."""
    for r in report.regimes:
        if r.symbol == name and r.lo <= v and (r.hi is None or v <= r.hi):
            if point is None or not r.report.needs_retrace(point) or not all(
                    r.report.inside(n, x) for n, x in point.items()
                    if n in r.report.ranges):
                return r.report
            key = ("crossed", name, r.hint)
            if key not in report.retracer.cache:
                report.retracer.cache[key] = cross_conditions(r.report, frozenset(), report,
                                                              {name: r.hint})
            return report.retracer.cache[key]
    hint = probe_size(report, name, v)
    try:
        sub = report.retracer.moved({name: hint}, report.fixed)
    except SpecializationError:
        sub = None
    except TraceError as e:
        lo, hi = report.ranges[name]
        raise OutOfRangeError(
            f"{name}={v}: the model's code fails past {name}={hi if v > hi else lo} "
            f"(traced at {name}={hint}: {e.message})",
            hint=f"its own limit, then: sizes {lo}..{hi} are covered") from e
    if sub is None or name not in sub.ranges:
        # the code path at that size pins it (a slice as long as the dimension, say; the
        # trace there has no range for it): exact there, traced with the size fixed
        return report.retracer({name: v}, report.fixed)
    return sub


def probe_size(report: Report, name: str, v: int,
               bounds: tuple[int, int | None] | None = None) -> int:
    """An example size for symbol ``name`` across the guard of ``report``'s code path that ``v``
    lies beyond: the smallest prime past the range's end (the largest below its start), not
    another symbol's example size and within the model's limit; ``v`` where none is.
    ``bounds``: the range to cross, where not ``report``'s own (a guard past another)."""
    lo, hi = bounds or report.ranges[name]
    taken = set((report.train or report.inference).trace.hints.values())
    limit = report.limit(name)
    step = report.config.multiples.get(name)
    if step is not None:   # a stepped symbol: the next multiple past the range's end
        p = (hi // step + 1) * step if hi is not None and v > hi else -(-v // step) * step
        counts = {h // step for h in taken}   # the run's symbols must differ too
        while p in taken or p // step in counts:
            p += step
        return p if limit is None or p <= limit else v
    if hi is not None and v > hi:
        p = sympy.nextprime(hi)
        while p in taken:
            p = sympy.nextprime(p)
        return int(p) if limit is None or p <= limit else v
    p = sympy.prevprime(lo) if lo > 2 else None
    while p is not None and p in taken:
        p = sympy.prevprime(p) if p > 2 else None
    return int(p) if p is not None and p >= max(2, v) else v


def _same_figures(a: Report, b: Report) -> bool:
    """One code path, as far as memory goes: the same allocations and releases, in the same
    order, of the same sizes and categories, under the same conditions (their peaks are then
    the same function of the sizes, however each trace's range pruned its candidates)."""
    return _same_timelines(a, b) and all(
        set(x.trace.conditions) == set(y.trace.conditions)
        for x, y in ((a.train, b.train), (a.inference, b.inference)) if x is not None)


def _same_timelines(a: Report, b: Report) -> bool:
    """The same allocations and releases, in the same order, of the same sizes, categories and
    devices, in each step (whatever the traces' conditions)."""
    for x, y in ((a.train, b.train), (a.inference, b.inference)):
        if (x is None) != (y is None) or (x is not None and _timeline(x) != _timeline(y)):
            return False
    return True


def _timeline(step: StepMemory) -> list:
    run = step.trace.run
    return [(e.sign, run.storages[e.sid].nbytes, run.storages[e.sid].category,
             run.storages[e.sid].device) for e in run.events]


def _widened(step: StepMemory | None, name: str, hi: int | None) -> StepMemory | None:
    if step is None:
        return None
    lo = step.ranges[name][0]
    return replace(step, trace=replace(step.trace, ranges={**step.ranges, name: (lo, hi)}))


MAX_GUARDS = 16  # guards of one symbol's code path crossed in a row, at most


def cross_guards(report: Report) -> Report:
    """``report`` with each symbol followed past the guards of its code path, up to the model's
    own limit.

    A guard (PyTorch picking a convolution backend below a batch of 16, a sliding window's mask
    path up to the window) ends a trace's range below the model's limit; it is a condition of
    the code path, not a limit of the model. Each is crossed by tracing once more at an example
    size past it (:func:`probe_size`): where the formulas are the same, the range reaches on
    (:attr:`Report.checked` keeps the sizes traced); where they differ, the other side is a
    :class:`Regime`. A trace that fails past a guard (the model's own check) ends the range
    there, with a note. The trace conditions on one symbol's residues are crossed first
    (:func:`cross_conditions`). ``--compiled`` reports are not explored (the partition depends
    on the sizes it is chosen at).
    """
    if report.retracer is None or report.config.compiled:
        return report
    report = cross_conditions(report)
    widened: dict[str, int | None] = {}
    checked: dict[str, tuple[int, ...]] = {}
    regimes: list[Regime] = []
    notes: list[str] = []
    for name in report.symbols:
        if name not in report.ranges:   # fitted (its code pins it): the fit says where it holds
            continue
        lo, hi = report.ranges[name]
        limit = report.limit(name)
        current = report
        sizes = [(report.train or report.inference).trace.hints[name]]
        crossed = 0
        while hi is not None and (limit is None or hi < limit):
            if crossed == MAX_GUARDS:
                notes.append(f"{name}: more than {MAX_GUARDS} guards of the code path in a row; "
                             f"past {name}={hi} each size is traced when asked for")
                break
            crossed += 1
            hint = probe_size(report, name, hi + 1, (lo, hi))
            try:
                sub = report.retracer.moved({name: hint}, report.fixed)
            except TraceError as e:
                if not (isinstance(e, SpecializationError) and e.symbol == name):
                    notes.append(f"{name} ends at {hi}: traced at {name}={hint}, the model "
                                 f"fails ({e.message}); taken as the model's own limit")
                    break
                if current is not None:
                    # the guards there hold at that one size (a sliding-window cache's slice
                    # is the whole dimension at S = window - 1): a code path of its own, and
                    # the model goes on past it (twice in a row: each size is its own)
                    notes.append(f"{name} = {hi + 1}..{hint} takes a code path of its own at "
                                 f"each size (at {name}={hint} the model's code ties {name} to "
                                 "its size): traced with the size fixed when asked for")
                    current, hi = None, hint
                    continue
                sub = None
            if sub is None or name not in sub.ranges:   # the model's code pins it there
                notes.append(f"past {name}={hi} the model's code ties {name} to its size "
                             f"(traced at {name}={hint}); each size is traced when asked for")
                break
            slo, shi = sub.ranges[name]
            if slo > hint or (shi is not None and shi < hint):
                break  # the trace does not hold at its own example size: stop here
            if slo > hi + 1:
                notes.append(f"{name} = {hi + 1}..{slo - 1} takes a code path of its own at each "
                             "size (a guard holds there only): traced with the size fixed when "
                             "asked for")
                current = None
            if current is not None and _same_figures(current, sub):
                if current is report:
                    widened[name] = shi
                    sizes.append(hint)
                else:
                    r = regimes.pop()
                    regimes.append(replace(r, hi=shi))
            else:
                regimes.append(Regime(name, slo, shi, hint, sub))
                current = sub
            hi = shi
        if len(sizes) > 1:
            checked[name] = tuple(sizes)
    if not (widened or regimes or notes):
        return report
    train, inference = report.train, report.inference
    for name, hi in widened.items():
        train, inference = _widened(train, name, hi), _widened(inference, name, hi)
    return replace(report, train=train, inference=inference, regimes=tuple(regimes),
                   checked=checked, notes=tuple(report.notes) + tuple(notes))


MAX_PERIOD = 256   # residues of a symbol checked for a condition's cover, at most


def _residue_conditions(report: Report, name: str) -> list:
    """The trace conditions on symbol ``name`` alone that are not bounds: conditions on its
    residues (``Ne(Mod(B, 2), 0)``, ``Ne(-S + 2*((S + 1)//2), 0)``)."""
    sym = report.symbols[name]
    out = []
    for step in (report.train, report.inference):
        for c in step.trace.conditions if step is not None else ():
            if c.free_symbols == {sym} and not is_bound(c) and c not in out:
                out.append(c)
    return out


def _period(conds: list) -> int | None:
    """A period of the truth of ``conds`` in their symbol: the least common multiple of the
    moduli and divisors in them (None: none found, or over :data:`MAX_PERIOD`)."""
    ks = []
    for c in conds:
        for node in sympy.preorder_traversal(c):
            name = type(node).__name__
            if name in ("Mod", "PythonMod", "FloorDiv", "CleanDiv") and len(node.args) == 2:
                k = node.args[1]
            elif name == "floor":
                k = sympy.fraction(sympy.together(node.args[0]))[1]
            else:
                continue
            if not (k.is_Integer and k > 0):
                return None
            ks.append(int(k))
    m = sympy.ilcm(*ks) if len(ks) > 1 else (ks[0] if ks else None)
    return int(m) if m is not None and m <= MAX_PERIOD else None


def _holds(conds: list, sym, x: int) -> bool:
    return all(c.xreplace({sym: x}) is sympy.true for c in conds)


def _covers(report: Report, sub: Report, name: str, conds: list) -> bool:
    """Whether ``report`` and ``sub`` (traced across ``conds``, the residue conditions of
    ``name``) hold on the same range, under the same other conditions, and between them on
    every residue of ``name`` (over the period of both sides' residue conditions)."""
    sym, (lo, hi) = report.symbols[name], report.ranges[name]
    theirs = _residue_conditions(sub, name)
    # the conditions of one side only (both sides' own are among the rest)
    mine, others = [c for c in conds if c not in theirs], [c for c in theirs if c not in conds]
    period = _period(mine + others)
    if period is None or sub.ranges[name] != (lo, hi):
        return False
    rest = [{c for c in step.trace.conditions if not (c in mine or c in others)}
            for step in (report.train, report.inference, sub.train, sub.inference)
            if step is not None]
    if any(r != rest[0] for r in rest):
        return False
    start = max(lo, 2)
    return all(_holds(mine, sym, x) or _holds(others, sym, x)
               for x in range(start, start + period) if hi is None or x <= hi)


def cross_conditions(report: Report, skip: frozenset = frozenset(), root: Report | None = None,
                     moved: Mapping[str, int] | None = None) -> Report:
    """``report`` with each symbol's residue conditions crossed.

    A trace condition on one symbol's residues (DTensor shards a dimension of size B over two
    ranks evenly or not: ``Ne(Mod(B, 2), 0)`` at the example size B = 5) makes the formulas
    hold on part of the sizes only, and every even B was traced again with B fixed. It is
    crossed by tracing once more at the example size, at least three periods up, where the
    most of the symbol's residue conditions are false (the first such). Where the two traces'
    residue conditions cover every residue (checked over their period) and the rest agree:
    with the same figures (the same
    allocations and releases, in order, of the same sizes), the conditions change nothing and
    are dropped; with others, the second trace is a side of this report (:attr:`Report.sides`)
    that :meth:`Report.for_point` and :meth:`Report.at` answer from, its own conditions on the
    other symbols crossed in turn (``skip``: the symbols a side was made for; ``root``, ``moved``:
    the report whose retracer traces them all, and the example sizes that made this side)."""
    root, moved = root or report, dict(moved or {})
    sides = list(report.sides)
    notes: list[str] = []
    hints = (report.train or report.inference).trace.hints
    for name in report.symbols:
        if name not in report.ranges or name not in hints or name in skip:
            continue
        conds = _residue_conditions(report, name)
        if not conds:
            continue
        sym, (_, hi) = report.symbols[name], report.ranges[name]
        limit = report.limit(name)
        taken = set(hints.values())
        # past the example size and three periods (a dimension split over 8 ranks at S = 8 would
        # hold one token per rank: size-1 dimensions, a code path of their own)
        start = max(hints[name] + 1, 3 * (_period(conds) or 1))
        near = [x for x in range(start, start + MAX_PERIOD)
                if x not in taken and (hi is None or x <= hi) and (limit is None or x <= limit)]
        # where the most residue conditions are false (the other side of as many as can be:
        # S = 32, not 30, for sequence parallelism over 8 ranks at S = 29), the first such
        false = {x: sum(c.xreplace({sym: x}) is not sympy.true for c in conds) for x in near}
        hint = max(near, key=lambda x: (false[x], -x)) if near else None
        if hint is None or not false[hint]:
            continue
        try:
            sub = root.retracer.moved({**moved, name: hint}, root.fixed)
        except TraceError:
            continue
        if name not in sub.ranges or sub.symbols.keys() != report.symbols.keys() or \
                sub.needs_retrace({**hints, name: hint}):
            continue   # the trace does not hold at its own example size
        if _covers(report, sub, name, conds) and _same_timelines(report, sub):
            gone = [c for c in conds if c not in _residue_conditions(sub, name)]
            report = _without(report, gone)
            report = replace(report, checked={**report.checked, name: tuple(
                dict.fromkeys((*report.checked.get(name, (hints[name],)), hint)))})
            notes.append(f"{name}: the trace's conditions {', '.join(map(str, gone))} change "
                         f"nothing (traced again at {name}={hint}, the same figures)")
        else:
            sides.append(cross_conditions(sub, skip | {name}, root, {**moved, name: hint}))
            false_there = ", ".join(str(c) for c in conds
                                    if c.xreplace({sym: hint}) is not sympy.true)
            notes.append(f"{name}: sizes like {name}={hint}, where a condition of the trace "
                         f"({false_there}) is false, take a code path of their own: answered "
                         f"from a trace at {name}={hint} where its conditions hold")
    if not notes:
        return report
    return replace(report, sides=tuple(sides), notes=tuple(report.notes) + tuple(notes))


def _without(report: Report, conds: list) -> Report:
    """``report`` with the trace conditions ``conds`` dropped from its steps."""
    def drop(step):
        if step is None:
            return None
        kept = [c for c in step.trace.conditions if c not in conds]
        gone = {str(c) for c in conds}
        return replace(step, trace=replace(step.trace, conditions=kept,
                                           guards=[g for g in step.trace.guards
                                                   if g not in gone]))
    return replace(report, train=drop(report.train), inference=drop(report.inference))


def fix_inputs(inputs: Mapping, fixed: Mapping[str, int]) -> dict:
    """``inputs`` with the symbols in ``fixed`` replaced by their integer sizes."""
    out = {}
    for name, value in inputs.items():
        if is_tensor_spec(value):
            spec = make_spec(name, value)
            value = TensorSpec(spec.name, spec.dtype, tuple(
                fixed.get(d, d) if isinstance(d, str) else d for d in spec.shape), spec.fill)
        out[name] = value
    return out
