"""The ``memsim`` command line.

    memsim analyze path/to/file.py:NAME --input input_ids=int64[B,S] --at B=4,S=2048

``NAME`` is an ``nn.Module`` instance, an ``nn.Module`` subclass (built with no arguments) or a
zero-argument function returning a module; ``file.py:NAME`` and ``package.module:NAME`` both
work. The target is imported and built under ``torch.device("meta")``: no weights exist.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys

import torch

from memsim.analysis import analyze
from memsim.tracer import (InputError, MemsimError, StepConfig, UsageError,
                           parse_assignments, parse_input)
from memsim.tracer.errors import did_you_mean

from .render import budget_text, to_json, to_text


def load_target(target: str) -> torch.nn.Module:
    """Import ``file.py:NAME`` or ``package.module:NAME`` and build the module on meta."""
    model = _load_target(target)
    from .entry import settle
    settle()
    return model


def _load_target(target: str) -> torch.nn.Module:
    if ":" not in target:
        raise UsageError(f"target {target!r} has no ':NAME'",
                         hint="write path/to/file.py:NAME or package.module:NAME")
    where, name = target.rsplit(":", 1)
    with torch.device("meta"):
        if where.endswith(".py") or os.sep in where or "/" in where:
            if not os.path.isfile(where):
                raise InputError(f"no such file: {where}", hint="check the path before ':'")
            modname = f"memsim_target_{abs(hash(os.path.abspath(where)))}"
            spec = importlib.util.spec_from_file_location(modname, where)
            mod = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
            try:
                spec.loader.exec_module(mod)
            finally:
                sys.path.pop(0)
        else:
            try:
                mod = importlib.import_module(where)
            except ImportError as e:
                raise InputError(f"cannot import {where!r}: {e}",
                                 hint="is the package installed, or did you mean a .py path?")
        if not hasattr(mod, name):
            found = [k for k, v in vars(mod).items() if not k.startswith("_") and (
                isinstance(v, torch.nn.Module) or callable(v))]
            raise InputError(f"{where} has no attribute {name!r}",
                             hint=f"candidates: {', '.join(found[:12]) or '(none)'}")
        obj = getattr(mod, name)
        if isinstance(obj, torch.nn.Module):
            return obj
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            return obj()
        if callable(obj):
            got = obj()
            if isinstance(got, torch.nn.Module):
                return got
            raise InputError(f"{target} returned {type(got).__name__}, not an nn.Module")
    raise InputError(f"{target} is neither an nn.Module, a subclass of it, nor a function")


def _add_common(a: argparse.ArgumentParser) -> None:
    a.add_argument("target", help="path/to/file.py:NAME or package.module:NAME")
    a.add_argument("--input", action="append", default=[], metavar="NAME=DTYPE[DIMS]",
                   help="a tensor input, e.g. input_ids=int64[B,S] (repeat per input)")
    a.add_argument("--at", metavar="B=4,S=2048", help="evaluate every formula at this point")
    s = a.add_argument_group("the step (memsim.StepConfig)")
    for _, opt, default in StepConfig.cli_options():
        s.add_argument(opt.flag, help=opt.help, **({} if opt.argparse.get("action") else
                                                  {"default": default}), **opt.argparse)
    a.add_argument("--json", action="store_true", help="print the JSON document")
    a.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (shown for traces over 2 s, never with --json)")
    a.add_argument("--no-cache", action="store_true",
                   help="trace again instead of answering from the on-disk cache")
    b = a.add_argument_group("budget (against a GPU)")
    b.add_argument("--gpu", metavar="NAME", help="a catalog GPU, e.g. h100-80gb (see 'memsim gpus')")
    b.add_argument("--memory", metavar="SIZE", help="any capacity instead, e.g. 24GiB or 80GB")
    b.add_argument("--gpu-file", metavar="FILE", help="extra GPUs, JSON or TOML {key: {name, mib, family}}")
    b.add_argument("--margin", type=float, default=0.10,
                   help="safety margin, fraction of the capacity kept free (default 0.10)")
    b.add_argument("--fragmentation", type=float, default=0.0,
                   help="an extra margin of your own, fraction of the allocated peak, on top "
                        "of the caching allocator's replayed reserve (default 0)")
    b.add_argument("--alloc-conf", metavar="CONF",
                   help="the CUDA caching allocator's settings, PYTORCH_CUDA_ALLOC_CONF's "
                        "syntax, e.g. expandable_segments:True,max_split_size_mb:128")
    b.add_argument("--cuda-context", metavar="SIZE",
                   help="CUDA context size (default: per GPU family, see docs/budget.md)")
    from memsim.strategies import add_strategy_options
    add_strategy_options(a.add_argument_group("strategies (per rank)"))
    b.add_argument("--batch-symbol", default="B", help="the batch-size symbol (default B)")
    b.add_argument("--seq-symbol", default="S", help="the sequence-length symbol (default S)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memsim", description="Training-memory simulator for PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="symbolic peak memory of a training step and inference")
    _add_common(a)
    g = a.add_mutually_exclusive_group()
    g.add_argument("--train", action="store_true", help="only the training step")
    g.add_argument("--inference", action="store_true", help="only inference")
    a.add_argument("--top", type=int, default=8, help="modules to list (default 8)")
    a.add_argument("--check", action="store_true",
                   help="exit 1 when the step does not fit --gpu/--memory (for CI)")
    a.add_argument("--plot", metavar="FILE",
                   help="draw the total against the batch and the sequence size (others at "
                        "--at) with GPU capacities: FILE.png, .svg, .pdf or .html (needs "
                        "matplotlib)")
    a.add_argument("--html", metavar="FILE",
                   help="one self-contained HTML report at --at: the verdict, the timeline, "
                        "memory against size, the tables and formulas (needs matplotlib)")
    a.add_argument("--timeline", metavar="FILE",
                   help="draw the step's live memory over its allocations and frees, stacked "
                        "by category, at --at: FILE.html (a page), .png, .svg or .pdf (needs "
                        "matplotlib: pip install 'memsim[plot]')")
    f = sub.add_parser("fit", help="does one training step fit a GPU? exit 0 yes, 1 no")
    _add_common(f)
    f.add_argument("--inference", action="store_true", help="check inference instead")
    c = sub.add_parser("checkpoint", help="which layers to checkpoint, and a plan's new peak")
    _add_common(c)
    c.add_argument("--plan", default="optimal",
                   help="none, blocks, selective, every:K or optimal (default optimal; needs "
                        "--budget or --gpu/--memory)")
    c.add_argument("--budget", metavar="SIZE",
                   help="the tensor peak to fit, e.g. 20GiB (no overheads or margin added)")
    c.add_argument("--top", type=int, default=10, help="rows of the ranking (default 10)")
    c.add_argument("--search", choices=("modules", "blocks"), default="modules",
                   help="with --plan optimal: what it may checkpoint: 'modules' (default) a "
                        "block or one of its children (attention, MLP, ...) in each block, two "
                        "kinds per plan; 'blocks' whole blocks only (fewer traces)")
    c.add_argument("--range", metavar="S=LO:HI", dest="size_range",
                   help="with --plan optimal: the optimal plan for every size LO..HI of one "
                        "symbol (the other symbols from --at)")
    m = sub.add_parser("compare", help="several configurations of one model side by side",
                       description="Each --config is a set of analyze options (strategies, "
                                   "precision, optimizer, loop) applied on top of the common "
                                   "ones; the training step of every configuration at --at, "
                                   "one table sorted by total (or peak), with the budget "
                                   "against --gpu/--memory.")
    _add_common(m)
    m.add_argument("--config", action="append", default=[], dest="configs", metavar="OPTIONS",
                   help="one configuration as analyze options, e.g. \"--fsdp --dp 8 "
                        "--checkpoint blocks\" (repeat; at least one)")
    m.add_argument("--inference", action="store_true", help="compare inference instead")
    m.add_argument("--plot", metavar="FILE",
                   help="draw every configuration's total against the batch and the sequence "
                        "size with GPU capacities: FILE.png, .svg, .pdf or .html")
    sub.add_parser("gpus", help="list the GPU catalog")
    return p


def _step_options(args) -> dict:
    """The step options (:class:`StepConfig` fields by name) the command line gives."""
    return StepConfig.from_options(args)


def _check_point(point: dict[str, int] | None, specs, option: str = "--at") -> None:
    """``--at`` names exactly the inputs' symbols, each a size >= 1 (checked before the
    trace)."""
    if point is None:
        return
    names = list(dict.fromkeys(n for s in specs for n in s.symbols))
    for n, v in point.items():
        if n not in names:
            raise UsageError(f"{option} names {n}, which no --input uses" + did_you_mean(n, names),
                             hint=f"the inputs' symbols: {', '.join(names) or '(none)'}")
        if v < 1:
            raise UsageError(f"{option} {n}={v}: sizes start at 1")
    missing = [n for n in names if n not in point]
    if missing:
        raise UsageError(f"{option} lacks {', '.join(missing)}",
                         hint=f"give every symbol the inputs use: {', '.join(names)}")


def _strategy(args, step: dict) -> dict:
    """The strategy options as keyword arguments of :func:`memsim.strategies.analyze` (checked
    before the trace); ``step`` as the strategies complete it (a DeepSpeed config's
    precision)."""
    from memsim.strategies import strategies_from_options
    return strategies_from_options(args, step)


def _compiled_hints(specs, point, hints):
    """Example sizes for a ``--compiled`` run: the min-cut partition depends on the sizes it is
    chosen at, as torch.compile's (which compiles for the shape it is called with), so the
    ``--at`` point is used when ``--hint`` is not given and the point can serve (sizes >= 2,
    all distinct)."""
    if hints is not None or point is None:
        return hints
    names = {n for s in specs for n in s.symbols}
    use = {k: v for k, v in point.items() if k in names}
    if set(use) == names and all(v >= 2 for v in use.values()) \
            and len(set(use.values())) == len(use):
        return use
    return None


def _budget_setup(args, point):
    """Check the budget options before the (slow) trace: ``(gpu, capacity, overheads)`` or
    None when no budget is asked for."""
    from memsim.analysis.budget import Overheads
    from memsim.analysis.gpus import gpu, load_catalog, parse_memory

    if args.gpu_file:
        load_catalog(args.gpu_file)
    if not (args.gpu or args.memory):
        if getattr(args, "check", False) or args.cmd == "fit":
            raise UsageError("nothing to check against", hint="give --gpu NAME or --memory SIZE")
        return None
    if args.gpu and args.memory:
        raise UsageError("--gpu and --memory both given", hint="give one capacity")
    if point is None:
        raise UsageError("the budget needs a point", hint="give --at with every symbol, "
                                                          "e.g. --at B=4,S=2048")
    device = gpu(args.gpu) if args.gpu else None
    cap = parse_memory(args.memory) if args.memory else None
    ctx = parse_memory(args.cuda_context) if args.cuda_context else None
    return device, cap, Overheads(fragmentation=args.fragmentation, cuda_context=ctx,
                                  alloc_conf=_alloc_conf(args))


def _alloc_conf(args):
    """``--alloc-conf`` parsed (None: PyTorch's defaults); refused off CUDA."""
    from memsim.analysis.caching import AllocConf
    if args.alloc_conf and args.device != "cuda":
        raise UsageError("--alloc-conf configures the CUDA caching allocator",
                         hint="it applies with --device cuda (the default)")
    return AllocConf.parse(args.alloc_conf) if args.alloc_conf else None


def _file_option(args, option: str, point, suffixes=None, wrong: str = "unknown file type",
                 hint: str | None = None) -> bool:
    """Check a picture option (``--timeline``, ``--plot``, ``--html``) before the trace: the
    file type, a point, matplotlib. False when the option is not given."""
    path = getattr(args, option, None)
    if not path:
        return False
    from .plots import FORMATS, pyplot
    suffixes = suffixes or FORMATS
    if not path.lower().endswith(suffixes):
        raise UsageError(f"--{option} {path}: {wrong}",
                         hint=hint or "end the name in " + ", ".join(suffixes))
    if point is None:
        raise UsageError(f"--{option} needs a point", hint="give --at with every symbol, e.g. "
                                                             "--at B=4,S=2048")
    pyplot()
    return True


def _workspace(report, setup) -> int:
    """The cuBLAS workspace the budget counts: its GPU's family's, or a generic GPU's."""
    from memsim.analysis.budget import Overheads
    overheads = setup[2] if setup is not None else Overheads()
    family = setup[0].family if setup is not None and setup[0] is not None else "unknown"
    return overheads.fixed(report.device, family)["cublas_workspace"]


def _write_html(args, report, point, setup, text: str, budget) -> None:
    from memsim.analysis.timeline import timeline

    from .plots import report_html, scaling_figure
    tl = scaling = None
    if getattr(report, "fit", None) is None:
        tl = timeline(report, point, alloc_conf=_alloc_conf(args),
                      workspace=_workspace(report, setup))
        curves, caps = _curves(args, [("", report, point)], setup)
        if curves:
            scaling = scaling_figure(curves, caps, args.margin)
    title = f"memsim: {args.target} at " + ", ".join(f"{k}={v}" for k, v in point.items())
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(report_html(title, text, tl, scaling, budget))
    print(f"memsim: report written to {args.html}", file=sys.stderr)


def _write_plot(args, rows, setup) -> None:
    """``--plot``: each row's (label, report, point) total against the batch and sequence."""
    from .plots import save_figure, scaling_figure
    curves, caps = _curves(args, rows, setup)
    if not curves:
        raise UsageError(f"--plot draws against {args.batch_symbol} or {args.seq_symbol}, "
                         "which no input uses",
                         hint="name the symbols with --batch-symbol / --seq-symbol")
    path = save_figure(scaling_figure(curves, caps, args.margin), args.plot)
    print(f"memsim: memory against size written to {path}", file=sys.stderr)


def _curves(args, rows, setup):
    """Each row's ``(label, report, point)`` total against the batch and the sequence, and the
    capacities drawn: ``({symbol: [Curve]}, {label: GPU})``."""
    from memsim.analysis.gpus import GPU, catalog
    from memsim.analysis.scaling import curve

    from .plots import COMMON_GPUS
    device, cap, overheads = setup if setup is not None else (None, None, None)
    if device is not None:
        caps = {device.name: device}
    elif cap is not None:
        caps = {args.memory: GPU("memory", args.memory, cap // 2 ** 20, "unknown",
                                 source="--memory")}
    else:
        caps = {catalog()[k].name: catalog()[k] for k in COMMON_GPUS}
    curves: dict = {}
    for label, report, point in rows:
        if getattr(report, "fit", None) is not None:
            raise UsageError("--plot needs traced formulas; this report's are fitted",
                             hint="analyse without --plot, or give the pinned symbol a size")
        for sym in (args.batch_symbol, args.seq_symbol):
            if sym in report.symbols and sym in point:
                curves.setdefault(sym, []).append(
                    curve(report, point, sym, label=label, capacities=caps, gpu=device,
                          overheads=overheads, margin=args.margin))
    return curves, caps


def run(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        # a configuration is options itself ("--config --fsdp"): argparse would read its value
        # as the next option, so each --config takes the next word whatever it is
        joined, i = [], 0
        while i < len(argv):
            if argv[i] == "--config" and i + 1 < len(argv):
                joined.append(f"--config={argv[i + 1]}")
                i += 2
            else:
                joined.append(argv[i])
                i += 1
        argv = joined
    args = _parser().parse_args(argv)
    if args.cmd != "gpus" and not (args.quiet or args.json):
        from memsim.tracer.progress import listening
        shown = _Progress()
        try:
            with listening(shown):
                return _run(args)
        finally:
            shown.close()
    return _run(args)


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

    def __call__(self, phase, module=None, index=None, count=None):
        now = self.clock()
        if now - self.start < _PROGRESS_AFTER or now - self.last < (
                0.2 if self.tty else _PROGRESS_EVERY):
            return
        self.last = now
        msg = f"tracing {phase}" + (f": {module} / {count}" if module is not None else "")
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
    fit = args.cmd == "fit"
    report, point, shown, spoint, budget, setup = _analysis(args, fit)
    if getattr(args, "timeline", None):
        _write_timeline(args, report, point, setup)
    if getattr(args, "plot", None):
        _write_plot(args, [("", report, point)], setup)
    text = None
    if not fit and (not args.json or getattr(args, "html", None)):
        text = to_text(shown, spoint, top=args.top, budget=budget, full=report,
                       full_point=point, seq=args.seq_symbol, batch=args.batch_symbol)
    if getattr(args, "html", None):
        _write_html(args, report, point, setup, text, budget)
    if args.json:
        print(json.dumps(to_json(shown, spoint, budget=budget, full=report), indent=2))
    elif fit:
        print(budget_text(budget, report.device))
    else:
        print(text)
    if budget is not None and (fit or getattr(args, "check", False)) and not budget.fits:
        return 1
    return 0


def _analysis(args, fit: bool = False):
    """The analysis the options describe: ``(report, point, shown, shown_point, budget,
    setup)``; every option is checked before the (slow) trace."""
    return _execute(args, _prepare(args), fit)


def _prepare(args) -> dict:
    """Every option checked, nothing traced yet."""
    if not args.input:
        raise UsageError("no --input given",
                         hint="name each tensor forward takes, e.g. --input input_ids=int64[B,S]")
    specs = [parse_input(s) for s in args.input]
    point = parse_assignments(args.at, "--at") if args.at else None
    _check_point(point, specs)
    step = _step_options(args)
    setup = _budget_setup(args, point)
    drawn = [_file_option(args, "timeline", point), _file_option(args, "plot", point),
             _file_option(args, "html", point, (".html", ".htm"), "not an .html file",
                          "e.g. --html report.html")]
    if drawn[0] or drawn[2]:
        _alloc_conf(args)   # the timeline's reserved line: its settings checked now
    strategy = _strategy(args, step)
    hints = step.pop("hints", None)
    if args.compiled:
        if set(strategy) - {"checkpoint"}:
            raise UsageError("--compiled does not combine with strategy options yet (only "
                             "with --checkpoint)",
                             hint="analyse the strategy without --compiled, or --compiled alone")
        hints = _compiled_hints(specs, point, hints)
    config = StepConfig(**step, hints=hints or {})
    return {"specs": specs, "point": point, "setup": setup, "strategy": strategy,
            "config": config}


def _execute(args, prep: dict, fit: bool = False):
    specs, point, setup = prep["specs"], prep["point"], prep["setup"]
    strategy, config = prep["strategy"], prep["config"]
    model = load_target(args.target)
    from memsim.analysis import pinning_fixed
    from memsim.strategies import analyze as analyze_with
    kw = dict(strategy, train=not args.inference,
              inference=args.inference or not (fit or getattr(args, "train", False)))
    inputs = {s.name: s for s in specs}
    if point is not None:   # a size of 1 in it is traced beside the formulas' trace
        kw["points"] = [point]
    report = pinning_fixed(analyze_with, model, inputs, config, point, **kw) \
        if point is not None else analyze_with(model, inputs, config, **kw)
    if point is not None:
        point = {k: v for k, v in point.items() if k not in report.fixed}
    if point is not None:
        shown, spoint = report.for_point(point)   # traces a point the formulas do not cover
        shown.train and shown.train.check_point(spoint)
        shown.inference and shown.inference.check_point(spoint)
    else:   # a fitted report shows its fitted formulas
        shown, spoint = (report.view() if hasattr(report, "view") else report), None
    budget = None
    if setup is not None:
        from memsim.analysis.budget import plan
        device, cap, overheads = setup
        budget = plan(report, point, gpu=device, capacity=cap, margin=args.margin,
                      overheads=overheads, batch=args.batch_symbol, seq=args.seq_symbol)
    return report, point, shown, spoint, budget, setup


# options a configuration of `memsim compare` may not set: the model, its inputs, the point and
# the budget are the same for every configuration
_SHARED = {"target", "input", "at", "gpu", "memory", "gpu_file", "json", "margin", "hint",
           "batch_symbol", "seq_symbol", "compiled", "plot", "timeline", "html", "no_fold",
           "no_cache"}


def _config_args(args, text: str) -> argparse.Namespace:
    """``args`` with the options of one ``--config`` string applied on top."""
    import copy
    import shlex

    p = argparse.ArgumentParser(prog="memsim compare --config", add_help=False,
                                exit_on_error=False)
    _add_common(p)
    try:
        tokens = shlex.split(text)
        ns, rest = p.parse_known_args([args.target] + tokens)
    except (ValueError, argparse.ArgumentError) as e:
        raise UsageError(f"--config {text!r}: {e}",
                         hint="a configuration is analyze options, e.g. "
                              "--config \"--zero 3 --dp 8\"") from None
    if rest:
        raise UsageError(f"--config {text!r}: unknown option(s) {' '.join(rest)}",
                         hint="see memsim analyze --help for the options")
    defaults = vars(p.parse_args([args.target]))
    changed = {k: v for k, v in vars(ns).items() if v != defaults.get(k)}
    shared = sorted(set(changed) & _SHARED)
    if shared:
        raise UsageError(f"--config {text!r} sets {', '.join('--' + k.replace('_', '-') for k in shared)}",
                         hint="the model, --input, --at and the budget are common to every "
                              "configuration: give them once, outside --config")
    out = copy.copy(args)
    for k, v in changed.items():
        setattr(out, k, v)
    out.timeline = None
    return out


def _compare(args) -> int:
    """``memsim compare``: the training step of each configuration side by side."""
    from .render import compare_json, compare_text
    if not args.configs:
        raise UsageError("memsim compare needs --config", hint="e.g. --config \"--fsdp --dp 8\" "
                         "--config \"--zero 3 --dp 8\"")
    if args.at is None:
        raise UsageError("memsim compare needs a point", hint="give --at with every symbol, "
                                                               "e.g. --at B=4,S=2048")
    prepared = []
    for text in args.configs:   # every configuration checked before any trace
        cargs = _config_args(args, text)
        prepared.append((text, cargs, _prepare(cargs)))
    rows = []
    for text, cargs, prep in prepared:
        try:
            report, point, shown, spoint, budget, _ = _execute(cargs, prep, fit=True) \
                if not args.inference else _execute(cargs, prep)
            rows.append({"config": text, "report": report, "shown": shown, "point": spoint,
                         "full_point": point, "budget": budget, "error": None})
        except MemsimError as e:
            rows.append({"config": text, "error": e})
    if args.plot:
        _write_plot(args, [(r["config"] or "(the common options)", r["report"], r["full_point"])
                           for r in rows if r["error"] is None], prepared[0][2]["setup"])
    if args.json:
        print(json.dumps(compare_json(rows, args), indent=2))
    else:
        print(compare_text(rows, args))
    return 2 if any(r["error"] is not None for r in rows) else 0


def _write_timeline(args, report, point, setup) -> None:
    from memsim.analysis.timeline import timeline
    from .plots import save_timeline
    if getattr(report, "fit", None) is not None:
        raise UsageError("--timeline needs a traced step; this report's formulas are fitted "
                         "(a symbol the model's code pins)",
                         hint="give --at with the sizes you want drawn; memsim traces them")
    tl = timeline(report, point, alloc_conf=_alloc_conf(args),
                  workspace=_workspace(report, setup))
    path = save_timeline(tl, args.timeline)
    print(f"memsim: timeline of the {tl.step} step written to {path}", file=sys.stderr)


def _checkpoint(args) -> int:
    from memsim.analysis.gpus import parse_memory

    from memsim.strategies import checkpoint as ck
    from .render import checkpoint_json, checkpoint_text

    if not args.input:
        raise UsageError("no --input given", hint="e.g. --input input_ids=int64[B,S]")
    if args.compiled:
        raise UsageError("memsim checkpoint does not take --compiled: its peaks with "
                         "checkpointed regions are within -4.4%..+8.2% of real compiled runs, too "
                         "coarse to choose plans by",
                         hint="see one plan under torch.compile with memsim analyze TARGET ... "
                              "--compiled --checkpoint PLAN")
    step = _step_options(args)
    if _strategy(args, step):
        raise UsageError("memsim checkpoint does not take strategy options yet",
                         hint="use memsim analyze ... --checkpoint PLAN with --fsdp/--tp/--lora")
    specs = {s.name: s for s in (parse_input(t) for t in args.input)}
    point = parse_assignments(args.at, "--at") if args.at else None
    setup = None if args.budget else _budget_setup(args, point)
    if args.plan == "optimal" and setup is None and not args.budget:
        raise UsageError("--plan optimal needs a budget",
                         hint="give --budget 20GiB, --gpu NAME or --memory SIZE")
    rng = _size_range(args.size_range, args.plan) if args.size_range else None
    if rng is not None:
        point = {**(point or {}), rng[0]: rng[2]}   # the plan shown fits the whole range
    _check_point(point, specs.values(), "--at" if rng is None else "--at with --range")
    if args.plan == "optimal" and point is None:
        raise UsageError("--plan optimal needs a point", hint="give --at B=...,S=...")
    config = StepConfig(**step)
    model = load_target(args.target)
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
        doc = checkpoint_json(base, result, rank, point, budget)
        if args.plan == "optimal":
            doc["search"] = args.search
        if bands is not None:
            doc["bands"] = [{"symbol": rng[0], "from": b.lo, "to": b.hi, "blocks": b.blocks,
                             "plan": list(b.plan)} for b in bands]
        print(json.dumps(doc, indent=2))
    else:
        text = checkpoint_text(base, result, rank, point, budget, args.plan, top=args.top)
        if bands is not None:
            from .render import bands_text
            text += "\n\n" + bands_text(bands, rng, budget, len(ck.blocks(model)))
        print(text)
    return 0 if result is not None else 1


def _size_range(text: str, plan: str):
    """``S=512:4096`` -> ("S", 512, 4096)."""
    name, eq, rest = text.partition("=")
    lo, colon, hi = rest.partition(":")
    try:
        lo_v, hi_v = int(lo), int(hi)
    except ValueError:
        lo_v = hi_v = None
    if not eq or not colon or lo_v is None or not 1 <= lo_v <= hi_v:
        raise UsageError(f"--range {text!r} is not NAME=LO:HI with 1 <= LO <= HI",
                         hint="e.g. --range S=512:4096")
    if plan != "optimal":
        raise UsageError("--range goes with --plan optimal", hint="drop --plan or --range")
    return name.strip(), lo_v, hi_v


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
