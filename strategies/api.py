"""One call for a model under a parallel setup: what each rank holds.

>>> import torch
>>> from memsim.strategies import analyze, LoRA
>>> # analyze(model, inputs, fsdp=FSDP(dp=8), lora=LoRA(r=16), checkpoint="blocks")

Model-level strategies are applied to a copy of the model and traced (LoRA, activation
checkpointing, then tensor parallelism and FSDP2 inside the symbolic run, with PyTorch's own
code); plan-level ones (DeepSpeed ZeRO, DDP buckets) are modelled on top of the traced step
(:mod:`strategies.zero`). The report's figures are one rank's: the rank with the largest peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memsim import analysis
from memsim.tracer import StrategyError

from .lora import LoRA, QLoRA, apply_lora, apply_qlora
from .parallel import FSDP, TensorParallel, rank_classes, transform
from .zero import DDP, ZeRO, ddp_rank, host_peak, rank_step

__all__ = ["analyze", "describe", "RankClass"]


@dataclass
class RankClass:
    """Ranks whose shards have the same sizes, hence the same memory; ``report`` is traced as
    the first of them."""

    ranks: tuple[int, ...]
    report: analysis.Report = field(repr=False)


def describe(*, lora=None, fsdp=None, tp=None, zero=None, ddp=None, checkpoint=None) -> dict:
    """The strategy as plain data (for the JSON document)."""
    from dataclasses import asdict
    out = {}
    for name, cfg in (("lora", lora), ("fsdp", fsdp), ("tp", tp), ("zero", zero), ("ddp", ddp)):
        if cfg is not None:
            out[name] = {k: (list(v) if isinstance(v, tuple) else v)
                         for k, v in asdict(cfg).items()}
    if checkpoint:
        out["checkpoint"] = checkpoint if isinstance(checkpoint, str) else list(checkpoint)
    out["world_size"] = world_size(fsdp=fsdp, tp=tp, zero=zero, ddp=ddp)
    return out


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def world_size(*, fsdp=None, tp=None, zero=None, ddp=None) -> int:
    dp = [c.dp for c in (fsdp, zero, ddp) if c is not None]
    return (dp[0] if dp else 1) * (tp.tp if tp is not None else 1)


def _check(lora, fsdp, tp, zero, ddp):
    given = [n for n, c in (("fsdp", fsdp), ("zero", zero), ("ddp", ddp)) if c is not None]
    if len(given) > 1:
        raise StrategyError(f"{' and '.join(given)} both shard or replicate over the data-"
                            "parallel ranks; give one", hint="FSDP2 and ZeRO-3 are the same "
                            "idea; DDP buckets do not exist under ZeRO or FSDP")
    if zero is not None and tp is not None:
        if zero.offloaded:
            raise StrategyError("ZeRO-Offload with tensor parallelism is not modelled",
                                hint="drop offload, or use FSDP (fsdp=FSDP(dp)) with tp")
        if tp.plan != "auto" or tp.sequence_parallel:
            raise StrategyError(
                "ZeRO with tp: DeepSpeed shards the model with its own AutoTP "
                "(tensor_parallel.autotp_size), which takes no plan= and has no sequence "
                "parallelism", hint="drop plan= / sequence_parallel, or use FSDP with tp")
    for name, cfg, typ in (("lora", lora, LoRA), ("fsdp", fsdp, FSDP),
                           ("tp", tp, TensorParallel), ("zero", zero, ZeRO), ("ddp", ddp, DDP)):
        if cfg is not None and not isinstance(cfg, typ):
            raise StrategyError(f"{name}= takes a {typ.__name__}, got {type(cfg).__name__}")


def _fused_adamw(params):
    return torch.optim.AdamW(params, fused=True)


def _zero_ranks(world: int) -> list[int]:
    """The ranks whose ZeRO step is traced: all of them up to ``MEMSIM_ZERO_RANKS`` (4), else
    the first two and the last two (the padding of the flat groups falls on the last ranks)."""
    import os
    limit = int(os.environ.get("MEMSIM_ZERO_RANKS", "4"))
    return list(range(world)) if world <= limit else sorted({0, 1, world - 2, world - 1})


def _deepspeed_ranks(traced, world: int):
    """``(report, classes, traced ranks, shown rank)``: each traced rank's report, grouped by
    equal peak formulas; the report shown is the rank with the largest peak at the example
    sizes."""
    ranks = _zero_ranks(world)
    reports = {r: traced(r) for r in ranks}
    groups: dict[str, list[int]] = {}
    for r, rep in reports.items():
        groups.setdefault(str(rep.train.peak), []).append(r)
    classes = [tuple(g) for g in groups.values()]

    def at_hints(rep) -> int:
        t = rep.train
        return int(t.peak.xreplace({t.trace.symbols[k]: v for k, v in t.trace.hints.items()}))

    best = max(ranks, key=lambda r: (at_hints(reports[r]), -r))
    report = reports[best]
    if len(classes) > 1:
        report.ranks = [RankClass(c, reports[c[0]]) for c in classes]
    return report, classes, ranks, best


def analyze(model: torch.nn.Module, inputs: dict, *, lora: LoRA | None = None,
            fsdp: FSDP | None = None, tp: TensorParallel | None = None,
            zero: ZeRO | None = None, ddp: DDP | None = None, checkpoint=None,
            **kw) -> analysis.Report:
    """:func:`analysis.analyze` under a strategy; ``kw`` as there.

    ``lora``: a :class:`LoRA` or :class:`QLoRA` (4-bit NF4 base). ``checkpoint``: a named
    plan (``"blocks"``, ``"selective"``, ``"every:K"``) or module paths.
    """
    from .checkpoint import apply_checkpointing, named_plan

    _check(lora, fsdp, tp, zero, ddp)
    if lora is not None:
        model = apply_qlora(model, lora) if isinstance(lora, QLoRA) else apply_lora(model, lora)
    plan = None
    if checkpoint:
        plan = named_plan(model, checkpoint) if isinstance(checkpoint, str) else list(checkpoint)
    driver = None
    if zero is not None:
        from .ds_engine import DeepSpeedDriver, deepspeed_config
        t = tp.tp if tp is not None else 1
        ds_config, world = deepspeed_config(zero, kw.get("precision"), t), zero.dp * t
        gpu = kw.get("device", "cuda") == "cuda"
        driver = DeepSpeedDriver(ds_config, world, gpu=gpu)
        fused = kw.get("optimizer") is None and gpu
        if fused:  # DeepSpeed's FusedAdam (its AdamW on a GPU) updates in place, as this does
            kw["optimizer"] = _fused_adamw
    # with ZeRO, DeepSpeed's AutoTP shards the model inside the engine
    torch_tp = None if driver is not None else tp
    classes = rank_classes(model, fsdp, torch_tp) if (fsdp or torch_tp) else [(0,)]

    def traced(rank: int) -> analysis.Report:
        sharding = transform(fsdp, torch_tp, rank)

        def apply(m):
            if plan:
                apply_checkpointing(m, plan)
            if sharding is not None:
                sharding(m)

        return analysis.analyze(model, inputs, transform=apply if (plan or sharding) else None,
                                driver=driver if driver is None or rank == 0 else
                                DeepSpeedDriver(ds_config, world, rank, gpu), **kw)

    if driver is None:
        report = traced(0)
        if len(classes) > 1:
            report.ranks = [RankClass(classes[0], report)] + [RankClass(c, traced(c[0]))
                                                              for c in classes[1:]]
    else:
        report, classes, traced_ranks, shown_rank = _deepspeed_ranks(traced, world)
    strategy = describe(lora=lora, fsdp=fsdp, tp=tp, zero=zero, ddp=ddp, checkpoint=checkpoint)

    def finish(report: analysis.Report) -> analysis.Report:
        report.strategy = dict(strategy)
        if (fsdp is not None or torch_tp is not None) and len(classes) == 1:
            report.notes.append("per-rank figures, traced with PyTorch's own FSDP2 / "
                                "tensor-parallel code on a fake process group; every rank "
                                "holds shards of the same sizes: ranks are equal")
        elif fsdp is not None or torch_tp is not None:
            report.notes.append(
                f"ranks differ: uneven shards put {len(classes)} groups of ranks "
                f"({', '.join(_ranks_text(c) for c in classes)}) at different sizes; each "
                "group is traced as its first rank, with PyTorch's own FSDP2 / tensor-parallel "
                "code on a fake process group; the figures shown are rank 0's, which holds the "
                "largest shard of every parameter (torch.chunk sizes); \"ranks\" lists them "
                "all")
        if fsdp is not None and fsdp.reduce_dtype and fsdp.reduce_dtype != fsdp.param_dtype:
            report.notes.append("FSDP reduce_dtype != param_dtype: a real 2-rank gloo run held "
                                "one more layer-sized gradient buffer at the reduce-scatter "
                                "than predicted (6.5% more at the one point checked); PyTorch's "
                                "own fake-process-group simulation gives memsim's figure; NCCL "
                                "on a GPU not measured")
        if driver is not None:
            autotp = (f" with its AutoTP over {tp.tp} tensor-parallel ranks"
                      if tp is not None else "")
            shown = f"rank {shown_rank}"
            which = ("every rank traced" if len(traced_ranks) == world else
                     f"ranks {', '.join(map(str, traced_ranks))} of {world} traced (the others' "
                     f"peaks are not known; MEMSIM_ZERO_RANKS={world} traces all)")
            report.notes.append(
                f"per-rank figures, traced with DeepSpeed's own ZeRO-{zero.stage} engine"
                f"{autotp} (deepspeed.initialize on a fake process group of {world}), {which}; "
                + (f"ranks differ (where ZeRO's partition boundaries fall): the figures shown "
                   f"are {shown}'s, the largest peak at the example sizes; \"ranks\" lists "
                   "them all" if len(classes) > 1 else "the traced ranks are equal") + "; the "
                + ("optimizer is DeepSpeed's FusedAdam, traced as torch's fused AdamW (both "
                   "update in place, no step temporaries; not measured on a GPU)" if fused else
                   "client optimizer is the one given (torch's AdamW by default)")
                + "; the inference figures are the plain forward"
                + ("; fp16 is traced but not checked against a real run (DeepSpeed's CPU "
                   "accelerator refuses fp16)" if "fp16" in ds_config else ""))
            if zero.offloaded and report.train is not None:
                what = ("ZeRO-Offload: what DeepSpeed places on the CPU (fp32 master "
                        "partitions, optimizer states, gradient partitions"
                        + (", parameter partitions" if zero.offload_param else "") + ") is host "
                        "memory")
                if report.device == "cuda":
                    report.strategy["host_bytes"] = str(host_peak(report.train.trace))
                    report.notes.append(
                        f"{what}, not in the figures: its peak is strategy.host_bytes; the "
                        "split is DeepSpeed's own placement, not measured on a GPU")
                else:
                    report.notes.append(f"{what}; on --device cpu it is the same memory, so "
                                        "the figures are the sum")
        if ddp is not None and report.train is not None:
            rank = ddp_rank(report, model, ddp)
            report.train = rank_step(report.train, rank)
            report.notes.extend(rank.notes)
            report.strategy["buffers"] = {k: str(v) for k, v in rank.buffers.items()}
        retrace = report._retrace
        if retrace is not None:
            report._retrace = lambda fixed: finish(retrace(fixed))
        return report

    return finish(report)
