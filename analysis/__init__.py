"""memsim.analysis: exact, symbolic memory of a training step and of inference.

From a trace (:mod:`memsim.tracer`) to figures: :mod:`~memsim.analysis.report` (the
:class:`Report`, a value), :mod:`~memsim.analysis.build` (:func:`analyze`, which makes one),
:mod:`~memsim.analysis.explore` (tracing again where a report's formulas do not reach), :mod:`~memsim.analysis.memory` (peak, breakdown, saved
activations, per module), :mod:`~memsim.analysis.peak` (symbolic peaks of a timeline),
:mod:`~memsim.analysis.allocator` (what an allocator charges), :mod:`~memsim.analysis.caching`
and :mod:`~memsim.analysis.reserved` (the CUDA caching allocator replayed over a step: reserved
memory), :mod:`~memsim.analysis.budget` and :mod:`~memsim.analysis.gpus` (a step against a GPU),
:mod:`~memsim.analysis.search` (monotone searches).
"""

from .alloc_conf import AllocConf
from .caching import AllocatorOOM, CachingAllocator
from .fitted import Fit, FittedReport
from .memory import ModuleSaved, PeakPoint, StepMemory
from .build import analyze, pinning_fixed
from .explore import Retracer, cross_conditions, cross_guards, fix_inputs, for_point
from .report import TRAIN_FIELDS, Regime, Report
from .reserved import Reserved, replay

__all__ = ["analyze", "for_point", "cross_guards", "cross_conditions", "pinning_fixed", "Report",
           "FittedReport", "Fit", "Regime", "Retracer", "StepMemory",
           "ModuleSaved", "PeakPoint", "TRAIN_FIELDS", "fix_inputs", "AllocConf",
           "AllocatorOOM", "CachingAllocator", "Reserved", "replay"]
