"""The stack of repeated blocks a trace folds (:mod:`memsim.tracer.fold`): found in a model
(:func:`find_stack`), and cut short for the runs the construction starts from (:func:`cut`).

A decoder repeats one block (same class, same parameter shapes, same code path) dozens of
times. The stack is the ``nn.ModuleList`` or ``nn.Sequential`` holding most parameters, and its
pattern: ``prefix`` blocks that differ (DeepSeek's first dense layers, a ResNet stage's
downsampling block), then a *unit* of ``period`` blocks repeated (one block; two for Gemma2's
alternating sliding and full attention). Blocks are compared by class, parameter and buffer
shapes, dtypes and ``requires_grad``, and every plain attribute of every submodule except
per-block identifiers (an attribute whose value differs in every block, such as ``layer_idx``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

TRACED_UNITS = 4   # run A; run B has one more
# fold stacks of at least this many units: the two runs trace 9 units and each run's step
# outside the stack (embeddings, head, loss, optimizer) costs about as much as a few more
MIN_UNITS = 14


class CannotFold(Exception):
    """The run does not repeat as the stack does; the reason says where."""


@dataclass(frozen=True)
class Stack:
    """A stack of blocks at ``path``: ``size`` blocks, ``prefix`` distinct ones first, then
    units of ``period`` blocks repeated."""

    path: str
    size: int
    prefix: int
    period: int

    @property
    def units(self) -> int:
        return (self.size - self.prefix) // self.period

    def layers(self, units: int) -> int:
        """Blocks of a stack cut to ``units`` units."""
        return self.prefix + units * self.period

    def describe(self) -> str:
        what = f"{self.units} units of {self.period} blocks" if self.period > 1 else \
            f"{self.units} blocks"
        pre = f" after {self.prefix} distinct" if self.prefix else ""
        return f"{self.path}: {what}{pre}"


def _plain(v) -> bool:
    if isinstance(v, (bool, int, float, str, type(None))):
        return True
    return isinstance(v, (tuple, list)) and all(_plain(x) for x in v)


def _frozen(v):
    return tuple(_frozen(x) for x in v) if isinstance(v, (tuple, list)) else v


def _attributes(block: torch.nn.Module) -> dict:
    """Every instance attribute of every submodule: plain values as they are, others by what
    they are (a ``forward`` replaced by a checkpointing wrapper, a cached tensor's shape)."""
    out = {}
    for name, m in block.named_modules(remove_duplicate=False):
        for k, v in vars(m).items():
            if k in _MODULE_STATE or k == "training":
                continue
            out[(name, k)] = _frozen(v) if _plain(v) else _kind(v)
    return out


# the state every module keeps (parameters, hooks...): compared by _shape, not here
_MODULE_STATE = frozenset(vars(torch.nn.Module()))


def _kind(v) -> tuple:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    fn = getattr(v, "func", v)
    return ("object", type(v).__qualname__, getattr(fn, "__qualname__", None))


def _shape(block: torch.nn.Module) -> tuple:
    out = []
    for name, m in block.named_modules(remove_duplicate=False):
        out.append((name, type(m),
                    tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                          for n, p in m._parameters.items() if p is not None),
                    tuple((n, tuple(b.shape), b.dtype)
                          for n, b in m._buffers.items() if b is not None),
                    len(m._forward_hooks), len(m._forward_pre_hooks),
                    len(m._backward_hooks), len(getattr(m, "_backward_pre_hooks", ()))))
    return tuple(out)


def find_stack(model: torch.nn.Module, touched: tuple = ()) -> Stack | None:
    """The stack of repeated blocks worth folding, or None. ``touched``: module paths a
    strategy treats one by one (a checkpoint plan's, a tensor-parallel plan's): blocks differ
    where it treats them differently."""
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or \
                len(mod) < MIN_UNITS or any(k is None for k in mod._modules.values()):
            continue
        keys = list(mod._modules)
        if keys != [str(i) for i in range(len(keys))]:
            continue
        n = sum(p.numel() for p in mod.parameters())
        if best is None or n > best[0]:
            best = (n, path, mod)
    if best is None or best[0] == 0:
        return None
    _, path, mod = best
    blocks = list(mod._modules.values())
    seen: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for t in list(b.parameters()) + list(b.buffers()):
            if seen.setdefault(id(t), i) != i:
                return None  # blocks sharing weights: not independent copies
    attrs = [_attributes(b) for b in blocks]
    keys = set().union(*attrs)
    ident = {k for k in keys if all(_plain(a.get(k)) for a in attrs)
             and len({a.get(k, _MISSING) for a in attrs}) == len(blocks)}
    sigs = [(_shape(b), tuple(sorted((k, v) for k, v in a.items() if k not in ident)),
             _touched(f"{path}.{i}" if path else str(i), touched))
            for i, (b, a) in enumerate(zip(blocks, attrs))]
    for period in range(1, 5):
        for prefix in range(0, 4):
            rest = len(blocks) - prefix
            if rest % period or rest // period < MIN_UNITS:
                continue
            if all(sigs[prefix + i] == sigs[prefix + i % period] for i in range(rest)):
                return Stack(path, len(blocks), prefix, period)
    return None


_MISSING = object()


def _touched(block: str, paths: tuple) -> tuple:
    """The paths in ``paths`` inside ``block``, relative to it."""
    return tuple(sorted(p[len(block):] for p in paths
                        if p == block or p.startswith(block + ".")))


_DEPTH_NAMES = ("num_hidden_layers", "n_layer", "num_layers")


@contextlib.contextmanager
def cut(model: torch.nn.Module, stack: Stack, units: int):
    """The model with its stack cut to ``units`` units (and a Hugging Face config's layer count
    with it), restored on exit."""
    mod = model.get_submodule(stack.path)
    saved = mod._modules
    n = stack.layers(units)
    configs = []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or any(c is cfg for c, _, _ in configs):
            continue
        for name in _DEPTH_NAMES:
            if getattr(cfg, name, None) == stack.size and not isinstance(
                    getattr(type(cfg), name, None), property):
                configs.append((cfg, name, stack.size))
                break
    mod._modules = OrderedDict(list(saved.items())[:n])
    mod.__dict__["_memsim_whole"] = len(saved)   # the progress says of how many (progress.py)
    try:
        for cfg, name, _ in configs:
            setattr(cfg, name, n)
        yield
    finally:
        mod._modules = saved
        mod.__dict__.pop("_memsim_whole", None)
        for cfg, name, v in configs:
            setattr(cfg, name, v)
