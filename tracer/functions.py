"""Python-level functions a rule replaces for the modelled device (``function`` rules of
:mod:`memsim.tracer.rules`), and the rules that hold on every device.

A torch-function mode routes each function with a rule for the device (or for any device) to
it; the rule returns the output, or None to leave the call as it is. Device-specific kernel
choices live with their device (:mod:`memsim.tracer.cuda`); here:

- ``F.interpolate`` with ``scale_factor``: PyTorch computes the output size in C++ from concrete
  sizes (``upsample_*.vec``), which pins every symbol of the input to its example size. The
  rule computes ``floor(size * scale)`` symbolically and calls the kernel's ATen overload with
  that size and the same scales, as the ``.vec`` overload does: the same output and gradient
  storages (the backward saves nothing but sizes).
"""

from __future__ import annotations

import contextlib
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .rules import Kind, keys, lookup, rule

aten = torch.ops.aten


class FunctionRules(TorchFunctionMode):
    """Routes the functions with a ``function`` rule for ``device`` (or any device)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = str(device)
        self._keys = keys(Kind.FUNCTION, self.device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._keys:
            out = lookup(Kind.FUNCTION, func, self.device).value(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def function_rules(device: str):
    """Inside: functions with a rule for ``device`` run as the rule says."""
    from . import cuda  # noqa: F401  (registers CUDA's kernel choices)

    with FunctionRules(device):
        yield


# (mode, spatial dims) -> the ATen overload upsample_*.vec calls, and whether it takes
# align_corners
_UPSAMPLE = {
    ("nearest", 1): (aten.upsample_nearest1d.default, False),
    ("nearest", 2): (aten.upsample_nearest2d.default, False),
    ("nearest", 3): (aten.upsample_nearest3d.default, False),
    ("nearest-exact", 1): (aten._upsample_nearest_exact1d.default, False),
    ("nearest-exact", 2): (aten._upsample_nearest_exact2d.default, False),
    ("nearest-exact", 3): (aten._upsample_nearest_exact3d.default, False),
    ("linear", 1): (aten.upsample_linear1d.default, True),
    ("bilinear", 2): (aten.upsample_bilinear2d.default, True),
    ("bicubic", 2): (aten.upsample_bicubic2d.default, True),
    ("trilinear", 3): (aten.upsample_trilinear3d.default, True),
}


def _scaled(size, scale: float):
    """``floor(size * scale)`` as the kernel computes it, kept symbolic: an integer scale
    multiplies, a fractional one is an exact fraction (``limit_denominator``) and a floor
    division."""
    f = Fraction(scale).limit_denominator(1 << 16)
    if isinstance(size, torch.SymInt) and size.node.expr.is_number:
        size = int(size)  # a constant: the kernels take plain ints where they can
    return size * f.numerator if f.denominator == 1 else (size * f.numerator) // f.denominator


@rule(Kind.FUNCTION, F.interpolate,
      doc="F.interpolate(scale_factor=...): output size floor(size * scale) computed "
          "symbolically (PyTorch's C++ reads concrete sizes and pins every symbol); the same "
          "ATen kernel and storages")
def _interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None, antialias=False):
    """The ``upsample_*`` overload with a symbolic output size, or None (size given,
    ``recompute_scale_factor``, antialiasing or a mode without a plain kernel)."""
    dim = input.dim() - 2
    entry = _UPSAMPLE.get((mode, dim))
    if size is not None or scale_factor is None or recompute_scale_factor or antialias \
            or entry is None:
        return None
    scales = list(scale_factor) if isinstance(scale_factor, (list, tuple)) else [scale_factor] * dim
    if len(scales) != dim:
        return None
    out = [_scaled(input.shape[i + 2], float(s)) for i, s in enumerate(scales)]
    op, corners = entry
    args = (input, out) + ((bool(align_corners),) if corners else ()) + tuple(map(float, scales))
    return op(*args)
