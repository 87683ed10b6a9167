"""Storages whose every element is known to be one, followed through the symbolic run.

A fake tensor has no values, but some code decides its path from values that are known without
reading them: Hugging Face's encoder-decoders (BART, Pegasus, Marian...) make their decoder's
padding mask with ``torch.ones`` when none is given, and its sdpa mask code then drops the
(B, 1, S, S) mask after checking ``padding_mask.all()`` (:func:`memsim.tracer.hf.all_ones_mask`).
This module remembers which storages hold only ones:

- made by ``ones``, ``ones_like``, ``new_ones``, or ``full``/``full_like``/``new_full`` with the
  value 1, or an input given with ``fill="ones"`` (:class:`~memsim.tracer.spec.TensorSpec`);
- a copy of such a tensor that keeps its values (a dtype conversion, ``clone``, an index or
  gather from it, ``repeat``, ``expand`` copied); a view shares the storage, so it is known too;
- forgotten when any op writes into the storage (an in-place op or an ``out=`` argument).

The recorder (:class:`~memsim.tracer.recorder.Recorder`) calls :func:`observe` for each op it
records, while :func:`tracking` is entered (the run). Nothing is assumed of values otherwise.

The run also keeps the checks of values it took to hold (:func:`assume`: a vision-language
model's check of its image tokens), which the report lists.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

aten = torch.ops.aten

# ops that make a fresh tensor of ones: op -> index of the fill value among the args (None: ones)
_MAKES = {aten.ones.default: None, aten.ones_like.default: None, aten.new_ones.default: None,
          aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}
# ops whose result holds only values of their first tensor argument
_KEEPS = frozenset({aten._to_copy.default, aten.clone.default, aten.index.Tensor,
                    aten.index_select.default, aten.gather.default, aten.repeat.default,
                    aten.expand_copy.default, aten.slice_copy.Tensor,
                    aten.select_copy.int, aten.alias_copy.default,
                    aten.view_copy.default, aten._unsafe_view.default})

_NOTHING, _MAKE, _KEEP, _WRITE = range(4)
_kinds: dict = {}
_active: "_Known | None" = None


def _kind(func) -> int:
    k = _kinds.get(func)
    if k is None:
        if func in _MAKES:
            k = _MAKE
        elif func in _KEEPS:
            k = _KEEP
        elif any(a.alias_info is not None and a.alias_info.is_write
                 for a in func._schema.arguments):
            k = _WRITE
        else:
            k = _NOTHING
        _kinds[func] = k
    return k


class _Known:
    def __init__(self) -> None:
        self.ones: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.assumed: list[str] = []  # checks of values taken to hold, in words

    def mark(self, t: torch.Tensor) -> None:
        self.ones[t.untyped_storage()] = True

    def holds(self, t) -> bool:
        return (isinstance(t, torch.Tensor) and bool(self.ones)
                and t.untyped_storage() in self.ones)

    def observe(self, func, args, kwargs, out) -> None:
        k = _kind(func)
        if k == _NOTHING:
            return
        if k == _MAKE:
            at = _MAKES[func]
            value = (args[at] if len(args) > at else kwargs.get("fill_value")) \
                if at is not None else 1
            if isinstance(out, torch.Tensor) and type(value) in (int, float, bool) \
                    and value == 1:
                self.mark(out)
            return
        if not self.ones:
            return
        if k == _KEEP:
            if args and self.holds(args[0]) and isinstance(out, torch.Tensor):
                self.mark(out)
            return
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor):
                    self.ones.pop(t.untyped_storage(), None)


@contextlib.contextmanager
def tracking():
    """Follow known-ones storages for the run (not nested: an inner run has its own)."""
    global _active
    prev, _active = _active, _Known()
    try:
        yield _active
    finally:
        _active = prev


def assume(text: str) -> None:
    """Record a check of tensor values that the run takes to hold (for the report's notes)."""
    if _active is not None and text not in _active.assumed:
        _active.assumed.append(text)


def mark(t: torch.Tensor) -> None:
    """``t``'s storage holds only ones (an input given so)."""
    if _active is not None:
        _active.mark(t)


def all_ones(t) -> bool:
    """Whether every element of ``t``'s storage is known to be one in the current run."""
    return _active is not None and _active.holds(t)


def observe(func, args, kwargs, out) -> None:
    if _active is not None:
        _active.observe(func, args, kwargs, out)
