"""Activation checkpointing: plans, applied for real, and re-analysed.

A plan is a list of module paths. :func:`apply_checkpointing` wraps exactly those modules'
``forward`` with ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; the effect of
a plan is found by tracing the step again with the plan applied (the checkpointed regions keep
only their inputs, and their forward runs again inside backward), not by subtracting numbers.

Named plans (:func:`named_plan`):

- ``none``;
- ``blocks``: every repeated block (the elements of the longest ``nn.ModuleList`` of identical
  module types: transformer layers, ResNet stages...);
- ``every:K``: every K-th block, starting with the first;
- ``selective``: the attention module of every block (a child whose name contains ``attn`` or
  ``attention``). Korthikanti et al. 2022 recompute only the attention core (QK^T, softmax,
  dropout, ·V); a module-level plan also recomputes the Q/K/V and output projections;
- ``optimal``: the plan with the least recompute that brings the peak under a budget: whole
  blocks or modules inside them (see :func:`optimal_plan` and :func:`mixed_plan`).

>>> import torch
>>> class Net(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
...     def forward(self, x):
...         for b in self.blocks:
...             x = b(x)
...         return x
>>> named_plan(Net(), "every:2")
['blocks.0', 'blocks.2']
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from dataclasses import dataclass
from typing import ClassVar

import sympy
import torch

from memsim.analysis import analyze
from memsim.analysis.search import last_true
from memsim.tracer import InputError, Phase, StepConfig, UsageError
from memsim.tracer.errors import closest
from memsim.tracer.records import Word

from .base import Strategy, register_strategy

PLANS = ("none", "blocks", "selective", "every:K", "optimal")


class Search(Word):
    """What ``optimal`` may checkpoint: ``modules`` (a block or one of its children in each
    block, two kinds per plan) or ``blocks`` (whole blocks only, fewer traces)."""

    MODULES = "modules"
    BLOCKS = "blocks"


@register_strategy
@dataclass(frozen=True)
class Checkpoint(Strategy):
    """Activation checkpointing: a named plan (``"blocks"``, ``"selective"``, ``"every:K"``,
    ``"none"``) or module paths, applied with ``torch.utils.checkpoint`` inside the run."""

    key: ClassVar[str] = "checkpoint"
    order: ClassVar[int] = 20
    flags: ClassVar[tuple[str, ...]] = ("--checkpoint",)
    plan: str | tuple[str, ...] = "blocks"

    @classmethod
    def coerce(cls, value):
        """A plan's name or module paths stand for ``Checkpoint(value)``."""
        return cls(value) if isinstance(value, (str, list, tuple)) else value

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--checkpoint", metavar="PLAN", dest="ckpt",
                           help="activation checkpointing: blocks, selective, every:K")

    @classmethod
    def from_options(cls, opts, step):
        return cls(opts.ckpt) if opts.ckpt else None

    @classmethod
    def summary(cls, d) -> str:
        return f"checkpointing {d}"

    def __post_init__(self):
        if isinstance(self.plan, list):
            object.__setattr__(self, "plan", tuple(self.plan))
        if isinstance(self.plan, str) and self.plan not in ("none", "blocks", "selective") \
                and not re.fullmatch(r"every:\d+", self.plan):
            raise UsageError(f"unknown plan {self.plan!r}", hint=f"use one of {', '.join(PLANS)}"
                             " (optimal: memsim checkpoint), or module paths")

    def describe(self):
        return self.plan if isinstance(self.plan, str) else list(self.plan)

    def apply(self, plan):
        paths = named_plan(plan.model, self.plan) if isinstance(self.plan, str) else \
            list(self.plan)
        if not paths:
            return plan
        notes = ()
        if getattr(getattr(plan.model, "config", None), "use_cache", None) is True:
            notes = ("checkpointing a Hugging Face model: its KV cache is off (use_cache=False), "
                     "as its own gradient checkpointing sets it in training",)
        _check_paths(plan.model, paths)

        def inside(model, rank):
            # a model whose stack of blocks is cut short (memsim.tracer.fold) lacks the
            # blocks past the cut: the plan is applied to those it has
            mods = dict(model.named_modules())
            apply_checkpointing(model, [p for p in paths if p in mods])
        inside.paths = tuple(paths)
        return plan.but(inside={"checkpoint": inside}, notes=notes)


def blocks(model: torch.nn.Module) -> list[str]:
    """Paths of the repeated blocks: the longest ``ModuleList`` whose elements share a type."""
    best: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1:
            types = {type(m) for m in mod}
            if len(types) == 1 and len(mod) > len(best):
                best = [f"{name}.{i}" if name else str(i) for i in range(len(mod))]
    return best


def named_plan(model: torch.nn.Module, plan: str) -> list[str]:
    """The module paths of a named plan (``none``, ``blocks``, ``selective``, ``every:K``)."""
    if plan == "none":
        return []
    found = blocks(model)
    if plan != "none" and not found:
        raise InputError(f"plan {plan!r}: the model has no repeated blocks (no ModuleList of "
                         "identical modules)", hint="give the module paths yourself")
    if plan == "blocks":
        return found
    m = re.fullmatch(r"every:(\d+)", plan)
    if m:
        k = int(m.group(1))
        if k < 1:
            raise UsageError(f"plan {plan!r}: K must be >= 1")
        return found[::k]
    if plan == "selective":
        mods = dict(model.named_modules())
        out = []
        for b in found:
            for name, _ in mods[b].named_children():
                if "attn" in name.lower() or "attention" in name.lower():
                    out.append(f"{b}.{name}")
                    break
        if not out:
            raise InputError("plan 'selective': no attention module (a child named *attn* or "
                             "*attention*) in the blocks", hint="give the module paths yourself")
        return out
    raise UsageError(f"unknown plan {plan!r}", hint=f"use one of {', '.join(PLANS)}")


def _check_paths(model: torch.nn.Module, plan: list[str]) -> None:
    names = [n for n, _ in model.named_modules()]
    known = set(names)
    for path in plan:
        if path not in known:
            close = closest(path, names, n=3)
            raise InputError(f"plan names module {path!r}, which the model does not have",
                             hint="close: " + ", ".join(close) if close else None)


def apply_checkpointing(model: torch.nn.Module, plan: list[str]) -> torch.nn.Module:
    """Wrap the ``forward`` of each module in ``plan`` with non-reentrant
    ``torch.utils.checkpoint`` (in place; returns the model). Paste-able for real training.

    A Hugging Face model's KV cache is turned off (``config.use_cache = False``, restored by
    :func:`remove_checkpointing`), as its own ``gradient_checkpointing_enable`` does in
    training: with the cache on, the recomputation in backward appends each layer's keys and
    values to the cache again, and the cache keeps that recomputed graph (the layer's norms,
    projections and the concatenated keys and values, 16*B*S*hidden bytes per bf16 layer) to
    the end of backward. Llama-2-7B, FSDP2 on 8 ranks, B 8, S 2048: 49.30 GiB with the cache,
    20.64 without."""
    _check_paths(model, plan)
    mods = dict(model.named_modules())
    for path in plan:
        mod = mods[path]
        if getattr(mod.forward, "_memsim_checkpointed", False):
            continue
        # A partial of the module (not a closure over a bound method): ``copy.deepcopy`` of the
        # model then checkpoints the copy, as strategies that copy the model need.
        forward = functools.partial(_checkpointed_forward, mod)
        forward._memsim_checkpointed = True
        forward.__signature__ = inspect.signature(mod.forward)
        mod.forward = forward
    cfg = getattr(model, "config", None)
    if plan and getattr(cfg, "use_cache", None) is True:
        cfg.use_cache = False
        model._memsim_use_cache = True
    return model


def _checkpointed_forward(mod: torch.nn.Module, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(type(mod).forward, mod, *args, use_reentrant=False,
                                             **kwargs)


def remove_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_checkpointing`."""
    for mod in model.modules():
        if getattr(mod.forward, "_memsim_checkpointed", False):
            del mod.forward
    if model.__dict__.pop("_memsim_use_cache", False):
        model.config.use_cache = True
    return model


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, plan: list[str]):
    """Inside: ``model`` with ``plan`` applied."""
    apply_checkpointing(model, plan)
    try:
        yield model
    finally:
        remove_checkpointing(model)


def plan_conditions(model: torch.nn.Module) -> list[str]:
    """What a checkpoint plan's figures assume of the user's code: how each module is
    checkpointed, and a Hugging Face model's KV cache off."""
    out = ["each module of the plan runs its forward under torch.utils.checkpoint.checkpoint("
           "use_reentrant=False), as apply_checkpointing(model, plan) wraps it"]
    if getattr(getattr(model, "config", None), "use_cache", None) is True:
        out.append("the Hugging Face model's KV cache is off (config.use_cache = False), as "
                   "apply_checkpointing and the model's own gradient_checkpointing_enable() "
                   "set it; checkpointing with the cache on holds the cache too")
    return out


def step_flops(step) -> sympy.Expr:
    """FLOPs of the step's ops (forward, loss, backward, optimizer), torch's flop formulas."""
    return sympy.expand(sympy.Add(*[r.flops for r in step.trace.run.ops
                                    if getattr(r, "phase", Phase.SETUP) is not Phase.SETUP
                                    and getattr(r, "flops", 0)]))


def forward_flops(step, path: str) -> sympy.Expr:
    """Forward FLOPs of module ``path`` (inclusive of its submodules)."""
    pre = path + "."
    return sympy.expand(sympy.Add(*[
        r.flops for r in step.trace.run.ops
        if getattr(r, "phase", None) is Phase.FORWARD and getattr(r, "flops", 0)
        and r.module is not None and (r.module == path or r.module.startswith(pre))]))


def _peak(res: "PlanResult", point: dict[str, int]) -> int:
    """The plan's step peak at ``point`` (traced again where its formulas do not cover it)."""
    report, pt = res.report.for_point(point)
    return report.at(**pt)["train"]["peak"]


@dataclass
class PlanResult:
    """A plan and the re-analysed step."""

    plan: list[str]
    report: object          # analysis.Report of the step with the plan applied
    step_flops: sympy.Expr
    recompute_flops: sympy.Expr


def evaluate_plan(model, inputs: dict, plan: list[str], config: StepConfig | None = None, *,
                  base=None, **options) -> PlanResult:
    """Trace the training step with ``plan`` applied; ``base`` (the plan-free report) gives
    the recompute FLOPs as the difference of the two step totals. ``options``: fields of
    :class:`~memsim.tracer.StepConfig` over ``config``."""
    config = StepConfig.of(config, **options)
    if base is None:
        base = analyze(model, inputs, config, inference=False)
    if not plan:
        return PlanResult([], base, step_flops(base.train), sympy.Integer(0))
    with checkpointed(model, plan):
        rep = analyze(model, inputs, config, inference=False)
    total = step_flops(rep.train)
    return PlanResult(list(plan), rep, total, sympy.expand(total - step_flops(base.train)))


def optimal_plan(model, inputs: dict, point: dict[str, int], budget: int,
                 config: StepConfig | None = None, *, base=None, cache: dict | None = None,
                 search: Search | str = Search.MODULES, **options) -> PlanResult | None:
    """The plan with the least recompute whose step peak fits ``budget`` bytes at ``point``;
    None when no plan searched fits.

    ``search="blocks"``: the fewest leading whole blocks. Blocks are identical, so recompute
    grows with their number: the least recompute is the smallest count ``k`` that fits, found by
    bisection over ``k`` (the peak shrinks as blocks are added), each ``k`` traced with the first
    ``k`` blocks checkpointed. Which ``k`` blocks are chosen can move transient peaks by less
    than one block's activations (not searched).

    ``search="modules"``: also the modules inside the blocks (see :func:`mixed_plan`).

    ``cache`` (keyed by block count, or by plan) lets several budgets and sizes share the traces
    of one model and inputs: every trace is symbolic, so it answers at any point.
    ``options``: fields of :class:`~memsim.tracer.StepConfig` over ``config``.
    """
    config = StepConfig.of(config, **options)
    try:
        search = Search(search)
    except ValueError:
        raise UsageError(f"unknown search {search!r}",
                         hint=f"use one of {', '.join(s.value for s in Search)}") from None
    if base is None:
        base = analyze(model, inputs, config, inference=False)
    found = blocks(model)
    if not found:
        raise InputError("plan 'optimal': the model has no repeated blocks")
    if search is Search.MODULES:
        return mixed_plan(model, inputs, point, budget, config, base=base, cache=cache)

    def peak(res: PlanResult) -> int:
        return _peak(res, point)

    results: dict[int, PlanResult] = cache if cache is not None else {}
    results.setdefault(0, evaluate_plan(model, inputs, [], config, base=base))
    if peak(results[0]) <= budget:
        return results[0]

    def run(k: int) -> PlanResult:
        if k not in results:
            results[k] = evaluate_plan(model, inputs, found[:k], config, base=base)
        return results[k]

    if peak(run(len(found))) > budget:
        return None
    # the fewest blocks that fit: 0 does not, all of them do
    return run(last_true(lambda k: peak(run(k)) > budget, 0, len(found)) + 1)


def block_options(model, base, point: dict[str, int]) -> list[tuple[str, ...]]:
    """What the ``modules`` search may checkpoint in each block: the whole block, or one of its
    children that saves bytes for backward at ``point`` (its attention, its MLP, a norm...), as
    paths relative to the block (``""`` is the block itself; blocks are identical, the first
    one is read)."""
    found = blocks(model)
    step = base.train
    saved = {m.path: step.evaluate(m.saved, point) for m in base.modules}
    first = dict(model.named_modules())[found[0]]
    return [("",)] + [(name,) for name, _ in first.named_children()
                      if saved.get(f"{found[0]}.{name}", 0) > 0]


def mixed_plan(model, inputs: dict, point: dict[str, int], budget: int,
               config: StepConfig | None = None, *, base, cache: dict | None = None
               ) -> PlanResult | None:
    """The least-recompute plan of the form "option H in the first k blocks, option L in the
    others", over every pair of options of :func:`block_options` (and nothing), whose peak at
    ``point`` fits ``budget``.

    Exact search over that family: for each pair, the smallest ``k`` that fits is found by
    bisection on traced plans (the peak shrinks as k grows when H saves more than L), and the
    plan with the least recompute FLOPs (torch.utils.flop_counter's formulas; ties: fewer
    modules, then lower peak) wins. Every plan it compares is traced, so the peak it reports is
    the plan's own, not an estimate; each option's recompute per block (measured on the trace
    of that option in every block) only prunes pairs that cannot beat the best plan found.
    Limits: at most two options per plan, options are the block or one child (not
    grandchildren, not two children of one block), and H goes to the leading blocks.
    Includes the ``blocks`` search's answer (H = the block, L = nothing).
    """
    found = blocks(model)
    n = len(found)
    results: dict = cache if cache is not None else {}

    def plan_of(heavy, light, k: int) -> list[str]:
        out: list[str] = []
        for i, b in enumerate(found):
            for r in (heavy if i < k else light) or ():
                out.append(f"{b}.{r}" if r else b)
        return out

    def run(plan: list[str]) -> PlanResult:
        key = ("plan", tuple(plan))
        if key not in results:
            results[key] = evaluate_plan(model, inputs, plan, config, base=base)
        return results[key]

    def peak(res: PlanResult) -> int:
        return _peak(res, point)

    def score(res: PlanResult) -> tuple:
        t = res.report.train
        return (t.evaluate(res.recompute_flops, point), len(res.plan), peak(res))

    none = run([])
    if peak(none) <= budget:
        return none
    every = {o: run(plan_of(o, None, n)) for o in block_options(model, base, point)}
    # Recompute per block of each option, measured (regions recompute independently; early
    # stop makes it less than the module's forward).
    per = {o: score(r)[0] // n for o, r in every.items()}
    opts = sorted(per.items(), key=lambda kv: kv[1])
    best: PlanResult | None = None
    for o, _ in opts:
        if peak(every[o]) <= budget and (best is None or score(every[o]) < score(best)):
            best = every[o]
    lights = [(None, 0)] + opts
    for heavy, fh in opts:
        if peak(every[heavy]) > budget:
            continue
        for light, fl in lights:
            if light == heavy or fh <= fl:
                continue    # a cheaper heavy option that fits everywhere is tried on its own
            if light is not None and peak(every[light]) <= budget:
                continue    # light alone fits: k = 0, already a candidate
            if light is not None and peak(every[light]) <= peak(every[heavy]):
                continue    # heavy does not save more than light
            kmax = n
            if best is not None:   # the largest k that could still cost less than the best
                b = score(best)[0]
                if n * fl >= b:
                    continue
                kmax = min(n, -(-(b - n * fl) // (fh - fl)) - 1)
                if kmax < 1 or peak(run(plan_of(heavy, light, kmax))) > budget:
                    continue
            # the smallest k that fits: 0 does not, kmax does
            k = last_true(lambda k: peak(run(plan_of(heavy, light, k))) > budget, 0, kmax) + 1
            res = run(plan_of(heavy, light, k))
            if best is None or score(res) < score(best):
                best = res
    return best


@dataclass
class Band:
    """Sizes ``lo..hi`` of one symbol (say S) for which one plan is the optimal one."""

    blocks: int             # blocks with something checkpointed in them
    plan: list[str]
    lo: int
    hi: int
    result: PlanResult


def plans_over_range(model, inputs: dict, point: dict[str, int], name: str, lo: int, hi: int,
                     budget: int, config: StepConfig | None = None, *, base=None,
                     cache: dict | None = None, search: Search | str = Search.MODULES,
                     **options) -> list[Band]:
    """The optimal plan (:func:`optimal_plan`, with ``search``) for every size of symbol
    ``name`` in ``lo..hi``, the other symbols at ``point``: bands of sizes, each with one plan.

    From the smallest size up: the optimal plan there, then the largest size its (symbolic)
    peak fits by bisection, as :mod:`memsim.analysis.budget` finds the largest batch; that plan is the
    optimum over the whole band, since a cheaper plan that fitted a larger size would fit the
    smaller one too. This assumes the peak grows with the size (true of every model seen; a
    model whose peak shrinks as the size grows would be mis-banded). Traces are shared through
    ``cache``: each plan is traced once for the whole range. Sizes that do not fit with any plan
    searched are left out: the last band ends before ``hi`` then.
    """
    if lo > hi:
        raise InputError(f"range {name}={lo}:{hi} is empty", hint="give LO:HI with LO <= HI")
    config = StepConfig.of(config, **options)
    cache = cache if cache is not None else {}
    if base is None:
        base = analyze(model, inputs, config, inference=False)

    def fits(res: PlanResult, v: int) -> bool:
        return _peak(res, {**point, name: v}) <= budget

    found = set(blocks(model))
    bands: list[Band] = []
    v = lo
    while v <= hi:
        res = optimal_plan(model, inputs, {**point, name: v}, budget, config, base=base,
                           cache=cache, search=search)
        if res is None:
            break
        # the largest size the plan fits: v does, hi + 1 is past the range
        a = hi if fits(res, hi) else last_true(lambda x: fits(res, x), v, hi + 1)
        touched = {p for p in found if any(q == p or q.startswith(p + ".") for q in res.plan)}
        bands.append(Band(len(touched), list(res.plan), v, a, res))
        v = a + 1
    return bands


@dataclass
class Ranked:
    """One row of "layers worth checkpointing": a module or a group of identical ones."""

    path: str               # e.g. "transformer.h.*" for a group
    type: str
    count: int
    saved: sympy.Expr       # bytes saved for backward, per module
    flops: sympy.Expr       # forward FLOPs recomputation would cost, per module


def ranking(report) -> list[Ranked]:
    """Modules by bytes saved for backward per forward FLOP, repeated blocks grouped."""
    step = report.train
    groups: dict[tuple, list] = {}
    for m in report.modules:
        if not m.path:
            continue
        key = (re.sub(r"\.\d+(?=\.|$)", ".*", m.path), m.type, m.saved)
        groups.setdefault(key, []).append(m.path)
    out = []
    for (gpath, typ, saved), paths in groups.items():
        out.append(Ranked(gpath if len(paths) > 1 else paths[0], typ, len(paths), saved,
                          forward_flops(step, paths[0])))
    return out


def budget_bytes(report, point: dict[str, int], *, capacity: int, margin: float = 0.10,
                 gpu=None, overheads=None) -> int:
    """The largest tensor peak (allocated bytes) that fits ``capacity`` with the budget's margin
    and overhead terms (:mod:`memsim.analysis.budget`).

    On CUDA the caching allocator's reserve depends on the plan's own allocations, which the
    search does not replay plan by plan: it is taken as the fraction of the allocated peak the
    allocator caches in ``report``'s step (no plan) replayed at ``point``, plus the user's
    ``fragmentation`` (:func:`memsim.analysis.budget.cache_fraction`)."""
    from memsim.analysis.budget import Overheads, cache_fraction

    ov = overheads or Overheads()
    family = gpu.family if gpu else "unknown"
    fixed = sum(ov.fixed(report.device, family).values())
    frag = ov.fragmentation if report.device == "cuda" else 0.0
    if point is not None:
        frag = max(frag, cache_fraction(report, point, overheads=ov, family=family))
    usable = int(capacity * (1 - margin))
    a = int((usable - fixed) / (1 + frag))
    while a > 0 and a + int(a * frag) + fixed > usable:
        a -= 1
    while a + 1 + int((a + 1) * frag) + fixed <= usable:
        a += 1
    return max(a, 0)
