"""DeepSpeed ZeRO stages 1, 2 and 3 and DDP gradient buckets, per rank.

ZeRO is **traced**: :mod:`strategies.ds_engine` runs DeepSpeed's own engine
(``deepspeed.initialize`` and its ``backward``/``step``) inside the symbolic step, on a fake
process group, once per rank; every rank's peak equals a real DeepSpeed step on CPU
(``tests/test_zero.py``). ZeRO-Offload (``offload_optimizer`` / ``offload_param`` ``"cpu"``)
is still **modelled** (:func:`zero_rank`), from DeepSpeed 0.19.6's ``stage_1_and_2.py`` and
``stage3.py`` (Ψ trainable parameters, N ranks, b bytes per 16-bit element, B =
``reduce_bucket_size`` elements, K optimizer bytes per parameter, 12 for Adam with fp32
master weights):

========  ==================================  =======================================  ========================
stage     persistent                          backward extra                           step extra
========  ==================================  =======================================  ========================
1         bΨ + KΨ/N                           bΨ (full 16-bit grads) + B·b (bucket)    bΨ/N + 2bΨ/N (flat, fp32)
2         bΨ + KΨ/N + bΨ/N (grad partition)   (1 + overlap)·B·b + B·b (reduce copy)    bΨ/N + 2bΨ/N
3         bΨ/N + KΨ/N + bΨ/N + B·b            2 × largest module's parameters (b)       6 × min(Ψ/N, sub_group)
========  ==================================  =======================================  ========================

Frozen parameters cost their own bytes, whole (stages 1, 2) or partitioned (stage 3); stage 3
keeps parameters under ``param_persistence_threshold`` elements whole. With
``offload_optimizer="cpu"`` the KΨ/N states, the fp32 gradients and the step move to the host.
This model is **not checked against a DeepSpeed run** (DeepSpeed's CPU optimizer needs its
compiled op); the output says so. The traced engine shows what it leaves out: DeepSpeed clones
an fp32 master even for fp32 weights (K = 12), and stage 3 keeps every parameter it gathered
under the default ``stage3_max_reuse_distance``. The ZeRO paper's model-state figures
(:func:`paper_model_states`) and DeepSpeed's own estimators (:func:`deepspeed_estimate`) are
reproduced for comparison.

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

from analysis import StepMemory
from analysis.memory import Added, PeakPoint, edited_candidates
from analysis.peak import Candidate, as_max
from tracer import MODEL_STATE, Category, Phase, StrategyError

__all__ = ["ZeRO", "DDP", "paper_model_states", "deepspeed_estimate", "load_deepspeed_config",
           "zero_rank", "ddp_rank", "RankMemory"]


@dataclass(frozen=True)
class ZeRO:
    """DeepSpeed ZeRO settings (the names of ``zero_optimization`` in ``ds_config.json``, with
    DeepSpeed's defaults). ``optimizer_bytes`` and ``low_bytes`` apply to the modelled
    ZeRO-Offload only."""

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
    optimizer_bytes: int | None = None        # K; default 12 (fp32 master + Adam moments)
    low_bytes: int | None = None              # b; default from the traced precision

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
                raise StrategyError(f"ZeRO {k}={v!r}: only 'cpu' is modelled",
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


def paper_model_states(psi: float, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per device in the ZeRO paper (Rajbhandari et al. 2019, Fig. 1):
    baseline (stage 0) (2 + 2 + K)Ψ, P_os 4Ψ + KΨ/N, P_os+g 2Ψ + (2 + K)Ψ/N, P_os+g+p
    (2 + 2 + K)Ψ/N."""
    if stage == 0:
        return (4 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (4 + k) * psi / n
    raise StrategyError(f"ZeRO stage {stage!r} must be 0..3")


def deepspeed_estimate(stage: int, total_params: int, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, largest_layer_params: int = 0,
                       cpu_offload: bool = False, cpu_offload_params: bool = False,
                       zero_init: bool = True, additional_buffer_factor: float = 1.5
                       ) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) per device, as DeepSpeed's ``estimate_zero2_model_states_mem_needs``
    and ``estimate_zero3_model_states_mem_needs`` compute them (DeepSpeed 0.19.6). They count
    every parameter as trainable (frozen ones included), no buckets, no activations."""
    gpus = num_gpus_per_node * num_nodes
    p = total_params
    if stage in (1, 2):
        if cpu_offload:
            return 2 * p, p * max(4 * gpus, 16) * additional_buffer_factor
        return 2 * p + 18 * p / gpus, 4 * p * num_gpus_per_node * additional_buffer_factor
    if stage != 3:
        raise StrategyError(f"DeepSpeed has estimators for stages 2 and 3, not {stage!r}")
    ll = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu, cpu = ll, 18 * p / num_nodes * additional_buffer_factor
    elif cpu_offload:
        gpu, cpu = ll + 2 * p / gpus, 16 * p / num_nodes * additional_buffer_factor
    else:
        gpu = ll + 18 * p / gpus
        cpu = (largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
               if zero_init else
               p * 4 * max(num_gpus_per_node, 4) * additional_buffer_factor)
    if not zero_init and (cpu_offload or cpu_offload_params):
        cpu = max(cpu, p * 4 * num_gpus_per_node * additional_buffer_factor)
    return gpu, cpu


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
    host: sympy.Expr = sympy.Integer(0)     # offloaded to CPU memory
    notes: list[str] = field(default_factory=list)
    candidates: list = field(default_factory=list)


def _numel(ps) -> int:
    return sum(p.numel() for p in dict.fromkeys(ps))


def _activation_peak_until(step, phase: Phase) -> list:
    """Candidates for the most non-model-state bytes live before ``phase`` ends."""
    from analysis.memory import peak_candidates

    run = step.trace.run
    return peak_candidates(step.trace, skip=MODEL_STATE,
                           until=run.phase_ends.get(phase, len(run.events)))


def zero_rank(report, model: torch.nn.Module, zero: ZeRO) -> RankMemory:
    """Per-rank memory of a training step under DeepSpeed ZeRO (see the module docstring)."""
    step = report.train
    if step is None:
        raise StrategyError("ZeRO needs the training step", hint="do not pass --inference")
    n, B = zero.dp, zero.reduce_bucket_size
    fp32 = report.precision in ("32-true", "bf16-mixed", "16-mixed")
    # DeepSpeed without bf16/fp16 trains fp32 weights, which are their own masters (K = 8)
    b = zero.low_bytes or (4 if fp32 else 2)
    k = zero.optimizer_bytes or (8 if fp32 else 12)
    params = list(dict.fromkeys(model.parameters()))
    train = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    psi = _numel(train)
    frozen_bytes = sum(p.numel() * b for p in frozen)
    shard = sympy.Rational(psi, n)
    act = _activation_peak_until(step, Phase.BACKWARD)
    largest = max((sum(p.numel() for p in m.parameters(recurse=False))
                   for m in model.modules()), default=0)
    off = zero.offload_optimizer == "cpu"
    host = sympy.Integer(0)
    notes = ["modelled from DeepSpeed 0.19.6's code; not checked against a DeepSpeed run"]
    bufs: dict[str, sympy.Expr] = {}
    opt = k * shard
    if off:
        host += opt + 4 * shard  # fp32 master + moments, fp32 gradient partition
        opt = sympy.Integer(0)
    if zero.stage in (1, 2):
        par = sympy.Integer(b * psi + frozen_bytes)
        grads = b * shard if zero.stage == 2 else sympy.Integer(0)
        if zero.stage == 1:
            bufs["reduce_bucket"] = sympy.Integer(B * b)
            bwd_extra = b * psi + B * b       # every 16-bit gradient lives to the boundary
        else:
            bufs["reduce_bucket"] = sympy.Integer((1 + zero.overlap) * B * b)
            bwd_extra = (1 + zero.overlap) * B * b + B * b  # buckets + the flattened copy
        step_extra = sympy.Integer(0) if off else 3 * b * shard
    else:
        small = sum(p.numel() for p in params
                    if p.numel() <= zero.stage3_param_persistence_threshold)
        par = b * sympy.Rational(psi + sum(p.numel() for p in frozen), n) + b * small
        grads = b * shard
        bufs["reduce_bucket"] = sympy.Integer(B * b)
        gathered = 2 * largest * b
        bufs["gathered_parameters"] = sympy.Integer(gathered)
        bwd_extra = gathered
        if zero.offload_param == "cpu":
            host += par
            par = sympy.Integer(0)
        step_extra = sympy.Integer(0) if off else 6 * sympy.Min(shard, zero.sub_group_size)
        notes.append("stage 3: the gathered working set is two modules' parameters (the one "
                     "running and one prefetched); DeepSpeed may keep more gathered "
                     "(max_reuse_distance)")
    persistent = par + opt + grads + (bufs["reduce_bucket"] if zero.stage == 3 else 0)
    cands = [Candidate(sympy.expand(persistent + bwd_extra + c.expr), c.event, c.label)
             for c in act]
    cands.append(Candidate(sympy.expand(persistent + step_extra), len(step.trace.run.events),
                           PeakPoint("optimizer", "ZeRO step (modelled)", None)))
    return RankMemory(peak=as_max(cands), parameters=par, gradients=grads,
                      optimizer_states=opt, buffers=bufs, host=host, notes=notes,
                      candidates=cands)


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
