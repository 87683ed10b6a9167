"""Pipeline parallelism with PyTorch's own ``torch.distributed.pipelining``, per pipeline rank.

Each pipeline rank holds its own stages of the model and runs its part of the schedule: the
activations of as many micro-batches as the schedule keeps in flight on that rank, the receive
buffers of its stage inputs and output gradients, and the sends still held by their ``Work``.
memsim does not model any of it with a formula: each rank's program is traced with PyTorch's
own ``PipelineStage`` and schedule classes on a fake process group of ``pp`` ranks, as the real
rank runs them (:class:`PipelineDriver`), so ranks differ where their schedules differ.

The program traced per rank (and measured against real gloo runs in
``tests/test_pipeline.py``)::

    stages = [PipelineStage(stage_module, s, n_stages, device, input_args=..., output_args=...)]
    schedule = Schedule1F1B(stages[0], n_microbatches=M, loss_fn=lambda out, target: loss(out))
    opt.zero_grad(set_to_none=True)
    schedule.step(x if first else nothing, target=placeholder, losses=[] if last,
                  return_outputs=False)
    opt.step()

A Hugging Face decoder LM with a pipeline plan is split by its layers (:class:`_Decoder`: the
embeddings on the first stage, the final norm, head and its own loss of the ``labels`` on the
last), an ``nn.Sequential`` by its children (:class:`_Sequential`: the loss is the step's loss
function of the last stage's output, per micro-batch, its target a zero-byte placeholder).
There are ``pp`` stages (``pp`` x 2 for the interleaved and V schedules: stage ``s`` on rank
``s % pp``, or ``r`` and ``2 pp - 1 - r`` for the V schedules), the pieces split as evenly as
they allow, earlier stages taking one more where they do not divide (``split`` names each
stage's first piece instead). The batch dimension of the inputs is split into ``microbatches``
chunks, so its symbol is traced at multiples of ``microbatches`` (its formulas hold there).
Every rank holds the step's inputs, as a data loader on every rank does. The warm-up vote of
the schedules (whose first step compares shapes across ranks) is answered as every rank of a
real run answers it: static shapes, given here from the stages' boundary shapes.

>>> PipelineParallel(pp=4, schedule="1F1B").stage_ids(3)
([3], 4)
>>> PipelineParallel(pp=2, schedule="ZBVZeroBubble", microbatches=4).stage_ids(0)
([0, 3], 4)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from memsim.tracer import Category, Driver, StrategyError, UsageError

from .base import Ranks, Strategy, register_strategy

__all__ = ["PipelineParallel", "PipelineDriver", "SCHEDULES"]

# torch.distributed.pipelining's schedules: one stage per rank, several looped over the ranks,
# two per rank in a V
SINGLE = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
LOOPED = {"Interleaved1F1B": "ScheduleInterleaved1F1B", "LoopedBFS": "ScheduleLoopedBFS",
          "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble"}
VSHAPE = {"ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
SCHEDULES = {**SINGLE, **LOOPED, **VSHAPE}


@register_strategy
@dataclass(frozen=True)
class PipelineParallel(Strategy):
    """``torch.distributed.pipelining`` over ``pp`` ranks with schedule ``schedule`` and
    ``microbatches`` micro-batches per step (default: ``pp``)."""

    key: ClassVar[str] = "pp"
    order: ClassVar[int] = 55
    axis: ClassVar[str] = "pp"
    flags: ClassVar[tuple[str, ...]] = ("--pp",)
    pp: int
    schedule: str = "1F1B"
    microbatches: int | None = None
    split: tuple[str, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.pp, int) or self.pp < 1:
            raise StrategyError(f"pipeline parallelism pp={self.pp!r} must be an int >= 1",
                                hint="--pp N: the number of pipeline ranks")
        if self.schedule not in SCHEDULES:
            raise StrategyError(f"unknown pipeline schedule {self.schedule!r}",
                                hint="--pp-schedule one of " + ", ".join(SCHEDULES))
        m = self.micro
        if not isinstance(m, int) or m < 1:
            raise StrategyError(f"microbatches={m!r} must be an int >= 1",
                                hint="--microbatches M: micro-batches per step")
        need = self.fewest_microbatches()
        if m < need:
            # torch's schedule refuses it at construction
            raise StrategyError(
                f"{self.schedule} over --pp {self.pp} needs at least {need} micro-batches "
                f"(one per stage); got --microbatches {m}",
                hint=f"--microbatches {need} or more, or --pp-schedule GPipe")
        rounds = max(1, m // self.pp)
        if self.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
            # torch's looped schedules run the micro-batches in rounds of equal size
            raise StrategyError(
                f"{self.schedule} runs --microbatches in rounds of equal size: {m} over --pp "
                f"{self.pp} does not split into {rounds} rounds",
                hint=f"--microbatches {self.pp * rounds} (a multiple of --pp)")
        if self.split is not None:
            object.__setattr__(self, "split", tuple(self.split))

    def fewest_microbatches(self) -> int:
        """The fewest micro-batches torch's schedule accepts: one per stage for 1F1B and
        DualPipeV, one otherwise."""
        return {"1F1B": self.pp, "DualPipeV": 2 * self.pp}.get(self.schedule, 1)

    @property
    def micro(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp

    @property
    def stages(self) -> int:
        """Stages in all: one per rank, two per rank for the looped and V schedules."""
        return self.pp * (1 if self.schedule in SINGLE else 2)

    def stage_ids(self, rank: int) -> tuple[list[int], int]:
        """The stages rank ``rank`` holds, and the number of stages."""
        if self.schedule in SINGLE:
            return [rank], self.pp
        if self.schedule in LOOPED:
            return [rank, rank + self.pp], 2 * self.pp
        return [rank, 2 * self.pp - 1 - rank], 2 * self.pp

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--pp", type=int, metavar="N",
                           help="pipeline parallelism over N ranks (torch.distributed.pipelining; "
                                "a Hugging Face decoder LM or an nn.Sequential)")
        group.add_argument("--pp-schedule", metavar="NAME",
                           help="pipeline schedule: " + ", ".join(SCHEDULES) + " (default 1F1B)")
        group.add_argument("--microbatches", type=int, metavar="M",
                           help="micro-batches per pipeline step (default: --pp)")
        group.add_argument("--pp-split", metavar="NAME,NAME",
                           help="the first layer (model.layers.16) or child of each pipeline "
                                "stage after the first (default: an even split)")

    @classmethod
    def from_options(cls, opts, step):
        if opts.pp is None:
            for flag, v in (("--pp-schedule", opts.pp_schedule), ("--microbatches",
                            opts.microbatches), ("--pp-split", opts.pp_split)):
                if v is not None:
                    raise UsageError(f"{flag} is a pipeline-parallel option", hint="add --pp N")
            return None
        return cls(pp=opts.pp, schedule=opts.pp_schedule or "1F1B",
                   microbatches=opts.microbatches,
                   split=tuple(opts.pp_split.split(",")) if opts.pp_split else None)

    @classmethod
    def summary(cls, d) -> str:
        return f"pipeline pp={d['pp']} ({d['schedule']}, {d['microbatches']} micro-batches)"

    def describe(self):
        out = super().describe()
        out["microbatches"] = self.micro
        return out

    def for_inputs(self, config, inputs):
        """The batch symbol traced at multiples of the micro-batch count (each micro-batch the
        same size, as ``tensor_split`` makes them where the count divides the batch)."""
        name, dim = _batch_dim(inputs)
        m = self.micro
        if isinstance(dim, int):
            if dim % m:
                raise StrategyError(
                    f"the batch of input {name!r} ({dim}) does not split into "
                    f"--microbatches {m}",
                    hint=f"a batch that {m} divides, or --microbatches dividing {dim}")
            return config
        step = math.lcm(config.multiples.get(dim, 1), m)
        if step == config.multiples.get(dim, 1):
            return config
        return config.replace(multiples={**config.multiples, dim: step})

    def validate(self, given, config) -> None:
        if config.precision.scaler or config.precision.master:
            raise StrategyError(
                f"precision {config.precision.value!r} is not modelled with pipeline "
                "parallelism yet (a gradient scaler or fp32 master weights across stages)",
                hint="--precision 32-true, bf16-mixed or bf16-true")
        others = [k for k in given if k not in (self.key, "checkpoint", "fsdp", "tp")]
        if others:
            raise StrategyError(
                f"pipeline parallelism does not combine with {', '.join(others)} yet",
                hint="--pp alone or with --fsdp --dp N and --tp N (with activation "
                     "checkpointing or not)")
        tp = given.get("tp")
        if tp is not None and tp.sequence_parallel:
            raise StrategyError(
                "sequence parallelism (--sp) is not modelled with pipeline parallelism yet "
                "(the stages' boundaries would carry a split sequence)",
                hint="--pp with --tp N, without --sp")
        fsdp = given.get("fsdp")
        if fsdp is not None and fsdp.units != "blocks":
            raise StrategyError(
                "with pipeline parallelism, FSDP2 shards each stage's pieces (its blocks or "
                "children) and the stage itself; FSDP units named by path are not taken",
                hint="leave FSDP's units at their default")

    def apply(self, plan):
        split = self.splitter(plan.model)
        pp = self
        fsdp, tp = plan.given.get("fsdp"), plan.given.get("tp")
        dp = fsdp.dp if fsdp is not None else 1
        tp_n = tp.tp if tp is not None else 1
        inner = dp * tp_n
        if inner == 1:
            classes = tuple((r,) for r in range(self.pp))
        else:
            from .mesh import rank_classes
            # the data- and tensor-parallel ranks of each pipeline rank grouped by the sizes of
            # their shards (every parameter's: a stage holds some of them), each group traced
            classes = tuple(tuple(r * inner + d for d in c) for r in range(self.pp)
                            for c in rank_classes(plan.model, fsdp, tp))
        world = self.pp * inner

        def note(info):
            sizes = ", ".join(str(len(g)) for g in split.groups)
            dims = [("pipeline", pp.pp), ("data-parallel", dp), ("tensor-parallel", tp_n)]
            dims = [(n, d) for i, (n, d) in enumerate(dims) if i == 0 or d > 1]
            how = [w for w, on in (
                ("each rank's layers sharded with parallelize_module over its tensor-parallel "
                 "ranks", tp is not None),
                ("each stage's pieces and the stage sharded with FSDP2's fully_shard over its "
                 "data-parallel ranks", fsdp is not None)) if on]
            over = (f"a fake process group of {pp.pp}" if inner == 1 else
                    f"a fake process group of {world} ranks, a "
                    f"({', '.join(str(d) for _, d in dims)}) mesh of "
                    f"{' by '.join(n for n, _ in dims)} ranks (the pipeline dimension "
                    "outermost, as torchtitan orders it), " + " and ".join(how))
            yield (f"per-rank figures, traced with PyTorch's own torch.distributed.pipelining "
                   f"({pp.schedule}, {pp.micro} micro-batches, {pp.stages} stages of "
                   f"{sizes} {split.what}) on {over}; every "
                   f"rank traced; the figures shown are rank {info.shown}'s, the largest peak "
                   "at the example sizes; \"ranks\" lists them all; the inference figures are "
                   "the plain forward of the whole model")
            yield ("the schedule interleaves the micro-batches' forward and backward: what "
                   "each keeps for its backward counts as activations while alive, in the "
                   "activation peak; \"saved for backward\", the bytes kept at the one moment "
                   "backward starts, has no such moment here and reads 0")

        notes: tuple = (note,)
        if fsdp is not None:
            notes += fsdp.notes_for(plan.model, tp, cuda=plan.config.device.value == "cuda")
        if tp is not None:
            def parallelized(model, rank):
                from memsim.tracer.recorder import real_meshes

                from .mesh import pipeline_meshes
                with real_meshes():
                    tp.parallelize(model, pipeline_meshes(pp.pp, dp, tp_n, rank)[2])
            # the layers a rank holds, after the driver dropped the others
            parallelized.paths = None
            plan = plan.but(inside={"sharding": parallelized})
        return plan.but(driver=lambda rank: PipelineDriver(self, rank, split, fsdp, tp_n),
                        ranks=Ranks(world=world, sampled=tuple(c[0] for c in classes),
                                    classes=classes),
                        notes=notes)

    def splitter(self, model: nn.Module) -> "_Sequential | _Decoder":
        """How ``model`` splits into stages: a Hugging Face decoder LM by its layers, an
        ``nn.Sequential`` by its children."""
        if _Decoder.fits(model):
            return _Decoder(model, self)
        if isinstance(model, nn.Sequential):
            return _Sequential(model, self)
        raise StrategyError(
            f"pipeline parallelism splits an nn.Sequential by its children or a Hugging Face "
            f"decoder LM with a pipeline plan by its layers; {type(model).__name__} is neither",
            hint="give the model as an nn.Sequential of its stages' pieces (embedding, blocks, "
                 "head)")

    def groups(self, model: nn.Module) -> list[list[int]]:
        """The pieces of ``model`` (children or layers, by position) of each stage."""
        return self.splitter(model).groups

    def bounds(self, names: list[str], what: str) -> list[list[int]]:
        """``names`` (the pieces, in order) split into the stages: as evenly as they allow,
        earlier stages one longer where they do not divide, or at :attr:`split`."""
        n, k = len(names), self.stages
        if n < k:
            raise StrategyError(
                f"{self.schedule} over --pp {self.pp} needs {k} stages and the model has "
                f"{n} {what} to split",
                hint=f"--pp {max(1, n // (k // self.pp))} or fewer, or a model of more {what}")
        if self.split is None:
            per, extra = divmod(n, k)
            bounds, at = [], 0
            for s in range(k):
                bounds.append(at)
                at += per + (1 if s < extra else 0)
        else:
            unknown = [c for c in self.split if c not in names]
            if unknown:
                raise StrategyError(f"--pp-split names {', '.join(unknown)}, not one of the "
                                    f"model's {what}", hint=f"{what}: " + ", ".join(names))
            bounds = [0] + [names.index(c) for c in self.split]
            if len(bounds) != k or bounds != sorted(set(bounds)) or bounds[1] == 0:
                raise StrategyError(
                    f"--pp-split needs {k - 1} of the model's {what} in order, the first of "
                    f"each stage after the first ({self.schedule} over --pp {self.pp}: {k} "
                    "stages)", hint=f"{what}: " + ", ".join(names))
        ends = bounds[1:] + [n]
        return [list(range(a, b)) for a, b in zip(bounds, ends)]


class _Sequential:
    """An ``nn.Sequential`` split by its children; the loss is the step's, of the output."""

    what = "children of the model"

    def __init__(self, model: nn.Sequential, pp: PipelineParallel):
        self.groups = pp.bounds(list(model._modules), "children")
        self.pp = pp

    def inputs(self, inputs: dict):
        return next(v for v in inputs.values() if isinstance(v, torch.Tensor)), None

    def prepare(self, model, ids) -> None:
        self.keep = {i for s in ids for i in self.groups[s]}
        self.children = list(model._modules.values())
        for i, name in enumerate(list(model._modules)):
            if i not in self.keep:
                model._modules[name] = nn.Identity()

    def build(self, model, ids, first_input, recorder):
        """This rank's stage modules and every stage's input and output (meta tensors)."""
        from memsim.tracer.run_context import fake_module

        held = list(model._modules.values())
        run = [held[i] if i in self.keep else c for i, c in enumerate(self.children)]
        elsewhere = nn.ModuleList([c for i, c in enumerate(self.children) if i not in self.keep])
        # the boundary shapes: every stage's output for one micro-batch, without autograd and
        # unrecorded (a real rank receives them from its neighbours)
        with recorder.paused(), torch.no_grad(), \
                fake_module(elsewhere, str(first_input.device)):
            mb = first_input.tensor_split(self.pp.micro)[0]
            h, outs = mb, []
            for g in self.groups:
                for i in g:
                    h = run[i](h)
                outs.append(torch.empty_like(h, device="meta"))
            ins = [torch.empty_like(mb, device="meta")] + outs[:-1]
            del h, mb
        self.children = None
        return [nn.Sequential(*[held[i] for i in self.groups[s]]) for s in ids], ins, outs

    def loss(self, stages, loss_fn):
        def loss_of(out, target):
            return loss_fn(out)
        return loss_of

    @staticmethod
    def pieces(stage: nn.Module) -> list[str]:
        """The paths of a stage's pieces (its children), FSDP2's units in it."""
        return [name for name, _ in stage.named_children()]


class _Decoder:
    """A Hugging Face decoder LM split by its layers, with the pipeline plan its config
    declares (``base_model_pp_plan``: embeddings, layers, norm; the head): the embeddings on
    the first stage, the final norm, the head and the loss on the last, as torchtitan splits.
    A stage runs the model's own forward on the layers it holds (``inputs_embeds`` after the
    first); the last stage's loss is the model's own ``loss_function`` of the logits and the
    ``labels`` input, per micro-batch."""

    def __init__(self, model, pp: PipelineParallel):
        self.pp = pp
        self.prefix = model.base_model_prefix
        base = getattr(model, self.prefix)
        self.names = [f"{self.prefix}.layers.{i}" for i in range(len(base.layers))]
        self.groups = pp.bounds(self.names, "layers")
        self.what = (f"layers of {type(model).__name__}, the embeddings on the first stage, "
                     "the final norm, head and loss on the last")

    @staticmethod
    def fits(model) -> bool:
        config = getattr(model, "config", None)
        plan = getattr(config, "base_model_pp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", None)
        base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
        return (isinstance(base, nn.Module) and {"embed_tokens", "layers", "norm"} <= set(plan)
                and "lm_head" in (getattr(model, "_pp_plan", None) or {})
                and isinstance(getattr(base, "layers", None), nn.ModuleList))

    def inputs(self, inputs: dict):
        extra = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)
                 and k not in ("input_ids", "labels")]
        if "input_ids" not in inputs or extra:
            raise StrategyError(
                "a pipeline over a Hugging Face decoder takes input_ids (and labels for the "
                "loss)" + (f"; not {', '.join(extra)}" if extra else ""),
                hint="--input input_ids=int64[B,S] --input labels=int64[B,S]")
        return inputs["input_ids"], inputs.get("labels")

    def _parts(self, lm, first: bool, last: bool, layers: list) -> nn.Module:
        """A shallow copy of ``lm`` holding ``layers`` and only the ends the stage holds."""
        import copy

        base = copy.copy(getattr(lm, self.prefix))
        base._modules = dict(base._modules)
        base.layers = nn.ModuleList(layers)
        if not first:
            base.embed_tokens = nn.Identity()
        if not last:
            base.norm = nn.Identity()
        out = copy.copy(lm)
        out._modules = dict(out._modules)
        setattr(out, self.prefix, base)
        if not last:
            out.lm_head = nn.Identity()
        return out

    def prepare(self, model, ids) -> None:
        keep = sorted(i for s in ids for i in self.groups[s])
        base = getattr(model, self.prefix)
        base.layers = nn.ModuleList([base.layers[i] for i in keep])
        self.kept = keep
        if 0 not in ids:
            base.embed_tokens = nn.Identity()
        if self.pp.stages - 1 not in ids:
            base.norm = nn.Identity()
            model.lm_head = nn.Identity()

    def build(self, model, ids, first_input, recorder):
        held = dict(zip(self.kept, getattr(model, self.prefix).layers))
        last = self.pp.stages - 1
        stages = [_DecoderStage(self._parts(model, s == 0, s == last,
                                            [held[i] for i in self.groups[s]]),
                                self.prefix, s == 0, s == last) for s in ids]
        # the boundary shapes: each of this rank's stages on one micro-batch, without
        # autograd and unrecorded; a later stage's input is the hidden states
        with recorder.paused(), torch.no_grad():
            mb = first_input.tensor_split(self.pp.micro)[0]
            dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
            hidden = torch.empty(*mb.shape, model.config.hidden_size, dtype=dtype,
                                 device="meta")
            ins, outs = {}, {}
            for s, st in zip(ids, stages):
                x = mb if s == 0 else torch.empty_like(hidden, device=mb.device)
                ins[s] = torch.empty_like(x, device="meta")
                outs[s] = torch.empty_like(st(x), device="meta")
            del mb, x
        full_in = [ins.get(s, hidden) for s in range(self.pp.stages)]
        full_out = [outs.get(s, hidden) for s in range(self.pp.stages)]
        return stages, full_in, full_out

    def loss(self, stages, loss_fn):
        last = next((st for st in stages if st.last), None)

        def loss_of(out, target):
            if target is None:
                return loss_fn(out)
            lm = last.lm
            return lm.loss_function(logits=out, labels=target, vocab_size=lm.config.vocab_size)
        return loss_of

    def pieces(self, stage: "_DecoderStage") -> list[str]:
        """The paths of a stage's layers, FSDP2's units in it."""
        n = len(getattr(stage.lm, self.prefix).layers)
        return [f"lm.{self.prefix}.layers.{j}" for j in range(n)]


class _DecoderStage(nn.Module):
    """One stage of a decoder LM: its forward on the layers it holds; the logits on the last
    stage, the hidden states before it."""

    def __init__(self, lm, prefix: str, first: bool, last: bool):
        super().__init__()
        self.lm, self.prefix, self.first, self.last = lm, prefix, first, last

    def forward(self, x):
        kw = dict(input_ids=x) if self.first else dict(inputs_embeds=x)
        if self.last:
            return self.lm(**kw, use_cache=False).logits
        return getattr(self.lm, self.prefix)(**kw, use_cache=False).last_hidden_state


def _batch_dim(inputs) -> tuple[str, int | str]:
    """The first tensor input's name and its batch dimension (a symbol's name or a size)."""
    from memsim.tracer import is_tensor_spec, make_spec
    for name, value in inputs.items():
        if is_tensor_spec(value):
            shape = make_spec(name, value).shape
            if shape:
                return name, shape[0]
    raise StrategyError("pipeline parallelism splits the first tensor input's first dimension "
                        "into micro-batches; no input has one",
                        hint="give the batch as the first dimension of an input")


class PipelineDriver(Driver):
    """One pipeline rank: its stages, the schedule, the optimizer over its stages' parameters
    (see the module docstring)."""

    warmup = 1
    owns_backward = True
    precision_ok = True

    def __init__(self, pp: PipelineParallel, rank: int, split, fsdp=None, tp: int = 1):
        import copy
        self.pp, self.rank, self.split = pp, rank, copy.copy(split)   # its own, per rank
        self.fsdp, self.tp = fsdp, tp
        self.dp = fsdp.dp if fsdp is not None else 1
        self.ids, self.n = pp.stage_ids(rank // (self.dp * tp))
        self.schedule = self.optimizer = None
        self.params: list = []

    @contextlib.contextmanager
    def context(self):
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining._utils import InferenceMode
        from torch.distributed.pipelining.schedules import _PipelineSchedule

        from memsim.tracer.recorder import patched

        def vote(orig):
            # every rank of a real run agrees on static shapes (input_args given): the vote's
            # receives and .item() are not traced
            def _warmup_p2p(self, stages, has_backward, p2p_done):
                for st in stages:
                    st._inference_mode = InferenceMode.STATIC
            return _warmup_p2p

        with patched(_PipelineSchedule, "_warmup_p2p", vote), \
                patched(schedules, "_batch_p2p", holding):
            yield

    def prepare(self, model, recorder):
        # the stages this rank does not hold leave the run's model before its parameters are
        # made
        self.recorder = recorder
        self.split.prepare(model, self.ids)

    def setup(self, model, params, optimizer):
        from .mesh import process_group

        process_group(self.pp.pp * self.dp * self.tp, self.rank)
        self.model = model
        self.optimizer_factory = optimizer
        self._built = False
        return self._call

    def _build(self, first_input):
        """The stages and the schedule, once the first input is known (its micro-batch gives
        each stage's boundary shapes)."""
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        pp = self.pp
        mods, ins, outs = self.split.build(self.model, self.ids, first_input, self.recorder)
        group = None   # the default group, where the pipeline is the whole world
        if self.dp * self.tp > 1:
            from memsim.tracer.recorder import real_meshes

            from .mesh import pipeline_meshes
            pp_mesh, dp_mesh, _ = pipeline_meshes(pp.pp, self.dp, self.tp, self.rank)
            group = pp_mesh.get_group()
            if self.fsdp is not None:
                with real_meshes():
                    for mod in mods:
                        self.fsdp.shard_stage(mod, self.split.pieces(mod), dp_mesh)
        stages = [PipelineStage(mod, s, self.n, first_input.device,
                                input_args=ins[s].requires_grad_(
                                    s > 0 and ins[s].is_floating_point()),
                                output_args=outs[s].requires_grad_(True), group=group)
                  for s, mod in zip(self.ids, mods)]
        self.stages = stages
        # parameters a V rank's two stages share (tied embeddings) once
        self.params = list(dict.fromkeys(p for st in stages for p in st.submod.parameters()
                                         if p.requires_grad))
        self.optimizer = self.optimizer_factory(self.params)
        cls = getattr(pipelining, SCHEDULES[pp.schedule])
        self.schedule = cls(stages[0] if pp.schedule in SINGLE else stages,
                            n_microbatches=pp.micro,
                            loss_fn=self.split.loss(mods, self.loss_fn))
        self.first = any(st.is_first for st in stages)
        self.last = any(st.is_last for st in stages)

    def _call(self, **inputs):
        x, target = self.split.inputs(inputs)
        if not self._built:
            self._build(x)
            self._built = True
        kw = {}
        if self.last:
            # without labels the loss is of the output alone: a zero-byte target
            kw = dict(target=target if target is not None else x.new_empty(self.pp.micro, 0),
                      losses=[])
        from memsim.tracer.precision import forward_context
        # the step's autocast around the schedule: forward, loss and backward of each
        # micro-batch run inside it
        with forward_context(self.precision):
            self.schedule.step(*((x,) if self.first else ()), return_outputs=False, **kw)
        return None

    def backward(self, loss):
        pass

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def label(self, recorder):
        for p in self.params:
            recorder.set_category(p, Category.PARAMETER)
        self.label_gradients(recorder)   # the warm-up step's, alive until zero_grad
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    recorder.set_category(v, Category.OPTIMIZER_STATE)

    def label_gradients(self, recorder):
        for p in self.params:
            if p.grad is not None:
                recorder.set_category(p.grad, Category.GRADIENT)


def holding(batch_p2p):
    """``torch.distributed.pipelining.schedules._batch_p2p`` whose ``Work``s keep their
    tensors: gloo's Work keeps the tensor of its send or receive until the Work is dropped,
    the fake group's does not."""
    def _batch_p2p(p2p_ops, desc=None):
        works = batch_p2p(p2p_ops, desc)
        if len(works) == len(p2p_ops):
            return [HeldWork(w, [op.tensor]) for w, op in zip(works, p2p_ops)]
        if works:  # coalesced: one work for all ops
            return [HeldWork(works[0], [op.tensor for op in p2p_ops])] + works[1:]
        return works
    return _batch_p2p


class HeldWork:
    """A fake ``Work`` that keeps its P2P tensors alive, as gloo's does."""

    def __init__(self, work, tensors):
        self.work, self.tensors = work, tensors

    def wait(self, *a, **k):
        return self.work.wait(*a, **k)

    def is_completed(self):
        return self.work.is_completed()
