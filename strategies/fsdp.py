"""FSDP2 (``fully_shard``), applied with PyTorch's own code on a fake process group.

Each rank's run applies ``torch.distributed.fsdp.fully_shard`` to a copy of the model, on fake
parameters (:meth:`FSDP.shard`, inside :func:`memsim.strategies.mesh.transform`): every
all-gather buffer, unsharded parameter, reduce-scatter output and sharded optimizer state is a
storage of the run, allocated and released where FSDP2 allocates and releases it. The units
are a model's decoder layers or repeated blocks (:func:`fsdp_units`), less those holding a
parameter tied outside them; FSDP2 pads every shard to one size (:func:`padding_note` says what
that costs where parameters have fewer rows than ranks).

>>> FSDP(dp=8)   # doctest: +NORMALIZE_WHITESPACE
FSDP(dp=8, reshard_after_forward=True, units='blocks', param_dtype=None, reduce_dtype=None,
     shard_dims=())
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from memsim.tracer import StrategyError, UsageError

from .base import Strategy, data_parallel, exclusive, register_strategy
from .mesh import sharded

if TYPE_CHECKING:
    from .tp import TensorParallel

__all__ = ["FSDP", "CUDA_FSDP_NOTE", "fsdp_units", "tied_outside", "untied_note",
           "padding_note"]


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
        if "tp" in plan.given or "pp" in plan.given or "ep" in plan.given:
            # TensorParallel shards both (a 2-D mesh); a pipeline shards each rank's stages;
            # expert parallelism lays out both with the model's own plans
            return plan
        return sharded(plan, self, None)

    def shard(self, model: torch.nn.Module, mesh) -> None:
        """Apply ``fully_shard`` to ``model`` in place over ``mesh`` (the data-parallel
        dimension): each unit, inner ones first, then the root (a StrategyError for a unit that
        is not a module of the model, or that holds a parameter tied to one outside it)."""
        _shard(model, self, mesh)

    def shard_stage(self, stage: torch.nn.Module, units: list[str], mesh) -> None:
        """Apply ``fully_shard`` to a pipeline stage over ``mesh``: each of ``units`` (its
        blocks or children), then the stage itself, as torchtitan shards its model chunks."""
        _shard(stage, self, mesh, units)

    def notes_for(self, model: torch.nn.Module, tp: TensorParallel | None,
                  cuda: bool) -> tuple[str, ...]:
        """The report's notes on this sharding of ``model`` (``tp``: the tensor parallelism
        beside it; ``cuda``: traced for a CUDA device): :data:`CUDA_FSDP_NOTE`,
        :func:`untied_note` and :func:`padding_note`, those that apply."""
        found = (CUDA_FSDP_NOTE if cuda else None, untied_note(model, self),
                 padding_note(model, self, tp))
        return tuple(n for n in found if n)


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


def _shard(model: torch.nn.Module, fsdp: FSDP, mesh, units: list[str] | None = None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if units is None:
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
