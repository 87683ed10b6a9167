"""The trace: a module's step run symbolically, in the user's symbols.

>>> import torch
>>> from memsim.tracer import StepConfig, trace
>>> t = trace(torch.nn.Linear(8, 4), {"input": ("float32", ["B", 8])}, StepConfig(device="cpu"),
...           train=False)
>>> sorted(map(str, t.symbols.values()))
['B']
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import sympy
import torch

from .config import StepConfig
from .driver import Driver
from . import branching, fold, fold_stack, progress
from .fork import abandon, forked, joined
from .divisions import exact
from .example_sizes import example_sizes, larger_sizes
from .errors import (DataDependentError, InputError, MemsimError, SpecializationError,
                     TraceError, UnsupportedOpError)
from .previous import add_previous_step
from .records import Category, LeafRecord, Phase, RunRecord, Storage
from .spec import is_tensor_spec, make_spec, symbol
from .step import run_step


@dataclass
class Trace:
    """One symbolic run, with sizes in the user's symbols.

    Attributes
    ----------
    run : RunRecord
        Storages (``nbytes`` in the user's symbols), events and ops.
    symbols : dict of str to sympy.Symbol
    hints : dict of str to int
        The example sizes the run used.
    device : str
        The device type modelled.
    train : bool
        Training step (True) or inference forward (False).
    ranges : dict of str to (int, int or None)
        Range of each symbol the trace is valid for (from the run's guards and model limits).
    limits : dict of str to int
        The model's own upper limits on symbols (given, or a Hugging Face model's positions);
        a range that ends below its symbol's limit ends at a guard of the code path taken.
    guards : list of str
        Other shape conditions the run assumed (in the user's symbols).
    conditions : list of sympy relations
        The guards that are not plain bounds (``Eq(Mod(S, 2), 0)``: DTensor shards S evenly
        only when it divides; ``Ne(Mod(B, 2), 0)``): the run's code paths depend on them, so
        the formulas are known to hold only where they are all true (a point where one is false
        is traced again: :meth:`memsim.analysis.Report.for_point`).
    folded : Folding or None
        How a stack of repeated blocks was folded (:mod:`memsim.tracer.fold`), or why it was
        traced whole after all; None where the model has no stack worth folding.
    multiples : dict of str to int
        The symbols traced at multiples of a step (``StepConfig.multiples``): the formulas
        hold where each is a multiple of its step (:meth:`step_conditions`).
    """

    run: RunRecord
    symbols: dict[str, sympy.Symbol]
    hints: dict[str, int]
    device: str
    train: bool
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    guards: list[str] = field(default_factory=list)
    conditions: list = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    folded: "Folding | None" = None
    multiples: dict[str, int] = field(default_factory=dict)

    def step_conditions(self) -> list:
        """``Eq(Mod(H, 32), 0)`` for each symbol traced at multiples of a step."""
        return [sympy.Eq(sympy.Mod(self.symbols[n], k), 0) for n, k in self.multiples.items()]

    def fx_graph(self) -> torch.fx.Graph:
        from .graph import to_fx
        return to_fx(self.run)

    def graph(self):
        """The run as a ``networkx.DiGraph`` (see :func:`memsim.tracer.graph.to_networkx`)."""
        from .graph import to_networkx
        return to_networkx(self.run)


def _pretty_bound(v) -> int | None:
    try:
        if v in (sympy.oo, -sympy.oo) or str(v) in ("int_oo", "-int_oo", "oo", "-oo"):
            return None
        return int(v)
    except (TypeError, ValueError):
        return None


def trace(model: torch.nn.Module, inputs: dict, config: StepConfig | None = None, *,
          train: bool = True, transform: Callable | None = None, driver: Driver | None = None,
          patches: Callable | None = None, sizes=(), **options) -> Trace:
    """Run ``model`` symbolically and return its :class:`Trace`.

    Parameters
    ----------
    model : torch.nn.Module
        Parameters may be on the meta device: the model is never materialized.
    inputs : dict
        ``{name: (dtype, shape)}`` for tensors (shape entries are ints or symbol names), or
        ``{name: TensorSpec}``; any other value is passed to ``forward`` as a constant.
    config : StepConfig, optional
        The step (device, precision, optimizer, loop...); the defaults when None.
    train : bool
        Trace the training step (see :mod:`memsim.tracer.step`) or an inference forward.
    transform : callable, optional
        ``transform(model)`` applied to a copy of the model with fake parameters, inside the
        symbolic run and before the optimizer is built (see :mod:`memsim.strategies`).
    driver : Driver, optional
        Owns the training loop (e.g. DeepSpeed's engine) in place of the plain one.
    patches : callable, optional
        A context-manager factory entered for the run, given the run's model (Hugging Face's
        scoped patches).
    sizes : list of dict, optional
        Points the user asks for (``[{"B": 2, "S": 64}]``): where the model fails at the
        example sizes, these are the first other example sizes tried
        (:func:`memsim.tracer.example_sizes.larger_sizes`).
    **options
        Fields of :class:`StepConfig` (``device="cpu"``...), applied over ``config``.
    """
    config = StepConfig.of(config, **options)
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"expected an nn.Module, got {type(model).__name__}")
    specs, constants = [], {}
    for name, value in inputs.items():
        if is_tensor_spec(value):
            specs.append(make_spec(name, value))
        else:
            constants[name] = value
    hint_map = example_sizes(specs, config.hints, config.multiples)
    # a strategy's transform says which modules it treats one by one; a library's loop
    # (DeepSpeed's engine) fills buckets across blocks: not folded
    touched = () if transform is None else getattr(transform, "paths", None)
    stack = fold_stack.find_stack(model, touched) if (
        config.fold and not config.compiled and touched is not None
        and not (driver is not None and train)) else None

    def once(hints: dict[str, int], cfg: StepConfig) -> Trace:
        if stack is not None:
            t = _folded(model, stack, specs, constants, cfg, hints, train=train,
                        transform=transform, driver=driver, patches=patches)
        else:
            t = _traced(model, specs, constants, cfg, hints, train=train,
                        transform=transform, driver=driver, patches=patches)
        # the previous step's output and loss, alive until the loop rebinds the names: added
        # to the finished run, whole or folded (a folded run's output grows with its blocks)
        add_previous_step(t.run)
        return t

    def run(hints: dict[str, int]) -> Trace:
        # a truth value the model reads without data: both ways (memsim.tracer.branching)
        return branching.explore(once, hints, config)

    try:
        return run(hint_map)
    except TraceError as e:
        if not getattr(e, "sizes", None):  # not the model's own failure at the sizes
            raise
        tried = []
        for larger in larger_sizes(hint_map, config, sizes, e.message):
            at = ", ".join(f"{k}={v}" for k, v in larger.items())
            try:
                return run(larger)
            except (DataDependentError, UnsupportedOpError, SpecializationError) as later:
                # past the small sizes, the model stops on something else: that is the answer
                MemsimError.__init__(later, later.message, hint=(later.hint or "") + (
                    f" (at the example sizes {at}; at the first ones the model failed "
                    f"earlier: {e.message})"))
                raise later from later.__cause__
            except MemsimError:
                tried.append(at)
        if not tried:
            raise
        MemsimError.__init__(e, e.message, hint=(e.hint or "") + (
            f" (memsim tried the larger example sizes {'; '.join(tried)} too, and they "
            "failed)"))
        raise e from e.__cause__


@dataclass(frozen=True)
class Folding:
    """How a folded trace was made (:mod:`memsim.tracer.fold`).

    Attributes
    ----------
    stack : the stack of blocks folded (path, blocks, pattern).
    traced : blocks of the two runs traced (the second proves the construction from the first).
    reason : why the model was traced whole after all (None when folded).
    """

    stack: fold_stack.Stack
    traced: tuple[int, int]
    reason: str | None = None
    # the run with one unit more than the first cut (equal to the second), and where the
    # second copy of each region lies in its events: the peak as a function of depth
    pair: RunRecord | None = field(default=None, repr=False, compare=False)
    copies: tuple = ()
    units: int = 0

    def describe(self) -> str:
        a, b = self.traced
        if self.reason is not None:
            return (f"every block traced: {self.stack.describe()} did not fold "
                    f"({self.reason})")
        return (f"{self.stack.describe()}: traced with {a} and with {b} blocks, the "
                f"{self.stack.size}-block run derived from the first and proven equal to the "
                "second with one more")


def _folded(model, stack, specs, constants, config, hint_map, **kw) -> Trace:
    """A trace of ``model`` from two runs of its stack cut short (:mod:`memsim.tracer.fold`),
    or of the whole model where the runs do not repeat as the stack does."""
    units = fold_stack.TRACED_UNITS
    traced = (stack.layers(units), stack.layers(units + 1))
    child = _fork_traced(model, stack, units + 1, specs, constants, config, hint_map, **kw)
    try:
        with fold_stack.cut(model, stack, units):
            a = _traced(model, specs, constants, config, hint_map, **kw)
        # built from run A while the child (if any) still traces run B
        try:
            folder = fold.Folder(a.run, stack, units)
            one = folder.construct(1)
            copies = tuple(folder.last_copies)
            run = folder.construct(stack.units - units)
            unfolded = None
        except fold_stack.CannotFold as e:
            unfolded = str(e)
        pending, child = child, None
        b = joined(pending)
        if b is None:
            with fold_stack.cut(model, stack, units + 1):
                b = _traced(model, specs, constants, config, hint_map, **kw)
        if (a.ranges, a.guards, a.hints) != (b.ranges, b.guards, b.hints):
            reason = "the cut runs take different code paths"
        elif unfolded is not None:
            reason = unfolded
        else:
            reason = fold.difference(one, b.run)
            reason = reason and f"one more block differs from the runs' pattern at {reason}"
        if reason is None:
            return replace(a, run=run, folded=Folding(stack, traced, pair=b.run,
                                                      copies=copies, units=units))
    except SpecializationError:
        raise
    except MemsimError as e:
        reason = f"a cut run failed: {e.message}"
    finally:
        abandon(child)
    t = _traced(model, specs, constants, config, hint_map, **kw)
    return replace(t, folded=Folding(stack, traced, reason))


def _fork_traced(model, stack, units, specs, constants, config, hint_map, **kw):
    """Start tracing ``model`` with its stack cut to ``units`` units in a forked child (its
    own copy of the model and of every module state), which sends back the pickled
    :class:`Trace`; ``(pid, pipe)``, or None where it is not worth it or not possible (the
    run is then traced here, after the other). The two runs are independent: each starts from
    the same state (the fork happens before either), as when they run one after the other,
    whose results do not depend on the other's either (tested: folded runs equal whole ones
    with and without the child)."""
    def run():
        with fold_stack.cut(model, stack, units):
            return _traced(model, specs, constants, config, hint_map, **kw)
    return forked(run)


def _traced(model, specs, constants, config, hint_map, *, train, transform, driver,
            patches) -> Trace:
    progress.started()
    try:
        run, shape_env, table = run_step(model, specs, constants, config, hints=hint_map,
                                         train=train, transform=transform, driver=driver,
                                         patches=patches)
    finally:
        progress.finished()
    user = {n: symbol(n) for n in table.raw}
    # a stepped symbol's run symbol counts its steps
    to_user = {raw: user[n] / table.steps.get(n, 1) for n, raw in table.raw.items()}
    lower = _lower_bounds(shape_env, table)
    ranges, guards, conditions = _validity(shape_env, table, to_user, lower, config.limits,
                                           run.specialized)
    cache: dict = {}

    def to_user_expr(e: sympy.Expr) -> sympy.Expr:
        if e not in cache:
            cache[e] = _in_range(sympy.expand(
                exact(shape_env.replace(e), lower).xreplace(to_user)), user, ranges)
        return cache[e]

    run = _in_user_symbols(run, to_user_expr)
    _classify(run)
    return Trace(run, user, hint_map, config.device, train, ranges, guards, conditions,
                 dict(config.limits), multiples=dict(table.steps))


def _in_user_symbols(run: RunRecord, fn) -> RunRecord:
    """The run with every size and output shape in the user's symbols (a new record)."""
    storages = [replace(s, nbytes=fn(s.nbytes)) for s in run.storages]
    for s in storages:
        _check_backed(s)
    return replace(run, storages=storages, ops=_map_shapes(run.ops, fn))


def _classify(run: RunRecord) -> None:
    """Label the forward's storages still alive when backward starts as activations (the
    record is the trace's own, not yet handed out); in a loop whose forward interleaves the
    backward of its parts (:attr:`RunRecord.interleaved`), those autograd saved for it."""
    if run.interleaved:
        for s in run.storages:
            if s.phase is Phase.FORWARD and s.saved and s.category is Category.TEMPORARY:
                s.category = Category.ACTIVATION
        return
    ends = run.phase_ends
    if Phase.LOSS not in ends:
        return
    cut = ends[Phase.LOSS]
    freed_before = {ev.sid for ev in run.events[:cut] if ev.sign < 0}
    for s in run.storages:
        if (s.phase in (Phase.FORWARD, Phase.LOSS) and s.category is Category.TEMPORARY
                and s.sid not in freed_before):
            s.category = Category.ACTIVATION


def _map_shapes(ops: list, fn) -> list:
    """Every recorded output shape in the user's symbols (records are frozen)."""
    def meta(m):
        return replace(m, shape=tuple(fn(d) for d in m.shape))

    return [replace(rec, meta=meta(rec.meta)) if isinstance(rec, LeafRecord) else
            replace(rec, outputs=tuple(meta(m) for m in rec.outputs),
                    flops=fn(rec.flops) if rec.flops else rec.flops) for rec in ops]


def _in_range(expr: sympy.Expr, user: dict, ranges: dict) -> sympy.Expr:
    """Simplify ``Max``/``Min`` of sizes using each symbol's lower bound (``Max(1, S-1)`` is
    ``S-1`` for ``S >= 2``)."""
    if expr.is_polynomial(*user.values()):
        return expr
    shift = {}
    for n, sym in user.items():
        y = sympy.Symbol(f"_{n}_y", integer=True, nonnegative=True)
        shift[sym] = (y, ranges[n][0])
    fwd = expr.xreplace({s: y + lo for s, (y, lo) in shift.items()})
    back = sympy.expand(fwd.xreplace({y: s - lo for s, (y, lo) in shift.items()}))
    return back


def _check_backed(s: Storage) -> None:
    free = [x for x in s.nbytes.free_symbols if not x.name.isidentifier() or
            x.name.startswith(("u", "s")) and x.name[1:].isdigit()]
    if free:
        raise DataDependentError(
            f"the size of a tensor depends on tensor values ({s.nbytes} bytes)",
            module=s.module, op=s.op,
            hint="ops such as nonzero/masked_select/unique have data-dependent sizes; "
                 "memsim cannot give a formula for them")


def _validity(shape_env, table, to_user, lower, limits, specialized=()):
    """Ranges of validity per symbol and the other guards, in the user's symbols (``lower``:
    each run symbol's least size, :func:`_lower_bounds`)."""
    # a pinned symbol is reported in the order the run pinned them (a loop over time steps
    # pins S first; a size computed from it may then pin B too)
    first = {sym: i for i, (sym, *_) in enumerate(specialized)}
    for name, raw in sorted(table.raw.items(), key=lambda kv: first.get(kv[1], len(first))):
        rep = shape_env.replacements.get(raw)
        if rep is not None and rep != raw:
            op = module = where = None
            for sym, _, op_, mod_, src in specialized:
                if sym == raw:
                    op, module, where = op_, mod_, src
                    break
            raise SpecializationError(
                f"the model's code ties symbol {name} to {rep.xreplace(to_user)} "
                f"(example size {table.hints[name]})", symbol=name, source=where, op=op,
                module=module, example=table.hints[name],
                hint=f"give {name} as a fixed integer, or a different example size "
                     f"(--hint {name}=N, Python hints={{'{name}': N}}) if it only matched a "
                     "constant by chance")
    ranges = {}
    for name, raw in table.raw.items():
        vr = shape_env.var_to_range.get(raw)
        hi = _pretty_bound(vr.upper) if vr is not None else None
        step = table.steps.get(name, 1)
        hi = hi if hi is None else hi * step
        if name in limits:
            hi = limits[name] if hi is None else min(hi, limits[name])
        ranges[name] = (lower[raw] * step, hi)
    conditions = []
    for g in shape_env.guards:
        e = exact(g.expr, lower).xreplace(to_user)
        if e is sympy.true or (len(e.free_symbols) == 1 and is_bound(e)):
            continue  # single-symbol bounds are already in var_to_range
        conditions.append(e)
    conditions = list(dict.fromkeys(conditions))
    return ranges, [str(c) for c in conditions], conditions


def _lower_bounds(shape_env, table) -> dict:
    """Each run symbol's least size (2 where the run knows none)."""
    out = {}
    for raw in table.raw.values():
        vr = shape_env.var_to_range.get(raw)
        lo = _pretty_bound(vr.lower) if vr is not None else None
        out[raw] = lo if lo is not None else 2
    return out


def is_bound(rel) -> bool:
    """``S <= 1024``, ``2*B > 3``: an inequality between polynomials."""
    return isinstance(rel, (sympy.LessThan, sympy.StrictLessThan, sympy.GreaterThan,
                            sympy.StrictGreaterThan)) and all(
        side.is_polynomial(*rel.free_symbols) for side in rel.args)
