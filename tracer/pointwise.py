"""Pointwise ops on fake tensors with symbolic sizes, without their Python decompositions.

With a symbolic size among its inputs, a fake tensor runs an op that has no C++ meta kernel
taking symbolic sizes through its Python decomposition: ``sigmoid_`` becomes PrimTorch's
``neg``, ``exp``, ``add``, ``reciprocal`` and a copy back, each computing its output's shape,
strides and dtype from symbolic sizes again (about 3.4 ms on a ``(B, 64)`` tensor, torch
2.13; ``sigmoid_backward`` 3.6 ms, ``tanh_backward`` 1.7 ms). A recurrent network issues these
in every time step: they were a third of a bidirectional GRU's trace.

:func:`fast_pointwise` registers, for the duration of a trace, fake kernels for a few such ops
in torch's own table of fast paths (``torch._subclasses.fake_impls``, where ``add`` and
``mul`` already have one). Each gives the output the decomposition would give, computed once:

- an out-of-place op on operands of one shape: that shape, the dtype of the op's type
  promotion, PrimTorch's elementwise output strides of the operands
  (``compute_elementwise_output_strides``, which the decomposition's ops apply in turn);
- an in-place op on a floating tensor: the tensor itself;
- ``clone`` keeping the layout: as an out-of-place op of one operand (PrimTorch's
  ``prims.clone`` does the same).

Anything else (broadcasting, a scalar operand, a keyword, operands on two devices, an integer
tensor updated in place, a shape equality that would need a guard) goes the decomposition's
way, as without this module. Traces are the same, storage for storage, with and without it
(``tests/test_pointwise.py``); ``MEMSIM_FAST_POINTWISE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch._prims_common import (ELEMENTWISE_TYPE_PROMOTION_KIND,
                                 compute_elementwise_output_strides, elementwise_dtypes)

__all__ = ["fast_pointwise", "OPS"]

_aten = torch.ops.aten
_FLOAT = ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT
_SAME = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT

# op: (its type promotion, in place)
OPS = {
    _aten.sigmoid_.default: (_FLOAT, True),
    _aten.tanh_.default: (_FLOAT, True),
    _aten.tanh.default: (_FLOAT, False),
    _aten.exp.default: (_FLOAT, False),
    _aten.neg.default: (_SAME, False),
    _aten.sigmoid_backward.default: (_SAME, False),
    _aten.tanh_backward.default: (_SAME, False),
    _aten.clone.default: (_SAME, False),
}


def _same_shapes(tensors) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    first = tensors[0].shape
    return all(t.shape is first or (t.dim() == len(first) and statically_known_true(
        sym_eq(t.shape, first))) for t in tensors[1:])


def _kernel(func, promotion, inplace: bool):
    from torch._decomp import decomposition_table
    from torch._subclasses.fake_tensor import FakeTensor

    slow_ref = decomposition_table[func]

    def impl(mode, *args, **kwargs):
        def slow():
            with mode:
                return slow_ref(*args, **kwargs)

        if kwargs and not (func is _aten.clone.default and kwargs == {
                "memory_format": torch.preserve_format}):
            return slow()
        if not args or not all(isinstance(a, FakeTensor) for a in args):
            return slow()
        device = args[0].device
        if any(a.device != device for a in args) or not _same_shapes(args):
            return slow()
        _, dtype = elementwise_dtypes(*args, type_promotion_kind=promotion)
        if inplace:
            self = args[0]
            if not self.dtype.is_floating_point or dtype != self.dtype:
                return slow()
            return self
        strides = compute_elementwise_output_strides(*args)
        out = torch.empty_strided(args[0].shape, strides, dtype=dtype, device="meta")
        return FakeTensor(mode, out, device=device)

    return impl


@contextlib.contextmanager
def fast_pointwise():
    """Fast fake kernels for :data:`OPS` while the block runs (nothing is registered where
    torch's table of fast paths is not the one this was written against, or under
    ``MEMSIM_FAST_POINTWISE=0``)."""
    try:
        from torch._subclasses import fake_impls
        table = fake_impls.FAST_OP_IMPLEMENTATIONS
    except (ImportError, AttributeError):
        table = None
    if not isinstance(table, dict) or os.environ.get("MEMSIM_FAST_POINTWISE") == "0":
        yield
        return
    added = {op: _kernel(op, *how) for op, how in OPS.items() if op not in table}
    table.update(added)
    try:
        yield
    finally:
        for op in added:
            table.pop(op, None)
