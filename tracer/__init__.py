"""tracer: run a module's training step (or inference) symbolically and record its memory.

>>> import torch
>>> from memsim.tracer import trace
>>> t = trace(torch.nn.Linear(8, 4), {"input": ("float32", ["B", 8])}, train=False, device="cpu")
>>> sorted(map(str, t.symbols.values()))
['B']
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from .errors import (
    DataDependentError,
    InputError,
    MemsimError,
    OutOfRangeError,
    SpecializationError,
    StrategyError,
    TraceError,
    UnsupportedOpError,
    UsageError,
)
from .records import MODEL_STATE, Category, Event, LeafRecord, OpRecord, Phase, RunRecord, Storage
from .spec import (TensorSpec, is_tensor_spec, make_spec, parse_assignments, parse_input,
                   symbol)
from . import precision  # noqa: F401  (tracer.precision: the precision modes)
from .step import LossFn, OptimizerFactory, default_loss, run_step

__all__ = [
    "trace", "Trace", "TensorSpec", "Category", "Phase", "Storage", "Event", "RunRecord",
    "OpRecord", "LeafRecord", "MODEL_STATE", "symbol", "make_spec", "parse_input",
    "parse_assignments", "default_loss", "MemsimError", "InputError", "UsageError", "TraceError",
    "UnsupportedOpError", "DataDependentError", "SpecializationError", "OutOfRangeError",
    "StrategyError", "DEVICES",
]

DEVICES = ("cuda", "cpu")
# Example sizes for the symbolic run: distinct, >= 2 (0 and 1 specialize), and primes so that
# they rarely equal a constant size of the model (which would tie the symbol to it).
_DEFAULT_HINTS = (5, 7, 11, 13, 17, 19, 23, 29)


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
    guards : list of str
        Other shape conditions the run assumed (in the user's symbols).
    conditions : list of sympy relations
        The guards that are not plain bounds (``Eq(Mod(S, 2), 0)``: DTensor shards S evenly
        only when it divides; ``Ne(Mod(B, 2), 0)``): the run's code paths depend on them, so
        the formulas are known to hold only where they are all true (a point where one is false
        is traced again: :meth:`analysis.Report.for_point`).
    """

    run: RunRecord
    symbols: dict[str, sympy.Symbol]
    hints: dict[str, int]
    device: str
    train: bool
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    guards: list[str] = field(default_factory=list)
    conditions: list = field(default_factory=list)

    def fx_graph(self) -> torch.fx.Graph:
        from .graph import to_fx
        return to_fx(self.run)

    def graph(self):
        """The run as a ``networkx.DiGraph`` (see :func:`tracer.graph.to_networkx`)."""
        from .graph import to_networkx
        return to_networkx(self.run)


def _hints(specs: list[TensorSpec], given: dict[str, int] | None) -> dict[str, int]:
    given = dict(given or {})
    names = list(dict.fromkeys(n for s in specs for n in s.symbols))
    for n, v in given.items():
        if n not in names:
            raise InputError(f"example size given for {n!r}, which no input uses",
                             hint=f"symbols: {', '.join(names) or '(none)'}")
        if not isinstance(v, int) or v < 2:
            raise InputError(f"example size {n}={v!r} must be an int >= 2",
                             hint="0 and 1 make PyTorch specialize the size")
    pool = [h for h in _DEFAULT_HINTS if h not in given.values()]
    out = {}
    for n in names:
        out[n] = given[n] if n in given else pool.pop(0)
    if len(set(out.values())) != len(out):
        raise InputError(f"example sizes must be distinct, got {out}",
                         hint="equal example sizes merge two symbols into one")
    return out


def _pretty_bound(v) -> int | None:
    try:
        if v in (sympy.oo, -sympy.oo) or str(v) in ("int_oo", "-int_oo", "oo", "-oo"):
            return None
        return int(v)
    except (TypeError, ValueError):
        return None


def trace(model: torch.nn.Module, inputs: dict, *, train: bool = True, device: str = "cuda",
          loss_fn: LossFn | None = None, optimizer: OptimizerFactory | None = None,
          hints: dict[str, int] | None = None, keep_outputs: bool = True,
          limits: dict[str, int] | None = None, patches=None, precision=None,
          accumulate: int = 1, transform=None, compiled: bool = False, driver=None) -> Trace:
    """Run ``model`` symbolically and return its :class:`Trace`.

    Parameters
    ----------
    model : torch.nn.Module
        Parameters may be on the meta device: the model is never materialized.
    inputs : dict
        ``{name: (dtype, shape)}`` for tensors (shape entries are ints or symbol names), or
        ``{name: TensorSpec}``; any other value is passed to ``forward`` as a constant.
    train : bool
        Trace the training step (see :mod:`tracer.step`) or an inference forward.
    device : {"cuda", "cpu"}
        The device whose kernels and allocator are modelled.
    limits : dict of str to int, optional
        Upper bounds of symbols that the model imposes (e.g. ``{"S": n_positions}``).
    precision : str, optional
        A mode of :mod:`tracer.precision` (default ``"32-true"``).
    accumulate : int
        Micro-batches per optimizer step (gradient accumulation).
    transform : callable, optional
        ``transform(model)`` applied to a copy of the model with fake parameters, inside the
        symbolic run and before the optimizer is built (see :mod:`strategies`).
    compiled : bool
        Run the forward as ``torch.compile(model, fullgraph=True)`` partitions it: AOTAutograd
        with Inductor's decompositions and min-cut partitioner (see :mod:`tracer.compiled`).
    driver : tracer.step.Driver, optional
        Owns the training loop (e.g. DeepSpeed's engine) in place of the plain one.
    """
    if device not in DEVICES:
        raise InputError(f"unknown device {device!r}", hint=f"use one of {', '.join(DEVICES)}")
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"expected an nn.Module, got {type(model).__name__}")
    specs, constants = [], {}
    for name, value in inputs.items():
        if is_tensor_spec(value):
            specs.append(make_spec(name, value))
        else:
            constants[name] = value
    hint_map = _hints(specs, hints)
    if isinstance(optimizer, str):
        optimizer = optimizer_factory(optimizer)
    run, shape_env, table = run_step(model, specs, device=device, hints=hint_map, train=train,
                                     loss_fn=loss_fn, optimizer=optimizer, constants=constants,
                                     keep_outputs=keep_outputs, patches=patches,
                                     precision=precision, accumulate=accumulate,
                                     transform=transform, compiled=compiled,
                                     driver=driver)
    user = {n: symbol(n) for n in table.raw}
    to_user = {raw: user[n] for n, raw in table.raw.items()}
    ranges, guards, conditions = _validity(shape_env, table, to_user, limits or {},
                                           run.specialized)
    cache: dict = {}

    def to_user_expr(e: sympy.Expr) -> sympy.Expr:
        if e not in cache:
            cache[e] = _in_range(sympy.expand(shape_env.replace(e).xreplace(to_user)), user,
                                 ranges)
        return cache[e]

    for s in run.storages:
        s.nbytes = to_user_expr(s.nbytes)
        _check_backed(s, run)
    _map_shapes(run, to_user_expr)
    return Trace(run, user, hint_map, device, train, ranges, guards, conditions)


def optimizer_factory(name: str) -> OptimizerFactory:
    """The factory for an optimizer name (:mod:`tracer.optimizers`)."""
    from .optimizers import lookup

    entry = lookup(name)

    def make(params):
        opt = entry.factory(params)
        opt._memsim_host_state = entry.host_state
        return opt

    return make


def _map_shapes(run: RunRecord, fn) -> None:
    """Rewrite every recorded output shape into the user's symbols (records are frozen)."""
    from dataclasses import replace

    def meta(m):
        return replace(m, shape=tuple(fn(d) for d in m.shape))

    for i, rec in enumerate(run.ops):
        if isinstance(rec, LeafRecord):
            run.ops[i] = replace(rec, meta=meta(rec.meta))
        else:
            run.ops[i] = replace(rec, outputs=tuple(meta(m) for m in rec.outputs),
                                 flops=fn(rec.flops) if rec.flops else rec.flops)


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


def _check_backed(s: Storage, run: RunRecord) -> None:
    free = [x for x in s.nbytes.free_symbols if not x.name.isidentifier() or
            x.name.startswith(("u", "s")) and x.name[1:].isdigit()]
    if free:
        raise DataDependentError(
            f"the size of a tensor depends on tensor values ({s.nbytes} bytes)",
            module=s.module, op=s.op,
            hint="ops such as nonzero/masked_select/unique have data-dependent sizes; "
                 "memsim cannot give a formula for them")


def _validity(shape_env, table, to_user, limits, specialized=()):
    """Ranges of validity per symbol and the other guards, in the user's symbols."""
    for name, raw in table.raw.items():
        rep = shape_env.replacements.get(raw)
        if rep is not None and rep != raw:
            op = module = where = None
            for sym, _, op_, mod_, src in specialized:
                if sym == raw:
                    op, module, where = op_, mod_, src
                    break
            raise SpecializationError(
                f"the model's code ties symbol {name} to {rep.xreplace(to_user)} "
                f"(example size {table.hints[name]})", source=where, op=op, module=module,
                hint=f"give {name} as a fixed integer, or a different example size "
                     f"(hints={{'{name}': ...}}) if it only matched a constant by chance")
    ranges = {}
    for name, raw in table.raw.items():
        vr = shape_env.var_to_range.get(raw)
        lo = _pretty_bound(vr.lower) if vr is not None else 2
        hi = _pretty_bound(vr.upper) if vr is not None else None
        if name in limits:
            hi = limits[name] if hi is None else min(hi, limits[name])
        ranges[name] = (lo if lo is not None else 2, hi)
    conditions = []
    for g in shape_env.guards:
        e = g.expr.xreplace(to_user)
        if e is sympy.true or (len(e.free_symbols) == 1 and _is_bound(e)):
            continue  # single-symbol bounds are already in var_to_range
        conditions.append(e)
    conditions = list(dict.fromkeys(conditions))
    return ranges, [str(c) for c in conditions], conditions


def _is_bound(rel) -> bool:
    """``S <= 1024``, ``2*B > 3``: an inequality between polynomials."""
    return isinstance(rel, (sympy.LessThan, sympy.StrictLessThan, sympy.GreaterThan,
                            sympy.StrictGreaterThan)) and all(
        side.is_polynomial(*rel.free_symbols) for side in rel.args)
