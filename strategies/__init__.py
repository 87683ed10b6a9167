"""memsim.strategies: transforms of the model, the loop or the memory plan, per rank.

Each strategy is a value with one interface (:mod:`~memsim.strategies.base`: validate,
describe, apply) and one file: :mod:`~memsim.strategies.lora` (LoRA, QLoRA),
:mod:`~memsim.strategies.checkpoint` (activation checkpointing and the search for the best
plan), :mod:`~memsim.strategies.tp` (tensor parallelism) and :mod:`~memsim.strategies.fsdp`
(FSDP2), both with PyTorch's own code on the fake process group of
:mod:`~memsim.strategies.mesh`, :mod:`~memsim.strategies.zero` (DeepSpeed ZeRO with DeepSpeed's
own engine, :mod:`~memsim.strategies.ds_engine`), :mod:`~memsim.strategies.ddp` (DDP's buckets).
:func:`analyze` composes them (:mod:`~memsim.strategies.compose`).

>>> from memsim.strategies import FSDP, LoRA, TensorParallel, ZeRO, DDP
>>> ZeRO(stage=3, dp=64).overlap
True
"""

# each file registers its own strategy; they apply in the order their classes declare
from .base import (Plan, Strategy, StrategyReport, register_strategy, registered_strategies,
                   summary_order)
from .lora import LoRA, QLoRA, apply_lora, apply_qlora
from .checkpoint import Checkpoint
from .tp import TensorParallel
from .fsdp import FSDP
from .zero import ZeRO
from .ddp import DDP
from .compose import (add_strategy_options, analyze, given_strategies, strategies_from_options,
                  world_size)



def _register_every_file() -> None:
    """Import every module of this package, so that a strategy in a file of its own is
    registered (and exported below) without a line here."""
    import importlib
    import pkgutil
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_register_every_file()
_NEW = [c.__name__ for c in registered_strategies().values() if c.__name__ not in globals()]
globals().update({c.__name__: c for c in registered_strategies().values()})

__all__ = _NEW + ["analyze", "Strategy", "StrategyReport", "Plan", "register_strategy",
           "registered_strategies", "summary_order", "given_strategies", "world_size",
           "add_strategy_options", "strategies_from_options", "LoRA", "QLoRA",
           "apply_lora", "apply_qlora", "Checkpoint", "FSDP", "TensorParallel", "ZeRO", "DDP"]
