"""DeepSpeed ZeRO settings and published figures, and DDP gradient buckets, per rank.

ZeRO is **traced**: :mod:`strategies.ds_engine` runs DeepSpeed's own engine
(``deepspeed.initialize`` and its ``backward``/``step``) inside the symbolic step, on a fake
process group, once per rank; every rank's peak equals a real DeepSpeed step on CPU
(``tests/test_zero.py``), ZeRO-Offload included (there as the sum of device and host: on the
CPU they are one memory). Modelling a GPU, what DeepSpeed places on the CPU is host memory
(:func:`host_peak`).

DDP (``torch.nn.parallel.DistributedDataParallel``) allocates, at construction, flat buckets
holding a copy of every trainable gradient (``gradient_as_bucket_view=False``, the default): one
more gradient-sized block alive for the whole step (checked against real 2-rank gloo runs in
``tests/test_parallel.py``). With ``gradient_as_bucket_view=True`` the gradients are views into
the buckets: each gradient autograd produces is dropped as soon as DDP copies it in (checked
against real gloo runs too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import sympy
import torch

from memsim.analysis import StepMemory
from memsim.analysis.memory import Added, edited_candidates
from memsim.analysis.peak import Candidate, as_max
from memsim.tracer import Category, Phase, StrategyError

__all__ = ["ZeRO", "DDP", "load_deepspeed_config",
           "host_peak", "ddp_rank", "RankMemory"]


@dataclass(frozen=True)
class ZeRO:
    """DeepSpeed ZeRO settings (the names of ``zero_optimization`` in ``ds_config.json``, with
    DeepSpeed's defaults)."""

    stage: int
    dp: int
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None          # None: True for stage 3, else False (DeepSpeed)
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    offload_optimizer: str | None = None      # "cpu"
    offload_param: str | None = None          # "cpu" (stage 3)

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise StrategyError(f"ZeRO stage {self.stage!r} must be 1, 2 or 3",
                                hint="stage 0 is plain data parallelism: use DDP")
        if not isinstance(self.dp, int) or self.dp < 1:
            raise StrategyError(f"ZeRO dp={self.dp!r} must be an int >= 1")
        if self.offload_param and self.stage != 3:
            raise StrategyError("offload_param needs ZeRO stage 3",
                                hint="stages 1 and 2 keep the 16-bit parameters on the GPU")
        for k in ("offload_optimizer", "offload_param"):
            v = getattr(self, k)
            if v not in (None, "none", "cpu"):
                raise StrategyError(f"ZeRO {k}={v!r}: only 'cpu' is traced",
                                    hint="NVMe offload (ZeRO-Infinity) is not modelled")

    @property
    def offloaded(self) -> bool:
        return "cpu" in (self.offload_optimizer, self.offload_param)

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else bool(self.overlap_comm)


@dataclass(frozen=True)
class DDP:
    """``DistributedDataParallel`` over ``dp`` ranks."""

    dp: int
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False


def load_deepspeed_config(path: str, dp: int) -> tuple[ZeRO | None, str | None]:
    """``(ZeRO settings or None, precision)`` from a DeepSpeed JSON config.

    ``"auto"`` values (resolved by Hugging Face's Trainer, not by DeepSpeed) are an error here:
    memsim cannot know the value the Trainer would pick without its arguments.
    """
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise StrategyError(f"cannot read DeepSpeed config {path}: {e}") from e
    z = cfg.get("zero_optimization") or {}
    precision = None
    if (cfg.get("bf16") or {}).get("enabled") is True:
        precision = "bf16-master"
    elif (cfg.get("fp16") or {}).get("enabled") is True:
        precision = "16-true"  # fp16 weights and activations; ZeRO holds the fp32 masters
    stage = int(z.get("stage", 0))
    if stage == 0:
        return None, precision
    kw = {}
    names = {"reduce_bucket_size": int, "overlap_comm": bool, "contiguous_gradients": bool,
             "stage3_prefetch_bucket_size": int, "stage3_param_persistence_threshold": int,
             "sub_group_size": int, "allgather_bucket_size": int,
             "stage3_max_live_parameters": int, "stage3_max_reuse_distance": int}
    for key, typ in names.items():
        if key in z:
            if z[key] == "auto":
                raise StrategyError(f"{path}: zero_optimization.{key} is \"auto\"",
                                    hint="Hugging Face's Trainer fills these in; give a number")
            kw[key] = typ(float(z[key])) if typ is int else typ(z[key])
    for key in ("offload_optimizer", "offload_param"):
        dev = (z.get(key) or {}).get("device")
        if dev not in (None, "none"):
            kw[key] = dev
    return ZeRO(stage=stage, dp=dp, **kw), precision


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


def _numel(ps) -> int:
    return sum(p.numel() for p in dict.fromkeys(ps))


def host_peak(trace) -> sympy.Expr:
    """The peak of host memory over a traced step (storages the run placed on the host)."""
    from dataclasses import replace

    from memsim.analysis.memory import peak_candidates
    return as_max(peak_candidates(replace(trace, device="host")))


def ddp_rank(report, model: torch.nn.Module, ddp: DDP) -> RankMemory:
    """Per-rank memory of a training step under DDP: the traced step plus its buckets.

    The buckets hold one flat copy of every trainable gradient, allocated at construction. By
    default each parameter keeps its own gradient too (autograd's, copied into the bucket and
    back). With ``gradient_as_bucket_view`` the gradients are views into the buckets: each one
    autograd produces lives until it is accumulated, when DDP's hook copies it into its bucket
    view and drops it (the trace records when: :attr:`tracer.RunRecord.grad_ready`).
    """
    step = report.train
    if step is None:
        raise StrategyError("DDP needs the training step", hint="do not pass --inference")
    buckets = step.gradients
    if not ddp.gradient_as_bucket_view:
        cands = [Candidate(sympy.expand(c.expr + buckets), c.event, c.label)
                 for c in step.candidates]
        how = "hold a copy of every gradient"
    else:
        run = step.trace.run
        frees: dict[int, int] = {}
        for i, sid in run.grad_ready:
            if sid is not None and run.storages[sid].phase is Phase.BACKWARD:
                frees.setdefault(sid, i)
        cands = edited_candidates(
            step.trace, frees=frees, added=[Added(buckets, run.start)],
            keep=lambda s, sign: s.category is not Category.GRADIENT or s.sid in frees)
        how = ("are the gradients (gradient_as_bucket_view): each gradient autograd produces "
               "is dropped once copied in")
    return RankMemory(peak=as_max(cands), candidates=cands, parameters=step.parameters,
                      gradients=step.gradients, optimizer_states=step.optimizer_states,
                      buffers={"ddp_buckets": buckets},
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
    kw = {f.name: getattr(step, f.name) for f in fields(StepMemory)}
    kw.update(peak=rank.peak, candidates=rank.candidates, parameters=rank.parameters,
              gradients=rank.gradients, optimizer_states=rank.optimizer_states)
    return RankStep(**kw, rank=rank)
