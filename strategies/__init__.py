"""strategies: transforms of the model or of the memory plan, the CLI and the report.

>>> from memsim.strategies import FSDP, LoRA, TensorParallel, ZeRO, DDP
>>> ZeRO(stage=3, dp=64).overlap
True
"""

from .api import analyze, describe
from .lora import LoRA, QLoRA, apply_lora, apply_qlora
from .parallel import FSDP, TensorParallel
from .zero import DDP, ZeRO

__all__ = ["analyze", "describe", "LoRA", "QLoRA", "apply_lora", "apply_qlora", "FSDP", "TensorParallel", "ZeRO", "DDP"]
