"""What is known of storages' values, followed through the symbolic run: every element one (or
zero, or another number), or between two bounds.

A fake tensor has no values, but some code decides its path from values that are known without
reading them: Hugging Face's encoder-decoders (BART, Pegasus, Marian...) make their decoder's
padding mask with ``torch.ones`` when none is given, and its sdpa mask code then drops the
(B, 1, S, S) mask after checking ``padding_mask.all()`` (:func:`memsim.tracer.hf.all_ones_mask`).
This module remembers which storages hold only one value (ones, zeros), or values between two
bounds (``lo <= x <= hi``, both included; one value is its own bounds):

- made by ``ones``/``zeros`` (and ``_like``, ``new_``), or ``full``/``full_like``/``new_full``
  or ``scalar_tensor`` with a finite number, or an input given with ``fill="ones"``
  (:class:`~memsim.tracer.spec.TensorSpec`);
- a copy of such a tensor that keeps its values (a dtype conversion, ``clone``, an index or
  gather from it, ``repeat``, ``expand`` copied, a nearest resize, a max pool or max/min); a
  view shares the storage, so it is known too;
- what is computed from such values: ``all``/``any``, the logical negation of a boolean one,
  a comparison with a number (answered where it is the same at both bounds), a product or
  logical and/or of two (or of one known side that decides it: ``x & 1`` is x), ``clamp``,
  ``torch.where`` (the branch a known condition takes, else both branches' bounds), ``F.pad``
  with a constant (its bounds widened to it), a sum with a number;
- a range of indices (``arange`` from 0 or more): at least its start (Hugging Face's
  bidirectional masks ask ``q_idx >= 0``); the max of a view holding every element of
  ``arange(n)`` is n - 1, its min 0 (Reformer reads ``position_ids.max().item()``);
- sizes combined into a 0-dim tensor (``torch.div(n, k, rounding_mode="trunc") - 1``:
  Longformer counts its chunks so): the size, which ``.item()`` gives back;
- a check that a healthy step's activations are finite: ``isfinite`` gives ones, ``isnan`` and
  ``isinf`` zeros (DETR's encoder clamps its activations ``if not torch.isfinite(h).all()``).
  A step that reads such a check's value (:func:`read`) records it as assumed (:func:`assume`),
  as it does for ``torch._is_all_true`` (torch.distributions' check of its parameters);
- forgotten when any op writes into the storage (an in-place op or an ``out=`` argument),
  except ``t[mask] = v`` with a boolean mask known all False (Longformer's
  ``mask[mask == 2] = max``), which writes nothing.

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

from .known_data import (_EXTREMES, _ROUTING, _SUMS, _TALLY_OPS, SMALL, Contents, Counts, Routes,
                         Tallies)

aten = torch.ops.aten
_INF = float("inf")

# ops that make a fresh tensor of one value: op -> (index of the value among the args, or
# None, and the value it has then)
_MAKES = {aten.ones.default: (None, 1), aten.ones_like.default: (None, 1),
          aten.new_ones.default: (None, 1), aten.zeros.default: (None, 0),
          aten.zeros_like.default: (None, 0), aten.new_zeros.default: (None, 0),
          aten.full.default: (1, None), aten.full_like.default: (1, None),
          aten.new_full.default: (2, None), aten.scalar_tensor.default: (0, None)}
# ops whose result holds only values of their first tensor argument
_KEEPS = frozenset({aten._to_copy.default, aten.clone.default, aten.index.Tensor,
                    aten.index_select.default, aten.gather.default, aten.repeat.default,
                    aten.expand_copy.default, aten.slice_copy.Tensor,
                    aten.select_copy.int, aten.alias_copy.default,
                    aten.view_copy.default, aten._unsafe_view.default}
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
# a range of indices against counts (known._against)
_RANGE_COMPARES = frozenset({aten.lt.Tensor, aten.ge.Tensor, aten.le.Tensor, aten.gt.Tensor})
_COMBINES = {aten.mul.Tensor: min, aten.logical_and.default: min,
             aten.bitwise_and.Tensor: min, aten.logical_or.default: max,
             aten.bitwise_or.Tensor: max}

# all/any: decided from the values (kept apart from _KEEPS: their result is a truth value)
_TRUTHS = frozenset({aten.all.default, aten.all.dim, aten.all.dims, aten.any.default,
                     aten.any.dim, aten.any.dims})
# ``clamp`` of known values: op -> the names of its bounds among the arguments
_CLAMPS = {aten.clamp.default: ("min", "max"), aten.clamp_min.default: ("min", None),
           aten.clamp_max.default: (None, "max")}
# ``F.pad(x, ..., value=c)``: x's values and c
_PADS = frozenset({aten.constant_pad_nd.default})
# a range of integers counting up from 0 or more (``arange``), and such values plus a number:
# Hugging Face's bidirectional masks compare indices with 0
_RANGES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
_SHIFTS = frozenset({aten.add.Tensor, aten.add.Scalar})

# arithmetic on sizes that makes 0-dim tensors (``torch.div(n, k, rounding_mode="trunc")``,
# then ``- 1``: Longformer counts its chunks so), read back as a size with ``.item()``
_SIZE_OPS = {aten.div.Tensor_mode: operator.floordiv, aten.add.Tensor: operator.add,
             aten.sub.Tensor: operator.sub, aten.mul.Tensor: operator.mul,
             aten.rsub.Scalar: lambda a, b: b - a}

_NOTHING, _MAKE, _KEEP, _WRITE, _NEGATE, _CHECK, _COMPARE, _COMBINE, _TRUTH, _CLAMP, _PICK, \
    _PAD, _RANGE, _SHIFT, _SIZE = range(15)
# each kind and the tables of its ops, in the order they are looked up (an op in several:
# the first); any other op that writes into an argument is a _WRITE
_KINDS = ((_MAKE, (_MAKES,)), (_KEEP, (_KEEPS,)), (_NEGATE, (_NEGATES,)),
          (_CHECK, (_HEALTHY, _ASSERTS)),
          (_COMPARE, (_SELF_COMPARE, _INF_COMPARE, _SCALAR_COMPARES, _RANGE_COMPARES)),
          (_COMBINE, (_COMBINES,)), (_TRUTH, (_TRUTHS,)), (_CLAMP, (_CLAMPS,)),
          (_PICK, ({aten.where.self},)), (_PAD, (_PADS,)), (_RANGE, (_RANGES,)),
          (_SHIFT, (_SHIFTS,)), (_SIZE, (_SIZE_OPS,)))
_kinds: dict = {}
_active: "_Known | None" = None
def _kind(func) -> int:
    k = _kinds.get(func)
    if k is None:
        k = next((kind for kind, tables in _KINDS if any(func in t for t in tables)), None)
        if k is None:
            k = _WRITE if any(a.alias_info is not None and a.alias_info.is_write
                              for a in func._schema.arguments) else _NOTHING
        _kinds[func] = k
    return k


class _Known(Contents, Counts, Routes, Tallies):
    def __init__(self) -> None:
        # storage -> the bounds (lo, hi) of every element's value; lo == hi: the value
        self.values: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # storage -> what its value was taken to hold from (a healthy step's check), in words
        self.because: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.assumed: list[str] = []  # checks of values taken to hold, in words
        # values read in Python control flow that the run has no data for, by site
        # (memsim.tracer.data_dependent.Branch), in the order first read
        self.branches: dict = {}
        # storage -> the size (a SymInt) a 0-dim tensor holds: ``torch.div`` of sizes
        self.sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # storage -> {(shape, stride, offset): count}: a mask counted once is counted the same
        # when it is used again (memsim.tracer.data_dependent.count)
        self.masks_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # storage -> every element's value, a real 1-D tensor as long as the storage (a small
        # storage of concrete size: the indices of a mask's true elements, what is computed
        # from them)
        self.contents: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # storage -> the most each element can be, a size: counts of true elements (the sum
        # of a boolean mask over a (B, S) dimension holds counts of at most S)
        self.counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # storage -> the size every element is taken to hold (counts at the run's bound), and
        # storage -> n for ``arange(n)`` (0, 1, ... n - 1): compared, they decide masks
        # (``arange(most) < counts`` is all true where every count is at its most)
        self.exactly: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.upto: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # a mixture of experts' routing, followed from ``topk``'s indices (:class:`Route`):
        # storage -> Route for the indices; -> (Route, classes) for their one-hot mask;
        # -> Route for the tokens per expert (the mask summed over tokens and slots), and for
        # which experts are hit (those counts > 0)
        self.routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.onehot: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.per_expert: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.hit: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # storage -> one size per element: tokens per expert counted and exchanged by expert
        # parallelism (:class:`~memsim.tracer.known_data.Tallies`)
        self.tallies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def mark(self, t: torch.Tensor, value: int = 1, because: str | None = None) -> None:
        self.bound(t, (value, value), because)

    def bound(self, t: torch.Tensor, bounds: tuple, because: str | None = None) -> None:
        """Every element of ``t``'s storage lies in ``bounds`` (lo, hi), both included."""
        self.values[t.untyped_storage()] = bounds
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

    def bounds(self, t) -> tuple | None:
        """(lo, hi) of the values in ``t``'s storage (of ``t``'s own elements where they are
        known one by one); a number is its own bounds."""
        if type(t) in (int, float, bool):
            return (t, t)
        if not isinstance(t, torch.Tensor):
            return None
        if self.contents:
            real = self.real(t)
            if real is not None and real.numel():
                from torch._subclasses.fake_tensor import unset_fake_temporarily
                with unset_fake_temporarily():
                    return (real.min().item(), real.max().item())
        if not self.values:
            return None
        return self.values.get(t.untyped_storage())

    def exact(self, t):
        """The one number every element of ``t``'s storage holds, or None."""
        b = self.bounds(t) if isinstance(t, torch.Tensor) else None
        return b[0] if b is not None and b[0] == b[1] else None

    def value(self, t):
        """:meth:`exact`, or the size a 0-dim tensor holds, or the count every element of a
        storage of counts is taken to hold, or one element of expert parallelism's tokens per
        expert (:meth:`tally`) (SymInts: read, never compared here, which would add a
        guard)."""
        if isinstance(t, torch.Tensor) and (self.sizes or self.exactly):
            size = self.sizes.get(t.untyped_storage())
            if size is None and self.exactly and type(t.numel()) is int and t.numel() == 1:
                size = self.exactly.get(t.untyped_storage())
            if size is not None:
                return size
        if isinstance(t, torch.Tensor) and self.tallies:
            size = self.tally(t)   # one of expert parallelism's counts of tokens
            if size is not None:
                return size
        return self.exact(t)

    def holds(self, t) -> bool:
        return self.exact(t) == 1

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
        if func in _RANGE_COMPARES and self._against(func, args, out):
            return
        if not (isinstance(out, torch.Tensor) and len(args) >= 2
                and isinstance(args[0], torch.Tensor)):
            return
        v, b = self.exact(args[0]), self.bounds(args[0])
        if func in _SCALAR_COMPARES and b is not None and type(args[1]) in (int, float, bool):
            # every element's answer is the same where it is the same at both bounds (and,
            # for ==/!=, where the number is outside them)
            c, op = args[1], _SCALAR_COMPARES[func]
            lo, hi = int(op(b[0], c)), int(op(b[1], c))
            if func in (aten.eq.Scalar, aten.ne.Scalar) and b[0] != b[1]:
                lo = hi = (int(op(c - 1 if c > b[1] else c + 1, c))
                           if (c < b[0] or c > b[1]) else None)
            if lo is not None and lo == hi:
                self.mark(out, lo, self.why(args[0]))
        elif not args[0].is_floating_point():
            return
        elif func in _SELF_COMPARE and args[1] is args[0]:
            # x == x: no NaN; a known value has none, others are a healthy step's
            self.mark(out, _SELF_COMPARE[func],
                      self.why(args[0]) if v is not None else self._healthy(args[0]))
        elif func in _INF_COMPARE and isinstance(args[1], float) and abs(args[1]) == _INF:
            self.mark(out, _INF_COMPARE[func], self._healthy(args[0]))

    def observe(self, func, args, kwargs, out) -> None:
        if self.contents and self._compute(func, args, kwargs, out):
            return
        if func in _TALLY_OPS and self._tally(func, args, kwargs, out):
            return
        if func in _ROUTING and self._route(func, args, kwargs, out):
            return
        if func in _SUMS and self._count(func, args, kwargs, out):
            return
        if func in _EXTREMES and self._whole_range(func, args, out):
            return
        k = _kind(func)
        if k == _KEEP and self.counts and args and isinstance(args[0], torch.Tensor):
            most = self.counts.get(args[0].untyped_storage())
            first = out[0] if isinstance(out, tuple) and out else out
            if most is not None and isinstance(first, torch.Tensor):
                self._counts(first, most)
                return
        if func is aten._to_copy.default and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.bool and self.bounds(args[0]) is None \
                and isinstance(out, torch.Tensor):
            self.bound(out, (0, 1))   # a boolean's values, converted
            return
        if k == _NOTHING:
            return
        if func in _SIZE_OPS and self._size_arithmetic(func, args, kwargs, out) or k == _SIZE:
            return
        if k == _MAKE:
            at, value = _MAKES[func]
            if at is not None:
                value = args[at] if len(args) > at else kwargs.get("fill_value")
            if isinstance(out, torch.Tensor) and type(value) in (int, float, bool) \
                    and abs(value) != _INF and value == value:
                self.mark(out, int(value) if value in (0, 1) else value)
            return
        if k == _CHECK:
            if func in _ASSERTS and isinstance(out, torch.Tensor):
                v = self.exact(args[0]) if args else None
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
            self._combine(func, args, out)
            return
        if k == _RANGE:
            self._range(func, args, out)
            return
        if not self.values:
            return
        if k in (_KEEP, _NEGATE, _TRUTH):
            b = self.bounds(args[0]) if args and isinstance(args[0], torch.Tensor) else None
            first = out[0] if isinstance(out, tuple) and out else out   # (values, indices)
            if b is None or not isinstance(first, torch.Tensor):
                return
            if k == _KEEP:
                self.bound(first, b, self.why(args[0]))
            elif k == _NEGATE and b[0] == b[1] and b[0] in (0, 1):
                self.mark(first, 1 - b[0], self.why(args[0]))
            elif k == _TRUTH and (b[0] == b[1] or b[0] > 0 or b[1] < 0):
                self.mark(first, int(b[0] != 0), self.why(args[0]))   # all zero, or none
            return
        if k == _CLAMP:
            self._clamp(func, args, kwargs, out)
            return
        if k == _PICK:
            self._pick(args, out)
            return
        if k == _PAD:
            b = self.bounds(args[0])
            c = args[2] if len(args) > 2 else kwargs.get("value", 0)
            if b is not None and type(c) in (int, float) and isinstance(out, torch.Tensor):
                self.bound(out, (min(b[0], c), max(b[1], c)), self.why(args[0]))
            return
        if k == _SHIFT:
            b = self.bounds(args[0]) if isinstance(args[0], torch.Tensor) else None
            c = args[1] if len(args) > 1 else None
            if b is not None and type(c) in (int, float) and kwargs.get("alpha", 1) == 1 \
                    and isinstance(out, torch.Tensor):
                self.bound(out, (b[0] + c, b[1] + c), self.why(args[0]))
            return
        if func is aten.index_put_.default and self._writes_nothing(args):
            return
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor):
                    self.values.pop(t.untyped_storage(), None)
                    self.because.pop(t.untyped_storage(), None)
                    self.contents.pop(t.untyped_storage(), None)
                    self.counts.pop(t.untyped_storage(), None)
                    self.exactly.pop(t.untyped_storage(), None)
                    self.tallies.pop(t.untyped_storage(), None)


    def _combine(self, func, args, out) -> None:
        """A product or logical and/or: of two known 0/1 values, its value; with one side
        known, what that side decides (``x & 1`` is x, ``x & 0`` is 0, ``x | 1`` is 1)."""
        if not isinstance(out, torch.Tensor) or len(args) < 2:
            return
        a, b = (self.exact(x) for x in args[:2])
        why = self.why(*args[:2])
        if a is not None and b is not None:
            if a in (0, 1) and b in (0, 1):
                self.mark(out, _COMBINES[func](a, b), why)
            return
        one, other = (a, args[1]) if a is not None else (b, args[0])
        if one not in (0, 1):
            return
        decides = 1 if _COMBINES[func] is max else 0     # or: 1 decides; product/and: 0
        if one == decides:
            self.mark(out, one, why)
        elif self.bounds(other) is not None:
            self.bound(out, self.bounds(other), why)

    def _clamp(self, func, args, kwargs, out) -> None:
        b = self.bounds(args[0])
        if b is None or not isinstance(out, torch.Tensor):
            return
        ends = [args[i + 1] if len(args) > i + 1 else kwargs.get(n) if n else None
                for i, n in enumerate(_CLAMPS[func])]
        if any(e is not None and type(e) not in (int, float) for e in ends):
            return
        lo, hi = ends
        b = tuple(min(max(x, lo) if lo is not None else x, hi) if hi is not None else
                  (max(x, lo) if lo is not None else x) for x in b)
        self.bound(out, b, self.why(args[0]))

    def _pick(self, args, out) -> None:
        """``where(cond, a, b)``: the branch a known condition takes, else both's bounds."""
        if not isinstance(out, torch.Tensor) or len(args) < 3:
            return
        c, a, b = self.exact(args[0]), self.bounds(args[1]), self.bounds(args[2])
        why = self.why(*args[:3])
        if c is not None:
            if (a if c else b) is not None:
                self.bound(out, a if c else b, why)
        elif a is not None and b is not None:
            self.bound(out, (min(a[0], b[0]), max(a[1], b[1])), why)

    def _range(self, func, args, out) -> None:
        """``arange`` counting up from 0 or more: at least its start."""
        if not isinstance(out, torch.Tensor) or out.dtype.is_floating_point:
            return
        start = args[0] if func is not aten.arange.default and args else 0
        step = args[2] if func is aten.arange.start_step and len(args) > 2 else 1
        if type(start) is int and start >= 0 and type(step) is int and step > 0:
            self.bound(out, (start, _INF))
        end = args[0] if func is aten.arange.default else args[1] if len(args) > 1 else None
        if start == 0 and step == 1 and end is not None and not isinstance(end, float):
            self.upto[out.untyped_storage()] = end

    def _size(self, x):
        if type(x) is int or isinstance(x, torch.SymInt):
            return x
        if isinstance(x, torch.Tensor) and self.sizes and x.dim() == 0:
            return self.sizes.get(x.untyped_storage())
        return None

    def _size_arithmetic(self, func, args, kwargs, out) -> bool:
        """Sizes combined into a 0-dim tensor: its value is theirs (trunc and floor agree on
        sizes, which are not negative). Whether it was such arithmetic."""
        if len(args) < 2 or not isinstance(out, torch.Tensor) or out.dim() != 0 \
                or out.is_floating_point():
            return False
        a, b = self._size(args[0]), self._size(args[1])
        if a is None or b is None or kwargs.get("alpha", 1) != 1:
            return False
        if func is aten.div.Tensor_mode and (kwargs.get("rounding_mode") not in ("trunc", "floor")
                                              or (type(b) is int and b <= 0)):
            return False
        self.sizes[out.untyped_storage()] = _SIZE_OPS[func](a, b)
        return True

    def _writes_nothing(self, args) -> bool:
        """``t[mask] = v`` with a boolean ``mask`` known to be all False."""
        indices = args[1] if len(args) > 1 else ()
        return (len(indices) == 1 and isinstance(indices[0], torch.Tensor)
                and indices[0].dtype == torch.bool and self.exact(indices[0]) == 0)


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


def branch(b) -> None:
    """Record a value the run went on with where the model read one it has no data for (the
    first read at each site)."""
    if _active is not None:
        _active.branches.setdefault(b.site, b)


def assume(text: str) -> None:
    """Record a check of tensor values that the run takes to hold (for the report's notes)."""
    if _active is not None and text not in _active.assumed:
        _active.assumed.append(text)


def mark(t: torch.Tensor) -> None:
    """``t``'s storage holds only ones (an input given so)."""
    if _active is not None:
        _active.mark(t)


def why(t) -> str | None:
    """The assumption ``t``'s known values rest on in the current run, or None."""
    return None if _active is None else _active.why(t)


def bounds(t) -> tuple | None:
    """(lo, hi) of the values of ``t``'s storage known in the current run, or None."""
    return None if _active is None else _active.bounds(t)


def most(t) -> object | None:
    """The most each element of ``t`` can be where it holds counts of true elements (an int
    or a SymInt), or None."""
    return None if _active is None else _active.most(t)


def counted(mask: torch.Tensor, count):
    """The count of ``mask``'s true elements the current run took the first time it counted
    this view of its storage, ``count()`` the first time (outside a run: ``count()``)."""
    if _active is None:
        return count()
    from .recorder import as_expr
    key = tuple(as_expr(d) for d in (*mask.shape, -1, *mask.stride(), mask.storage_offset()))
    seen = _active.masks_counted.setdefault(mask.untyped_storage(), {})
    if key not in seen:
        seen[key] = count()
    return seen[key]


def routed(t: torch.Tensor):
    """:meth:`_Known.routed` in the current run."""
    return None if _active is None else _active.routed(t)


def tokens_per_expert(t: torch.Tensor):
    """:meth:`_Known.tokens_per_expert` in the current run."""
    return None if _active is None else _active.tokens_per_expert(t)


def contents(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s values as a real tensor where they are known element by element, or None."""
    return None if _active is None else _active.real(t)


def set_contents(t: torch.Tensor, values: torch.Tensor) -> None:
    """``t``'s elements are ``values`` (a real tensor of its shape; kept where the storage is
    concrete and small)."""
    if _active is not None:
        _active.set_real(t, values)


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
