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


@register_rule(aten.constant_pad_nd.default,
               doc="F.pad: its C++ kernel reads concrete sizes and would pin symbols; same "
                   "single output allocation, computed symbolically")
def _constant_pad(recorder, func, args, kwargs):
    """``constant_pad_nd(x, pad, value)``: one output storage of the padded shape."""
    x, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    shape = list(x.shape)
    src = [slice(None)] * x.dim()
    dst = [slice(None)] * x.dim()
    for i in range(len(pad) // 2):
        d = x.dim() - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        shape[d] = shape[d] + lo + hi
        src[d] = slice(max(-lo, 0), x.shape[d] - max(-hi, 0))
        dst[d] = slice(max(lo, 0), shape[d] - max(hi, 0))
    out = torch.full(shape, value if value is not None else 0, dtype=x.dtype, device=x.device)
    out[tuple(dst)] = x[tuple(src)]
    return out
