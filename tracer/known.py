"""Storages whose every element is known to be one (or zero), followed through the symbolic run.

A fake tensor has no values, but some code decides its path from values that are known without
reading them: Hugging Face's encoder-decoders (BART, Pegasus, Marian...) make their decoder's
padding mask with ``torch.ones`` when none is given, and its sdpa mask code then drops the
(B, 1, S, S) mask after checking ``padding_mask.all()`` (:func:`memsim.tracer.hf.all_ones_mask`).
This module remembers which storages hold only ones, or only zeros:

- made by ``ones``/``zeros`` (and ``_like``, ``new_``), or ``full``/``full_like``/``new_full``
  with the value 1 or 0, or an input given with ``fill="ones"``
  (:class:`~memsim.tracer.spec.TensorSpec`);
- a copy of such a tensor that keeps its values (a dtype conversion, ``clone``, an index or
  gather from it, ``repeat``, ``expand`` copied, a nearest resize, a max pool or max/min); a
  view shares the storage, so it is known too;
- what is computed from such values: ``all``/``any``, the logical negation of a boolean one,
  a comparison with a number, a product or logical and/or of two;
- a check that a healthy step's activations are finite: ``isfinite`` gives ones, ``isnan`` and
  ``isinf`` zeros (DETR's encoder clamps its activations ``if not torch.isfinite(h).all()``).
  A step that reads such a check's value (:func:`read`) records it as assumed (:func:`assume`),
  as it does for ``torch._is_all_true`` (torch.distributions' check of its parameters);
- forgotten when any op writes into the storage (an in-place op or an ``out=`` argument).

Reading such a value (``.item()``, ``bool()``) gives it (:func:`value`). The recorder
(:class:`~memsim.tracer.recorder.Recorder`) calls :func:`observe` for each op it records, while
:func:`tracking` is entered (the run). Nothing is assumed of values otherwise.

The run also keeps the checks of values it took to hold (:func:`assume`: a vision-language
model's check of its image tokens), which the report lists.
"""

from __future__ import annotations

import contextlib
import operator
import weakref

import torch

aten = torch.ops.aten
_INF = float("inf")

# ops that make a fresh tensor of one value: op -> (index of the value among the args, or
# None, and the value it has then)
_MAKES = {aten.ones.default: (None, 1), aten.ones_like.default: (None, 1),
          aten.new_ones.default: (None, 1), aten.zeros.default: (None, 0),
          aten.zeros_like.default: (None, 0), aten.new_zeros.default: (None, 0),
          aten.full.default: (1, None), aten.full_like.default: (1, None),
          aten.new_full.default: (2, None)}
# ops whose result holds only values of their first tensor argument
_KEEPS = frozenset({aten._to_copy.default, aten.clone.default, aten.index.Tensor,
                    aten.index_select.default, aten.gather.default, aten.repeat.default,
                    aten.expand_copy.default, aten.slice_copy.Tensor,
                    aten.select_copy.int, aten.alias_copy.default,
                    aten.view_copy.default, aten._unsafe_view.default,
                    aten.all.default, aten.all.dim, aten.all.dims, aten.any.default,
                    aten.any.dim, aten.any.dims}
                   # nearest resizing copies values (DETR resizes its mask of ones), max
                   # pooling and max/min reductions pick them (CANINE pools its mask of ones)
                   | {getattr(getattr(aten, f"{p}{d}d"), o) for p in (
                       "upsample_nearest", "_upsample_nearest_exact") for d in (1, 2, 3)
                      for o in ("default", "vec")}
                   | {aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default,
                      aten.amax.default, aten.amin.default, aten.max.default, aten.min.default,
                      aten.max.dim, aten.min.dim})
# ops whose boolean result flips a known one: logical negation
_NEGATES = frozenset({aten.logical_not.default, aten.bitwise_not.default})
# a healthy step's checks of its activations: op -> the value of every element
_HEALTHY = {aten.isfinite.default: 1, aten.isnan.default: 0, aten.isinf.default: 0,
            aten.isposinf.default: 0, aten.isneginf.default: 0}
# torch.distributions' check of its parameters' constraints (``if not torch._is_all_true(valid):
# raise``): it holds in any run that goes past it (GroupViT's Gumbel checks its Uniform's bounds)
_ASSERTS = frozenset({aten._is_all_true.default})

# torch.isfinite is composite: ``(x == x) * (x.abs() != inf)``; a healthy step's comparisons
_SELF_COMPARE = {aten.eq.Tensor: 1, aten.ne.Tensor: 0}          # x == x (no NaN), x != x
_INF_COMPARE = {aten.ne.Scalar: 1, aten.eq.Scalar: 0}           # x != inf, x == inf
# a known value compared with a number: op -> the comparison (torch.distributions checks its
# parameters' constraints so: GroupViT's Gumbel(full(0.), full(1.)) checks scale > 0)
_SCALAR_COMPARES = {aten.gt.Scalar: operator.gt, aten.ge.Scalar: operator.ge,
                    aten.lt.Scalar: operator.lt, aten.le.Scalar: operator.le,
                    aten.eq.Scalar: operator.eq, aten.ne.Scalar: operator.ne}
# ops that combine two known boolean values: op -> how
_COMBINES = {aten.mul.Tensor: min, aten.logical_and.default: min,
             aten.bitwise_and.Tensor: min, aten.logical_or.default: max,
             aten.bitwise_or.Tensor: max}

_NOTHING, _MAKE, _KEEP, _WRITE, _NEGATE, _CHECK, _COMPARE, _COMBINE = range(8)
_kinds: dict = {}
_active: "_Known | None" = None


def _kind(func) -> int:
    k = _kinds.get(func)
    if k is None:
        if func in _MAKES:
            k = _MAKE
        elif func in _KEEPS:
            k = _KEEP
        elif func in _NEGATES:
            k = _NEGATE
        elif func in _HEALTHY or func in _ASSERTS:
            k = _CHECK
        elif func in _SELF_COMPARE or func in _INF_COMPARE or func in _SCALAR_COMPARES:
            k = _COMPARE
        elif func in _COMBINES:
            k = _COMBINE
        elif any(a.alias_info is not None and a.alias_info.is_write
                 for a in func._schema.arguments):
            k = _WRITE
        else:
            k = _NOTHING
        _kinds[func] = k
    return k


class _Known:
    def __init__(self) -> None:
        # storage -> the value every element holds (1 or 0)
        self.values: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # storage -> what its value was taken to hold from (a healthy step's check), in words
        self.because: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.assumed: list[str] = []  # checks of values taken to hold, in words

    def mark(self, t: torch.Tensor, value: int = 1, because: str | None = None) -> None:
        self.values[t.untyped_storage()] = value
        if because is not None:
            self.because[t.untyped_storage()] = because
        else:
            self.because.pop(t.untyped_storage(), None)

    def why(self, *ts) -> str | None:
        """The assumption any of ``ts``'s values rests on (None: none)."""
        for t in ts:
            if isinstance(t, torch.Tensor) and self.because:
                w = self.because.get(t.untyped_storage())
                if w is not None:
                    return w
        return None

    def value(self, t):
        if not (isinstance(t, torch.Tensor) and self.values):
            return None
        return self.values.get(t.untyped_storage())

    def holds(self, t) -> bool:
        return self.value(t) == 1

    @staticmethod
    def _healthy(t: torch.Tensor) -> str | None:
        """What a check of ``t``'s values taken to find them finite assumes, in words (None
        where ``t`` is not floating: then it holds). Noted when the value is read."""
        if not (t.is_floating_point() or t.is_complex()):
            return None
        from .sources import model_line
        return (f"assumed: the model's check that its values are finite{model_line()} holds, "
                "as in a healthy step")

    def _compare(self, func, args, out) -> None:
        """A comparison: of a known value with a number, its answer (nothing assumed); of a
        floating tensor with itself or with infinity, a healthy step's answer."""
        if not (isinstance(out, torch.Tensor) and len(args) >= 2
                and isinstance(args[0], torch.Tensor)):
            return
        v = self.value(args[0])
        if func in _SCALAR_COMPARES and v is not None and type(args[1]) in (int, float, bool):
            self.mark(out, int(_SCALAR_COMPARES[func](v, args[1])), self.why(args[0]))
        elif not args[0].is_floating_point():
            return
        elif func in _SELF_COMPARE and args[1] is args[0]:
            # x == x: no NaN; a known value has none, others are a healthy step's
            self.mark(out, _SELF_COMPARE[func],
                      self.why(args[0]) if v is not None else self._healthy(args[0]))
        elif func in _INF_COMPARE and isinstance(args[1], float) and abs(args[1]) == _INF:
            self.mark(out, _INF_COMPARE[func], self._healthy(args[0]))

    def observe(self, func, args, kwargs, out) -> None:
        k = _kind(func)
        if k == _NOTHING:
            return
        if k == _MAKE:
            at, value = _MAKES[func]
            if at is not None:
                value = args[at] if len(args) > at else kwargs.get("fill_value")
            if isinstance(out, torch.Tensor) and type(value) in (int, float, bool) \
                    and value in (0, 1):
                self.mark(out, int(value))
            return
        if k == _CHECK:
            if func in _ASSERTS and isinstance(out, torch.Tensor):
                v = self.value(args[0]) if args else None
                if v is not None:   # known: the real answer
                    self.mark(out, int(bool(v)), self.why(args[0]))
                else:
                    self.mark(out, 1, _asserted_here())
            elif isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                self.mark(out, _HEALTHY[func], self._healthy(args[0]))
            return
        if k == _COMPARE:
            self._compare(func, args, out)
            return
        if k == _COMBINE:
            a, b = (self.value(x) for x in args[:2])
            if a is not None and b is not None and isinstance(out, torch.Tensor):
                self.mark(out, _COMBINES[func](a, b), self.why(*args[:2]))
            return
        if not self.values:
            return
        if k in (_KEEP, _NEGATE):
            v = self.value(args[0]) if args else None
            first = out[0] if isinstance(out, tuple) and out else out   # (values, indices)
            if v is not None and isinstance(first, torch.Tensor):
                self.mark(first, v if k == _KEEP else 1 - v, self.why(args[0]))
            return
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor):
                    self.values.pop(t.untyped_storage(), None)
                    self.because.pop(t.untyped_storage(), None)


def _asserted_here() -> str:
    from .sources import model_line
    return (f"assumed: the check of values{model_line()} holds, as in any run that goes past "
            "it (torch.distributions checks its parameters so)")


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


def value(t):
    """The value every element of ``t``'s storage is known to hold in the current run (1 or
    0), or None."""
    return None if _active is None else _active.value(t)


def read(t):
    """:func:`value`, read by the step (``.item()``, ``bool()``): the assumption it rests on,
    if any, is recorded (:func:`assume`)."""
    v = value(t)
    if v is not None:
        why = _active.why(t)
        if why is not None:
            assume(why)
    return v


def observe(func, args, kwargs, out) -> None:
    if _active is not None:
        _active.observe(func, args, kwargs, out)
