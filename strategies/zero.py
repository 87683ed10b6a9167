"""DeepSpeed ZeRO, traced with DeepSpeed's own engine, per rank.

:mod:`memsim.strategies.ds_engine` runs DeepSpeed's own engine (``deepspeed.initialize`` and its
``backward``/``step``) inside the symbolic step, on a fake process group, once per rank it
traces (a :class:`~memsim.tracer.Driver`); every rank's peak equals a real DeepSpeed step on CPU
(``tests/test_zero.py``), ZeRO-Offload included (there as the sum of device and host: on the
CPU they are one memory). Modelling a GPU, what DeepSpeed places on the CPU is host memory
(:func:`host_peak`). With tensor parallelism, DeepSpeed's AutoTP shards the model inside the
same engine.

>>> ZeRO(stage=3, dp=64).overlap
True
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import ClassVar

import sympy
import torch

from memsim.analysis.peak import as_max
from memsim.tracer import Precision, StrategyError, UsageError

from .base import Ranks, Strategy, data_parallel, exclusive, register_strategy

__all__ = ["ZeRO", "load_deepspeed_config", "host_peak", "fused_adamw"]


@register_strategy
@dataclass(frozen=True)
class ZeRO(Strategy):
    """DeepSpeed ZeRO settings (the names of ``zero_optimization`` in ``ds_config.json``, with
    DeepSpeed's defaults), and ``traced_ranks``: stages 1 and 2 trace every rank up to that
    many ranks, else ranks 0, 1, N-2 and N-1 (the padding of the flat groups falls on the last
    ranks); stage 3 traces one rank per group (:meth:`partition_classes`) and ignores it."""

    key: ClassVar[str] = "zero"
    order: ClassVar[int] = 50
    axis: ClassVar[str] = "dp"
    flags: ClassVar[tuple[str, ...]] = ("--zero", "--deepspeed")
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
    traced_ranks: int = 4

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

        if not isinstance(self.traced_ranks, int) or self.traced_ranks < 1:
            raise StrategyError(f"ZeRO traced_ranks={self.traced_ranks!r} must be an int >= 1")

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--zero", type=int, choices=(1, 2, 3),
                           help="DeepSpeed ZeRO stage (DeepSpeed's engine traced; needs the "
                                "deepspeed package)")
        group.add_argument("--deepspeed", metavar="FILE",
                           help="a DeepSpeed ds_config.json (stage, buckets, precision, offload)")
        group.add_argument("--offload", choices=("optimizer", "optimizer+params"),
                           help="ZeRO-Offload to CPU memory")

    @classmethod
    def from_options(cls, opts, step):
        if not (opts.zero or opts.deepspeed):
            if opts.offload:
                raise UsageError("--offload is a ZeRO option", hint="add --zero 2 or --zero 3")
            return None
        dp = data_parallel("--zero" if opts.zero else "--deepspeed", opts)
        z = None
        if opts.deepspeed:
            z, prec = load_deepspeed_config(opts.deepspeed, dp)
            if prec is not None:
                given = Precision.parse(step.get("precision", Precision.TRUE32))
                if given is not Precision.TRUE32 and given is not prec:
                    raise UsageError(f"--precision {step['precision']} contradicts "
                                     f"{opts.deepspeed} ({prec})")
                step["precision"] = prec
        if opts.zero:
            z = replace(z, stage=opts.zero) if z is not None else cls(opts.zero, dp)
        if z is not None and os.environ.get("MEMSIM_ZERO_RANKS"):
            # ranks traced per ZeRO analysis (beyond it: 0, 1, N-2, N-1)
            try:
                n = int(os.environ["MEMSIM_ZERO_RANKS"])
            except ValueError:
                raise UsageError(f"MEMSIM_ZERO_RANKS={os.environ['MEMSIM_ZERO_RANKS']!r} is not "
                                 "an int", hint="the number of ranks ZeRO traces, e.g. 8") from None
            z = replace(z, traced_ranks=n)
        if opts.offload:
            if z is None:
                raise UsageError("--offload is a ZeRO option", hint="add --zero 2 or --zero 3")
            z = replace(z, offload_optimizer="cpu",
                        offload_param="cpu" if "params" in opts.offload else None)
        return z

    @classmethod
    def summary(cls, d) -> str:
        off = "cpu" in (d.get("offload_optimizer"), d.get("offload_param"))
        return (f"DeepSpeed ZeRO-{d['stage']} dp={d['dp']}" + (" + CPU offload" if off else "")
                + " (DeepSpeed's engine, traced)")

    @property
    def offloaded(self) -> bool:
        return "cpu" in (self.offload_optimizer, self.offload_param)

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else bool(self.overlap_comm)


    def ranks_traced(self, world: int) -> tuple[int, ...]:
        """All ranks up to ``traced_ranks``, else the first two and the last two."""
        if world <= self.traced_ranks:
            return tuple(range(world))
        return tuple(sorted({0, 1, world - 2, world - 1}))

    def partition_classes(self, model: torch.nn.Module, world: int
                          ) -> tuple[tuple[int, ...], ...] | None:
        """Stage 3: the ranks grouped by the data their partitions hold, or None (stages 1
        and 2, whose flat groups split parameters where the rank's boundaries fall).

        Stage 3 partitions each parameter on its own: every rank holds ``ceil(numel / world)``
        elements of it, padded, and copies, reduces and steps the same buffers; the one thing
        that depends on the rank is how much of its partition is real data (a rank past the
        end of a small parameter skips its gradient, ``partition_grads``). Ranks whose
        partitions hold the same amount of every parameter run the same allocations, so one
        of each group is traced (``tests/test_zero.py`` checks the grouping against every
        rank of real runs)."""
        if self.stage != 3:
            return None
        lengths = []
        for p in dict.fromkeys(model.parameters()):
            n = p.numel()
            lengths.append((n, -(-n // world)))
        groups: dict[tuple, list[int]] = {}
        for r in range(world):
            key = tuple(min(size, max(0, n - r * size)) for n, size in lengths)
            groups.setdefault(key, []).append(r)
        return tuple(tuple(g) for g in groups.values())

    def describe(self):
        out = super().describe()
        out.pop("traced_ranks")
        return out

    def validate(self, given, config) -> None:
        exclusive(given, self.key, ("fsdp", "zero", "ddp"),
                  "FSDP2 and ZeRO-3 are the same idea; DDP buckets do not exist under ZeRO")
        tp = given.get("tp")
        if tp is not None:
            if self.offloaded:
                raise StrategyError("ZeRO-Offload with tensor parallelism is not modelled",
                                    hint="drop offload, or use FSDP (fsdp=FSDP(dp)) with tp")
            if given.get("lora") is not None:
                raise StrategyError(
                    "ZeRO with tp and LoRA: DeepSpeed's AutoTP replaces every module with a 2-D "
                    "weight whole, so a LoRA-wrapped layer (peft's lora.Linear shows its base "
                    "weight) loses its adapters and deepspeed.initialize fails (DeepSpeed "
                    "0.19.8: KeyError in _create_param_mapping)",
                    hint="drop tp (ZeRO with LoRA), or drop zero (tp with LoRA)")
            if tp.plan != "auto" or tp.sequence_parallel:
                raise StrategyError(
                    "ZeRO with tp: DeepSpeed shards the model with its own AutoTP "
                    "(tensor_parallel.autotp_size), which takes no plan= and has no sequence "
                    "parallelism", hint="drop plan= / sequence_parallel, or use FSDP with tp")

    def apply(self, plan):
        from .ds_engine import DeepSpeedDriver, deepspeed_config

        tp = plan.given.get("tp")
        t = tp.tp if tp is not None else 1
        config, world = plan.config, self.dp * t
        ds_config = deepspeed_config(self, config.precision, t)
        gpu = config.device == "cuda"
        fused = config.optimizer is None and gpu
        if fused:  # DeepSpeed's FusedAdam (its AdamW on a GPU) updates in place, as this does
            config = config.replace(optimizer=fused_adamw)
        classes = self.partition_classes(plan.model, world) if tp is None else None
        traced = (tuple(c[0] for c in classes) if classes is not None else
                  self.ranks_traced(world))

        def note(info):
            autotp = f" with its AutoTP over {t} tensor-parallel ranks" if tp is not None else ""
            if len(traced) == world:
                which = "every rank traced"
            elif classes is not None:
                which = (f"{len(traced)} of {world} ranks traced, one for each group whose "
                         "partitions hold the same amount of every parameter (a stage-3 rank "
                         "runs the same allocations as the others of its group)")
            else:
                which = (f"ranks {', '.join(map(str, traced))} of {world} traced (the others' "
                         f"peaks are not known; ZeRO(traced_ranks={world}) traces all)")
            if len(info.classes) > 1:
                equal = (f"ranks differ (where ZeRO's partition boundaries fall): the figures "
                         f"shown are rank {info.shown}'s, the largest peak at the example sizes; "
                         "\"ranks\" lists them all")
            else:
                equal = ("ranks are equal" if classes is not None or len(traced) == world
                         else "the traced ranks are equal")
            yield (f"per-rank figures, traced with DeepSpeed's own ZeRO-{self.stage} engine"
                   f"{autotp} (deepspeed.initialize on a fake process group of {world}), "
                   f"{which}; {equal}; the "
                   + ("optimizer is DeepSpeed's FusedAdam, traced as torch's fused AdamW (both "
                      "update in place, no step temporaries; not measured on a GPU)" if fused
                      else "client optimizer is the one given (torch's AdamW by default)")
                   + "; the inference figures are the plain forward"
                   + ("; fp16 is traced but not checked against a real run (DeepSpeed's CPU "
                      "accelerator refuses fp16)" if "fp16" in ds_config else ""))
            if self.offloaded:
                what = ("ZeRO-Offload: what DeepSpeed places on the CPU (fp32 master "
                        "partitions, optimizer states, gradient partitions"
                        + (", parameter partitions" if self.offload_param else "")
                        + ") is host memory")
                yield (f"{what}, not in the figures: its peak is strategy.host_bytes; the "
                       "split is DeepSpeed's own placement, not measured on a GPU" if gpu else
                       f"{what}; on --device cpu it is the same memory, so the figures are "
                       "the sum")

        host = None
        if self.offloaded and gpu:
            def host(report):
                return host_peak(report.train.trace) if report.train is not None else None

        return plan.but(config=config, notes=(note,), host=host,
                        driver=lambda rank: DeepSpeedDriver(ds_config, world, rank, gpu),
                        ranks=Ranks(world=world, sampled=traced,
                                    classes=classes or Ranks.classes))


def fused_adamw(params):
    """torch's fused AdamW: DeepSpeed's FusedAdam stands in as it on CUDA (both update in
    place)."""
    return torch.optim.AdamW(params, fused=True)


def load_deepspeed_config(path: str, dp: int) -> tuple[ZeRO | None, Precision | None]:
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
        precision = Precision.BF16_MASTER
    elif (cfg.get("fp16") or {}).get("enabled") is True:
        precision = Precision.FP16_TRUE  # fp16 weights and activations; ZeRO holds the fp32 masters
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


def host_peak(trace) -> sympy.Expr:
    """The peak of host memory over a traced step (storages the run placed on the host)."""
    from dataclasses import replace

    from memsim.analysis.memory import peak_candidates
    return as_max(peak_candidates(replace(trace, device="host")))


