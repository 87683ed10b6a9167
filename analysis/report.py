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
memsim.tracer.errors.OutOfRangeError: B=1 is below the range the formulas hold for (2 <= B)
  hint: report.for_point({'B': 1}) traces that case on its own (one more symbolic run): size-1 dimensions and other code paths differ in PyTorch
>>> sub, pt = r.for_point({"B": 1})
>>> sub.fixed, sub.at(**pt)["train"]["peak"]
({'B': 1}, 15012)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import sympy
import torch

from memsim.tracer import (InputError, OutOfRangeError, StepConfig, TensorSpec, is_tensor_spec,
                           make_spec, trace)
from memsim.tracer import hf

from .memory import ModuleSaved, StepMemory, module_savings, step_memory

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
        key = tuple(sorted(fixed.items()))
        if key not in self.cache:
            self.cache[key] = self.analyze(self.model, fix_inputs(self.inputs, fixed),
                                           self.config.fixing(fixed),
                                           fixed={**(already or {}), **fixed}, **self.options)
        return self.cache[key]


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

    def needs_retrace(self, point: Mapping[str, int]) -> dict[str, int]:
        """The sizes of ``point`` that this report's formulas do not cover and that
        :meth:`for_point` would trace with fixed: sizes below a symbol's range, or, failing
        those, the symbols of a trace condition that is false at ``point``. Empty: covered."""
        fix = {}
        for n, v in point.items():
            lo = self.ranges.get(n, (2, None))[0]
            if n in self.symbols and isinstance(v, int) and 0 < v < lo:
                fix[n] = v
        if not fix:
            for step in (self.train, self.inference):
                for cond in step.violated(point) if step is not None else ():
                    fix.update({x.name: point[x.name] for x in cond.free_symbols})
        return fix

    def for_point(self, point: Mapping[str, int]) -> tuple["Report", dict[str, int]]:
        """The report that covers ``point``, and the point in its symbols. **May trace
        again.**

        A size below a symbol's range (``B = 1`` for a formula valid from ``B >= 2``) takes
        other paths in PyTorch (size-1 dimensions broadcast, skip copies): that case is traced
        on its own, with the symbol fixed to its value, by :attr:`retracer` (once per value,
        cached there). So is a point where one of the traces' conditions is false
        (``Eq(Mod(S, 2), 0)`` from an even example size, say): the symbols of those conditions
        are fixed to the point's values.
        """
        fix = self.needs_retrace(point)
        if not fix or self.retracer is None:
            return self, dict(point)
        sub = self.retracer(fix, self.fixed)
        return sub.for_point({n: v for n, v in point.items() if n not in fix})

    def at(self, **point: int) -> dict:
        """Every figure evaluated at ``point`` (plain ints), from this report's formulas.

        A point they do not cover (below a symbol's range, or where a trace condition is
        false) is an :class:`OutOfRangeError` naming :meth:`for_point`, which traces it."""
        fix = self.needs_retrace(point) if self.retracer is not None else {}
        if fix:
            where = ", ".join(f"{k}={v}" for k, v in fix.items())
            below = [f"{lo} <= {n}" + (f" <= {hi}" if hi is not None else "")
                     for n, (lo, hi) in self.ranges.items() if n in fix and fix[n] < lo]
            false = [str(c) for step in (self.train, self.inference) if step is not None
                     for c in step.violated(point)]
            why = (f"{where} is below the range the formulas hold for ({', '.join(below)})"
                   if below else f"at {where} a condition of the trace is false "
                   f"({'; '.join(false)}): the formulas do not cover that point")
            raise OutOfRangeError(
                why,
                hint=f"report.for_point({dict(point)!r}) traces that case on its own (one more "
                     "symbolic run): size-1 dimensions and other code paths differ in PyTorch")
        out: dict = {}
        if self.train is not None:
            out["train"] = {f: self.train.evaluate(getattr(self.train, f), point)
                            for f in TRAIN_FIELDS}
        if self.inference is not None:
            out["inference"] = {"peak": self.inference.evaluate(self.inference.peak, point)}
        return out


def _module_types(model: torch.nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules()}


def analyze(model: torch.nn.Module, inputs: dict, config: StepConfig | None = None, *,
            train: bool = True, inference: bool = True, transform=None, driver=None,
            fixed: Mapping[str, int] | None = None, **options) -> Report:
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
    **options
        Fields of :class:`~memsim.tracer.StepConfig` (``device="cpu"``,
        ``keep_outputs=False``...), applied over ``config`` and validated once.
    """
    config = StepConfig.of(config, **options)
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
    return Report(config, first.trace.symbols, tr_step, inf_step, tuple(modules), other,
                  fixed=dict(fixed or {}), notes=tuple(_compiled_notes(config, first)),
                  retracer=Retracer(analyze, model, inputs, config, dict(
                      train=train, inference=inference, transform=transform, driver=driver)))


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
