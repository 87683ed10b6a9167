"""The ``memsim`` command line.

    memsim analyze path/to/file.py:NAME --input input_ids=int64[B,S] --at B=4,S=2048

The commands (``analyze``, ``fit``, ``compare``, ``checkpoint``, ``gpus``); their options and
the checks made before a trace are :mod:`memsim.options`, the model is loaded by
:mod:`memsim.target`, the files written by :mod:`memsim.outputs`, the text and JSON by
:mod:`memsim.render`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

from memsim.analysis import analyze
from memsim.strategies import strategies_from_options
from memsim.tracer import MemsimError, StepConfig, UsageError, parse_assignments, parse_input

from .options import (alloc_conf, budget_setup, check_point, compiled_hints, config_args,
                      file_option, input_options, join_configs, parser, size_range)
from .outputs import write_html, write_plot, write_timeline
from .render import budget_text, to_json, to_text
from .target import load_target

__all__ = ["main", "run", "load_target"]


def run(argv: list[str] | None = None) -> int:
    argv = join_configs(list(sys.argv[1:] if argv is None else argv))
    args = parser().parse_args(argv)
    global _SHOWN
    if args.cmd == "gpus":
        return _run(args)
    with _held_back(args.quiet):
        if args.quiet or args.json:
            return _run(args)
        from memsim.tracer.progress import listening
        shown = _SHOWN = _Progress()
        try:
            with listening(shown):
                return _run(args)
        finally:
            shown.close()
            _SHOWN = None


@contextlib.contextmanager
def _held_back(quiet: bool):
    """Warnings of other libraries while memsim traces (Python's ``warnings`` and ``logging``
    records of loggers not memsim's: transformers' ``loss_type`` notice, say) held back: they
    would break the progress line and come before the answer. Printed once each on stderr
    after the answer, or dropped under ``--quiet``."""
    import logging
    import warnings
    records: list[str] = []
    handle = logging.Logger.handle

    def hold(self, record):
        if record.name.split(".")[0] == "memsim" or record.levelno < logging.WARNING:
            return handle(self, record)
        records.append(f"{record.name}: {record.getMessage()}")

    logging.Logger.handle = hold
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield records
    finally:
        logging.Logger.handle = handle
        records += [f"{w.category.__name__}: {w.message}" for w in caught]
        if not quiet:
            for text in dict.fromkeys(records):
                print(f"memsim: said while tracing: {text}", file=sys.stderr)


# the progress line being shown (None under --quiet and --json): compare names its
# configuration in it
_SHOWN = None
# progress appears once a trace has run this long, then at most this often off a terminal (s)
_PROGRESS_AFTER = 2.0
_PROGRESS_EVERY = 5.0


class _Progress:
    """The tracer's progress on stderr: one line rewritten on a terminal, else a line every
    5 s; nothing for the first couple of seconds."""

    def __init__(self):
        import time
        self.clock = time.monotonic
        self.start = self.clock()
        self.last = 0.0
        self.tty = sys.stderr.isatty()
        self.shown = False
        self.what = None   # what is traced, where a command traces several things
        from memsim.tracer import progress
        self.before = progress.traces()   # runs traced before this command

    def __call__(self, phase, module=None, index=None, count=None, traced=None):
        now = self.clock()
        if now - self.start < _PROGRESS_AFTER or now - self.last < (
                0.2 if self.tty else _PROGRESS_EVERY):
            return
        self.last = now
        from memsim.tracer import progress
        rank = progress.context()
        k = max(progress.traces() - self.before, 1)
        n = max(progress.expected() - self.before, k)
        left = progress.estimate(self.before)
        msg = (f"{self.what}: " if self.what else "") + (f"{rank}: " if rank else "") + \
            f"tracing {phase}" + (
            f": block {index + 1} of {count} ({module})" if module is not None else "") + (
            f", a run of {traced} blocks, the others derived from it"
            if module is not None and traced else "") + \
            f" [trace {k} of {n}, {now - self.start:.0f} s" + (
                f", about {left:.0f} s left" if left is not None else "") + "]"
        if self.tty:
            sys.stderr.write("\r\033[K" + msg)
            sys.stderr.flush()
        else:
            print(f"memsim: {msg}", file=sys.stderr)
        self.shown = True

    def close(self):
        if self.tty and self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _run(args) -> int:
    if args.cmd == "gpus":
        from .render import gpu_table
        print(gpu_table())
        return 0
    if args.cmd == "checkpoint":
        return _checkpoint(args)
    if args.cmd == "compare":
        return _compare(args)
    if args.cmd == "plan":
        return _plan(args)
    fit = args.cmd == "fit"
    report, point, shown, spoint, budget, setup = _analysis(args, fit)
    if getattr(args, "timeline", None):
        write_timeline(args, report, point, setup)
    if getattr(args, "plot", None):
        write_plot(args, [("", report, point)], setup)
    text = None
    if not fit and (not args.json or getattr(args, "html", None)):
        text = to_text(shown, spoint, top=args.top, budget=budget, full=report,
                       full_point=point, seq=args.seq_symbol, batch=args.batch_symbol,
                       model=args.target)
    if getattr(args, "html", None):
        write_html(args, report, point, setup, text, budget)
    if args.json:
        print(json.dumps(to_json(shown, spoint, budget=budget, full=report, model=args.target),
                         indent=2))
    elif fit:
        print(_coloured(budget_text(budget, report.device), budget))
    else:
        print(_coloured(text, budget))
    if budget is not None and (fit or getattr(args, "check", False)) and not budget.fits:
        return 1
    return 0


def _coloured(text: str, budget) -> str:
    """``text`` with its first line (the verdict) green where the step fits and red where it
    does not, on a terminal that takes colour (not ``NO_COLOR``, not a pipe)."""
    if budget is None or not sys.stdout.isatty() or os.environ.get("NO_COLOR") \
            or os.environ.get("TERM") == "dumb":
        return text
    first, _, rest = text.partition("\n")
    colour = "32" if budget.fits else "31"
    return f"\033[1;{colour}m{first}\033[0m" + ("\n" + rest if rest else "")


def _analysis(args, fit: bool = False):
    """The analysis the options describe: ``(report, point, shown, shown_point, budget,
    setup)``; every option is checked before the (slow) trace."""
    return _execute(args, _prepare(args), fit)


def _prepare(args) -> dict:
    """Every option checked, nothing traced yet."""
    specs = [parse_input(s) for s in input_options(args)]
    point = parse_assignments(args.at, "--at") if args.at else None
    check_point(point, specs)
    step = StepConfig.from_options(args)
    setup = budget_setup(args, point)
    drawn = [file_option(args, "timeline", point), file_option(args, "plot", point),
             file_option(args, "html", point, (".html", ".htm"), "not an .html file",
                          "e.g. --html report.html")]
    if drawn[0] or drawn[2]:
        alloc_conf(args)   # the timeline's reserved line: its settings checked now
    strategy = strategies_from_options(args, step)
    hints = step.pop("hints", None)
    if args.compiled:
        if set(strategy) - {"checkpoint"}:
            raise UsageError("--compiled does not combine with strategy options yet (only "
                             "with --checkpoint)",
                             hint="analyse the strategy without --compiled, or --compiled alone")
        hints = compiled_hints(specs, point, hints)
    config = StepConfig(**step, hints=hints or {})
    return {"specs": specs, "point": point, "setup": setup, "strategy": strategy,
            "config": config}


def _within_limits(model, inputs, config, point) -> None:
    """A size past the model's own limit (a Hugging Face model's positions, ``limits``) is an
    error before any trace: no trace can answer it."""
    from memsim.tracer import OutOfRangeError, hf
    for name, most in {**hf.limits(model, inputs), **config.limits}.items():
        if point.get(name, 0) > most:
            raise OutOfRangeError(
                f"{name}={point[name]} is outside the range the formula holds for "
                f"({name} <= {most})", hint=f"the model itself does not accept {name} > {most}")


def _execute(args, prep: dict, fit: bool = False):
    specs, point, setup = prep["specs"], prep["point"], prep["setup"]
    strategy, config = prep["strategy"], prep["config"]
    model = load_target(args.target, args.hf_class)
    from memsim.analysis import pinning_fixed
    from memsim.strategies import analyze as analyze_with
    kw = dict(strategy, train=not args.inference,
              inference=args.inference or not (fit or getattr(args, "train", False)))
    inputs = {s.name: s for s in specs}
    if point is not None:   # a size of 1 in it is traced beside the formulas' trace
        _within_limits(model, inputs, config, point)
        kw["points"] = [point]
    report = pinning_fixed(analyze_with, model, inputs, config, point, **kw) \
        if point is not None else analyze_with(model, inputs, config, **kw)
    if point is not None:
        point = {k: v for k, v in point.items() if k not in report.fixed}
    if point is not None:
        report = worst_rank(report, point)
        shown, spoint = report.for_point(point)   # traces a point the formulas do not cover
        shown.train and shown.train.check_point(spoint)
        shown.inference and shown.inference.check_point(spoint)
    else:   # a fitted report shows its fitted formulas
        shown, spoint = (report.view() if hasattr(report, "view") else report), None
    budget = None
    if setup is not None:
        budget = _budget(args, setup, report, point)
        # the largest sizes that fit are every rank's: the least over the ranks
        for rc in getattr(report, "ranks", ()):
            if rc.report.rank == report.rank:
                continue
            other = _budget(args, setup, rc.report, point)
            for f in ("max_batch", "max_seq"):
                mine, theirs = getattr(budget, f), getattr(other, f)
                if theirs is not None and (mine is None or theirs < mine):
                    setattr(budget, f, theirs)
    if "ep" in strategy and point is not None and config.data_dependent.kind == "max":
        report, shown = _routed_evenly(model, inputs, config, point, kw, report, shown, setup,
                                       budget, args)
    if budget is not None:
        if not budget.fits and point is not None and args.cmd == "analyze" \
                and not getattr(args, "no_options", False):
            budget.options = _fit_options(args, model, inputs, config, strategy, point,
                                          setup, budget, report)
    return report, point, shown, spoint, budget, setup


def _budget(args, setup, report, point):
    """``report``'s budget at ``point`` against the GPU the options give (``setup``)."""
    from memsim.analysis.budget import against
    device, cap, overheads = setup
    return against(report, point, gpu=device, capacity=cap, margin=args.margin,
                   overheads=overheads, batch=args.batch_symbol, seq=args.seq_symbol)


def _routed_evenly(model, inputs, config, point, kw, report, shown, setup, budget, args):
    """Under expert parallelism the figures are the routing's worst case (``--data-dependent
    max``: every token to the experts of the first expert rank); the same analysis with the
    tokens routed evenly (``balanced``) gives the other end: a note that says which one the
    verdict uses, on the budget with its total where there is one, else on the report."""
    from dataclasses import replace

    from memsim.analysis import pinning_fixed
    from memsim.strategies import analyze as analyze_with

    from .formats import human
    even = worst_rank(pinning_fixed(analyze_with, model, inputs,
                                    config.replace(data_dependent="balanced"), point, **kw),
                      point)
    peak = figures_at(even, point)["peak"]
    text = (f"expert parallelism: these figures and the verdict are the routing's worst case "
            f"(--data-dependent max: every token to the same experts, all on the first expert "
            f"rank); routed evenly (--data-dependent balanced) the largest rank peak here is "
            f"{human(peak)}")
    if budget is not None:
        b = _budget(args, setup, even, point)
        text += f", total {human(b.total)}: {'fits' if b.fits else 'does not fit'}"
        budget.notes = [*budget.notes, text]   # said with the verdict, not again above it
        return report, shown
    return (replace(report, notes=(*report.notes, text)),
            replace(shown, notes=(*shown.notes, text)))


def _fit_options(args, model, inputs, config, strategy, point, setup, budget, report):
    """What would make the step fit, each option traced (memsim.suggest)."""
    from memsim.analysis.budget import against
    from memsim.strategies import analyze as analyze_with

    from .suggest import fit_options
    device, cap, overheads = setup

    def analyze(m, i, c, **kw):
        return analyze_with(m, i, c, train=not args.inference, inference=args.inference,
                            points=[point], **kw)

    def budget_of(rep):
        return against(worst_rank(rep, point), point, gpu=device, capacity=cap,
                       margin=args.margin, overheads=overheads, batch="", seq="")

    def progress(flags):
        if _SHOWN is not None:
            _SHOWN.what = f"what would make it fit: {flags}"

    states = model_states(figures_at(report, point))
    try:
        return fit_options(analyze, model, inputs, config, strategy, point, budget_of,
                           states, budget.usable, progress)
    finally:
        if _SHOWN is not None:
            _SHOWN.what = None


def _plan(args) -> int:
    """``memsim plan``: every layout checked before any trace, then one analysis per program
    (memsim.plan)."""
    from .plan import check_rank_by, check_world, layouts, parse_fix, plan, programs_of
    from .plan_run import Job, _model, connect, in_processes, locally, on_ray, workers_for
    from .render_plan import plan_json, plan_text
    check_world(args.gpus, args.gpus_per_node)   # (layouts() checks it too, after the inputs)
    check_rank_by(args.rank_by)
    fixed = parse_fix(args.fix)
    specs = [parse_input(s) for s in input_options(args)]
    names = list(dict.fromkeys(n for sp in specs for n in sp.symbols))
    batch, seq = args.batch_symbol, args.seq_symbol
    if batch not in names:
        raise UsageError(f"memsim plan sizes the micro-batch, and no --input has {batch}",
                         hint=f"give the batch dimension as {batch}, e.g. "
                              f"--input input_ids=int64[{batch},{seq}] (or --batch-symbol)")
    point = parse_assignments(args.at, "--at") if args.at else {}
    if batch in point:
        raise UsageError(f"--at {batch}=...: memsim plan chooses the micro-batch",
                         hint="pin it with --fix micro_batch=N")
    if seq in names:
        if args.seq is None and seq not in point:
            raise UsageError(f"memsim plan needs the sequence length ({seq} in --input)",
                             hint="e.g. --seq 4096")
        if args.seq is not None:
            point[seq] = args.seq
    elif args.seq is not None:
        raise UsageError(f"--seq given, and no --input has {seq}",
                         hint="drop --seq, or name the sequence dimension with --seq-symbol")
    check_point({**point, batch: 1}, specs)
    file_option(args, "html", {batch: 1}, (".html", ".htm"), "not an .html file",
                "e.g. --html plan.html")
    step = StepConfig.from_options(args)
    setup = budget_setup(args, {**point, batch: 1})
    if setup is None:
        raise UsageError("memsim plan needs a GPU", hint="give --gpu NAME or --memory SIZE")
    if strategies_from_options(args, step):
        raise UsageError("memsim plan chooses the strategies itself",
                         hint="pin a degree with --fix tp=8 or --fix dp=4; drop --fsdp/--tp/...")
    candidates, rejected = layouts(args.gpus, args.gpus_per_node, args.global_batch, fixed)
    config = StepConfig(**step)
    if args.cluster and args.workers is not None:
        raise UsageError("--workers and --cluster both say where the traces run",
                         hint="give one: --cluster ADDRESS (Ray) or --workers N (this machine)")
    workers_for(args.workers, 1)   # a bad --workers, before any trace
    if args.cluster:
        connect(args.cluster)   # before any trace: a cluster that does not answer is an error
    job = Job(args.target, args.hf_class, tuple(input_options(args)), config, setup,
              args.margin, tuple(point.items()), batch, seq, os.getcwd())
    # the model's own limits (a Hugging Face model's positions), before the first trace
    model = _model(job)
    _within_limits(model, {s.name: s for s in specs}, config, {**point, batch: 1})
    from memsim.strategies.ep import expert_counts
    experts = list(expert_counts(model).values())
    if experts or fixed.get("ep", 1) > 1:   # a mixture of experts: its expert-parallel layouts
        candidates, rejected = layouts(args.gpus, args.gpus_per_node, args.global_batch,
                                       fixed, experts)
    programs = programs_of(candidates)

    def said(lays):
        if _SHOWN is not None:
            _SHOWN.what = f"layout {lays[0].program_flags()}"

    workers = workers_for(args.workers, len(programs))
    if args.cluster:
        answers = on_ray(job, programs)
    elif workers > 1:
        answers = in_processes(job, programs, workers, _answered(len(programs), workers, args))
    else:
        answers = locally(job, programs, said)
    device, cap, _ = setup
    capacity = device.bytes if cap is None else cap
    usable = int(capacity * (1 - args.margin))
    result = plan(answers, rejected, world=args.gpus, per_node=args.gpus_per_node,
                  global_batch=args.global_batch, usable=usable, rank_by=args.rank_by)
    what = dict(model=args.target, gpu=device.name if device else None, seq=point.get(seq),
                precision=config.precision.value, margin=args.margin)
    text = plan_text(result, **what, top=args.top)
    if args.html:
        from .render_plan import plan_html
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(plan_html(result, text, **what, capacity=capacity))
        print(f"memsim: plan written to {args.html}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan_json(result, **what), indent=2))
    else:
        print(text)
    return 0 if result.fitting else 1


def _answered(n: int, workers: int, args):
    """A line on stderr as each of the ``n`` programs traced in ``workers`` processes is
    answered (nothing under --quiet or --json)."""
    import time
    start = time.monotonic()

    def done(k, lays):
        if not (args.quiet or args.json):
            print(f"memsim: program {k} of {n} answered ({lays[0].program_flags()}), "
                  f"{time.monotonic() - start:.0f} s, {workers} processes", file=sys.stderr)
    return done


def figures_at(report, point: dict) -> dict:
    """``report``'s figures at ``point``: its training step's where it has one, else
    inference's (a point below the formulas' range traced beside them, Report.for_point)."""
    sub, at = report.for_point(point)
    return sub.at(**at)["train" if sub.train is not None else "inference"]


def model_states(figures: dict) -> int:
    """Parameters, gradients and optimizer states, of :func:`figures_at`'s figures."""
    return sum(figures.get(k, 0) for k in ("parameters", "gradients", "optimizer_states"))


def worst_rank(report, point: dict):
    """Where ranks differ, the report of the rank whose peak is the largest at ``point`` (the
    one the verdict is about), with a note where it is not the rank shown at the example
    sizes; ``report`` itself otherwise."""
    classes = getattr(report, "ranks", ())
    if len(classes) < 2:
        return report

    worst = max(classes, key=lambda rc: (figures_at(rc.report, point)["peak"], -rc.ranks[0]))
    if worst.report.rank == report.rank:
        return report
    from dataclasses import replace
    note = (f"at the point, rank {worst.report.rank}'s peak is the largest of every rank's: its "
            f"figures are shown and the verdict is about it (rank {report.rank}'s is the largest "
            "at the example sizes)")
    return replace(worst.report, notes=tuple(worst.report.notes) + (note,))


# options a configuration of `memsim compare` may not set: the model, its inputs, the point and
# the budget are the same for every configuration
def _compare(args) -> int:
    """``memsim compare``: the training step of each configuration side by side."""
    from .render_compare import compare_json, compare_text
    if not args.configs:
        raise UsageError("memsim compare needs --config", hint="e.g. --config \"--fsdp --dp 8\" "
                         "--config \"--zero 3 --dp 8\"")
    if args.at is None:
        raise UsageError("memsim compare needs a point", hint="give --at with every symbol, "
                                                               "e.g. --at B=4,S=2048")
    prepared = []
    for text in args.configs:   # every configuration checked before any trace
        cargs = config_args(args, text)
        prepared.append((text, cargs, _prepare(cargs)))
    rows = []
    from memsim.tracer import progress
    for i, (text, cargs, prep) in enumerate(prepared, 1):
        progress.expect(len(prepared) - i + 1)   # this one and those after it
        if _SHOWN is not None:
            _SHOWN.what = (f"configuration {i} of {len(prepared)} "
                           f"({text.strip() or 'the common options'})")
        try:
            report, point, shown, spoint, budget, _ = _execute(cargs, prep, fit=True) \
                if not args.inference else _execute(cargs, prep)
            rows.append({"config": text, "report": report, "shown": shown, "point": spoint,
                         "full_point": point, "budget": budget, "error": None})
        except MemsimError as e:
            rows.append({"config": text, "error": e})
    if args.plot:
        write_plot(args, [(r["config"] or "(the common options)", r["report"], r["full_point"])
                           for r in rows if r["error"] is None], prepared[0][2]["setup"])
    if args.json:
        print(json.dumps(compare_json(rows, args.gpu, args.memory), indent=2))
    else:
        print(compare_text(rows, args.inference, args.gpu or args.memory, args.margin))
    return 2 if any(r["error"] is not None for r in rows) else 0


def _checkpoint(args) -> int:
    from memsim.analysis.gpus import parse_memory

    from memsim.strategies import checkpoint as ck
    from .render_checkpoint import checkpoint_json, checkpoint_text

    inputs = input_options(args)
    if args.compiled:
        raise UsageError("memsim checkpoint does not take --compiled: its peaks with "
                         "checkpointed regions are within -4.4%..+8.2% of real compiled runs, too "
                         "coarse to choose plans by",
                         hint="see one plan under torch.compile with memsim analyze TARGET ... "
                              "--compiled --checkpoint PLAN")
    step = StepConfig.from_options(args)
    if strategies_from_options(args, step):
        raise UsageError("memsim checkpoint does not take strategy options yet",
                         hint="use memsim analyze ... --checkpoint PLAN with --fsdp/--tp/--lora")
    specs = {s.name: s for s in (parse_input(t) for t in inputs)}
    point = parse_assignments(args.at, "--at") if args.at else None
    setup = None if args.budget else budget_setup(args, point)
    if args.plan == "optimal" and setup is None and not args.budget:
        raise UsageError("--plan optimal needs a budget",
                         hint="give --budget 20GiB, --gpu NAME or --memory SIZE")
    rng = size_range(args.size_range, args.plan) if args.size_range else None
    if rng is not None:
        point = {**(point or {}), rng[0]: rng[2]}   # the plan shown fits the whole range
    check_point(point, specs.values(), "--at" if rng is None else "--at with --range")
    if args.plan == "optimal" and point is None:
        raise UsageError("--plan optimal needs a point", hint="give --at B=...,S=...")
    config = StepConfig(**step)
    model = load_target(args.target, args.hf_class)
    base = analyze(model, specs, config, inference=False)
    budget = parse_memory(args.budget) if args.budget else None
    if setup is not None:
        device, cap, overheads = setup
        budget = ck.budget_bytes(base, point, capacity=device.bytes if cap is None else cap,
                                 margin=args.margin, gpu=device, overheads=overheads)
    bands = None
    if rng is not None:
        name, lo, hi = rng
        bands = ck.plans_over_range(model, specs, point, name, lo, hi, budget, config,
                                    base=base, search=args.search)
        result = bands[-1].result if bands and bands[-1].hi == hi else None
    elif args.plan == "optimal":
        result = ck.optimal_plan(model, specs, point, budget, config, base=base,
                                 search=args.search)
    else:
        result = ck.evaluate_plan(model, specs, ck.named_plan(model, args.plan), config,
                                  base=base)
    rank = ck.ranking(base)
    if args.json:
        doc = checkpoint_json(base, result, rank, point, budget, ck.plan_conditions(model))
        if args.plan == "optimal":
            doc["search"] = args.search
        if bands is not None:
            doc["bands"] = [{"symbol": rng[0], "from": b.lo, "to": b.hi, "blocks": b.blocks,
                             "plan": list(b.plan)} for b in bands]
        print(json.dumps(doc, indent=2))
    else:
        text = checkpoint_text(base, result, rank, point, budget, args.plan, top=args.top,
                               conditions=ck.plan_conditions(model))
        if bands is not None:
            from .render_checkpoint import bands_text
            text += "\n\n" + bands_text(bands, rng, budget, len(ck.blocks(model)))
        print(text)
    return 0 if result is not None else 1


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    try:
        return run(argv)
    except MemsimError as e:
        print(f"memsim: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader closed early (memsim gpus | head): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
