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
- ``optimal``: the fewest blocks whose checkpointing brings the peak under a budget (see
  :func:`optimal_plan`).

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

import sympy
import torch

from tracer import InputError, Phase, UsageError

PLANS = ("none", "blocks", "selective", "every:K", "optimal")


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


def apply_checkpointing(model: torch.nn.Module, plan: list[str]) -> torch.nn.Module:
    """Wrap the ``forward`` of each module in ``plan`` with non-reentrant
    ``torch.utils.checkpoint`` (in place; returns the model). Paste-able for real training."""
    mods = dict(model.named_modules())
    for path in plan:
        if path not in mods:
            import difflib
            close = difflib.get_close_matches(path, list(mods), n=3)
            raise InputError(f"plan names module {path!r}, which the model does not have",
                             hint="close: " + ", ".join(close) if close else None)
        mod = mods[path]
        if getattr(mod.forward, "_memsim_checkpointed", False):
            continue
        # A partial of the module (not a closure over a bound method): ``copy.deepcopy`` of the
        # model then checkpoints the copy, as strategies that copy the model need.
        forward = functools.partial(_checkpointed_forward, mod)
        forward._memsim_checkpointed = True
        forward.__signature__ = inspect.signature(mod.forward)
        mod.forward = forward
    return model


def _checkpointed_forward(mod: torch.nn.Module, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(type(mod).forward, mod, *args, use_reentrant=False,
                                             **kwargs)


def remove_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply_checkpointing`."""
    for mod in model.modules():
        if getattr(mod.forward, "_memsim_checkpointed", False):
            del mod.forward
    return model


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, plan: list[str]):
    """Inside: ``model`` with ``plan`` applied."""
    apply_checkpointing(model, plan)
    try:
        yield model
    finally:
        remove_checkpointing(model)


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


@dataclass
class PlanResult:
    """A plan and the re-analysed step."""

    plan: list[str]
    report: object          # analysis.Report of the step with the plan applied
    step_flops: sympy.Expr
    recompute_flops: sympy.Expr


def evaluate_plan(model, inputs: dict, plan: list[str], *, base=None, **kw) -> PlanResult:
    """Trace the training step with ``plan`` applied; ``base`` (the plan-free report) gives
    the recompute FLOPs as the difference of the two step totals."""
    from analysis import analyze

    kw = {**kw, "inference": False}
    if base is None:
        base = analyze(model, inputs, **kw)
    if not plan:
        return PlanResult([], base, step_flops(base.train), sympy.Integer(0))
    with checkpointed(model, plan):
        rep = analyze(model, inputs, **kw)
    total = step_flops(rep.train)
    return PlanResult(list(plan), rep, total, sympy.expand(total - step_flops(base.train)))


def optimal_plan(model, inputs: dict, point: dict[str, int], budget: int, *, base=None,
                 cache: dict | None = None, **kw) -> PlanResult | None:
    """The fewest leading blocks to checkpoint so that the step's peak fits ``budget`` bytes.

    Blocks are identical, so recompute grows with their number: the least recompute is the
    smallest count ``k`` that fits, found by bisection over ``k`` (the peak shrinks as blocks
    are added), each ``k`` traced with the first ``k`` blocks checkpointed. Exact for plans made
    of whole blocks; which ``k`` blocks are chosen can move transient peaks by less than one
    block's activations (not searched). None when not even every block fits. ``cache``
    (``{k: PlanResult}``) lets several budgets share the traces of one model and inputs.
    """
    from analysis import analyze

    kw = {**kw, "inference": False}
    if base is None:
        base = analyze(model, inputs, **kw)
    found = blocks(model)
    if not found:
        raise InputError("plan 'optimal': the model has no repeated blocks")

    def peak(res: PlanResult) -> int:
        return res.report.at(**point)["train"]["peak"]

    results: dict[int, PlanResult] = cache if cache is not None else {}
    results.setdefault(0, evaluate_plan(model, inputs, [], base=base, **kw))
    if peak(results[0]) <= budget:
        return results[0]

    def run(k: int) -> PlanResult:
        if k not in results:
            results[k] = evaluate_plan(model, inputs, found[:k], base=base, **kw)
        return results[k]

    if peak(run(len(found))) > budget:
        return None
    lo, hi = 0, len(found)  # lo does not fit, hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(run(mid)) <= budget:
            hi = mid
        else:
            lo = mid
    return run(hi)


@dataclass
class Band:
    """Sizes ``lo..hi`` of one symbol (say S) for which one plan is the optimal one."""

    blocks: int             # leading blocks checkpointed
    plan: list[str]
    lo: int
    hi: int
    result: PlanResult


def plans_over_range(model, inputs: dict, point: dict[str, int], name: str, lo: int, hi: int,
                     budget: int, *, base=None, cache: dict | None = None,
                     **kw) -> list[Band]:
    """The optimal plan (:func:`optimal_plan`) for every size of symbol ``name`` in
    ``lo..hi``, the other symbols at ``point``: bands of sizes, each with the fewest leading
    blocks that fit there. Each block count is traced once; its symbolic peak gives the largest
    size it fits by bisection, as :mod:`analysis.budget` finds the largest batch, so this
    assumes the peak grows with the size (true of every model seen; a model whose peak shrinks
    as the size grows would be mis-banded). Sizes that do not fit even with every block
    checkpointed are left out: the last band ends before ``hi`` then. ``cache`` as in
    :func:`optimal_plan`.
    """
    if lo > hi:
        raise InputError(f"range {name}={lo}:{hi} is empty", hint="give LO:HI with LO <= HI")
    found = blocks(model)
    cache = cache if cache is not None else {}
    kw = {**kw, "inference": False}

    def fits(res: PlanResult, v: int) -> bool:
        return res.report.at(**{**point, name: v})["train"]["peak"] <= budget

    first = optimal_plan(model, inputs, {**point, name: lo}, budget, base=base, cache=cache,
                         **kw)
    if first is None:
        return []
    base = base if base is not None else cache[0].report
    bands: list[Band] = []
    k, v = len(first.plan), lo
    while True:
        res = cache[k]
        a, b = v, hi + 1        # fits at a; b does not (or is past the range)
        if fits(res, hi):
            a = hi
        else:
            while b - a > 1:
                mid = (a + b) // 2
                a, b = (mid, b) if fits(res, mid) else (a, mid)
        bands.append(Band(k, list(res.plan), v, a, res))
        v = a + 1
        if v > hi:
            return bands
        while True:             # the next count that fits at v
            k += 1
            if k > len(found):
                return bands
            if k not in cache:
                cache[k] = evaluate_plan(model, inputs, found[:k], base=base, **kw)
            if fits(cache[k], v):
                break


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
    and overhead terms (:mod:`analysis.budget`)."""
    from analysis.budget import Overheads

    ov = overheads or Overheads()
    fixed = sum(ov.fixed(report.device, gpu.family if gpu else "unknown").values())
    frag = ov.fragmentation if report.device == "cuda" else 0.0
    usable = int(capacity * (1 - margin))
    a = int((usable - fixed) / (1 + frag))
    while a > 0 and a + int(a * frag) + fixed > usable:
        a -= 1
    while a + 1 + int((a + 1) * frag) + fixed <= usable:
        a += 1
    return max(a, 0)
