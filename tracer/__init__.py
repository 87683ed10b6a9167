"""memsim.tracer: run a module's training step (or inference) symbolically and record its memory.

The public names of the package; the engine is in :mod:`memsim.tracer.trace` (a trace in the
user's symbols), :mod:`memsim.tracer.step` (the step run on fake tensors) and
:mod:`memsim.tracer.recorder` (every storage's allocation and release). Per-op decisions are in
one registry, :mod:`memsim.tracer.rules`.
"""

from __future__ import annotations

from . import precision  # noqa: F401  (memsim.tracer.precision: the precision modes)
from .config import CpuIsa, Device, Loop, StepConfig
from .driver import Driver
from .errors import (
    DataDependentError,
    InputError,
    MemsimError,
    OutOfRangeError,
    SpecializationError,
    StrategyError,
    TraceError,
    UnsupportedOpError,
    UsageError,
)
from .precision import Precision
from .records import MODEL_STATE, Category, Event, LeafRecord, OpRecord, Phase, RunRecord, Storage
from .spec import (TensorSpec, is_tensor_spec, make_spec, parse_assignments, parse_input,
                   symbol)
from .optimizer_state import OptimizerFactory
from .step import LossFn, default_loss
from .trace import Trace, trace

__all__ = [
    "trace", "Trace", "StepConfig", "Device", "CpuIsa", "Loop", "Precision", "Driver", "TensorSpec",
    "Category", "Phase", "Storage", "Event", "RunRecord", "OpRecord", "LeafRecord",
    "MODEL_STATE", "symbol", "make_spec", "parse_input", "parse_assignments", "is_tensor_spec",
    "default_loss", "LossFn", "OptimizerFactory", "MemsimError", "InputError", "UsageError",
    "TraceError", "UnsupportedOpError", "DataDependentError", "SpecializationError",
    "OutOfRangeError", "StrategyError",
]
