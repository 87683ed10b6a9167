"""A model's step analysed: the :class:`Report` (immutable) and :func:`analyze`.

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

import io
import pickle
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import sympy
import torch

from memsim.tracer import (InputError, OutOfRangeError, SpecializationError, StepConfig,
                           TensorSpec, TraceError, is_tensor_spec, make_spec, trace)
from memsim.tracer import hf
from memsim.tracer.rnn_cuda import reserve_notes

from .memory import ModuleSaved, StepMemory, module_savings, step_memory
from .peak import unevaluated_max

TRAIN_FIELDS = ("peak", "activation_peak", "saved_activations", "parameters", "gradients",
                "optimizer_states")


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
        key = ("fixed",) + tuple(sorted(fixed.items()))
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
        process can be forked (:func:`memsim.tracer.trace.forked`) nothing starts and they are
        traced when asked. Returns how many started."""
        from memsim.tracer.trace import forked
        names = {d for v in self.inputs.values() if is_tensor_spec(v)
                 for d in make_spec("x", v).symbols} - set(already or {})
        started = 0
        for point in points or ():
            fixed = {n: v for n, v in point.items() if n in names and v == 1}
            key = ("fixed",) + tuple(sorted(fixed.items()))
            if not fixed or key in self.cache:
                continue
            child = forked(lambda f=fixed: _portable(self._fixed(f, already)))
            if child is not None:
                self.cache[key] = _Beside(child)
                started += 1
        return started


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

        from memsim.tracer.trace import _abandon
        self._child = child
        self._done = weakref.finalize(self, _abandon, child)

    def join(self, retracer: "Retracer"):
        """The child's report, or None (it failed: the caller traces it in-process and gets
        the error there, if any), with ``retracer`` for its own retraces."""
        from memsim.tracer.trace import _joined
        self._done.detach()
        data = _joined(self._child)
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
    retracer : Retracer or None
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
    retracer: Retracer | None = field(default=None, repr=False, compare=False)

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
        again.**

        A size of 1 (below every formula's range: size-1 dimensions broadcast and skip copies
        in PyTorch), or a point where one of the traces' conditions is false
        (``Eq(Mod(S, 2), 0)`` from an even example size, say), is traced on its own with those
        symbols fixed to the point's values. A size past a guard of the code path (a kernel
        choice, a sliding window: not the model's own limit) is answered by the regime that
        covers it (:attr:`regimes`), else traced symbolically at an example size across the
        guard. Each retrace runs once, by :attr:`retracer`, and is cached there.
        """
        need = self.needs_retrace(point) if self.retracer is not None else {}
        if not need:
            return self, dict(point)
        side = self._side_for(point)
        if side is not None:
            return self._counterpart(side), dict(point)
        moved = {n: v for n, v in need.items() if v >= 2 and not self._inside(n, v)}
        sub = self._across(*next(iter(moved.items())), point) if moved else \
            self.retracer(need, self.fixed)
        sub = self._counterpart(sub)
        return sub.for_point({k: x for k, x in point.items() if k in sub.symbols})

    def _side_for(self, point: Mapping[str, int]) -> "Report | None":
        """The side of this report (:attr:`sides`, theirs in turn) whose formulas cover
        ``point``, or None."""
        todo = list(self.sides)
        while todo:
            side = todo.pop(0)
            if not side.needs_retrace(point):
                return side
            todo += side.sides
        return None

    def _counterpart(self, other: "Report") -> "Report":
        """``other`` (an analysis traced again) as this report stands for it: itself here; a
        strategy's report answers with its rank's group."""
        return other

    def _inside(self, name: str, v: int) -> bool:
        lo, hi = self.ranges.get(name, (2, None))
        return lo <= v and (hi is None or v <= hi)

    def _across(self, name: str, v: int, point: Mapping[str, int] | None = None) -> "Report":
        """The report for symbol ``name`` at size ``v``, past a guard of this one's code path:
        a regime of it, or a trace at an example size across the guard. A regime with a
        condition false at ``point``, inside its ranges, is crossed first, once
        (:func:`cross_conditions`, as the report itself was: TP 8 + SP past B = 7 at an S
        that 8 divides)."""
        for r in self.regimes:
            if r.symbol == name and r.lo <= v and (r.hi is None or v <= r.hi):
                if point is None or not r.report.needs_retrace(point) or not all(
                        r.report._inside(n, x) for n, x in point.items()
                        if n in r.report.ranges):
                    return r.report
                key = ("crossed", name, r.hint)
                if key not in self.retracer.cache:
                    self.retracer.cache[key] = cross_conditions(r.report, frozenset(), self,
                                                                {name: r.hint})
                return self.retracer.cache[key]
        hint = probe_size(self, name, v)
        try:
            sub = self.retracer.moved({name: hint}, self.fixed)
        except SpecializationError:
            sub = None
        except TraceError as e:
            lo, hi = self.ranges[name]
            raise OutOfRangeError(
                f"{name}={v}: the model's code fails past {name}={hi if v > hi else lo} "
                f"(traced at {name}={hint}: {e.message})",
                hint=f"its own limit, then: sizes {lo}..{hi} are covered") from e
        if sub is None or name not in sub.ranges:
            # the code path at that size pins it (a slice as long as the dimension, say; the
            # trace there has no range for it): exact there, traced with the size fixed
            return self.retracer({name: v}, self.fixed)
        return sub

    def at(self, **point: int) -> dict:
        """Every figure evaluated at ``point`` (plain ints), from this report's formulas.

        A point they do not cover (below a symbol's range, past a guard of the code path, or
        where a trace condition is false) is an :class:`OutOfRangeError` naming
        :meth:`for_point`, which traces it."""
        fix = self.needs_retrace(point) if self.retracer is not None else {}
        side = self._side_for(point) if fix else None
        if side is not None:
            return self._counterpart(side).at(**point)
        if fix:
            where = ", ".join(f"{k}={v}" for k, v in fix.items())
            outside = [f"{lo} <= {n}" + (f" <= {hi}" if hi is not None else "")
                       for n, (lo, hi) in self.ranges.items() if n in fix
                       and not self._inside(n, fix[n])]
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


def _module_types(model: torch.nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules()}


def analyze(model: torch.nn.Module, inputs: dict, config: StepConfig | None = None, *,
            train: bool = True, inference: bool = True, transform=None, driver=None,
            fixed: Mapping[str, int] | None = None, explore: bool = True, fit: bool = True,
            points=None, **options) -> Report:
    """Trace ``model`` and return the symbolic :class:`Report` of a step.

    Parameters
    ----------
    model : torch.nn.Module
        Its parameters may live on the meta device; nothing is materialized.
    inputs : dict
        ``{name: (dtype, shape)}``, e.g. ``{"input_ids": ("int64", ["B", "S"])}``; other values
        are passed to ``forward`` as constants.
    config : StepConfig, optional
        The step: device, precision, optimizer, loss, loop, accumulation, ``compiled``, example
        sizes and limits (:class:`memsim.tracer.StepConfig`); the defaults when None.
    train, inference : bool
        Which analyses to run.
    transform : callable, optional
        Applied to a copy of the model inside each symbolic run (see :func:`memsim.tracer.trace`);
        :mod:`memsim.strategies` builds these.
    driver : memsim.tracer.Driver, optional
        Owns the training loop in place of the plain one (DeepSpeed's engine, built by
        :mod:`memsim.strategies.zero`); the inference forward stays plain.
    fixed : dict, optional
        The symbols of the user's inputs that ``inputs`` gives as integers (set when a report
        traces a point again: :meth:`Report.for_point`).
    explore : bool
        Follow each symbol past the guards of the code path up to the model's own limit, and
        across the conditions on its residues (:func:`cross_guards`: one more trace per guard).
    fit : bool
        Where the model's code pins a symbol (:class:`~memsim.tracer.SpecializationError`),
        fit its formulas from traces with it fixed (:mod:`memsim.analysis.fit`: a
        :class:`~memsim.analysis.fit.FittedReport`, four traces or more) instead of raising.
    points : list of dict, optional
        Points that will be asked for (``[{"B": 1, "S": 4096}]``). A size of 1 among them lies
        below every formula's range, and :meth:`Report.for_point` would trace it after this
        analysis; it is traced now instead, in a forked process beside this one's trace
        (:meth:`Retracer.beside`; Linux, two CPUs or more, not under ``MEMSIM_PARALLEL=0``).
    **options
        Fields of :class:`~memsim.tracer.StepConfig` (``device="cpu"``,
        ``keep_outputs=False``...), applied over ``config`` and validated once.
    """
    config = StepConfig.of(config, **options)
    try:
        retracer = Retracer(analyze, model, inputs, config, dict(
            train=train, inference=inference, transform=transform, driver=driver))
        retracer.beside(points, fixed)
        return _analyze(model, inputs, config, train=train, inference=inference,
                        transform=transform, driver=driver, fixed=fixed, explore=explore,
                        retracer=retracer)
    except TraceError as e:
        if not fit:
            raise
        original, hints = e, _example_sizes(inputs, config)
        if not isinstance(e, SpecializationError):
            # a kernel that takes no symbolic sizes at all: its symbols are fitted one after
            # the other, each trace with the others fixed
            free = [n for n in hints if n not in (fixed or {})]
            if "symbolic sizes" not in e.message or not free:
                raise
            e = SpecializationError(f"a kernel takes no symbolic sizes ({e.message})",
                                    symbol=free[0], module=e.module, op=e.op,
                                    source=e.source)
        if e.symbol is None:
            raise
        from .fit import fitted
        return fitted(analyze, model, inputs, config, e, hints[e.symbol],
                      [v for k, v in hints.items() if k != e.symbol], fixed=fixed,
                      explore=explore, original=original, train=train,
                      inference=inference, transform=transform, driver=driver)


def _example_sizes(inputs: dict, config: StepConfig) -> dict[str, int]:
    from memsim.tracer.trace import example_sizes
    return example_sizes([make_spec(n, v) for n, v in inputs.items() if is_tensor_spec(v)],
                         config.hints)


def _analyze(model, inputs, config, *, train, inference, transform, driver, fixed, explore,
             retracer):
    patches, auto_limits = hf.adapt(model, inputs)
    run_config = config.replace(limits={**auto_limits, **config.limits})
    kw = dict(transform=transform, patches=patches)
    tr_step = inf_step = None
    modules: list[ModuleSaved] = []
    other: dict[str, int] = {}
    if train:
        t = trace(model, inputs, run_config, train=True, driver=driver, **kw)
        tr_step = step_memory(t)
        modules = module_savings(t, _module_types(model))
        other.update(t.run.other_ops)
    if inference:
        t = trace(model, inputs, run_config, train=False, **kw)
        inf_step = step_memory(t)
        for k, v in t.run.other_ops.items():
            other[k] = other.get(k, 0) + v
    if tr_step is None and inf_step is None:
        raise InputError("nothing to analyse: both train and inference are off")
    first = tr_step or inf_step
    report = Report(config, first.trace.symbols, tr_step, inf_step, tuple(modules), other,
                    fixed=dict(fixed or {}), notes=tuple(_compiled_notes(config, first)) + tuple(
                        dict.fromkeys(s.trace.folded.describe() for s in (tr_step, inf_step)
                                      if s is not None and s.trace.folded is not None)) + tuple(
                        reserve_notes(tr_step.trace.run.ops) if tr_step is not None else ())
                    + tuple(hf.layerdrop_note(model) if tr_step is not None else ())
                    + tuple(dict.fromkeys(a for s in (tr_step, inf_step) if s is not None
                                          for a in s.trace.run.assumed)),
                    retracer=retracer)
    return cross_guards(report) if explore else report


def probe_size(report: Report, name: str, v: int,
               bounds: tuple[int, int | None] | None = None) -> int:
    """An example size for symbol ``name`` across the guard of ``report``'s code path that ``v``
    lies beyond: the smallest prime past the range's end (the largest below its start), not
    another symbol's example size and within the model's limit; ``v`` where none is.
    ``bounds``: the range to cross, where not ``report``'s own (a guard past another)."""
    lo, hi = bounds or report.ranges[name]
    taken = set((report.train or report.inference).trace.hints.values())
    limit = report.limit(name)
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
    from memsim.tracer.trace import _is_bound
    sym = report.symbols[name]
    out = []
    for step in (report.train, report.inference):
        for c in step.trace.conditions if step is not None else ():
            if c.free_symbols == {sym} and not _is_bound(c) and c not in out:
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
        sym, (lo, hi) = report.symbols[name], report.ranges[name]
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


def _compiled_notes(config: StepConfig, step: StepMemory) -> list[str]:
    if not config.compiled:
        return []
    notes = []
    at = ", ".join(f"{k}={v}" for k, v in step.trace.hints.items())
    notes.append(
        "torch.compile (fullgraph): Inductor's min-cut partition"
        + (f", chosen at {at} as torch.compile chooses it at the shape it compiles for "
           "(at other sizes a real compile may save other tensors)" if at else "")
        + "; saved-for-backward bytes equalled real CPU Inductor runs on the models "
        "checked; the peak models Inductor's fusion and buffer reuse, not its scheduler's "
        "reordering: -2.4% to +10.2% of real CPU compiled runs (benchmarks/compiled.py)")
    regions = step.trace.run.checkpoint_regions
    if regions:
        notes.append(
            f"torch.compile with activation checkpointing ({regions} regions): each region "
            "is recomputed as Dynamo rewrites torch.utils.checkpoint (its ops tagged for the "
            "partitioner to recompute); against real CPU compiled runs "
            "(benchmarks/compiled.py --plan blocks) saved bytes were equal on TinyGPT and "
            "Llama, but GPT-2 (dropout inside the blocks) saved 26-34% more than predicted; "
            "peaks -4.4% to +8.2% of the real runs")
    ops = step.trace.run.ops
    if config.device != "cpu" and any("convolution" in getattr(o, "op", "") for o in ops):
        notes.append(
            "torch.compile with convolutions on CUDA: Inductor decides its layout "
            "optimization (channels-last copies of the inputs convolutions read) by "
            "heuristics at the shape it compiles for; the symbolic trace does not apply it "
            "(on CPU it always applies, and is modelled)")
    return notes


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


def pinning_fixed(analyze, model: torch.nn.Module, inputs: dict, config: StepConfig,
                  point: Mapping[str, int], **options) -> Report:
    """``analyze(model, inputs, config, **options)``; where the model's code pins a symbol to
    its example size (:class:`~memsim.tracer.SpecializationError`) or a kernel takes no
    symbolic sizes, the analysis again with that symbol (for a kernel, every symbol) given as
    its size at ``point``: exact there, with no formula in it, and a note saying so."""
    fixed: dict[str, int] = {}
    notes: list[str] = []
    names = list(dict.fromkeys(d for n, v in inputs.items() if is_tensor_spec(v)
                               for d in make_spec(n, v).symbols))
    while True:
        try:
            report = analyze(model, fix_inputs(inputs, fixed), config.fixing(fixed),
                             fixed=dict(fixed), **options)
            break
        except SpecializationError as e:
            if e.symbol not in point or e.symbol in fixed:
                raise
            fixed[e.symbol] = point[e.symbol]
            notes.append(f"{e.symbol} is traced at the size asked for, {point[e.symbol]}, with no "
                         f"formula in it: {e.message}")
        except TraceError as e:
            rest = [n for n in names if n not in fixed and n in point]
            if "symbolic sizes" not in e.message or not rest:
                raise
            fixed.update({n: point[n] for n in rest})
            notes.append(f"{', '.join(rest)} traced at the sizes asked for, with no formula in "
                         f"them: a kernel takes no symbolic sizes ({e.message})")
    if not notes:
        return report
    return replace(report, notes=tuple(report.notes) + tuple(notes))
