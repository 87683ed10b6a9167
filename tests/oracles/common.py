"""What the CPU and the multi-rank oracles share (nothing of memsim)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def default_loss(out):
    """``out.loss`` if present, else ``out`` if 0-dim, else the first float tensor ``.sum()``
    (the loss a plain training loop takes, written here independently of memsim's)."""
    if isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.sum()
    seq = out.to_tuple() if hasattr(out, "to_tuple") else out
    return next(t for t in tree_flatten(seq)[0]
                if isinstance(t, torch.Tensor) and t.is_floating_point()).sum()
