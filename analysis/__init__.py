"""memsim.analysis: exact, symbolic memory of a training step and of inference.

From a trace (:mod:`memsim.tracer`) to figures: :mod:`~memsim.analysis.report` (the
:class:`Report` and :func:`analyze`), :mod:`~memsim.analysis.memory` (peak, breakdown, saved
activations, per module), :mod:`~memsim.analysis.peak` (symbolic peaks of a timeline),
:mod:`~memsim.analysis.allocator` (what an allocator charges), :mod:`~memsim.analysis.caching`
and :mod:`~memsim.analysis.reserved` (the CUDA caching allocator replayed over a step: reserved
memory), :mod:`~memsim.analysis.budget` and :mod:`~memsim.analysis.gpus` (a step against a GPU),
:mod:`~memsim.analysis.search` (monotone searches).
"""

from .caching import AllocConf, AllocatorOOM, CachingAllocator
from .fit import Fit, FittedReport
from .memory import ModuleSaved, PeakPoint, StepMemory
from .report import (TRAIN_FIELDS, Regime, Report, Retracer, analyze, cross_conditions,
                     cross_guards, fix_inputs, pinning_fixed)
from .reserved import Reserved, replay

__all__ = ["analyze", "cross_guards", "cross_conditions", "pinning_fixed", "Report",
           "FittedReport", "Fit", "Regime", "Retracer", "StepMemory",
           "ModuleSaved", "PeakPoint", "TRAIN_FIELDS", "fix_inputs", "AllocConf",
           "AllocatorOOM", "CachingAllocator", "Reserved", "replay"]
