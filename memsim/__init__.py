"""memsim: how much memory one training step of a PyTorch model takes on each device, why, and
how to make it fit, before a tensor touches a GPU.

The front door. The engine is in three packages, data flowing one way:
:mod:`memsim.tracer` (module -> symbolic run -> records and graphs), :mod:`memsim.analysis`
(lifetimes, peaks, formulas, budget) and :mod:`memsim.strategies` (transforms of the model, the
loop or the memory plan); this package adds the public API below, the command line
(:mod:`memsim.cli`) and the rendering (:mod:`memsim.render`), the only code that prints.

>>> import torch, memsim
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> report = memsim.analyze(model, {"input": ("float32", ["B", 16])}, device="cpu")
>>> report.at(B=4)["train"]["peak"]
15252
"""

import os as _os

# A source checkout run without installing: memsim.tracer, .analysis and .strategies are the
# top-level folders beside this one (installed, setuptools' package-dir maps them the same way).
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "tracer", "__init__.py")) and _ROOT not in __path__:
    __path__.append(_ROOT)

from memsim._version import __version__  # noqa: E402

# The public API is imported on first use (PEP 562): the command line answers a repeated
# command from its cache without importing torch (memsim.entry).
_EXPORTS = {
    "memsim.analysis": ("FittedReport", "Report", "StepMemory"),
    "memsim.strategies": ("DDP", "FSDP", "Checkpoint", "LoRA", "QLoRA", "Strategy",
                          "StrategyReport", "TensorParallel", "ZeRO", "analyze"),
    "memsim.tracer": ("Category", "CpuIsa", "DataDependentError", "Device", "InputError", "Loop",
                      "MemsimError", "OutOfRangeError", "Precision", "SpecializationError",
                      "StepConfig", "StrategyError", "TraceError", "UnsupportedOpError",
                      "UsageError", "trace"),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    mod = _WHERE.get(name)
    if mod is None and name[:1].isupper():   # a strategy registered in a file of its own
        import importlib
        strategies = importlib.import_module("memsim.strategies")
        for cls in strategies.registered_strategies().values():
            if cls.__name__ == name:
                return cls
    if mod is None:
        raise AttributeError(f"module 'memsim' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


__all__ = ["__version__", "analyze", "trace", "StepConfig", "Device", "CpuIsa", "Precision",
           "Loop",
           "Report", "FittedReport", "StrategyReport", "StepMemory", "Category", "Strategy", "LoRA", "QLoRA",
           "Checkpoint", "FSDP", "TensorParallel", "ZeRO", "DDP", "MemsimError", "InputError",
           "UsageError", "TraceError", "UnsupportedOpError", "DataDependentError",
           "SpecializationError", "OutOfRangeError", "StrategyError"]
