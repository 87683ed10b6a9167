"""DDP (``torch.nn.parallel.DistributedDataParallel``): the traced step plus its gradient
buckets, per rank.

DDP allocates, at construction, flat buckets holding a copy of every trainable gradient
(``gradient_as_bucket_view=False``, the default): one more gradient-sized block alive for the
whole step (checked against real 2-rank gloo runs in ``tests/test_parallel.py``). With
``gradient_as_bucket_view=True`` the gradients are views into the buckets: each gradient
autograd produces is dropped as soon as DDP copies it in (checked against real gloo runs too).
This is a timeline edit of the traced step (:class:`~memsim.strategies.base.Edit`).

>>> DDP(dp=8).describe()
{'dp': 8, 'bucket_cap_mb': 25.0, 'gradient_as_bucket_view': False}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import sympy
import torch

from memsim.analysis import StepMemory
from memsim.analysis.memory import Added, edited_candidates
from memsim.analysis.peak import Candidate, as_max
from memsim.tracer import Category, Phase, StrategyError, UsageError

from .base import Edit, Strategy, data_parallel, exclusive, register_strategy

__all__ = ["DDP", "ddp_rank", "RankMemory", "RankStep", "rank_step"]


@register_strategy
@dataclass(frozen=True)
class DDP(Strategy):
    """``DistributedDataParallel`` over ``dp`` ranks."""

    key: ClassVar[str] = "ddp"
    order: ClassVar[int] = 60
    axis: ClassVar[str] = "dp"
    flags: ClassVar[tuple[str, ...]] = ("--ddp",)
    dp: int
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False

    def __post_init__(self):
        if not isinstance(self.dp, int) or self.dp < 1:
            raise StrategyError(f"DDP dp={self.dp!r} must be an int >= 1")

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--ddp", action="store_true", help="DDP buckets over --dp ranks")
        group.add_argument("--bucket-view", action="store_true",
                           help="DDP gradient_as_bucket_view=True (gradients are views into the "
                                "buckets)")

    @classmethod
    def from_options(cls, opts, step):
        if not opts.ddp:
            if opts.bucket_view:
                raise UsageError("--bucket-view is a DDP option", hint="add --ddp --dp N")
            return None
        return cls(dp=data_parallel("--ddp", opts), gradient_as_bucket_view=opts.bucket_view)

    @classmethod
    def summary(cls, d) -> str:
        return f"DDP dp={d['dp']}"

    def validate(self, given, config) -> None:
        exclusive(given, self.key, ("fsdp", "zero", "ddp"),
                  "DDP buckets do not exist under ZeRO or FSDP")

    def apply(self, plan):
        return plan.but(edits=(self._edit,))

    def _edit(self, report, model) -> Edit:
        if report.train is None:
            raise StrategyError("DDP needs the training step", hint="do not pass --inference")
        rank = ddp_rank(report, model, self)
        return Edit(rank_step(report.train, rank), tuple(rank.notes), dict(rank.buffers),
                    modelled="DDP buckets")


@dataclass
class RankMemory:
    """One rank's figures under a modelled strategy (bytes, sympy)."""

    peak: sympy.Expr
    parameters: sympy.Expr
    gradients: sympy.Expr
    optimizer_states: sympy.Expr
    buffers: dict[str, sympy.Expr] = field(default_factory=dict)  # communication buffers
    notes: list[str] = field(default_factory=list)
    candidates: list = field(default_factory=list)
    # the timeline edit behind ``candidates`` (edited_candidates' frees / added / keep), which
    # the caching allocator replay applies too (memsim.analysis.reserved)
    edit: dict = field(default_factory=dict)


def ddp_rank(report, model: torch.nn.Module, ddp: DDP) -> RankMemory:
    """Per-rank memory of a training step under DDP: the traced step plus its buckets.

    The buckets hold one flat copy of every trainable gradient, allocated at construction. By
    default each parameter keeps its own gradient too (autograd's, copied into the bucket and
    back). With ``gradient_as_bucket_view`` the gradients are views into the buckets: each one
    autograd produces lives until it is accumulated, when DDP's hook copies it into its bucket
    view and drops it (the trace records when: :attr:`memsim.tracer.RunRecord.grad_ready`).
    """
    step = report.train
    if step is None:
        raise StrategyError("DDP needs the training step", hint="do not pass --inference")
    buckets = step.gradients
    run = step.trace.run
    if not ddp.gradient_as_bucket_view:
        cands = [Candidate(sympy.expand(c.expr + buckets), c.event, c.label)
                 for c in step.candidates]
        edit = {"added": [Added(buckets, run.start)]}
        how = "hold a copy of every gradient"
    else:
        frees: dict[int, int] = {}
        for i, sid in run.grad_ready:
            if sid is not None and run.storages[sid].phase is Phase.BACKWARD:
                frees.setdefault(sid, i)
        edit = {"frees": frees, "added": [Added(buckets, run.start)],
                "keep": lambda s, sign: s.category is not Category.GRADIENT or s.sid in frees}
        cands = edited_candidates(step.trace, **edit)
        how = ("are the gradients (gradient_as_bucket_view): each gradient autograd produces "
               "is dropped once copied in")
    return RankMemory(peak=as_max(cands), candidates=cands, parameters=step.parameters,
                      gradients=step.gradients, optimizer_states=step.optimizer_states,
                      buffers={"ddp_buckets": buckets}, edit=edit,
                      notes=[f"DDP buckets ({ddp.bucket_cap_mb:g} MiB each), allocated at "
                             f"construction, {how}"])


@dataclass
class RankStep(StepMemory):
    """A traced step with a modelled strategy's per-rank figures in place of its own."""

    rank: RankMemory | None = None

    def breakdown(self, point: dict[str, int]) -> dict[str, int]:
        subs = self.check_point(point)
        ev = lambda e: int(sympy.sympify(e).xreplace(subs))
        r = self.rank
        out = {c.value: 0 for c in Category}
        out[Category.PARAMETER.value] = ev(r.parameters)
        out[Category.GRADIENT.value] = ev(r.gradients)
        out[Category.OPTIMIZER_STATE.value] = ev(r.optimizer_states)
        out[Category.TEMPORARY.value] = ev(self.peak) - sum(out.values())
        return out


def rank_step(step: StepMemory, rank: RankMemory) -> RankStep:
    """``step`` with ``rank``'s peak, candidates and model states (for reports and budgets)."""
    from dataclasses import fields
    kw = {f.name: getattr(step, f.name) for f in fields(StepMemory) if f.init}
    kw.update(peak=rank.peak, candidates=rank.candidates, parameters=rank.parameters,
              gradients=rank.gradients, optimizer_states=rank.optimizer_states)
    return RankStep(**kw, rank=rank)
