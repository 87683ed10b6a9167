"""The built-in memory rules (see :mod:`tracer.rules`)."""

from __future__ import annotations

import torch

from .errors import DataDependentError
from .records import Phase
from .rules import register_rule

aten = torch.ops.aten


@register_rule(aten._local_scalar_dense.default,
               doc="optimizer step counters read with .item(): value 1, memory never depends on it")
def _local_scalar(recorder, func, args, kwargs):
    """``.item()``: allowed only in the optimizer, where it reads the step count."""
    if recorder.phase is Phase.OPTIMIZER or recorder.phase is Phase.SETUP:
        t = args[0]
        return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
    raise DataDependentError(
        "the model reads a tensor value with .item() / bool() / int(), which a symbolic run "
        "does not have", module=recorder.module, op=str(func),
        hint="move the data-dependent branch out of forward, or give that value as a constant")
