"""Expert parallelism: a mixture of experts' experts sharded over ``ep`` ranks, with Hugging
Face's own code on a fake process group.

Each rank's run lays the model out as ``transformers.distributed`` does for
``DistributedConfig(ep_size=ep, fsdp_size=dp)``: the model's expert-parallel plan
(``base_model_ep_plan``: each experts module's weights ``Shard(0)`` over the ``ep`` ranks, its
forward the token exchange of ``AllToAllEP``), then its FSDP2 plan (the dense modules over the
``dp`` ranks, the experts over the ``dp / ep`` copies of each expert group), through
``maybe_distribute_model`` itself. The token exchange reads the tokens each rank sends and
receives back to the host (``.tolist()``): the tracker answers them from the routing at the
run's bound (``--data-dependent``), every rank routing its tokens as the one traced does
(:class:`~memsim.tracer.known_data.Tallies`). Under ``max`` every token goes to the same
``k`` experts, all held by the first expert rank, which receives ``ep x k x tokens`` rows: the
most the routing can send one rank; ``balanced`` deals them evenly.

Hugging Face's layout needs FSDP2 beside it (``ep`` divides ``dp``); tensor, pipeline and the
other data-parallel strategies do not combine with it here.

>>> ExpertParallel(ep=4).describe()
{'ep': 4}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from memsim.tracer import StrategyError, UsageError

from .base import Ranks, Strategy, register_strategy
from .mesh import _WORLD, _chunk, process_group, ranks_text

__all__ = ["ExpertParallel", "expert_counts"]


@register_strategy
@dataclass(frozen=True)
class ExpertParallel(Strategy):
    """Expert parallelism over ``ep`` ranks (Hugging Face's ``ep_size``), beside FSDP2 over
    ``dp`` ranks (``ep`` divides ``dp``)."""

    key: ClassVar[str] = "ep"
    order: ClassVar[int] = 35
    flags: ClassVar[tuple[str, ...]] = ("--ep",)
    ep: int

    def __post_init__(self):
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 2:
            raise StrategyError(f"ExpertParallel ep={self.ep!r} must be an int >= 2",
                                hint="the ranks the experts are sharded over")

    @classmethod
    def add_options(cls, group) -> None:
        group.add_argument("--ep", type=int, metavar="N",
                           help="expert-parallel ranks (Hugging Face's expert-parallel plan; "
                                "with --fsdp --dp M, N dividing M)")

    @classmethod
    def from_options(cls, opts, step):
        if not getattr(opts, "ep", None):
            return None
        if opts.ep < 2:
            raise UsageError(f"--ep {opts.ep}: expert parallelism needs 2 or more ranks",
                             hint="leave --ep out for none")
        return cls(opts.ep)

    @classmethod
    def summary(cls, d) -> str:
        return f"EP ep={d['ep']}"

    def validate(self, given, config) -> None:
        others = [k for k in ("tp", "pp", "zero", "ddp") if k in given]
        if others:
            flags = ", ".join(f"--{k}" for k in others)
            raise StrategyError(f"--ep does not combine with {flags} here",
                                hint="expert parallelism runs beside FSDP2: --ep N --fsdp --dp M")
        fsdp = given.get("fsdp")
        if fsdp is None:
            raise StrategyError(
                f"--ep {self.ep} needs FSDP2 beside it: Hugging Face's layout shards the dense "
                "modules with FSDP2 over the data-parallel ranks, the experts over --ep of them",
                hint=f"add --fsdp --dp M with M a multiple of {self.ep}")
        if fsdp.dp % self.ep:
            raise StrategyError(
                f"--ep {self.ep} does not divide --dp {fsdp.dp}: the expert-parallel groups "
                "are made of the data-parallel ranks",
                hint=f"--dp {self.ep * max(1, fsdp.dp // self.ep)} or an --ep dividing "
                     f"{fsdp.dp} ({', '.join(map(str, _divisors(fsdp.dp)))})")
        changed = [f for f, v in (("--no-reshard/--reshard-not-last",
                                   fsdp.reshard_after_forward is not True),
                                  ("units", fsdp.units != "blocks"),
                                  ("--param-dtype/--reduce-dtype",
                                   fsdp.param_dtype or fsdp.reduce_dtype),
                                  ("--fsdp-shard-dim", fsdp.shard_dims)) if v]
        if changed:
            raise StrategyError(
                f"with --ep, the model's own FSDP2 plan decides the units, the resharding and "
                f"the dtypes: {', '.join(changed)} cannot be given",
                hint="leave those FSDP options out")

    def apply(self, plan):
        fsdp = plan.given["fsdp"]
        model = plan.model
        _check_model(model, self.ep)
        world = fsdp.dp
        classes = tuple(_classes(model, self.ep, world))

        def inside(m, rank):
            _distribute(m, self.ep, world, rank)
        inside.paths = ()

        def note(info):
            yield (f"per-rank figures, traced with Hugging Face's own expert parallelism "
                   f"(ep_size={self.ep}, its AllToAllEP token exchange) and FSDP2 plan "
                   f"(fsdp_size={world}) on a fake process group; the tokens each rank "
                   "receives follow the routing at the run's bound (--data-dependent), every "
                   "rank routing as the one traced: under max, every token to the same experts, "
                   "all on the first expert rank (the most one rank can receive); ranks "
                   f"grouped by expert rank and shard sizes: "
                   f"{'; '.join(ranks_text(c) for c in info.classes)}")
        return plan.but(inside={"sharding": inside}, ranks=Ranks(world=world, classes=classes),
                        notes=(note,))


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def expert_counts(model: torch.nn.Module) -> dict[str, int]:
    """``{module path: experts}`` of the experts modules the model's expert-parallel plan
    dispatches to (``ep_dispatch_experts``), each module's name looked up in the plan as
    Hugging Face looks it up when it applies the plan (its layer numbers as ``*``)."""
    plan = _ep_plan(model)
    if not plan:
        return {}
    from transformers.distributed.parallel_utils import _get_parameter_plan
    return {name: m.num_experts for name, m in model.named_modules()
            if _get_parameter_plan(name, plan, is_weight=False) == "ep_dispatch_experts"
            and isinstance(getattr(m, "num_experts", None), int)}


def _ep_plan(model: torch.nn.Module) -> dict:
    """The model's expert-parallel plan: a Hugging Face model's ``ep_plan`` (its config's
    ``base_model_ep_plan`` under the base model's prefix), none for any other model."""
    return dict(getattr(model, "ep_plan", None) or {})


def _check_model(model: torch.nn.Module, ep: int) -> None:
    """Before any trace: the model has Hugging Face's expert-parallel plan, and every experts
    module's experts divide by ``ep``."""
    if not _ep_plan(model):
        raise StrategyError(
            f"--ep: {type(model).__name__} has no expert-parallel plan (Hugging Face's "
            "base_model_ep_plan, which its mixture-of-experts models publish)",
            hint="expert parallelism runs through transformers' own code: a Hugging Face MoE "
                 "model built from its config (Qwen3-MoE, Mixtral, DeepSeek-V3...)")
    counts = expert_counts(model)
    if not counts:
        raise StrategyError(f"--ep: the expert-parallel plan of {type(model).__name__} names no "
                            "experts module of the model",
                            hint="a Hugging Face MoE model built from its config")
    for name, n in counts.items():
        if n % ep:
            raise StrategyError(
                f"--ep {ep} does not divide the {n} experts of {name!r}: each expert rank "
                "holds whole experts",
                hint=f"--ep one of {', '.join(map(str, _divisors(n)))}")


def _classes(model: torch.nn.Module, ep: int, dp: int) -> list[tuple[int, ...]]:
    """The ranks grouped by what they hold and receive: the expert rank (``rank % ep``: the
    routing bound sends the first expert rank the most tokens) and the size of each shard
    (FSDP2's ``torch.chunk`` rows over the ``dp`` ranks for the dense parameters, over the
    ``dp / ep`` copies for the experts' local ones)."""
    experts = tuple(expert_counts(model))
    shapes = []
    for name, p in model.named_parameters():
        owner = next((e for e in experts if name.startswith(e + ".")), None)
        rows = p.shape[0] if p.dim() else 1
        shapes.append((owner is not None, rows // ep if owner is not None else rows))
    groups: dict[tuple, list[int]] = {}
    for r in range(dp):
        sig = (r % ep,) + tuple(_chunk(rows, dp // ep, r // ep) if expert else
                                _chunk(rows, dp, r) for expert, rows in shapes)
        groups.setdefault(sig, []).append(r)
    return [tuple(g) for g in groups.values()]


def _distribute(model: torch.nn.Module, ep: int, dp: int, rank: int) -> None:
    """Hugging Face's ``maybe_distribute_model`` on ``model`` as ``rank`` sees it, over device
    meshes of the fake process group laid out as ``initialize_distributed_mesh`` lays them
    out (built once per group)."""
    from transformers.distributed import DistributedConfig

    from memsim.tracer.recorder import real_meshes

    config = DistributedConfig(ep_size=ep, fsdp_size=dp, tp_size=1)
    process_group(dp, rank)
    meshes = _meshes(dp, ep)
    with real_meshes():
        type(model).maybe_distribute_model(model, config, meshes)


def _meshes(dp: int, ep: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.utils import TransformersDeviceMesh

    from memsim.tracer.recorder import outside_fake

    key = ("ep", dp, ep)
    got = _WORLD["meshes"].get(key)
    if got is None:
        def build():
            dense = init_device_mesh("cpu", (1, 1, dp, 1),
                                     mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
            expert = init_device_mesh("cpu", (1, 1, dp // ep, ep),
                                      mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
            return TransformersDeviceMesh(dense, expert)
        got = _WORLD["meshes"][key] = outside_fake(build)()
    return got
