"""FSDP2 and tensor parallelism, applied with PyTorch's own code on a fake process group.

memsim does not re-implement sharding. Each symbolic run builds a *fake* process group of the
requested world size (``torch.testing._internal.distributed.fake_pg``: collectives are no-ops
that return tensors of the right shapes) and applies ``torch.distributed.fsdp.fully_shard`` and
``torch.distributed.tensor.parallel.parallelize_module`` to a copy of the model, on fake
parameters, before the step runs. Every all-gather buffer, unsharded parameter, reduce-scatter
output and sharded optimizer state is then a storage of the run, allocated and released where
FSDP2 and DTensor allocate and release it (``UntypedStorage.resize_`` included). The figures are
rank 0's; ranks are equal (FSDP2 pads every shard to one size; uneven TP splits are refused).

>>> FSDP(dp=8)   # doctest: +NORMALIZE_WHITESPACE
FSDP(dp=8, reshard_after_forward=True, units='blocks', param_dtype=None, reduce_dtype=None,
     shard_dims=())
>>> TensorParallel(tp=2).plan
'auto'
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from memsim.tracer import MemsimError, StrategyError, UsageError
from memsim.tracer.records import Word

from .base import Ranks, Strategy, data_parallel, exclusive, register_strategy

__all__ = ["FSDP", "TensorParallel", "Style", "transform", "process_group", "tp_plan"]


class Style(Word):
    """How a tensor-parallel plan shards a module: the plan's words (``colwise``,
    ``rowwise``, ``sequence``; ``colwise_rep``: column-wise with the output all-gathered,
    ``rowwise_rep``: row-wise from a replicated input), and those :func:`sp_plan` adds
    (``gather``, ``head``)."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    SEQUENCE = "sequence"
    COLWISE_REP = "colwise_rep"
    ROWWISE_REP = "rowwise_rep"
    GATHER = "gather"
    HEAD = "head"


# what a plan may say: memsim's words and Hugging Face's (transformers.distributed's
# ALL_PARALLEL_STYLES, 5.x) for the same sharding; None: the module stays whole on every rank
# (Qwen3's and Gemma3's per-head q_norm/k_norm: replicated, their gradients all-reduced in
# place by a hook)
PLAN_WORDS = {"colwise": Style.COLWISE, "rowwise": Style.ROWWISE, "sequence": Style.SEQUENCE,
              "colwise_rep": Style.COLWISE_REP, "colwise_gather_output": Style.COLWISE_REP,
              "rowwise_rep": Style.ROWWISE_REP, "rowwise_split_input": Style.ROWWISE_REP,
              "embedding_rowwise": Style.ROWWISE, "replicate": None,
              "replicated_with_grad_allreduce": None}
_SHARDED = {Style.COLWISE: 0, Style.COLWISE_REP: 0, Style.ROWWISE: 1, Style.ROWWISE_REP: 1}


@register_strategy
@dataclass(frozen=True)
class TensorParallel(Strategy):
    """Tensor parallelism over ``tp`` ranks (``parallelize_module``).

    plan : "auto" or dict
        ``{module-name pattern: "colwise" | "rowwise" | "sequence" | "colwise_rep" |
        "rowwise_rep" | "replicate"}`` (``*`` matches one path component, as in Hugging Face's
        ``base_model_tp_plan``, whose words for the same shardings are read too:
        ``colwise_gather_output``, ``rowwise_split_input``, ``embedding_rowwise``,
        ``replicated_with_grad_allreduce``); ``"auto"`` takes the model's own Hugging Face plan
        (Llama, Mistral, Qwen, Gemma, Phi... publish one) or fails naming the model.
    sequence_parallel : bool
        Megatron's sequence parallelism (:func:`sp_plan`): outside the column-/row-wise pairs
        (the norms, the residual stream) activations are split along the sequence.
    sequence_dim : int
        The sequence dimension of the activations (1: batch first, as Hugging Face; 0:
        Megatron's sequence-first layout).
    """

    key: ClassVar[str] = "tp"
    order: ClassVar[int] = 30
    axis: ClassVar[str] = "tp"
    flags: ClassVar[tuple[str, ...]] = ("--tp",)
    tp: int
    plan: str | dict = "auto"
    sequence_parallel: bool = False
    sequence_dim: int = 1

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise StrategyError(f"TensorParallel tp={self.tp!r} must be an int >= 1")

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--tp", type=int, metavar="N", help="tensor-parallel ranks")
        group.add_argument(
            "--tp-plan", metavar="PAT=STYLE,...",
            help="tensor-parallel plan (default: the model's Hugging Face plan); styles "
                 "colwise, rowwise, sequence, colwise_rep, rowwise_rep, replicate")
        group.add_argument("--sp", action="store_true",
                           help="sequence parallelism with --tp (Megatron's: norms and the "
                                "residual stream split along the sequence)")

    @classmethod
    def from_options(cls, opts, step):
        if not opts.tp:
            if opts.sp or opts.tp_plan:
                raise UsageError("--sp and --tp-plan need --tp N")
            return None
        plan = "auto"
        if opts.tp_plan:
            plan = {}
            for part in opts.tp_plan.split(","):
                pat, eq, style = part.partition("=")
                if not eq:
                    raise UsageError(f"--tp-plan entry {part!r} is not PATTERN=STYLE",
                                     hint="e.g. --tp-plan 'h.*.attn.c_attn=colwise'")
                plan[pat.strip()] = style.strip()
        return cls(opts.tp, plan, opts.sp)

    @classmethod
    def summary(cls, d) -> str:
        return f"TP {d['tp']}" + (" + SP" if d["sequence_parallel"] else "")

    def apply(self, plan):
        if "zero" in plan.given:
            return plan  # DeepSpeed's AutoTP shards the model inside its engine (ZeRO)
        return sharded(plan, plan.given.get("fsdp"), self)


@register_strategy
@dataclass(frozen=True)
class FSDP(Strategy):
    """FSDP2 (``fully_shard``) over ``dp`` ranks.

    reshard_after_forward : bool or "not-last"
        True frees each unit's unsharded parameters after its forward and gathers them again in
        backward (ZeRO-3-like); False keeps them to the end of backward (ZeRO-2-like);
        ``"not-last"`` is True for every unit but the last, whose backward comes first
        (torchtitan's default policy: ``reshard_after_forward = layer_id < n_layers - 1``), and
        True for the root.
    units : "blocks" or tuple of str
        The modules wrapped with their own ``fully_shard`` (then the root): ``"blocks"`` (see
        :func:`fsdp_units`) or module paths.
    param_dtype, reduce_dtype : str, optional
        ``MixedPrecisionPolicy``: e.g. ``"bfloat16"`` parameters for compute, fp32 reduction.
    shard_dims : dict or tuple of (pattern, dim) pairs
        ``fully_shard``'s ``shard_placement_fn``: a parameter whose name matches a pattern
        (``fnmatch``, first match wins) is sharded on that dimension instead of FSDP2's
        ``Shard(0)``. A stacked MoE's experts (``(experts, rows, cols)``) over more ranks than
        experts: ``Shard(0)`` pads every rank's shard to a whole expert, so each rank holds
        1/experts of them, not 1/ranks; torchtitan shards them on dimension 1
        (``{"*.experts.*": 1}``). FSDP2 needs the dimension to divide by ``dp``.
    """

    key: ClassVar[str] = "fsdp"
    order: ClassVar[int] = 40
    axis: ClassVar[str] = "dp"
    flags: ClassVar[tuple[str, ...]] = ("--fsdp",)
    dp: int
    reshard_after_forward: bool | str = True
    units: str | tuple[str, ...] = "blocks"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    shard_dims: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if not isinstance(self.dp, int) or self.dp < 1:
            raise StrategyError(f"FSDP dp={self.dp!r} must be an int >= 1")
        dims = self.shard_dims
        pairs = tuple(dims.items()) if isinstance(dims, dict) else tuple(map(tuple, dims))
        for pair in pairs:
            if (len(pair) != 2 or not isinstance(pair[0], str) or isinstance(pair[1], bool)
                    or not isinstance(pair[1], int) or pair[1] < 0):
                raise StrategyError(
                    f"FSDP shard_dims entry {pair!r} must be (parameter-name pattern, dim >= 0)",
                    hint="e.g. shard_dims={'*.experts.*': 1}")
        object.__setattr__(self, "shard_dims", pairs)
        if isinstance(self.units, list):
            object.__setattr__(self, "units", tuple(self.units))
        if self.reshard_after_forward not in (True, False, "not-last"):
            raise StrategyError(
                f"FSDP reshard_after_forward={self.reshard_after_forward!r} must be True, "
                "False or 'not-last'",
                hint="'not-last' reshards every unit but the last (torchtitan's default)")
        for k in ("param_dtype", "reduce_dtype"):
            name = _DTYPE_ALIASES.get(getattr(self, k), getattr(self, k))
            object.__setattr__(self, k, name)
            _dtype(name)  # an unknown dtype fails here, before any trace

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard over --dp ranks")
        group.add_argument("--no-reshard", action="store_true",
                           help="FSDP2 reshard_after_forward=False (ZeRO-2-like)")
        group.add_argument("--reshard-not-last", action="store_true",
                           help="FSDP2 reshard_after_forward for every unit but the last, whose "
                                "backward comes first (torchtitan's default policy)")
        group.add_argument("--param-dtype", metavar="DTYPE",
                           help="FSDP2 MixedPrecisionPolicy param_dtype: the dtype parameters "
                                "are all-gathered and computed in (bf16, fp16, fp32)")
        group.add_argument("--reduce-dtype", metavar="DTYPE",
                           help="FSDP2 MixedPrecisionPolicy reduce_dtype: the dtype gradients "
                                "are reduce-scattered in (default: --param-dtype)")
        group.add_argument("--fsdp-shard-dim", action="append", metavar="PATTERN=DIM",
                           help="FSDP2 shard_placement_fn: shard the parameters whose names "
                                "match PATTERN (fnmatch) on dimension DIM instead of 0, e.g. "
                                "'*.experts.*=1' for stacked MoE experts over more ranks than "
                                "experts (torchtitan's choice); repeatable, the first match wins")

    @classmethod
    def from_options(cls, opts, step):
        if not opts.fsdp:
            for flag in ("no_reshard", "reshard_not_last", "param_dtype", "reduce_dtype",
                         "fsdp_shard_dim"):
                if getattr(opts, flag):
                    raise UsageError(f"--{flag.replace('_', '-')} is an FSDP option",
                                     hint="add --fsdp --dp N")
            return None
        dp = data_parallel("--fsdp", opts)
        if opts.no_reshard and opts.reshard_not_last:
            raise UsageError("--no-reshard and --reshard-not-last contradict each other",
                             hint="give one of them")
        return cls(dp=dp, reshard_after_forward="not-last" if opts.reshard_not_last
                   else not opts.no_reshard, param_dtype=opts.param_dtype,
                   reduce_dtype=opts.reduce_dtype,
                   shard_dims=_shard_dim_options(opts.fsdp_shard_dim or ()))

    @classmethod
    def summary(cls, d) -> str:
        raf = d["reshard_after_forward"]
        return f"FSDP2 dp={d['dp']} (" + (
            "reshard after forward but the last unit" if raf == "not-last"
            else "reshard after forward" if raf else "no reshard after forward") + "".join(
            f"; {pat} on dim {dim}" for pat, dim in d.get("shard_dims") or ()) + ")"

    def validate(self, given, config) -> None:
        exclusive(given, self.key, ("fsdp", "zero", "ddp"),
                  "FSDP2 and ZeRO-3 are the same idea; DDP buckets do not exist under FSDP")

    def apply(self, plan):
        if "tp" in plan.given:
            return plan  # TensorParallel shards both (a 2-D mesh)
        return sharded(plan, self, None)


# FSDP2 is traced on CPU fake tensors, so through its CPU code path also for --device cuda.
# In PyTorch 2.13 that path frees the same storages at the same points as the CUDA one: streams
# and events only order work (dummies on CPU); FSDP2 frees memory by dropping references and by
# UntypedStorage.resize_(0) (_fsdp_param.py free_unsharded_param / free_storage), never with
# record_stream; the reduce-scatter input is held until the next group's post-backward
# (_fsdp_param_group.py, reduce_scatter_states) on both. Its device branches (_fsdp_state.py
# inputs to the device, an HSDP assertion, mtia's SUM reduction) allocate nothing different.
# The CPU path's one extra buffer, gloo's reduce-scatter copy, is added on --device cpu only.
CUDA_FSDP_NOTE = ("FSDP2 on CUDA: traced through FSDP2's own code on CPU fake tensors; in "
                  "PyTorch 2.13 it frees the same buffers at the same points on CUDA (streams "
                  "and events order work, buffers die with their last reference or resize_(0)); "
                  "NCCL's own buffers, outside the caching allocator, and stream overlap are not "
                  "modelled; not measured on a GPU")


def _shard_dim_options(given) -> tuple[tuple[str, int], ...]:
    """``--fsdp-shard-dim PATTERN=DIM`` options as :attr:`FSDP.shard_dims` pairs."""
    out = []
    for text in given:
        pattern, eq, dim = text.rpartition("=")
        if not eq or not pattern or not dim.strip().isdigit():
            raise UsageError(f"--fsdp-shard-dim {text!r} is not PATTERN=DIM",
                             hint="e.g. --fsdp-shard-dim '*.experts.*=1'")
        out.append((pattern, int(dim)))
    return tuple(out)


def sharded(plan, fsdp: FSDP | None, tp: TensorParallel | None):
    """``plan`` with TP then FSDP2 applied inside the run, per rank, and its rank groups."""
    classes = tuple(rank_classes(plan.model, fsdp, tp))
    world = (fsdp.dp if fsdp else 1) * (tp.tp if tp else 1)
    by_sizes = None
    if tp is not None and tp.sequence_parallel and tp.tp > 1:
        def by_sizes(sizes):
            return tuple(rank_classes(plan.model, fsdp, tp, sizes))

    seq = ", or of the sequence" if by_sizes is not None else ""

    def note(info):
        if len(info.classes) == 1:
            yield ("per-rank figures, traced with PyTorch's own FSDP2 / tensor-parallel code on "
                   "a fake process group; every rank holds shards of the same sizes: ranks are "
                   "equal")
        else:
            yield (f"ranks differ: uneven shards (of parameters{seq}) put "
                   f"{len(info.classes)} groups of ranks "
                   f"({', '.join(ranks_text(c) for c in info.classes)}) at different sizes; "
                   "each group is traced as its first rank, with PyTorch's own FSDP2 / "
                   "tensor-parallel code on a fake process group; the figures shown are rank "
                   "0's, which holds the largest shard of every parameter (torch.chunk sizes)"
                   f"{' and of the sequence' if seq else ''}; \"ranks\" lists them all")

    notes: tuple = (note,)
    if fsdp is not None and plan.config.device.value == "cuda":
        notes += (CUDA_FSDP_NOTE,)
    for extra in (untied_note(plan.model, fsdp), padding_note(plan.model, fsdp, tp)):
        if extra:
            notes += (extra,)
    def inside(model, rank):
        transform(fsdp, tp, rank)(model)
    inside.paths = _tp_paths(plan.model, tp)
    return plan.but(inside={"sharding": inside},
                    ranks=Ranks(world=world, classes=classes, by_sizes=by_sizes),
                    notes=notes)


def ranks_text(ranks: tuple[int, ...]) -> str:
    """``ranks 2-5`` / ``rank 0`` / ``ranks 0,3``."""
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


# -- the fake process group ---------------------------------------------------------------------
_WORLD: dict = {}


def process_group(world: int, rank: int = 0):
    """A fake default process group of ``world`` ranks, this process being ``rank``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if (_WORLD.get("size"), _WORLD.get("rank")) == (world, rank) and \
                dist.get_backend() == "fake":
            return
        if _WORLD.get("size") is None:
            raise StrategyError(
                "a real torch.distributed process group is already initialized in this "
                "process; memsim simulates ranks with its own fake group",
                hint="run the analysis in a process without init_process_group")
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    _WORLD.update(size=world, rank=rank, meshes={})
    _clear_sharding_caches()


def _clear_sharding_caches() -> None:
    """DTensor caches each op's sharding by a key in which device meshes of different ranks
    compare equal, yet the cached result holds this rank's local shapes: drop it when the
    rank changes."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    type(prop)._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    from torch.distributed.tensor import _redistribute
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def _mesh(dp: int, tp: int, rank: int = 0):
    """``(dp mesh or None, tp mesh or None, root mesh)`` on the fake group at ``rank``, built
    once per process group (outside any fake mode: a mesh holds real host integers)."""
    from torch.distributed.device_mesh import init_device_mesh

    from memsim.tracer.recorder import outside_fake

    process_group(dp * tp, rank)
    got = _WORLD["meshes"].get((dp, tp))
    if got is None:
        mesh = outside_fake(init_device_mesh)
        if tp == 1:
            root = mesh("cpu", (dp,), mesh_dim_names=("dp",))
            got = root, None, root
        elif dp == 1:
            root = mesh("cpu", (tp,), mesh_dim_names=("tp",))
            got = None, root, root
        else:
            root = mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            got = outside_fake(lambda: (root["dp"], root["tp"], root))()
        _WORLD["meshes"][(dp, tp)] = got
    return got


# -- tensor-parallel plans ----------------------------------------------------------------------
def tp_plan(model: torch.nn.Module, tp: TensorParallel) -> dict[str, str]:
    """The plan as ``{module path: style}`` for the modules of ``model`` it matches."""
    plan = tp.plan
    auto = plan == "auto"
    if auto:
        cfg = getattr(model, "config", None)
        plan = getattr(cfg, "base_model_tp_plan", None)
        if not plan:
            raise StrategyError(
                f"{type(model).__name__} has no built-in tensor-parallel plan",
                hint="give one: TensorParallel(tp, plan={'layers.*.attn.q': 'colwise', ...}) "
                     "or --tp-plan 'layers.*.attn.q=colwise,...'")
        prefix = getattr(model, "base_model_prefix", "")
        if prefix and hasattr(model, prefix):
            plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    mods = dict(model.named_modules())
    names = [n for n in mods if n]
    out: dict[str, str] = {}
    for pat, style in plan.items():
        word = str(style).removesuffix("_parallel")
        if word not in PLAN_WORDS:
            raise StrategyError(f"tensor-parallel plan {pat!r}: style {style!r} is not one of "
                                f"{', '.join(PLAN_WORDS)}",
                                hint="give the plan yourself (TensorParallel(tp, plan={...}) "
                                     "or --tp-plan) with these words")
        style = PLAN_WORDS[word]
        rx = fnmatch.translate(pat).replace(".*", "[^.]*")
        hit = [n for n in names if re.fullmatch(rx, n)]
        if not hit and auto:
            # Hugging Face's plan covers every variant of the family's layers (Qwen3-MoE's
            # dense mlp.gate_proj, for the layers in mlp_only_layers): an entry this model has
            # no module for does nothing, as in Hugging Face's own loading
            continue
        if not hit:
            raise StrategyError(f"tensor-parallel plan entry {pat!r} matches no module",
                                hint="patterns match module paths; * stands for one component")
        if word == "embedding_rowwise" and not all(isinstance(mods[n], torch.nn.Embedding)
                                                   for n in hit):
            raise StrategyError(f"tensor-parallel plan {pat!r}: 'embedding_rowwise' on a "
                                "module that is not an nn.Embedding")
        for n in hit:
            if style is None:
                out.pop(n, None)
            else:
                out[n] = style
    if auto and not out:
        raise StrategyError(f"{type(model).__name__}'s Hugging Face tensor-parallel plan matches "
                            "none of its modules",
                            hint="give one: TensorParallel(tp, plan={...}) or --tp-plan")
    out = _lora_split(model, out, tp)
    _check_divisible(model, out, tp.tp)
    return sp_plan(model, out) if tp.sequence_parallel else out


def _lora_split(model: torch.nn.Module, plan: dict[str, str],
                tp: TensorParallel) -> dict[str, str]:
    """A LoRA layer the plan shards: its frozen base as the plan says, and the adapter on the
    sharded side with it (column-wise: B splits its output, A stays whole; row-wise: A splits
    its input and all-reduces its r outputs, B stays whole), so that both sums are local."""
    from .lora import LoRALayer

    mods = dict(model.named_modules())
    out = {}
    for name, style in plan.items():
        if not isinstance(mods[name], LoRALayer) or style not in (Style.COLWISE,
                                                                   Style.ROWWISE):
            out[name] = style
            continue
        if tp.sequence_parallel:
            raise StrategyError(f"sequence parallelism with a LoRA adapter on {name} is not "
                                "supported", hint="analyse TensorParallel without --sp")
        out[f"{name}.base_layer"] = style
        out[f"{name}.{'lora_B' if style is Style.COLWISE else 'lora_A'}"] = style
    return out


def _is_norm(m: torch.nn.Module) -> bool:
    return isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or (
        type(m).__name__.endswith("Norm") and any(True for _ in m.parameters(recurse=False)))


def sp_plan(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A tensor-parallel plan extended with Megatron's sequence parallelism.

    The parallel regions are the parents of the row-wise linear layers (attention, MLP): their
    input is gathered along the sequence (``"gather"``) and their row-wise exit reduce-scatters
    back to sequence shards. Every norm outside them runs on its sequence shard
    (``"sequence"``); the input embedding becomes vocab-parallel with a sequence-sharded output
    and the output embedding (the LM head) gathers the sequence first (``"head"``), unless the
    plan places them itself. The residual stream stays a DTensor of the full shape, so code that
    reads the sequence length (position ids, masks, rotary tables) sees the whole sequence.
    """
    mods = dict(model.named_modules())
    names = {id(m): n for n, m in mods.items()}
    rep = sorted(n for n, st in plan.items() if st in (Style.COLWISE_REP, Style.ROWWISE_REP))
    if rep:
        raise StrategyError(f"sequence parallelism with a {plan[rep[0]]} layer ({rep[0]}) is "
                            "not supported: its activations are whole on every rank",
                            hint="analyse TensorParallel without --sp")
    out = dict(plan)
    regions = {n.rpartition(".")[0] for n, st in plan.items() if st is Style.ROWWISE
               and isinstance(mods[n], torch.nn.Linear)}
    inside = lambda n: any(n.startswith(r + ".") for r in regions)  # noqa: E731
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if emb is None or id(emb) not in names:
        raise StrategyError(f"sequence parallelism on {type(model).__name__}: no input "
                            "embedding found (get_input_embeddings)",
                            hint="it starts at a vocab-parallel embedding that splits the "
                                 "sequence; without one, analyse TensorParallel without --sp")
    out.setdefault(names[id(emb)], Style.ROWWISE)
    if head is not None and id(head) in names:
        if head.weight is emb.weight:
            raise StrategyError("sequence parallelism with tied input and output embeddings "
                                "is not supported", hint="untie them or analyse without --sp")
        out[names[id(head)]] = Style.HEAD
    for r in regions:
        out[r] = Style.GATHER
    for n, m in mods.items():
        if n and _is_norm(m) and not inside(n):
            out.setdefault(n, Style.SEQUENCE)
    return out


def _check_divisible(model: torch.nn.Module, plan: dict[str, str], t: int) -> None:
    """Heads and sharded linear dimensions must divide by ``t``. An embedding may split its
    vocabulary unevenly (DTensor gives the last ranks fewer rows: ranks differ, and each is
    traced); a linear layer may not: a column-wise layer's local output feeding a row-wise
    one fails in PyTorch itself (``DTensor.from_local`` assumes even shards)."""
    mods = dict(model.named_modules())
    cfg = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n % t:
            raise StrategyError(f"tensor-parallel degree {t} does not divide {key}={n}",
                                hint=f"choose tp among the divisors of {n}")
    for name, style in plan.items():
        m = mods[name]
        if style is Style.SEQUENCE:
            continue
        if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            raise StrategyError(f"tensor-parallel plan: {name} is a {type(m).__name__}; "
                                "colwise/rowwise shard nn.Linear and nn.Embedding only")
        if isinstance(m, torch.nn.Embedding):
            continue
        dim = _SHARDED[style]
        size = m.weight.shape[dim]  # a Linear weight is (out, in)
        if size % t:
            raise StrategyError(f"tensor-parallel degree {t} does not divide {name}'s "
                                f"{'input' if dim else 'output'} size {size}",
                                hint="uneven linear shards fail in PyTorch's own TP (local "
                                     "outputs of uneven shards); choose a divisor")


def _styles(model: torch.nn.Module, plan: dict[str, str], seq: int | None = None):
    """Style objects for ``plan``; ``seq`` is the sequence dimension under sequence
    parallelism (None: plain tensor parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    mods = dict(model.named_modules())
    sp = {} if seq is None else {"output_layouts": Shard(seq), "use_local_output": False}
    out = {}
    for name, style in plan.items():
        if style is Style.SEQUENCE:
            out[name] = SequenceParallel(sequence_dim=1 if seq is None else seq)
        elif style is Style.COLWISE:
            out[name] = ColwiseParallel()
        elif style is Style.COLWISE_REP:
            out[name] = ColwiseParallel(output_layouts=Replicate())
        elif style is Style.ROWWISE_REP:
            out[name] = RowwiseParallel(input_layouts=Replicate())
        elif style is Style.HEAD:
            out[name] = ColwiseParallel(input_layouts=Shard(seq), output_layouts=Replicate())
        elif style is Style.GATHER:
            out[name] = _gather_style()()
        elif isinstance(mods[name], torch.nn.Embedding):
            # vocab-parallel embedding: token ids are replicated, the table split by rows
            out[name] = RowwiseParallel(input_layouts=Replicate(), **sp)
        else:
            out[name] = RowwiseParallel(**sp)
    return out


def _gather_sequence(x):
    """A sequence-sharded DTensor as the whole local tensor (an all-gather); others as are."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(x, DTensor) and any(p.is_shard() for p in x.placements):
        return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
    return x


@functools.cache
def _gather_style():
    """The region-entry style class (built on first use: it needs torch.distributed)."""
    from torch.distributed.tensor.parallel.style import ParallelStyle
    from torch.utils._pytree import tree_map

    class GatherSequence(ParallelStyle):
        """Entry of a parallel region under sequence parallelism: every sequence-sharded
        DTensor argument (positional or keyword) is all-gathered into a local tensor, as
        ``PrepareModuleInput(Shard(seq) -> Replicate, use_local_output=True)`` does."""

        def _apply(self, module, device_mesh):
            module.register_forward_pre_hook(
                lambda m, args, kwargs: tree_map(_gather_sequence, (args, kwargs)),
                with_kwargs=True)
            return module

    return GatherSequence


def _tp_paths(model: torch.nn.Module, tp: TensorParallel | None) -> tuple | None:
    """The modules a tensor-parallel plan shards one by one (None where the plan does not
    resolve on the model: the trace reports why)."""
    if tp is None or tp.tp <= 1:
        return ()
    try:
        return tuple(tp_plan(model, tp))
    except MemsimError:
        return None


# -- the transform ------------------------------------------------------------------------------
def transform(fsdp: FSDP | None = None, tp: TensorParallel | None = None, rank: int = 0):
    """The ``transform(model)`` for :func:`memsim.analysis.analyze` that applies TP then FSDP2, as
    ``rank`` of the world sees it."""
    if fsdp is None and tp is None:
        return None
    dp_n, tp_n = fsdp.dp if fsdp else 1, tp.tp if tp else 1

    def apply(model: torch.nn.Module) -> None:
        from memsim.tracer.recorder import real_meshes

        dp_mesh, tp_mesh, _ = _mesh(dp_n, tp_n, rank)
        with real_meshes():
            if tp is not None and tp.tp > 1:
                from torch.distributed.tensor.parallel import parallelize_module
                plan = tp_plan(model, tp)
                with _quiet():
                    parallelize_module(model, tp_mesh, _styles(
                        model, plan, tp.sequence_dim if tp.sequence_parallel else None))
            if fsdp is not None:
                _shard(model, fsdp, dp_mesh)

    return apply


def rank_classes(model: torch.nn.Module, fsdp: FSDP | None = None,
                 tp: TensorParallel | None = None,
                 sizes: list[int] | None = None) -> list[tuple[int, ...]]:
    """The ranks grouped by the local shape of every sharded parameter, lowest rank first.

    The strategy is applied once to a copy of ``model`` (meta device, nothing traced); each
    rank's local shapes come from DTensor's own chunking (``torch.chunk`` sizes: ceil(n/w) rows
    until they run out, so later ranks may hold less, or nothing). Ranks of one class hold
    storages of the same sizes and have the same memory; rank 0 holds the largest shard of
    every parameter.

    ``sizes`` (under sequence parallelism): the sizes the step runs at; the activations are
    split along the sequence too, so ranks also group by the chunk each tensor-parallel rank
    holds of each of those sizes, whichever is the sequence (rank 0 holds the largest).
    """
    if fsdp is None and tp is None:
        return [(0,)]
    # a retrace (Report.for_point) asks again for the same model: answered from memory when
    # nothing the grouping reads has changed (modules, parameters, the strategies, the sizes)
    key = (tuple((n, type(m)) for n, m in model.named_modules()),
           tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                 for n, p in model.named_parameters()),
           repr(getattr(getattr(model, "config", None), "base_model_tp_plan", None)),
           repr(fsdp), repr(tp), None if sizes is None else tuple(sizes))
    if key not in _CLASSES:
        if len(_CLASSES) >= 8:
            _CLASSES.pop(next(iter(_CLASSES)))
        _CLASSES[key] = _rank_classes(model, fsdp, tp, sizes)
    return list(_CLASSES[key])


_CLASSES: dict = {}


def _rank_classes(model, fsdp, tp, sizes) -> list[tuple[int, ...]]:
    import copy

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    apply = transform(fsdp, tp)
    with torch.device("meta"):
        m = copy.deepcopy(model).to("meta")
    apply(m)
    root = _mesh(fsdp.dp if fsdp else 1, tp.tp if tp else 1)[2]
    names = root.mesh_dim_names
    # a parameter's local shape depends only on its shape, its mesh and placements, and the
    # rank's place on that mesh: worked out once for each, not for every parameter of every
    # rank (Llama-3.1-405B over TP 8 x FSDP 128: 1,024 ranks x 1,137 parameters took over 15
    # minutes; benchmarks/frontier_strategies.py)
    kinds = [(tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.device_mesh.mesh_dim_names),
              tuple(p.placements)) for p in m.parameters() if isinstance(p, DTensor)]
    distinct = list(dict.fromkeys(kinds))
    local: dict[tuple, tuple] = {}
    groups: dict[tuple, list[int]] = {}
    for r in range(root.size()):
        where = dict(zip(names, (root.mesh == r).nonzero()[0].tolist()))
        here = {}
        for kind in distinct:
            shape, mesh_shape, dims, placements = kind
            at = (kind, tuple(where[n] for n in dims))
            if at not in local:
                local[at] = tuple(int(d) for d in _compute_local_shape_and_global_offset(
                    shape, mesh_shape, list(at[1]), placements, skip_offset=True)[0])
            here[kind] = local[at]
        sig = tuple(here[kind] for kind in kinds)
        if sizes is not None and "tp" in where:
            sig += tuple(_chunk(n, tp.tp, where["tp"]) for n in sizes)
        groups.setdefault(sig, []).append(r)
    return [tuple(g) for g in groups.values()]


def _chunk(n: int, parts: int, i: int) -> int:
    """The length of ``torch.chunk``'s ``i``-th piece of ``n`` into ``parts``."""
    each = -(-n // parts)
    return max(0, min(each, n - i * each))


def fsdp_units(model: torch.nn.Module) -> list[str]:
    """The default FSDP units: modules of a Hugging Face model's ``_no_split_modules`` classes
    (its decoder layers), else the repeated blocks (:func:`memsim.strategies.checkpoint.blocks`), else
    the children of a ``Sequential`` root; less those holding a parameter tied to one outside
    them (:func:`tied_outside`: an MLM head's decoder shares the word embeddings, which
    ModernBERT's ``_no_split_modules`` name), left to the root's group with their partner."""
    tied = _tied(model)
    return [u for u in _candidate_units(model) if not tied_outside(model, u, tied)]


def _candidate_units(model: torch.nn.Module) -> list[str]:
    from .checkpoint import blocks

    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [n for n, m in model.named_modules() if n and type(m).__name__ in names]
        if found:
            return found
    found = blocks(model)
    if not found and isinstance(model, torch.nn.Sequential):
        found = [n for n, _ in model.named_children()]
    return found


def _tied(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter registered under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [g for g in names.values() if len(g) > 1]


def tied_outside(model: torch.nn.Module, unit: str,
                 tied: list[list[str]] | None = None) -> list[tuple[str, str]]:
    """``(inside, outside)`` names of each parameter registered both inside module ``unit`` and
    outside it (tied weights; ``tied``: :func:`_tied` of the model, where known). FSDP2
    refuses such a unit: a parameter belongs to one group."""
    out = []
    for group in _tied(model) if tied is None else tied:
        inside = [n for n in group if n.startswith(unit + ".")]
        outside = [n for n in group if not n.startswith(unit + ".")]
        if inside and outside:
            out.append((inside[0], outside[0]))
    return out


def untied_note(model: torch.nn.Module, fsdp) -> str | None:
    """What :func:`fsdp_units` left out for tied weights, in words (None: nothing)."""
    if fsdp is None or fsdp.units != "blocks":
        return None
    tied = _tied(model)
    if not tied:
        return None
    left = [(u, t[0]) for u in _candidate_units(model) if (t := tied_outside(model, u, tied))]
    if not left:
        return None
    u, (a, b) = left[0]
    more = f" and {len(left) - 1} more" if len(left) > 1 else ""
    return (f"FSDP2 unit {u!r}{more} left to the root's group: its parameter {a!r} is tied to "
            f"{b!r} outside it, and a parameter belongs to one FSDP group")


def padding_note(model: torch.nn.Module, fsdp: FSDP | None,
                 tp: TensorParallel | None) -> str | None:
    """What FSDP2's padding costs where parameters have fewer rows than ranks, in words, with
    the option that avoids it (None: under 1% of the parameters). ``Shard(0)`` gives every
    rank ``ceil(rows / dp)`` rows of each parameter, padding included: a stacked MoE's 8
    experts over 64 ranks leave each rank a whole expert, 8 times an even split."""
    if fsdp is None or tp is not None or fsdp.dp == 1:
        return None
    moved = any(dim for _, dim in fsdp.shard_dims)
    total = padded = 0
    short = []
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or p.ndim == 0:
            continue
        seen.add(id(p))
        total += p.numel()
        if _placement(name, fsdp) is not None:
            continue
        rows = p.shape[0]
        held = -(-rows // fsdp.dp) * fsdp.dp * (p.numel() // rows if rows else 0)
        if held > p.numel() and rows < fsdp.dp:
            padded += held - p.numel()
            short.append((name, p))
    if not short or padded < 0.01 * total:
        return None
    name, p = max(short, key=lambda np: np[1].numel())
    pattern = re.sub(r"\.\d+\.", ".*.", name.rsplit(".", 1)[0]) + ".*"
    fits = p.ndim > 1 and p.shape[1] % fsdp.dp == 0
    how = (f"FSDP(shard_dims={{{pattern!r}: 1}}), --fsdp-shard-dim '{pattern}=1'" if fits
           else "FSDP(shard_dims=...), --fsdp-shard-dim PATTERN=DIM")
    return (f"FSDP2 pads each rank's shard of a parameter to ceil(rows / {fsdp.dp}) rows: "
            f"{len(short)} parameters have fewer rows than the {fsdp.dp} ranks (the largest "
            f"{name!r}, shape {tuple(p.shape)}), so the ranks hold "
            f"{padded / total:.0%} more parameter elements than an even split"
            f"{'' if not moved else ' (after shard_dims)'}; sharded on another dimension "
            f"they split evenly (torchtitan does so for MoE experts): {how}")


def _shard(model: torch.nn.Module, fsdp: FSDP, mesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = fsdp_units(model) if fsdp.units == "blocks" else list(fsdp.units)
    mods = dict(model.named_modules())
    shared = _tied(model)
    for u in units:
        if u not in mods:
            raise StrategyError(f"FSDP unit {u!r} is not a module of the model",
                                hint="units are module paths, e.g. 'model.layers.0'")
        tied = tied_outside(model, u, shared)
        if tied:
            # (fully_shard's own ValueError, raised inside the run, read as the model failing)
            raise StrategyError(
                f"FSDP unit {u!r} holds {tied[0][0]!r}, tied to {tied[0][1]!r} outside it: "
                "a parameter belongs to one FSDP group, and fully_shard refuses the unit",
                hint="leave the unit to the root's group (drop it from units), or name a "
                     "module that holds both")
    kw = {}
    if fsdp.param_dtype or fsdp.reduce_dtype:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=_dtype(fsdp.param_dtype), reduce_dtype=_dtype(fsdp.reduce_dtype))
    if fsdp.shard_dims:
        from torch.distributed.tensor import Shard
        dims = _shard_dims(model, fsdp, mesh.size())
        kw["shard_placement_fn"] = lambda p: Shard(dims[id(p)]) if id(p) in dims else None
    policy = fsdp.reshard_after_forward
    last = units[-1] if units and policy == "not-last" else None   # in the model's order
    for u in _inner_first(units):
        fully_shard(mods[u], mesh=mesh,
                    reshard_after_forward=u != last if policy == "not-last" else policy, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if policy == "not-last" else policy,
                **kw)


def _placement(name: str, fsdp: FSDP) -> tuple[str, int] | None:
    """The first ``(pattern, dim)`` of :attr:`FSDP.shard_dims` whose pattern matches the
    parameter ``name`` (None: FSDP2's ``Shard(0)``)."""
    return next(((pat, dim) for pat, dim in fsdp.shard_dims
                 if fnmatch.fnmatchcase(name, pat)), None)


def _shard_dims(model: torch.nn.Module, fsdp: FSDP, ranks: int) -> dict[int, int]:
    """``id(parameter) -> dim`` for the parameters :attr:`FSDP.shard_dims` moves off dimension
    0 (the first pattern a name matches), checked as ``fully_shard`` would check them inside
    the run: every pattern matches a parameter, the dimension exists, and (FSDP2 pads only
    dimension 0) divides by the ranks."""
    from torch.distributed.tensor import DTensor

    named = list(model.named_parameters())
    out: dict[int, int] = {}
    used = set()
    for name, p in named:
        hit = _placement(name, fsdp)
        if hit is None:
            continue
        pattern, dim = hit
        used.add(pattern)
        local = p.to_local().shape if isinstance(p, DTensor) else p.shape
        if dim >= len(local):
            raise StrategyError(
                f"FSDP shard_dims {pattern!r}: {dim} is not a dimension of {name!r} "
                f"(shape {tuple(local)})", hint="dimensions count from 0")
        if dim > 0 and local[dim] % ranks:
            raise StrategyError(
                f"FSDP shard_dims {pattern!r}: dimension {dim} of {name!r} (shape "
                f"{tuple(local)}) does not divide by {ranks} ranks, and FSDP2 pads only "
                "dimension 0", hint="choose a dimension the ranks divide, or a pattern "
                "that leaves this parameter on dimension 0")
        if dim:
            out[id(p)] = dim
    for pattern, _ in fsdp.shard_dims:
        if pattern not in used:
            some = ", ".join(repr(n) for n, _ in named[:3])
            raise StrategyError(f"FSDP shard_dims pattern {pattern!r} matches no parameter",
                                hint=f"patterns match parameter names ({some}, ...) with "
                                     "fnmatch: '*' spans dots")
    return out


def _inner_first(units: list[str]) -> list[str]:
    """``units`` with every unit inside another sharded before it, as FSDP2 needs: each
    ``fully_shard`` takes the parameters no inner unit took, and a parameter it finds already
    sharded fails (ConvNext's ``_no_split_modules`` name both its stages and their layers:
    "Cannot concatenate overlapping meshes"). Units that do not nest keep their order."""
    nested = any(v.startswith(u + ".") for u in units for v in units)
    if not nested:
        return list(units)
    index = {u: i for i, u in enumerate(units)}
    return sorted(units, key=lambda u: (-u.count("."), index[u]))


# the short names users type (torchtitan's and Lightning's configs, the CLI) for torch's dtypes
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32"}


def _dtype(name: str | None):
    if name is None:
        return None
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise StrategyError(f"FSDP mixed precision: unknown dtype {name!r}",
                            hint="e.g. bfloat16 (bf16), float16 (fp16), float32 (fp32)")
    return dt


@contextlib.contextmanager
def _quiet():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
