"""The command line's options: the parser (each step option from a
:class:`~memsim.tracer.StepConfig` field, each strategy's from its class) and every check made
before a trace (the point, the budget, the files to write, ``memsim compare``'s
configurations)."""

from __future__ import annotations

import argparse
import copy
import shlex
import sys

from memsim.tracer import StepConfig, UsageError
from memsim.tracer.errors import did_you_mean

__all__ = ["parser", "add_common", "join_configs", "input_options", "check_point",
           "compiled_hints", "budget_setup", "alloc_conf", "file_option", "size_range",
           "config_args", "SHARED"]


def join_configs(argv: list[str]) -> list[str]:
    """``memsim compare``'s arguments with each ``--config VALUE`` joined into one word: a
    configuration is options itself (``--config --fsdp``), which argparse would read as the
    next option."""
    if argv[:1] != ["compare"]:
        return argv
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            out.append(f"--config={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def input_options(args) -> list[str]:
    """``--input`` as given; for an ``hf:`` target given none, its defaults (said on stderr)."""
    if args.input:
        return args.input
    from .target import HF, default_inputs
    if args.target.startswith(HF):
        got = default_inputs(args.target, args.hf_class)
        if got:
            print(f"memsim: inputs {' '.join('--input ' + i for i in got)} (the defaults of "
                  "a Hugging Face model; give --input to change them)", file=sys.stderr)
            return got
    raise UsageError("no --input given",
                     hint="name each tensor forward takes, e.g. --input input_ids=int64[B,S]")


def add_common(a: argparse.ArgumentParser) -> None:
    a.add_argument("target", help="path/to/file.py:NAME, package.module:NAME, or "
                                  "hf:path/to/config.json (a Hugging Face model from its "
                                  "configuration)")
    a.add_argument("--input", action="append", default=[], metavar="NAME=DTYPE[DIMS]",
                   help="a tensor input, e.g. input_ids=int64[B,S] (repeat per input)")
    a.add_argument("--at", metavar="B=4,S=2048", help="evaluate every formula at this point")
    a.add_argument("--hf-class", metavar="NAME",
                   help="with an hf: target, the transformers class to build (default: the "
                        "configuration's architectures)")
    s = a.add_argument_group("the step (memsim.StepConfig)")
    for _, opt, default in StepConfig.cli_options():
        s.add_argument(opt.flag, help=opt.help, **({} if opt.argparse.get("action") else
                                                  {"default": default}), **opt.argparse)
    a.add_argument("--json", action="store_true", help="print the JSON document")
    a.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (shown for traces over 2 s, never with "
                        "--json), and other libraries' warnings dropped (else printed after "
                        "the answer)")
    a.add_argument("--no-cache", action="store_true",
                   help="trace again instead of answering from the on-disk cache")
    b = a.add_argument_group("budget (against a GPU)")
    b.add_argument("--gpu", metavar="NAME", help="a catalog GPU, e.g. h100-80gb (see 'memsim gpus')")
    b.add_argument("--memory", metavar="SIZE", help="any capacity instead, e.g. 24GiB or 80GB")
    b.add_argument("--gpu-file", metavar="FILE", help="extra GPUs, JSON or TOML {key: {name, mib, family}}")
    b.add_argument("--margin", type=float, default=0.10,
                   help="safety margin, fraction of the capacity kept free (default 0.10)")
    b.add_argument("--no-options", action="store_true",
                   help="where the step does not fit, do not trace what would make it fit "
                        "(a lower precision, checkpointing, FSDP2: one analysis each)")
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


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line and a hint (its own print the whole usage
    first, 25 lines above the error for ``memsim analyze``)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n  hint: {self.prog} --help lists the "
                     "options\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memsim", description="Training-memory simulator for PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="symbolic peak memory of a training step and inference")
    add_common(a)
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
    add_common(f)
    f.add_argument("--inference", action="store_true", help="check inference instead")
    c = sub.add_parser("checkpoint", help="which layers to checkpoint, and a plan's new peak")
    add_common(c)
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
    add_common(m)
    m.add_argument("--config", action="append", default=[], dest="configs", metavar="OPTIONS",
                   help="one configuration as analyze options, e.g. \"--fsdp --dp 8 "
                        "--checkpoint blocks\" (repeat; at least one)")
    m.add_argument("--inference", action="store_true", help="compare inference instead")
    m.add_argument("--plot", metavar="FILE",
                   help="draw every configuration's total against the batch and the sequence "
                        "size with GPU capacities: FILE.png, .svg, .pdf or .html")
    n = sub.add_parser("plan", help="which layouts (TP, FSDP2, checkpointing, micro-batch) "
                                    "fit this model on a cluster, ranked",
                       description="Every layout of --gpus ranks reaching --global-batch, each "
                                   "answered from memsim's traced per-rank figures on the rank "
                                   "with the largest peak; one trace per program answers every "
                                   "micro-batch (docs/plan.md).")
    add_common(n)
    n.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in all")
    n.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="GPUs per node: tensor parallelism stays within one (default 8)")
    n.add_argument("--global-batch", type=int, required=True, metavar="G",
                   help="sequences per optimizer step over every data-parallel rank")
    n.add_argument("--seq", type=int, metavar="S",
                   help="the sequence length (the --seq-symbol's size)")
    n.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help="pin a field of every layout: tp, dp, ep (a mixture of experts), "
                        "checkpoint (none, blocks), micro_batch (repeatable), e.g. --fix tp=8")
    n.add_argument("--cluster", metavar="ADDRESS",
                   help="trace the layouts' programs as tasks of the Ray cluster at ADDRESS "
                        "(host:port of 'ray start --head'), or 'local' for a Ray cluster of "
                        "this machine's processes (pip install 'memsim[cluster]'); default: "
                        "processes of this machine (--workers)")
    n.add_argument("--workers", type=int, metavar="N",
                   help="trace the programs in N processes of this machine (default: one per "
                        "core; 1: in this process)")
    n.add_argument("--top", type=int, default=10,
                   help="layouts that fit to list (default 10; --json has them all)")
    n.add_argument("--html", metavar="FILE",
                   help="also write the plan as one self-contained page: the layouts' totals "
                        "against the GPU, the table, the reasons")
    n.add_argument("--rank-by", default="default", metavar="RULE",
                   help="the ranking among layouts that fit: default (least recomputation, "
                        "smallest tp, fewest accumulation steps, largest headroom), headroom, "
                        "throughput (least recomputation, fewest accumulation steps, smallest tp)")
    sub.add_parser("gpus", help="list the GPU catalog")
    return p


def check_point(point: dict[str, int] | None, specs, option: str = "--at") -> None:
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


def compiled_hints(specs, point, hints):
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


def budget_setup(args, point):
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
                                  alloc_conf=alloc_conf(args))


def alloc_conf(args):
    """``--alloc-conf`` parsed (None: PyTorch's defaults); refused off CUDA."""
    from memsim.analysis.alloc_conf import AllocConf
    if args.alloc_conf and args.device != "cuda":
        raise UsageError("--alloc-conf configures the CUDA caching allocator",
                         hint="it applies with --device cuda (the default)")
    return AllocConf.parse(args.alloc_conf) if args.alloc_conf else None


def file_option(args, option: str, point, suffixes=None, wrong: str = "unknown file type",
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


def size_range(text: str, plan: str):
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


SHARED = {"target", "hf_class", "input", "at", "gpu", "memory", "gpu_file", "json", "margin", "hint",
           "batch_symbol", "seq_symbol", "compiled", "plot", "timeline", "html", "no_fold",
           "no_cache"}


def config_args(args, text: str) -> argparse.Namespace:
    """``args`` with the options of one ``--config`` string applied on top."""
    p = argparse.ArgumentParser(prog="memsim compare --config", add_help=False,
                                exit_on_error=False)
    add_common(p)
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
    shared = sorted(set(changed) & SHARED)
    if shared:
        raise UsageError(f"--config {text!r} sets {', '.join('--' + k.replace('_', '-') for k in shared)}",
                         hint="the model, --input, --at and the budget are common to every "
                              "configuration: give them once, outside --config")
    out = copy.copy(args)
    for k, v in changed.items():
        setattr(out, k, v)
    out.timeline = None
    return out
