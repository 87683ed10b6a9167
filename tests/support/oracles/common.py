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


class ChangeLog:
    """Every change of the live bytes, in order: ``(token, bytes added or removed)``. A token
    names one storage for its whole life (an ``id()`` is reused once the storage is freed), so
    the log can be replayed with some storages left out (:meth:`peak_without`)."""

    def __init__(self):
        self.changes: list[tuple[int, int]] = []
        self.tokens: dict[int, int] = {}  # id() of a live storage -> its token

    def alloc(self, key: int, n: int) -> None:
        self.tokens[key] = len(self.changes)
        self.changes.append((self.tokens[key], n))

    def resize(self, key: int, delta: int) -> None:
        self.changes.append((self.tokens[key], delta))

    def free(self, key: int, n: int) -> None:
        tok = self.tokens.pop(key, None)
        if tok is not None and n:
            self.changes.append((tok, -n))

    def peak_without(self, tokens: set[int], start: int = 0) -> int:
        """The most bytes live at once from change ``start`` on, ``tokens`` left out."""
        cur = sum(n for tok, n in self.changes[:start] if tok not in tokens)
        peak = cur
        for tok, n in self.changes[start:]:
            if tok not in tokens:
                cur += n
                peak = max(peak, cur)
        return peak


def held_tensors(obj) -> list:
    """The tensors an output holds: through dicts (a ``ModelOutput``), lists, tuples and
    objects' attributes (a Hugging Face ``DynamicCache`` and its layers), not into modules."""
    found, seen, todo = [], set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or o is None or isinstance(o, (torch.nn.Module, type, str, int,
                                                         float, bool)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            todo.extend(o)
        elif hasattr(o, "__dict__") and not callable(o):
            todo.extend(vars(o).values())
    return found
