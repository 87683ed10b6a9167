"""analysis: exact, symbolic memory of a training step and of inference.

>>> import torch
>>> from memsim.analysis import analyze
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> r = analyze(model, {"input": ("float32", ["B", 16])}, device="cpu")
>>> r.train.peak            # three regimes: backward of the ReLU, of the first Linear, the step
Max(80*B + 14932, 208*B + 10840, 464*B + 8664)
>>> r.at(B=4)["train"]["peak"]
15252
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from memsim import tracer
from memsim.tracer import Trace, trace

from .memory import ModuleSaved, PeakPoint, StepMemory, module_savings, step_memory

__all__ = ["analyze", "Report", "StepMemory", "ModuleSaved", "PeakPoint", "TRAIN_FIELDS"]

TRAIN_FIELDS = ("peak", "activation_peak", "saved_activations", "parameters", "gradients",
                "optimizer_states")


@dataclass
class Report:
    """What one step of a model takes on one device.

    Attributes
    ----------
    device : str
        ``"cuda"`` or ``"cpu"``: whose kernels were modelled.
    symbols : dict of str to sympy.Symbol
    train, inference : StepMemory or None
    modules : list of ModuleSaved
        Bytes saved for backward per module, largest first (at the example sizes).
    other_ops : dict of str to int
        Ops outside ATen/prims (custom ops) that ran, with their counts: their memory comes from
        their fake kernel and was not checked against a real run.
    """

    device: str
    symbols: dict[str, sympy.Symbol]
    train: StepMemory | None
    inference: StepMemory | None
    modules: list[ModuleSaved] = field(default_factory=list)
    other_ops: dict[str, int] = field(default_factory=dict)
    fixed: dict[str, int] = field(default_factory=dict)
    precision: str = "32-true"
    accumulate: int = 1
    compiled: bool = False                         # torch.compile's partition (tracer.compiled)
    strategy: dict = field(default_factory=dict)   # set by strategies.analyze
    ranks: list = field(default_factory=list)      # per-rank figures where ranks differ
    notes: list = field(default_factory=list)
    _retrace: object = field(default=None, repr=False, compare=False)
    _specialized: dict = field(default_factory=dict, repr=False, compare=False)

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

    def for_point(self, point: dict[str, int]) -> tuple["Report", dict[str, int]]:
        """The report that covers ``point``, and the point in its symbols.

        A size below a symbol's range (``B = 1`` for a formula valid from ``B >= 2``) takes
        other paths in PyTorch (size-1 dimensions broadcast, skip copies): that case is traced
        on its own, with the symbol fixed to its value, once, and that report answers. So is a
        point where one of the traces' conditions is false (``Eq(Mod(S, 2), 0)`` from an even
        example size, say): the symbols of those conditions are fixed to the point's values.
        """
        if self._retrace is None:
            return self, dict(point)
        fix = {}
        for n, v in point.items():
            lo = self.ranges.get(n, (2, None))[0]
            if n in self.symbols and isinstance(v, int) and 0 < v < lo:
                fix[n] = v
        if not fix:
            for step in (self.train, self.inference):
                for cond in step.violated(point) if step is not None else ():
                    fix.update({x.name: point[x.name] for x in cond.free_symbols})
        if not fix:
            return self, dict(point)
        key = tuple(sorted(fix.items()))
        if key not in self._specialized:
            sub = self._specialized[key] = self._retrace(fix)
            sub.fixed = {**self.fixed, **fix}
        return self._specialized[key].for_point(
            {n: v for n, v in point.items() if n not in fix})

    def at(self, **point: int) -> dict:
        """Every figure evaluated at ``point`` (plain ints); see :meth:`for_point` for sizes
        below a symbol's range."""
        report, point = self.for_point(point)
        if report is not self:
            return report.at(**point)
        out: dict = {}
        if self.train is not None:
            out["train"] = {f: self.train.evaluate(getattr(self.train, f), point)
                            for f in TRAIN_FIELDS}
        if self.inference is not None:
            out["inference"] = {"peak": self.inference.evaluate(self.inference.peak, point)}
        return out


def _module_types(model: torch.nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules()}


def analyze(model: torch.nn.Module, inputs: dict, *, device: str = "cuda",
            train: bool = True, inference: bool = True, loss_fn=None, optimizer=None,
            hints: dict[str, int] | None = None, keep_outputs: bool = True,
            limits: dict[str, int] | None = None, precision: str | None = None,
            accumulate: int = 1, transform=None, compiled: bool = False,
            driver=None) -> Report:
    """Trace ``model`` and return the symbolic :class:`Report` of a step.

    Parameters
    ----------
    model : torch.nn.Module
        Its parameters may live on the meta device; nothing is materialized.
    inputs : dict
        ``{name: (dtype, shape)}``, e.g. ``{"input_ids": ("int64", ["B", "S"])}``; other values
        are passed to ``forward`` as constants.
    device : {"cuda", "cpu"}
        Whose kernels and allocator to model.
    train, inference : bool
        Which analyses to run.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar``; default: ``output.loss``, a scalar output, or the sum of
        the first floating-point tensor of the output.
    optimizer : callable or str, optional
        ``optimizer(params) -> torch.optim.Optimizer``, or a name of :mod:`tracer.optimizers`
        (any torch.optim class, ``lion``, ``adamw8bit``, ``paged_adamw8bit``...); default
        AdamW with torch's defaults.
    hints : dict, optional
        Example sizes for the symbolic run (distinct, >= 2).
    keep_outputs : bool
        Keep the forward output referenced through backward and the optimizer step, as a plain
        training loop does (default True); False drops it once the loss is computed.
    limits : dict, optional
        Upper bounds the model imposes on symbols (Hugging Face limits are found on their own).
    precision : str, optional
        ``"32-true"`` (default), ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
        ``"16-true"`` or ``"bf16-master"`` (see :mod:`tracer.precision`).
    accumulate : int
        Micro-batches per optimizer step (gradient accumulation; default 1).
    transform : callable, optional
        Applied to a copy of the model inside each symbolic run (see :func:`tracer.trace`);
        :mod:`strategies` builds these.
    compiled : bool
        Predict the step under ``torch.compile(model, fullgraph=True)``: what Inductor's min-cut
        partitioner saves for backward (exact at the example sizes), and the peak with Inductor's
        kernel fusion modelled (close, not exact; see :mod:`tracer.compiled`).
    driver : tracer.step.Driver, optional
        Owns the training loop in place of the plain one (DeepSpeed's engine, built by
        :mod:`strategies.zero`); the inference forward stays plain.
    """
    from memsim.tracer import hf

    patches, auto_limits = hf.adapt(model, inputs)
    limits = {**auto_limits, **(limits or {})}
    kw = dict(device=device, hints=hints, limits=limits, patches=patches, precision=precision,
              transform=transform, compiled=compiled)
    tr_step = inf_step = None
    modules: list[ModuleSaved] = []
    other: dict[str, int] = {}
    if train:
        t = trace(model, inputs, train=True, loss_fn=loss_fn, optimizer=optimizer,
                  keep_outputs=keep_outputs, accumulate=accumulate, driver=driver, **kw)
        tr_step = step_memory(t)
        modules = module_savings(t, _module_types(model))
        other.update(t.run.other_ops)
    if inference:
        t = trace(model, inputs, train=False, **kw)
        inf_step = step_memory(t)
        for k, v in t.run.other_ops.items():
            other[k] = other.get(k, 0) + v
    if tr_step is None and inf_step is None:
        raise tracer.InputError("nothing to analyse: both train and inference are off")
    symbols = (tr_step or inf_step).trace.symbols

    def retrace(fixed: dict[str, int]) -> Report:
        sub = analyze(model, _fix(inputs, fixed), device=device, train=train,
                      inference=inference, loss_fn=loss_fn, optimizer=optimizer,
                      hints={k: v for k, v in (hints or {}).items() if k not in fixed} or None,
                      keep_outputs=keep_outputs, precision=precision, accumulate=accumulate,
                      limits={k: v for k, v in limits.items() if k not in fixed},
                      transform=transform, compiled=compiled, driver=driver)
        sub.fixed = dict(fixed)
        return sub

    report = Report(device, symbols, tr_step, inf_step, modules, other,
                    precision=tracer.precision.precision(precision).name,
                    accumulate=accumulate, compiled=compiled, _retrace=retrace)
    if compiled:
        at = ", ".join(f"{k}={v}" for k, v in (tr_step or inf_step).trace.hints.items())
        report.notes.append(
            "torch.compile (fullgraph): Inductor's min-cut partition"
            + (f", chosen at {at} as torch.compile chooses it at the shape it compiles for "
               "(at other sizes a real compile may save other tensors)" if at else "")
            + "; saved-for-backward bytes equalled real CPU Inductor runs on the models "
            "checked; the peak models Inductor's fusion and buffer reuse, not its scheduler's "
            "reordering: -2.4% to +10.2% of real CPU compiled runs (benchmarks/compiled.py)")
        regions = (tr_step or inf_step).trace.run.checkpoint_regions
        if regions:
            report.notes.append(
                f"torch.compile with activation checkpointing ({regions} regions): each region "
                "is recomputed as Dynamo rewrites torch.utils.checkpoint (its ops tagged for the "
                "partitioner to recompute); against real CPU compiled runs "
                "(benchmarks/compiled.py --plan blocks) saved bytes were equal on TinyGPT and "
                "Llama, but GPT-2 (dropout inside the blocks) saved 26-34% more than predicted; "
                "peaks -4.4% to +8.2% of the real runs")
        ops = (tr_step or inf_step).trace.run.ops
        if device != "cpu" and any("convolution" in getattr(o, "op", "") for o in ops):
            report.notes.append(
                "torch.compile with convolutions on CUDA: Inductor decides its layout "
                "optimization (channels-last copies of the inputs convolutions read) by "
                "heuristics at the shape it compiles for; the symbolic trace does not apply it "
                "(on CPU it always applies, and is modelled)")
    return report


def _fix(inputs: dict, fixed: dict[str, int]) -> dict:
    """``inputs`` with the symbols in ``fixed`` replaced by their integer sizes."""
    out = {}
    for name, value in inputs.items():
        if tracer.is_tensor_spec(value):
            spec = tracer.make_spec(name, value)
            value = tracer.TensorSpec(spec.name, spec.dtype, tuple(
                fixed.get(d, d) if isinstance(d, str) else d for d in spec.shape), spec.fill)
        out[name] = value
    return out
