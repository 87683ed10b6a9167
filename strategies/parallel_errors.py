"""Failures inside a traced step that tensor parallelism or FSDP2 explain: the tracer's error
says which parameters or modules and what to change, where a real run fails the same way.
Registered with the tracer (:func:`memsim.tracer.run_errors.register_explainer`), which knows
nothing of the strategies.
"""

from __future__ import annotations

import os

from memsim.tracer import MemsimError, StrategyError
from memsim.tracer.recorder import Recorder
from memsim.tracer.run_errors import register_explainer


@register_explainer
def mixed_dtensors(err: BaseException, model, recorder: Recorder) -> MemsimError | None:
    """The optimizer's foreach update over parameters a tensor-parallel plan left unsharded
    (DTensor refuses a list mixing both): a real CUDA run fails the same way. None for any
    other error, and for this one raised outside ``torch.optim`` (a model's own op)."""
    import traceback

    if "got mixed torch.Tensor and DTensor" not in str(err) or not any(
            "torch/optim/" in f.filename.replace(os.sep, "/")
            for f in traceback.extract_tb(err.__traceback__)):
        return None
    from torch.distributed.tensor import DTensor
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if not plain:
        return None
    op = str(err).split(" got mixed", 1)[0].strip()
    names = ", ".join(repr(n) for n in plain[:3]) + (f" and {len(plain) - 3} more"
                                                     if len(plain) > 3 else "")
    return StrategyError(
        f"{op} fails in the optimizer step: it updates its parameters with foreach ops, and "
        f"the tensor-parallel plan leaves {names} plain tensors beside its DTensors; a real "
        "run fails the same way (torch picks the foreach update on CUDA, and DTensor refuses "
        "a list that mixes both)",
        hint="give the optimizer foreach=False (--optimizer 'AdamW(foreach=False)', "
             "optimizer='AdamW(foreach=False)'), or make every parameter a DTensor (FSDP "
             "with TP: --fsdp)")


@register_explainer
def outside_unit(err: BaseException, model, recorder: Recorder) -> MemsimError | None:
    """A module of an FSDP2 unit that the model calls outside the unit's forward (DiT's
    top level calls ``transformer_blocks[0].norm1.emb`` for its conditioning): the unit's
    parameters are still sharded there, and a real run fails the same way. None for any other
    error."""
    if "got mixed torch.Tensor and DTensor" not in str(err) or not recorder.module_stack:
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    units = [n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)]
    inner = recorder.module_stack[-1]
    owner = max((u for u in units if inner == u or inner.startswith(u + ".")),
                key=len, default=None)
    if owner is None or owner in recorder.module_stack:
        return None  # the unit's forward runs: not this case
    called = next((m for m in recorder.module_stack if m.startswith(owner + ".")), inner)
    return StrategyError(
        f"the model calls {called!r} outside the forward of its FSDP unit {owner!r}, where "
        f"the unit's parameters are still sharded (DTensors): {inner!r} fails on them, and a "
        "real FSDP2 run fails the same way (torch: 'got mixed torch.Tensor and DTensor')",
        hint=f"make {called!r} a unit of its own (FSDP(units=[..., {called!r}, {owner!r}, "
             f"...]): its own hooks then gather it), or leave {owner!r} out of the units")
