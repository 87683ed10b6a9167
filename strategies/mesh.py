"""What FSDP2 and tensor parallelism share: a fake process group, its device meshes, the
per-rank transform that applies both with PyTorch's own code, and the ranks grouped by what
they hold.

memsim does not re-implement sharding. Each symbolic run builds a *fake* process group of the
requested world size (``torch.testing._internal.distributed.fake_pg``: collectives are no-ops
that return tensors of the right shapes) and applies ``torch.distributed.fsdp.fully_shard``
(:class:`~memsim.strategies.fsdp.FSDP`) and
``torch.distributed.tensor.parallel.parallelize_module``
(:class:`~memsim.strategies.tp.TensorParallel`) to a copy of the model, on fake parameters,
before the step runs. Every all-gather buffer, unsharded parameter, reduce-scatter output and
sharded optimizer state is then a storage of the run, allocated and released where FSDP2 and
DTensor allocate and release it (``UntypedStorage.resize_`` included). The figures are rank 0's;
ranks that hold shards of other sizes are grouped (:func:`rank_classes`) and each group traced.

>>> ranks_text((2, 3, 4, 5))
'ranks 2-5'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from memsim.tracer import StrategyError

from .base import Ranks

if TYPE_CHECKING:
    from .fsdp import FSDP
    from .tp import TensorParallel

__all__ = ["sharded", "ranks_text", "process_group", "transform", "rank_classes",
           "pipeline_meshes"]


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
    if fsdp is not None:
        notes += fsdp.notes_for(plan.model, tp, cuda=plan.config.device.value == "cuda")
    def inside(model, rank):
        transform(fsdp, tp, rank)(model)
    inside.paths = () if tp is None else tp.sharded_paths(plan.model)
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


def pipeline_meshes(pp: int, dp: int, tp: int, rank: int):
    """``(pp mesh, dp mesh, tp mesh)`` of a ``(pp, dp, tp)`` device mesh on the fake group at
    ``rank`` (global rank ``(pp_rank * dp + dp_rank) * tp + tp_rank``, the pipeline dimension
    outermost, as torchtitan orders its mesh), built once per process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from memsim.tracer.recorder import outside_fake

    process_group(pp * dp * tp, rank)
    key = ("pp", pp, dp, tp)
    got = _WORLD["meshes"].get(key)
    if got is None:
        root = outside_fake(init_device_mesh)("cpu", (pp, dp, tp),
                                              mesh_dim_names=("pp", "dp", "tp"))
        got = _WORLD["meshes"][key] = outside_fake(
            lambda: (root["pp"], root["dp"], root["tp"]))()
    return got


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
            if tp is not None:
                tp.parallelize(model, tp_mesh)
            if fsdp is not None:
                fsdp.shard(model, dp_mesh)

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
