"""Tensor parallelism, applied with PyTorch's own ``parallelize_module`` on a fake process group.

A plan says how each module is sharded (:class:`Style`): the model's own Hugging Face plan or
one given. :func:`tp_plan` resolves it on the model, :func:`sp_plan` extends it with Megatron's
sequence parallelism, and :meth:`TensorParallel.parallelize` applies it to a copy of the model,
on fake parameters, inside each rank's run (:func:`memsim.strategies.mesh.transform`). Uneven
linear splits are refused (PyTorch's own TP fails on them); an embedding may split its
vocabulary unevenly, and then ranks differ (:func:`memsim.strategies.mesh.rank_classes`).

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

from .base import Strategy, register_strategy
from .mesh import sharded

__all__ = ["TensorParallel", "Style", "PLAN_WORDS", "tp_plan", "sp_plan"]


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
        if "zero" in plan.given or "pp" in plan.given:
            # DeepSpeed's AutoTP shards the model inside its engine (ZeRO); a pipeline shards
            # each rank's layers over its own tensor-parallel group
            return plan
        return sharded(plan, plan.given.get("fsdp"), self)

    def parallelize(self, model: torch.nn.Module, mesh) -> None:
        """Shard ``model`` in place over ``mesh`` (the tensor-parallel dimension) as
        :func:`tp_plan` says, with PyTorch's ``parallelize_module``; nothing for ``tp=1``."""
        if self.tp <= 1:
            return
        from torch.distributed.tensor.parallel import parallelize_module
        plan = tp_plan(model, self)
        with _quiet():
            parallelize_module(model, mesh, _styles(
                model, plan, self.sequence_dim if self.sequence_parallel else None))

    def sharded_paths(self, model: torch.nn.Module) -> tuple | None:
        """The modules the plan shards one by one (None where the plan does not resolve on
        ``model``: the trace reports why)."""
        if self.tp <= 1:
            return ()
        try:
            return tuple(tp_plan(model, self))
        except MemsimError:
            return None


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


@contextlib.contextmanager
def _quiet():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
