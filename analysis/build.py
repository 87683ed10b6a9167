"""Making a :class:`~memsim.analysis.Report`: :func:`analyze` traces the step (training and
inference) and gathers the figures, notes and modules; where the model's code pins a symbol it
fits the formulas instead (:mod:`memsim.analysis.fitted`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from memsim.tracer import (InputError, MemsimError, SpecializationError, StepConfig,
                           TraceError, is_tensor_spec, make_spec, trace)
from memsim.tracer import hf, progress
from memsim.tracer.rnn_cuda import reserve_notes

from .explore import Retracer, cross_guards, fix_inputs
from .memory import ModuleSaved, StepMemory, module_savings, step_memory
from .report import Report

__all__ = ["analyze", "pinning_fixed"]


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
        fit its formulas from traces with it fixed (:mod:`memsim.analysis.fitted`: a
        :class:`~memsim.analysis.fitted.FittedReport`, four traces or more) instead of raising.
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
    # a windowed vision transformer's image sizes: traced at multiples of its step (hf.py)
    auto = {n: k for n, k in hf.multiples(model, inputs).items()
            if n not in config.multiples and config.hints.get(n, k) % k == 0}
    if auto:
        config = config.replace(multiples={**config.multiples, **auto})
    try:
        retracer = Retracer(analyze, model, inputs, config, dict(
            train=train, inference=inference, transform=transform, driver=driver))
        retracer.beside(points, fixed)
        return _analyze(model, inputs, config, train=train, inference=inference,
                        transform=transform, driver=driver, fixed=fixed, explore=explore,
                        retracer=retracer, points=points)
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
        from .fitted import fitted
        # the sizes fitted stay within the model's own limits (a Hugging Face model's
        # positions) as the traces do
        config = config.replace(limits={**hf.limits(model, inputs), **config.limits})
        # from the size it was pinned at (a retry at the sizes asked for: Reformer's S)
        start = getattr(e, "example", None) or hints[e.symbol]
        return fitted(analyze, model, inputs, config, e, start,
                      [v for k, v in hints.items() if k != e.symbol], fixed=fixed,
                      explore=explore, original=original, train=train,
                      inference=inference, transform=transform, driver=driver)


def _example_sizes(inputs: dict, config: StepConfig) -> dict[str, int]:
    from memsim.tracer.example_sizes import example_sizes
    return example_sizes([make_spec(n, v) for n, v in inputs.items() if is_tensor_spec(v)],
                         config.hints, config.multiples)


def _analyze(model, inputs, config, *, train, inference, transform, driver, fixed, explore,
             retracer, points=None):
    patches, auto_limits = hf.adapt(model, inputs)
    run_config = config.replace(limits={**auto_limits, **config.limits})
    kw = dict(transform=transform, patches=patches, sizes=list(points or ()))
    tr_step = inf_step = None
    progress.expect(int(bool(train)) + int(bool(inference)))
    modules: list[ModuleSaved] = []
    other: dict[str, int] = {}
    if train:
        t = trace(model, inputs, run_config, train=True, driver=driver, **kw)
        tr_step = step_memory(t)
        modules = module_savings(t, _module_types(model))
        other.update(t.run.other_ops)
    unanswered = []
    if inference:
        try:
            t = trace(model, inputs, run_config, train=False, **kw)
        except SpecializationError:
            raise   # a pinned symbol: fitted for both steps (analyze)
        except MemsimError as e:
            if tr_step is None:
                raise
            # a failure only inference meets (a value read in eval mode): the training answer
            # stands, and says so
            unanswered.append(f"inference is not answered: its trace failed ({e}); the "
                              "training step's figures are")
        else:
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
                                          for a in s.trace.run.assumed)) + tuple(unanswered)
                    + tuple(_step_notes(first.trace.multiples)),
                    retracer=retracer)
    return cross_guards(report) if explore else report


def _step_notes(multiples: dict[str, int]) -> list[str]:
    return [f"{n} is traced at multiples of {k} (where the model pads other sizes to whole "
            f"steps, or a strategy splits {n} into {k} equal parts): the formulas hold where {n} is a multiple of {k}, from {2 * k} on; "
            f"another {n} is traced at that size when asked for (exact there)"
            for n, k in multiples.items()]


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
