"""From a trace to the figures of one step: peak, breakdown, saved activations, per module.

All figures are sympy expressions in the user's symbols (bytes). Only storages on the modelled
device count (e.g. AdamW's step counters stay on the CPU in a CUDA run), each at the size its
allocator charges (:mod:`memsim.analysis.allocator`: 512-byte blocks on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import sympy

from memsim.tracer import MODEL_STATE, Category, InputError, OutOfRangeError, Phase, Trace
from memsim.tracer.previous import held_items

from .allocator import block_bytes
from .peak import (Candidate, PolyBasis, as_max, exact_values, prune, regime_changes,
                   running_peaks)


@dataclass(frozen=True)
class PeakPoint:
    """Where a candidate peak is reached: the phase, op and module that allocated last."""

    phase: str
    op: str
    module: str | None

    def __str__(self) -> str:
        where = f" in {self.module or '<root>'}" if self.module is not None else ""
        return f"{self.phase}: {self.op}{where}"


@dataclass
class StepMemory:
    """The memory figures of one traced run (training step or inference forward).

    Attributes (all sympy expressions, bytes)
    ----------
    peak : most bytes live at any moment of the step (a ``Max`` over regimes).
    candidates : the regimes of ``peak``, each with where it is reached.
    parameters, buffers, inputs : live for the whole step.
    gradients : the gradients this step produces (alive at its end).
    optimizer_states : optimizer state on the device.
    saved_activations : bytes kept for backward when backward starts (activations only: no
        parameters, buffers or inputs, which autograd may also save).
    activation_peak : most bytes at any moment that are not parameters, gradients or optimizer
        states (activations, temporaries, inputs, buffers).
    """

    trace: Trace
    peak: sympy.Expr
    candidates: list[Candidate]
    parameters: sympy.Expr
    buffers: sympy.Expr
    inputs: sympy.Expr
    gradients: sympy.Expr
    optimizer_states: sympy.Expr
    saved_activations: sympy.Expr
    activation_peak: sympy.Expr
    activation_candidates: list[Candidate] = field(default_factory=list)
    _functions: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def symbols(self) -> list[sympy.Symbol]:
        return list(self.trace.symbols.values())

    @property
    def ranges(self) -> dict[str, tuple[int, int | None]]:
        return self.trace.ranges

    def check_point(self, point: dict[str, int]) -> dict[sympy.Symbol, int]:
        """Validate a ``{name: int}`` point against the symbols and their ranges."""
        names = set(self.trace.symbols)
        missing = names - set(point)
        extra = set(point) - names
        if missing or extra:
            raise InputError(
                "evaluation point " + (f"lacks {', '.join(sorted(missing))}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"names unknown symbol(s) {', '.join(sorted(extra))}" if extra else ""),
                hint=f"symbols: {', '.join(sorted(names)) or '(none)'}")
        for n, v in point.items():
            lo, hi = self.ranges.get(n, (2, None))
            if v < lo or (hi is not None and v > hi):
                rng = f"{lo} <= {n}" + (f" <= {hi}" if hi is not None else "")
                limit = self.trace.limits.get(n)
                raise OutOfRangeError(
                    f"{n}={v} is outside the range the formula holds for ({rng})",
                    hint=(f"the model itself does not accept {n} > {limit}"
                          if limit is not None and v > limit else
                          "a code path of the trace holds there only (a size-1 dimension, a "
                          "kernel choice, a window): Report.for_point traces that case"))
        return {self.trace.symbols[n]: v for n, v in point.items()}

    def value(self, name: str, point: dict[str, int]) -> int:
        """Figure ``name`` at ``point`` (plain ints, a point :meth:`check_point` accepts) by
        exact integer arithmetic, through functions compiled once per figure (the peak: the
        largest candidate's), for searches that evaluate many points."""
        if name not in self._functions:
            syms = list(self.trace.symbols.values())
            exprs = [c.expr for c in self.candidates] if name == "peak" else \
                [getattr(self, name)]
            self._functions[name] = exact_values([sympy.sympify(e) for e in exprs], syms) \
                if exprs else (lambda *a: [0])
        args = [point[n] for n in self.trace.symbols]
        return max(int(v) for v in self._functions[name](*args))

    def violated(self, point: dict[str, int]) -> list:
        """The trace's conditions (:attr:`memsim.tracer.Trace.conditions`, and a stepped
        symbol's multiples: :meth:`memsim.tracer.Trace.step_conditions`) false at ``point``."""
        subs = {self.trace.symbols[n]: v for n, v in point.items() if n in self.trace.symbols}
        return [c for c in (*self.trace.conditions, *self.trace.step_conditions())
                if c.xreplace(subs) is not sympy.true]

    def evaluate(self, expr: sympy.Expr, point: dict[str, int]) -> int:
        return int(sympy.sympify(expr).xreplace(self.check_point(point)))

    def winner(self, point: dict[str, int]) -> Candidate:
        """The candidate that is the peak at ``point``."""
        subs = self.check_point(point)
        return max(self.candidates, key=lambda c: (int(c.expr.xreplace(subs)), -c.event))

    def breakdown(self, point: dict[str, int]) -> dict[str, int]:
        """Bytes live at the peak at ``point``, by category."""
        subs = self.check_point(point)
        cand = self.winner(point)
        run = self.trace.run
        live = live_at(run, cand.event + 1)
        out = {c.value: 0 for c in Category}
        for sid in live:
            s = run.storages[sid]
            if s.device == self.trace.device:
                out[s.category.value] += int(charged(s, self.trace.device).xreplace(subs))
        return out

    def regimes(self, sym: str, point: dict[str, int]) -> list[tuple[int, Candidate]]:
        """Where the peak's regime changes as ``sym`` grows (others at ``point``)."""
        subs = self.check_point(point)
        lo, hi = self.ranges.get(sym, (2, None))
        return regime_changes(self.candidates, self.trace.symbols[sym], subs, lo, hi)


def peak_point_of(trace: Trace):
    """``label(i) -> PeakPoint``: where event ``i`` of ``trace``'s run happens (its op, phase
    and module)."""
    run = trace.run

    def label(i: int) -> PeakPoint:
        if i < 0 or i >= len(run.events):
            return PeakPoint("end" if i >= 0 else "start", "-", None)
        s = run.storages[run.events[i].sid]
        op = s.op
        if s.phase is Phase.BACKWARD and 0 <= s.alloc < len(run.ops):
            rec = run.ops[s.alloc]
            node = getattr(rec, "autograd_node", None)
            if node:
                op = f"{op} ({node})"
        return PeakPoint(s.phase.value, op, s.module)

    return label


def peak_candidates(trace: Trace, *, skip=frozenset(), until: int | None = None,
                    basis: PolyBasis | None = None, charge: list | None = None) -> list[Candidate]:
    """Candidate peaks of the running sum of live bytes over the run's first ``until`` events
    (all by default), counting the storages on the modelled device whose category is not in
    ``skip``. ``basis`` and ``charge`` (bytes charged per storage) may be shared between calls."""
    run, dev = trace.run, trace.device
    syms = list(trace.symbols.values())
    basis = basis or PolyBasis(syms)
    if charge is None:
        charge = [charged(s, dev) for s in run.storages]
    sizes = [basis.coeffs(c) if s.device == dev and s.category not in skip else None
             for s, c in zip(run.storages, charge)]
    evs = [(e.sign, e.sid) for e in run.events[:until]]
    lows = {n: r[0] for n, r in trace.ranges.items()}
    return prune(running_peaks(evs, sizes.__getitem__, basis, run.start, peak_point_of(trace)), syms,
                 lows)


@dataclass(frozen=True)
class Added:
    """A storage a plan-level strategy adds to a traced run (a DDP bucket, a ZeRO partition).

    ``alloc`` and ``free`` are indices into the run's events: the storage is allocated just
    before event ``alloc`` (``run.start`` or earlier: alive when the step starts) and released
    just before event ``free`` (None: alive at the end)."""

    nbytes: sympy.Expr
    alloc: int
    free: int | None = None


def edited_candidates(trace: Trace, *, keep=None, frees: dict | None = None,
                      added=(), skip=frozenset()) -> list[Candidate]:
    """Candidate peaks of the run with its timeline edited as a modelled strategy changes it.

    ``keep(storage, sign)`` says whether an event of the run stays (default: all); ``frees``
    maps a storage id to the event index before which it is released instead; ``added`` are
    :class:`Added` storages. Labels name the run's own events.
    """
    run, dev = trace.run, trace.device
    basis = PolyBasis(list(trace.symbols.values()))
    n = len(run.storages)
    sizes = [basis.coeffs(charged(s, dev)) if s.device == dev and s.category not in skip
             else None for s in run.storages]
    sizes += [basis.coeffs(a.nbytes) for a in added]
    before: dict[int, list] = {}
    for sid, i in (frees or {}).items():
        before.setdefault(i, []).append((-1, sid))
    for k, a in enumerate(added):
        before.setdefault(max(a.alloc, 0), []).append((1, n + k))
        if a.free is not None:
            before.setdefault(a.free, []).append((-1, n + k))
    moved = set(frees or ())
    evs, where, start = [], [], 0
    for i in range(len(run.events) + 1):
        if i == run.start:
            start = len(evs) + len(before.get(i, ()))
        for ev in sorted(before.get(i, ()), key=lambda e: e[0]):
            evs.append(ev)
            where.append(i)
        if i == len(run.events):
            break
        e = run.events[i]
        if (e.sign < 0 and e.sid in moved) or (keep and not keep(run.storages[e.sid], e.sign)):
            continue
        evs.append((e.sign, e.sid))
        where.append(i)
    label = peak_point_of(trace)
    lows = {nm: r[0] for nm, r in trace.ranges.items()}
    return prune(running_peaks(evs, sizes.__getitem__, basis, start,
                               lambda j: label(where[j] if 0 <= j < len(where) else j)),
                 list(trace.symbols.values()), lows)


def step_memory(trace: Trace) -> StepMemory:
    """Compute the figures of one traced run."""
    run, dev = trace.run, trace.device
    basis = PolyBasis(list(trace.symbols.values()))
    on_dev = [s.device == dev for s in run.storages]
    charge = [charged(s, dev) for s in run.storages]
    total = peak_candidates(trace, basis=basis, charge=charge)
    act = peak_candidates(trace, skip=MODEL_STATE, basis=basis, charge=charge)

    end_live = live_at(run, len(run.events))
    start_live = live_at(run, run.start)

    def total_of(cat: Category, live: set[int]) -> sympy.Expr:
        return sympy.Add(*[charge[s.sid] for s in run.storages
                           if s.sid in live and on_dev[s.sid] and s.category is cat])

    saved = sympy.Integer(0)
    if Phase.LOSS in run.phase_ends:
        at_bwd = live_at(run, run.phase_ends[Phase.LOSS])
        saved = sympy.Add(*[charge[s.sid] for s in run.storages if s.sid in at_bwd and on_dev[s.sid]
                            and s.saved and s.category is Category.ACTIVATION])
    return StepMemory(
        trace=trace, peak=as_max(total), candidates=total,
        parameters=total_of(Category.PARAMETER, start_live),
        buffers=total_of(Category.BUFFER, start_live),
        inputs=total_of(Category.INPUT, start_live),
        gradients=total_of(Category.GRADIENT, end_live) if trace.train else sympy.Integer(0),
        optimizer_states=total_of(Category.OPTIMIZER_STATE, start_live),
        saved_activations=sympy.expand(saved),
        activation_peak=as_max(act), activation_candidates=act)


@dataclass(frozen=True)
class DepthPeak:
    """The peak as a function of the stack's depth too (a folded trace).

    Attributes
    ----------
    symbol : the depth symbol (``L``: blocks of the stack; ``layers`` where the inputs use L).
    peak : the peak in the input symbols and ``symbol``, exact for every depth from ``low``.
    low : the least depth it holds for (one unit more than the first cut run).
    candidates : the regimes of ``peak``.
    """

    symbol: sympy.Symbol
    peak: sympy.Expr
    low: int
    candidates: list


def depth_peak(step: StepMemory) -> DepthPeak | None:
    """The peak of a folded step (:mod:`memsim.tracer.fold`) as a function of the number of
    blocks too, or None where the trace was not folded.

    The run with one unit more than the first cut run holds two copies of each region of the
    copied unit; a model with ``k`` more units runs ``k - 1`` more between them, each changing
    the live bytes by what one copy changes them by (the copies are equal), so the running sum
    from the second copy on is the pair's plus ``(k - 1)`` times that change. Inside the copies
    the sum is affine in the copy's number: its largest value is at the first or at the last
    copy, the two the pair has. The candidates are the pair's with that term, pruned as
    usual; the depth's lower bound is the pair's.
    """
    trace = step.trace
    f = trace.folded
    if f is None or f.reason is not None or f.pair is None:
        return None
    run, dev = f.pair, trace.device
    syms = list(trace.symbols.values())
    extra = sympy.Symbol("_extra", integer=True, positive=True)
    basis = PolyBasis(syms + [extra])
    charge = [charged(s, dev) if s.device == dev else None for s in run.storages]
    sizes = [basis.coeffs(c) if c is not None else None for c in charge]
    starts = {a: b for a, b in f.copies}
    # the previous step's output and loss (tracer/previous.py): alive when the step starts,
    # released where the loop rebinds the names; the output's blocks (a KV cache) grow by what
    # one copy of a region makes
    born = {}
    for i, e in enumerate(run.events):
        if e.sign > 0:
            born.setdefault(e.sid, i)
    ghosts: dict[int, list] = {}
    for _what, sids, at in held_items(run):
        per_copy = [sid for sid in sids if any(a <= born[sid] < b for a, b in f.copies)]
        size = sympy.Add(*[charge[sid] for sid in sids if charge[sid] is not None]) + \
            (extra - 1) * sympy.Add(*[charge[sid] for sid in per_copy if charge[sid] is not None])
        sizes.append(basis.coeffs(sympy.expand(size)))
        ghosts.setdefault(run.start, []).append((1, len(sizes) - 1))
        ghosts.setdefault(at, []).append((-1, len(sizes) - 1))
    evs, where, start = [], [], 0
    for i, e in enumerate(run.events):
        for ev in ghosts.get(i, ()):
            evs.append(ev)
            where.append(i)
        if i == run.start:
            start = len(evs)
        if i in starts:
            net = sympy.Add(*[ev.sign * charge[ev.sid] for ev in run.events[i:starts[i]]
                              if charge[ev.sid] is not None])
            sizes.append(basis.coeffs(sympy.expand((extra - 1) * net)))
            evs.append((1, len(sizes) - 1))
            where.append(i)
        evs.append((e.sign, e.sid))
        where.append(i)
    for ev in ghosts.get(len(run.events), ()):
        evs.append(ev)
        where.append(len(run.events))
    if run.start >= len(run.events):
        start = len(evs)
    label = peak_point_of(replace(trace, run=run))
    cands = running_peaks(evs, sizes.__getitem__, basis, start,
                          lambda j: label(where[j] if 0 <= j < len(where) else j))
    lows = {n: r[0] for n, r in trace.ranges.items()}
    lows["_extra"] = 1
    cands = prune(cands, syms + [extra], lows)
    st = f.stack
    name = "L" if "L" not in trace.symbols else "layers"
    depth = sympy.Symbol(name, integer=True, positive=True)
    # blocks = prefix + period * (units of the pair + extra - 1)
    units = (depth - st.prefix) / st.period
    to_depth = {extra: sympy.expand(units - f.units)}
    out = [Candidate(sympy.expand(c.expr.xreplace(to_depth)), c.event, c.label) for c in cands]
    return DepthPeak(depth, as_max(out), st.layers(f.units + 1), out)


def charged(s, device: str) -> sympy.Expr:
    """Bytes the allocator of ``device`` charges for storage ``s``."""
    return block_bytes(s.nbytes, device)


def live_at(run, upto: int) -> set[int]:
    """The storages live after the first ``upto`` events of ``run``."""
    live: set[int] = set()
    for ev in run.events[:upto]:
        (live.add if ev.sign > 0 else live.discard)(ev.sid)
    return live


@dataclass(frozen=True)
class ModuleSaved:
    """Bytes a module's forward keeps for backward (inclusive of its submodules)."""

    path: str
    type: str
    saved: sympy.Expr


def module_savings(trace: Trace, types: dict[str, str]) -> list[ModuleSaved]:
    """Per module: activation bytes saved for backward by ops inside it (deduplicated), the
    largest first at the example sizes, equal ones in the model's order (``types``, from
    ``named_modules``: layers 0, 1, 2 ... 10, not 0, 1, 10, 11, 2)."""
    acc: dict[str, list] = {}
    for s in trace.run.storages:
        if s.saved and s.category is Category.ACTIVATION and s.device == trace.device:
            for m in s.saved_by:
                acc.setdefault(m, []).append(charged(s, trace.device))
    hint = {sym: trace.hints[n] for n, sym in trace.symbols.items()}
    out = [ModuleSaved(p, types.get(p, ""), sympy.expand(sympy.Add(*v))) for p, v in acc.items()]
    order = {p: i for i, p in enumerate(types)}
    out.sort(key=lambda m: (-int(m.saved.xreplace(hint)), order.get(m.path, len(order)), m.path))
    return out
