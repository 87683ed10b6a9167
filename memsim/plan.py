"""``memsim plan``: which layouts fit a model on a cluster, each answered from traced figures.

A layout is a tensor-parallel degree ``tp`` (within a node), the data-parallel degree
``dp = world / tp`` sharded with FSDP2 (``--fsdp --dp dp``; no sharding where ``dp`` is 1), for
a mixture of experts without tensor parallelism an expert-parallel degree ``ep`` dividing
``dp`` (``--ep``; 1: none), an activation-checkpointing plan (none or every repeated block),
and the micro-batch ``mb`` with the gradient accumulation ``k`` that reach the global batch:
``mb * k * dp = global batch``.

Exact and cheap: a layout's figures are those ``memsim analyze`` gives for its options at
``B=mb`` and the sequence asked for, on the rank with the largest peak. One trace answers every
micro-batch of a *program*: the same ``tp``, ``dp`` and checkpointing, and accumulation 1 or
more than 1 (a step of ``k >= 2`` micro-batches peaks as one of 2: the micro-steps after the
second repeat it; docs/step.md), since the trace's formulas are symbolic in the batch and the
sequence. The plan says how many traces answered how many layouts.

Ranked by a stated rule (:data:`RANK_RULES`): by default the layouts that fit first; among
them the least recomputation (no checkpointing before checkpointing), then the smallest
tensor-parallel degree (its all-reduces are on every layer's critical path), then the fewest
accumulation steps (the largest micro-batch), then the largest headroom. Layouts that do not fit
are grouped by reason: the model states alone exceed the usable memory; they fit, but not the
activations at the smallest micro-batch; a degree the model or the batch does not divide.

The programs are traced in a pool of this machine's processes, in this process, or as tasks of a
Ray cluster (memsim.plan_run).
Pipeline and context parallelism, ZeRO, offload and HSDP are not searched yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from memsim.tracer import InputError, UsageError

__all__ = ["Layout", "Planned", "PlanResult", "layouts", "programs_of", "plan", "RANK_RULES"]

CHECKPOINTS = ("none", "blocks")
# --fix KEY=VALUE: what a layout may pin
FIXABLE = ("tp", "dp", "ep", "checkpoint", "micro_batch")


@dataclass(frozen=True)
class Layout:
    """One way to run the step on the cluster."""

    tp: int
    dp: int
    checkpoint: str          # "none" or "blocks"
    micro_batch: int
    accumulate: int
    ep: int = 1              # expert-parallel ranks (a mixture of experts, beside FSDP2)

    @property
    def degrees(self) -> tuple:
        """The degrees and checkpointing: the layouts that differ only in the micro-batch and
        the accumulation share them."""
        return (self.tp, self.dp, self.ep, self.checkpoint)

    @property
    def program(self) -> tuple:
        """What one trace answers: every micro-batch of the same degrees and checkpointing, and
        accumulation 1 or more."""
        return (*self.degrees, self.accumulate > 1)

    def flags(self) -> str:
        """The ``memsim analyze`` options of this layout (the micro-batch is ``--at B=``)."""
        out = []
        if self.tp > 1:
            out.append(f"--tp {self.tp}")
        if self.dp > 1:
            out.append(f"--fsdp --dp {self.dp}")
        if self.ep > 1:
            out.append(f"--ep {self.ep}")
        if self.checkpoint != "none":
            out.append(f"--checkpoint {self.checkpoint}")
        if self.accumulate > 1:
            out.append(f"--accumulate {self.accumulate}")
        return " ".join(out) or "(one device, no strategy)"

    def program_flags(self) -> str:
        """The options of this layout's program: its own, accumulation said as such."""
        return replace(self, accumulate=1).flags() + (
            " with accumulation" if self.accumulate > 1 else "")

    def as_dict(self) -> dict:
        return {"tp": self.tp, "dp": self.dp, "fsdp": self.dp > 1, "ep": self.ep,
                "checkpoint": self.checkpoint,
                "micro_batch": self.micro_batch, "accumulate": self.accumulate,
                "options": self.flags()}


@dataclass
class Planned:
    """A layout and what it needs per rank, or why it was not answered."""

    layout: Layout
    total: int | None = None       # the budget's total on the worst rank (bytes)
    peak: int | None = None        # its allocated peak
    states: int | None = None      # parameters, gradients and optimizer states
    headroom: float | None = None
    fits: bool = False
    reason: str | None = None      # why it does not fit (grouped in the output)

    def as_dict(self) -> dict:
        return {**self.layout.as_dict(), "fits": self.fits, "total": self.total,
                "peak": self.peak, "model_states": self.states,
                "headroom": None if self.headroom is None else round(self.headroom, 6),
                **({"reason": self.reason} if self.reason else {})}


@dataclass
class PlanResult:
    """Every layout considered, ranked; the traces that answered them."""

    world: int
    per_node: int
    global_batch: int
    usable: int
    rows: list[Planned] = field(default_factory=list)
    traces: int = 0                # symbolic runs: one per program, and sizes traced beside
    rule: str = "default"

    @property
    def fitting(self) -> list[Planned]:
        return [r for r in self.rows if r.fits]

    def reasons(self) -> dict[str, list[Planned]]:
        """The layouts that do not fit, by reason, in the order of the rows."""
        out: dict[str, list[Planned]] = {}
        for r in self.rows:
            if not r.fits:
                out.setdefault(r.reason or "does not fit", []).append(r)
        return out


# the rules a plan may be ranked by (--rank-by): each a key over a row, after "fits first"
RANK_RULES: dict[str, Callable[[Planned], tuple]] = {
    "default": lambda r: (r.layout.checkpoint != "none", r.layout.tp, r.layout.accumulate,
                          -(r.headroom or 0)),
    "headroom": lambda r: (-(r.headroom or 0),),
    "throughput": lambda r: (r.layout.checkpoint != "none", r.layout.accumulate, r.layout.tp,
                             -(r.headroom or 0)),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(world: int, per_node: int, global_batch: int, fixed: dict | None = None,
            experts: list[int] | None = None) -> tuple[list[Layout], list[Planned]]:
    """Every layout of ``world`` ranks reaching ``global_batch``, with ``fixed`` (``--fix``)
    pinning some of its fields; and the combinations of degrees that cannot reach the global
    batch (``dp`` not dividing it), as rows that do not fit. ``experts``: the expert counts of
    a mixture of experts' experts modules (memsim.strategies.ep.expert_counts), whose layouts
    without tensor parallelism also shard the experts over every ``ep`` dividing ``dp`` and
    every count. A typed error where no layout is left, naming the option."""
    fixed = dict(fixed or {})
    check_world(world, per_node)
    if fixed.get("ep", 1) > 1 and not experts:
        raise UsageError(f"--fix ep={fixed['ep']}: the model has no experts to shard",
                         hint="expert parallelism is for a mixture of experts with Hugging "
                              "Face's expert-parallel plan; drop --fix ep")
    if global_batch < 1:
        raise UsageError(f"--global-batch {global_batch} must be at least 1")
    tps = [t for t in _divisors(min(per_node, world)) if world % t == 0]
    out: list[Layout] = []
    rejected: list[Planned] = []
    for tp in tps:
        if "tp" in fixed and tp != fixed["tp"]:
            continue
        dp = world // tp
        if "dp" in fixed and dp != fixed["dp"]:
            continue
        eps = [1] + [e for e in _divisors(dp) if e > 1 and tp == 1 and experts
                     and all(n % e == 0 for n in experts)]
        for ep in eps:
            if "ep" in fixed and ep != fixed["ep"]:
                continue
            for ck in CHECKPOINTS:
                if "checkpoint" in fixed and ck != fixed["checkpoint"]:
                    continue
                if global_batch % dp:
                    rejected.append(Planned(Layout(tp, dp, ck, 0, 0, ep), reason=(
                        f"the global batch {global_batch} does not divide by dp={dp}")))
                    continue
                per_rank = global_batch // dp
                for mb in _divisors(per_rank):
                    if "micro_batch" in fixed and mb != fixed["micro_batch"]:
                        continue
                    out.append(Layout(tp, dp, ck, mb, per_rank // mb, ep))
    if not out:
        pinned = ", ".join(f"{k}={v}" for k, v in fixed.items())
        raise UsageError(
            f"no layout of {world} GPUs ({per_node} per node) reaches global batch "
            f"{global_batch}" + (f" with {pinned}" if pinned else ""),
            hint="the data-parallel degree (GPUs / tp) must divide --global-batch; tp divides "
                 "--gpus-per-node; ep divides dp and the experts, without tp"
                 + ("; check --fix" if pinned else ""))
    return out, rejected


def parse_fix(items: list[str]) -> dict:
    """``--fix tp=8 --fix checkpoint=blocks`` as a dict, checked."""
    out: dict = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in FIXABLE:
            raise UsageError(f"--fix {item!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(FIXABLE)}", hint="e.g. --fix tp=8 --fix checkpoint=blocks")
        if key == "checkpoint":
            if value not in CHECKPOINTS:
                raise UsageError(f"--fix checkpoint={value!r}: the plan searches "
                                 f"{' and '.join(CHECKPOINTS)}", hint="e.g. --fix checkpoint=blocks")
            out[key] = value
        else:
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"--fix {key}={value!r} must be a whole number of at least 1",
                                 hint=f"e.g. --fix {key}=2")
            out[key] = int(value)
    return out


def programs_of(candidates: list[Layout]) -> list[list[Layout]]:
    """The layouts grouped by the program that answers them (one trace each), in order."""
    out: dict[tuple, list[Layout]] = {}
    for lay in candidates:
        out.setdefault(lay.program, []).append(lay)
    return list(out.values())


def plan(answers: Iterable[tuple[list[Planned], int]], rejected: list[Planned], *,
         world: int, per_node: int, global_batch: int, usable: int,
         rank_by: str = "default") -> PlanResult:
    """The plan from each program's answer (``(rows, symbolic runs)``, memsim.plan_run) and
    the combinations that cannot reach the global batch: reasons given, ranked by
    ``rank_by``."""
    check_rank_by(rank_by)
    result = PlanResult(world, per_node, global_batch, usable, rule=rank_by)
    rows: list[Planned] = list(rejected)
    for got, runs in answers:
        rows += got
        result.traces += runs
    _reasons(rows, usable)
    rule = RANK_RULES[rank_by]
    rows.sort(key=lambda r: (not r.fits, rule(r) if r.fits else (
        r.total is None, r.total or 0)))
    result.rows = rows
    return result


def _reasons(rows: list[Planned], usable: int) -> None:
    """Why each answered layout that does not fit does not, from the layouts of the same
    degrees and checkpointing: the model states alone, the activations even at the smallest
    micro-batch, or this micro-batch and accumulation where another fits (accumulation keeps
    the gradients through the next micro-batch's forward: a smaller micro-batch with it can
    need more than a larger one without)."""
    groups: dict[tuple, list[Planned]] = {}
    for r in rows:
        if r.reason is None:
            groups.setdefault(r.layout.degrees, []).append(r)
    for same in groups.values():
        fitting = [(r.layout.micro_batch, r.layout.accumulate) for r in same if r.fits]
        least = min(r.layout.micro_batch for r in same)
        for r in same:
            if r.fits:
                continue
            if r.states is not None and r.states >= usable:
                r.reason = "the model states alone exceed the usable memory"
            elif not fitting:
                r.reason = (f"the model states fit, the activations do not, even at "
                            f"micro-batch {least}")
            else:
                mb, k = max(fitting)
                r.reason = (f"this micro-batch and accumulation do not fit: {mb} x {k} does, "
                            "with the same degrees")


def check_rank_by(rule: str) -> None:
    if rule not in RANK_RULES:
        raise UsageError(f"--rank-by {rule!r} is not a rule",
                         hint=f"one of {', '.join(RANK_RULES)}")


def check_world(world: int, per_node: int) -> None:
    """``--gpus`` and ``--gpus-per-node`` checked before any trace."""
    if world < 1:
        raise UsageError(f"--gpus {world}: a plan needs at least one GPU", hint="e.g. --gpus 8")
    if per_node < 1:
        raise UsageError(f"--gpus-per-node {per_node} must be at least 1",
                         hint="e.g. --gpus-per-node 8")
    if world > per_node and world % per_node:
        raise InputError(f"--gpus {world} is not a whole number of nodes of {per_node}",
                         hint=f"e.g. --gpus {world - world % per_node} or --gpus-per-node "
                              "that divides it")
