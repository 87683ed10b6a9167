"""One call for a model under strategies: what each rank holds.

>>> import torch
>>> from memsim.strategies import analyze, LoRA
>>> # analyze(model, inputs, fsdp=FSDP(dp=8), lora=LoRA(r=16), checkpoint="blocks")

The strategies validate their combination, then each adds what it needs to a
:class:`~memsim.strategies.base.Plan` (in the order their classes declare: LoRA,
checkpointing, tensor parallelism, FSDP2, ZeRO, DDP). The plan is traced once per rank it selects, with PyTorch's or
DeepSpeed's own code inside the symbolic run; the strategies' timeline edits are applied to each
rank's report, and the result is a :class:`~memsim.strategies.base.StrategyReport` of the rank
shown (rank 0, or under ZeRO the largest peak), which lists the others.
"""

from __future__ import annotations

import contextlib

from typing import Iterable, Mapping

import sympy
import torch

from memsim import analysis
from memsim.analysis import Report, Retracer
from memsim.tracer import InputError, StepConfig, StrategyError, UsageError
from memsim.tracer.errors import did_you_mean

from .base import (Plan, RankClass, RankInfo, Strategy, StrategyReport,
                   registered_strategies)

__all__ = ["analyze", "given_strategies", "world_size", "add_strategy_options",
           "strategies_from_options"]


def given_strategies(strategies: Iterable[Strategy] = (), **by_key) -> dict[str, Strategy]:
    """``{key: strategy}`` in application order, from strategy values and keyword ones
    (``fsdp=FSDP(8)``, ``checkpoint="blocks"``); a key given twice or a value of the wrong
    kind is an error naming it."""
    known = registered_strategies()
    out: dict[str, Strategy] = {}
    items = [(s.key if isinstance(s, Strategy) else None, s) for s in strategies]
    items += [(k, v) for k, v in by_key.items() if v is not None and v is not False]
    for key, value in items:
        if key in known:
            value = known[key].coerce(value)
        if key not in known or not isinstance(value, known[key]):
            want = known[key].__name__ if key in known else "a strategy"
            raise StrategyError(f"{key or 'strategy'}= takes a {want}, got "
                                f"{type(value).__name__}",
                                hint="strategies: " + ", ".join(known))
        if key in out:
            raise StrategyError(f"two {key} strategies given", hint="give each kind once")
        out[key] = value
    return {k: out[k] for k in known if k in out}


def add_strategy_options(group) -> None:
    """Every registered strategy's command-line options on ``group`` (an argparse group), and
    ``--dp``, the data-parallel ranks the strategies on that mesh dimension share."""
    group.add_argument("--dp", type=int, metavar="N",
                       help=f"data-parallel ranks (with {_either(_dp_flags())})")
    for cls in registered_strategies().values():
        cls.add_options(group)


def strategies_from_options(opts, step: dict) -> dict[str, Strategy]:
    """``{key: strategy}`` from parsed command-line options, each checked before any trace;
    ``step`` (the step options by name) as the strategies complete it."""
    known = registered_strategies()
    out = {}
    for key, cls in known.items():
        got = cls.from_options(opts, step)
        if got is not None:
            out[key] = got
    dp = _dp_flags()
    if getattr(opts, "dp", None) is not None and not any(
            getattr(opts, f[2:].replace("-", "_"), None) for f in dp):
        raise UsageError(f"--dp given without {_either(dp)}",
                         hint="say how the data-parallel ranks share the model")
    return out


def _dp_flags() -> list[str]:
    """The options that turn on a strategy over the data-parallel ranks (``--dp``'s users)."""
    return [f for cls in registered_strategies().values() if cls.axis == "dp" for f in cls.flags]


def _either(flags: list[str]) -> str:
    return ", ".join(flags[:-1]) + " or " + flags[-1] if len(flags) > 1 else "".join(flags)


def world_size(given: Mapping[str, Strategy]) -> int:
    """The product of the ranks along each mesh dimension the strategies span."""
    degree: dict[str, int] = {}
    for s in given.values():
        if s.axis:
            degree.setdefault(s.axis, s.degree)
    out = 1
    for d in degree.values():
        out *= d
    return out


def analyze(model: torch.nn.Module, inputs: dict, config: StepConfig | None = None, *,
            strategies: Iterable[Strategy] = (), train: bool = True, inference: bool = True,
            fixed: Mapping[str, int] | None = None, explore: bool = True, fit: bool = True,
            points=None, **options) -> Report:
    """:func:`memsim.analysis.analyze` under strategies: one rank's figures.

    ``strategies``: :class:`~memsim.strategies.base.Strategy` values. ``options``: a
    strategy by its key (``lora=LoRA(r=16)`` or a :class:`QLoRA`, ``fsdp=FSDP(8)``, ``tp``,
    ``zero``, ``ddp``, ``checkpoint`` as a named plan ``"blocks"``, ``"selective"``,
    ``"every:K"``, module paths or a :class:`Checkpoint`; every registered key), or a field of
    :class:`~memsim.tracer.StepConfig` over ``config`` (``device="cpu"``,
    ``precision="bf16-mixed"``...). ``fixed``, ``explore``, ``points``: as
    :func:`memsim.analysis.analyze` (the strategy's report is explored as a whole; a point of
    ``points`` below the range is traced beside it, under the strategies). With no strategy,
    the plain :class:`~memsim.analysis.Report`.
    """
    known = registered_strategies()
    steps = StepConfig.option_names()
    for k in options:
        if k not in known and k not in steps:
            raise InputError(f"unknown option {k!r}" + did_you_mean(k, sorted(known) + steps),
                             hint=f"strategies: {', '.join(known)}; step options: "
                                  f"{', '.join(steps)}")
    config = StepConfig.of(config, **{k: v for k, v in options.items() if k not in known})
    given = given_strategies(strategies, **{k: v for k, v in options.items() if k in known})
    if not given:
        return analysis.analyze(model, inputs, config, train=train, inference=inference,
                                fixed=fixed, explore=explore, fit=fit, points=points)
    for s in given.values():
        s.validate(given, config)
    config = _sequence_hints(config, inputs, given.get("tp"))
    for s in given.values():
        config = s.for_inputs(config, inputs)
    retracer = Retracer(analyze, model, inputs, config, dict(
        strategies=tuple(given.values()), train=train, inference=inference))
    retracer.beside(points, fixed)
    plan = Plan(model, config, given)
    for s in given.values():
        plan = s.apply(plan)

    def traced(rank: int, left: int = 1) -> Report:
        """Rank ``rank``'s analysis, ``left`` ranks (this one included) still to trace."""
        from memsim.tracer import progress
        progress.expect(per_rank * left)
        with progress.about(f"rank {rank} of {plan.ranks.world}") if plan.ranks.world > 1 \
                else contextlib.nullcontext():
            return analysis.analyze(plan.model, inputs, plan.config, train=train,
                                    inference=inference, fixed=fixed, explore=False, fit=fit,
                                    transform=plan.transform(rank),
                                    driver=plan.driver(rank) if plan.driver else None)

    ranks = plan.ranks
    per_rank = int(bool(train)) + int(bool(inference))   # runs of one rank's analysis
    if ranks.by_sizes is not None:
        reports = {0: traced(0)}
        classes = ranks.by_sizes(_sizes(reports[0], inputs, fixed))
        rest = [c[0] for c in classes if c[0] not in reports]
        reports.update({r: traced(r, len(rest) - i) for i, r in enumerate(rest)})
        classes = _merged(classes, reports)
        reports = {c[0]: reports[c[0]] for c in classes}
        shown = 0
    elif ranks.sampled is None:
        classes = ranks.classes
        reports = {c[0]: traced(c[0], len(classes) - i) for i, c in enumerate(classes)}
        shown = classes[0][0]
    else:
        reports = {r: traced(r, len(ranks.sampled) - i) for i, r in enumerate(ranks.sampled)}
        heads = {c[0]: c for c in ranks.classes}
        groups: dict[str, list[int]] = {}
        for r, rep in reports.items():
            groups.setdefault(_same(rep.train.peak if rep.train else rep.inference.peak),
                              []).extend(heads.get(r, (r,)))
        classes = tuple(tuple(sorted(g)) for g in groups.values())
        shown = max(reports, key=lambda r: (_at_hints(reports[r]), -r))
    info = RankInfo(world_size(given), classes, tuple(reports), shown, reports[shown])
    notes = [n for item in plan.notes for n in ([item] if isinstance(item, str) else item(info))]
    wrapped = {r: _wrap(rep, r, plan, given, info, notes, retracer)
               for r, rep in reports.items()}
    if explore:   # past the guards of the code path, the strategy analysed as a whole
        wrapped[shown] = analysis.cross_guards(wrapped[shown])
    out = wrapped[shown]
    if len(classes) > 1:
        rows = tuple(RankClass(c, wrapped[c[0]]) for c in classes)
        for rep in wrapped.values():
            # every rank's report lists the groups, itself among them: set once, here, before
            # any report is handed out (the reports are frozen from then on)
            object.__setattr__(rep, "rank_classes", rows)
    return out


def _sequence_hints(config: StepConfig, inputs: dict, tp) -> StepConfig:
    """Example sizes for the sequence under sequence parallelism over ``t`` ranks: the default
    (S = 7) split over 8 ranks leaves each rank one token or none, a code path of its own whose
    formulas hold up to S = 7 only (Llama-3-70B over TP 8 + SP was traced again at every size
    asked for). Each symbol of the inputs' sequence dimension not given one gets a prime above
    3t (7 for t = 2, the default already; 29 for t = 8)."""
    from memsim.tracer import is_tensor_spec, make_spec
    if tp is None or not tp.sequence_parallel:
        return config
    names = []
    for name, value in inputs.items():
        if is_tensor_spec(value):
            shape = make_spec(name, value).shape
            d = tp.sequence_dim
            if -len(shape) <= d < len(shape) and isinstance(shape[d], str) \
                    and shape[d] not in config.hints and shape[d] not in names:
                names.append(shape[d])
    if not names:
        return config
    hints, p = dict(config.hints), 3 * tp.tp
    for n in names:
        p = int(sympy.nextprime(p))
        while p in hints.values():
            p = int(sympy.nextprime(p))
        if p > 7:   # not below the default
            hints[n] = p
    return config.replace(hints=hints) if hints != dict(config.hints) else config


def _sizes(report: Report, inputs: dict, fixed: Mapping[str, int] | None) -> list[int]:
    """Every size the trace of ``report`` ran at: the symbols' example sizes, the fixed ones,
    and the integer dimensions of the inputs' specs."""
    step = report.train or report.inference
    dims = [d for v in inputs.values() if isinstance(v, (tuple, list)) and len(v) == 2
            and isinstance(v[1], (tuple, list)) for d in v[1]]
    return sorted({*step.trace.hints.values(), *(fixed or {}).values(),
                   *(d for d in dims if isinstance(d, int) and not isinstance(d, bool))})


def _merged(classes, reports: dict[int, Report]) -> tuple[tuple[int, ...], ...]:
    """``classes`` (each traced as its first rank) with those of equal figures merged."""
    def key(rep):
        return tuple(_same(getattr(s, f)) for s in (rep.train, rep.inference) if s is not None
                     for f in ("peak", "parameters", "gradients", "optimizer_states",
                               "saved_activations", "activation_peak"))

    groups: dict[tuple, list[int]] = {}
    for c in classes:
        groups.setdefault(key(reports[c[0]]), []).extend(c)
    return tuple(tuple(sorted(g)) for g in groups.values())


def _same(expr):
    """A key equal for equal formulas: the expression itself, a ``Max`` as the set of its
    regimes (in whatever order they came). Their text was the key once; printing the thousands
    of regimes of a tensor-parallel model's peak was most of the time of Llama-3-70B's
    analysis over TP 8 with sequence parallelism x FSDP 8 (``benchmarks/frontier_strategies.py``,
    which did not finish in 300 s then)."""
    if isinstance(expr, sympy.Max):
        return ("max", frozenset(expr.args))
    return expr


def _at_hints(report: Report) -> int:
    step = report.train or report.inference
    t = step.trace
    return int(step.peak.xreplace({t.symbols[k]: v for k, v in t.hints.items()}))


def _wrap(base: Report, rank: int, plan: Plan, given, info: RankInfo, notes: list[str],
          retracer: Retracer) -> StrategyReport:
    """``base`` (one rank's traced report) with the strategies' edits, notes and buffers."""
    from dataclasses import fields

    train, extra, buffers, modelled = base.train, [], {}, []
    for edit in plan.edits:
        e = edit(base if train is base.train else _with_train(base, train), plan.model)
        train = e.train
        extra += e.notes
        buffers.update(e.buffers)
        modelled += [e.modelled] if e.modelled else []
    host = plan.host(base) if plan.host is not None else None
    kw = {f.name: getattr(base, f.name) for f in fields(Report)}
    kw.update(train=train, notes=tuple(base.notes) + tuple(notes) + tuple(extra),
              retracer=retracer)
    return StrategyReport(**kw, base=base, strategies=tuple(given.values()),
                          world_size=info.world, rank=rank, buffers=buffers, host_bytes=host,
                          modelled=tuple(modelled))


def _with_train(report: Report, train) -> Report:
    from dataclasses import replace
    return replace(report, train=train)
