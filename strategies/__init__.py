"""memsim.strategies: transforms of the model, the loop or the memory plan, per rank.

Each strategy is a value with one interface (:mod:`~memsim.strategies.base`: validate,
describe, apply) and one file: :mod:`~memsim.strategies.lora` (LoRA, QLoRA),
:mod:`~memsim.strategies.checkpoint` (activation checkpointing and the search for the best
plan), :mod:`~memsim.strategies.parallel` (tensor parallelism and FSDP2 with PyTorch's own code),
:mod:`~memsim.strategies.zero` (DeepSpeed ZeRO with DeepSpeed's own engine,
:mod:`~memsim.strategies.ds_engine`), :mod:`~memsim.strategies.ddp` (DDP's buckets).
:func:`analyze` composes them (:mod:`~memsim.strategies.api`).

>>> from memsim.strategies import FSDP, LoRA, TensorParallel, ZeRO, DDP
>>> ZeRO(stage=3, dp=64).overlap
True
"""

# imported in the order the strategies apply (each file registers its own)
from .base import Plan, Strategy, StrategyReport, register_strategy, registered_strategies
from .lora import LoRA, QLoRA, apply_lora, apply_qlora
from .checkpoint import Checkpoint
from .parallel import FSDP, TensorParallel
from . import parallel_errors  # noqa: F401  (explains FSDP2's and TP's failures in a trace)
from .zero import ZeRO
from .ddp import DDP
from .api import analyze, given_strategies, world_size

__all__ = ["analyze", "Strategy", "StrategyReport", "Plan", "register_strategy",
           "registered_strategies", "given_strategies", "world_size", "LoRA", "QLoRA",
           "apply_lora", "apply_qlora", "Checkpoint", "FSDP", "TensorParallel", "ZeRO", "DDP"]
