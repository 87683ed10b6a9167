"""What is known of values that the data decides, for :mod:`memsim.tracer.known`'s tracker
(mixins of its ``_Known``):

- :class:`Contents`: every element of a small storage of concrete size, as a real tensor (the
  indices of a mask's true elements, and what ops compute from them: a model's loop over the
  experts hit runs over them);
- :class:`Counts`: sums of 0/1 values are counts of true elements, of at most the elements
  summed; read as sizes they are at the run's bound (:mod:`memsim.tracer.data_dependent`),
  noted where read, and compared with ``arange`` they decide masks;
- :class:`Routes`: a mixture of experts' routing followed from ``topk``'s indices to its one-hot
  mask, the tokens per expert and the experts hit.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# the most elements a storage known element by element may have
SMALL = 4096
# sums: of 0/1 values they make counts (of true elements), whose most is a size
_SUMS = frozenset({aten.sum.default, aten.sum.dim_IntList})
# whole reductions whose value a whole range decides (:meth:`Counts._whole_range`)
_EXTREMES = frozenset({aten.max.default, aten.min.default})
# the ops of a mixture of experts' routing (known._route)
_ROUTING = _SUMS | {aten.topk.default, aten.scatter_.value, aten.scatter.value,
                    aten._to_copy.default, aten.gt.Scalar, aten.ne.Scalar}


def _layout(t: torch.Tensor):
    """``(storage elements, shape, stride, offset)`` of ``t`` where all are concrete (reading a
    symbolic one would pin it), else None."""
    nbytes = t.untyped_storage().nbytes()
    parts = (nbytes, *t.shape, *t.stride(), t.storage_offset())
    if any(isinstance(p, torch.SymInt) for p in parts):
        return None
    return (nbytes // t.element_size(), tuple(t.shape), tuple(t.stride()),
            t.storage_offset())


def _expr(n):
    """A size as a sympy expression (an int as itself), read without a guard."""
    node = getattr(n, "node", None)
    return node.expr if node is not None else n


def _flat(x) -> list:
    from torch.utils._pytree import tree_flatten
    return tree_flatten(x)[0]


class Contents:
    """Storages known element by element (the tracker's ``contents``)."""

    def real(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s values as a real tensor, where its storage's elements are known one by one
        (and ``t``'s shape and strides are concrete)."""
        flat = self.contents.get(t.untyped_storage()) if self.contents else None
        if flat is None:
            return None
        layout = _layout(t)
        if layout is None:
            return None
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            return flat.as_strided(*layout[1:])

    def set_real(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """``t``'s elements are ``values`` (a real tensor of its shape); its storage, concrete
        and small, holds nothing else."""
        st = t.untyped_storage()
        layout = _layout(t)
        if layout is None or layout[0] > SMALL or tuple(values.shape) != layout[1]:
            return
        n, shape, stride, offset = layout
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            flat = torch.zeros(n, dtype=t.dtype)
            flat.as_strided(shape, stride, offset).copy_(values)
        self.contents[st] = flat
        self.values.pop(st, None)

    def _compute(self, func, args, kwargs, out) -> bool:
        """An op every tensor argument of which is known element by element: run it on those
        values, and know its outputs' (a write into an argument writes into the known values).
        Whether it was such an op."""
        flat_in = [a for a in _flat((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not flat_in or any(self.contents.get(a.untyped_storage()) is None for a in flat_in):
            return False
        if any(isinstance(a, torch.SymInt) for a in _flat((args, kwargs))):
            return False
        swap = {id(a): self.real(a) for a in flat_in}
        if any(v is None for v in swap.values()):
            return False
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_map
        real_args, real_kwargs = tree_map(
            lambda a: swap[id(a)] if isinstance(a, torch.Tensor) else a, (args, kwargs))
        try:
            with unset_fake_temporarily():
                got = func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 - values not computable here: simply not known
            return False
        outs = [o for o in _flat(out) if isinstance(o, torch.Tensor)]
        reals = [g for g in _flat(got) if isinstance(g, torch.Tensor)]
        if len(outs) != len(reals):
            return False
        for o, g in zip(outs, reals):
            if self.contents.get(o.untyped_storage()) is None:
                self.set_real(o, g)
        return True


class Counts:
    """Counts of true elements (the tracker's ``counts``, ``exactly`` and ``upto``)."""

    def _whole_range(self, func, args, out) -> bool:
        """The max (min) of a view that holds every element of ``arange(n)`` (its last
        dimension the whole range, in order, broadcast over the others: Reformer's position
        ids, expanded over the batch): n - 1 (0). Whether it was such a view."""
        t = args[0] if args else None
        if not (self.upto and isinstance(t, torch.Tensor) and isinstance(out, torch.Tensor)):
            return False
        end = self.upto.get(t.untyped_storage())
        if type(end) is not int or end < 1 or t.dim() == 0 or type(t.shape[-1]) is not int:
            return False
        if not (t.shape[-1] == end and t.stride()[-1] == 1 and t.storage_offset() == 0):
            return False
        self.mark(out, end - 1 if func is aten.max.default else 0)
        return True

    def _count(self, func, args, kwargs, out) -> bool:
        """A sum of 0/1 values (a boolean mask, or values known to lie in [0, 1]), or of such
        counts: counts of at most the elements summed over. Whether it was one."""
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)):
            return False
        each = self.counts.get(x.untyped_storage()) if self.counts else None
        exact = False
        if each is None:
            b = self.bounds(x)
            if b is None and x.dtype == torch.bool:
                b = (0, 1)
            if b is None or b[0] < 0 or b[1] > 1:
                return False
            if b[0] == b[1]:   # all zeros or all ones: the sum is known, nothing assumed
                exact, each = True, b[0]
            else:
                each = 1
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if func is aten.sum.default or dims is None or len(dims) == 0:
            over = x.numel()
        else:
            over = 1
            for d in dims:
                over = over * x.shape[d % max(x.dim(), 1)]
        self._counts(out, each * over, exact)
        return True

    def _counts(self, t: torch.Tensor, most, exact: bool = False) -> None:
        """``t`` holds counts of at most ``most`` (``exact``: each is ``most``); one count
        alone (a 0-dim tensor) is a size from here on, at the bound the run answers
        data-dependent counts at (:mod:`memsim.tracer.data_dependent`): arithmetic on it and
        reads of it follow it, and what it assumed is noted where it is read."""
        from .data_dependent import at_bound, bound_note
        st = t.untyped_storage()
        self.counts[st] = most
        if t.is_floating_point():
            return
        self.exactly[st] = most if exact else at_bound(most)
        if t.dim() == 0:
            self.sizes[st] = self.exactly[st]
        if exact:
            self.because.pop(st, None)
        else:
            self.because[st] = bound_note("a count of true elements")

    def most(self, t) -> object | None:
        """The most each element of ``t``'s storage can be, where it holds counts."""
        if not (isinstance(t, torch.Tensor) and self.counts):
            return None
        return self.counts.get(t.untyped_storage())

    def _against(self, func, args, out) -> bool:
        """``arange(n)`` compared with counts that are all ``n`` (either side): every answer
        the same (``<``: all true, ``>=``: all false). Whether it decided."""
        if not (self.upto and self.exactly and isinstance(out, torch.Tensor) and len(args) >= 2
                and all(isinstance(a, torch.Tensor) for a in args[:2])):
            return False
        a, b = (x.untyped_storage() for x in args[:2])
        flip = False
        n, v = self.upto.get(a), self.exactly.get(b)
        if n is None or v is None:
            n, v, flip = self.upto.get(b), self.exactly.get(a), True
        if n is None or v is None or _expr(n) != _expr(v):
            return False
        # range < n everywhere: lt true, ge false (flipped: n > range, n <= range)
        truth = {aten.lt.Tensor: 1, aten.ge.Tensor: 0, aten.le.Tensor: 1, aten.gt.Tensor: 0}
        flipped = {aten.gt.Tensor: 1, aten.le.Tensor: 0, aten.ge.Tensor: 1, aten.lt.Tensor: 0}
        got = (flipped if flip else truth).get(func)
        if got is None:
            return False
        self.mark(out, got, self.why(*args[:2]))
        return True


class Routes:
    """A mixture of experts' routing (the tracker's ``routes``, ``onehot``, ``per_expert`` and
    ``hit``)."""

    def _route(self, func, args, kwargs, out) -> bool:
        """A mixture of experts' routing, op by op: ``topk``'s indices (``k`` distinct experts
        of ``n`` per token), their one-hot mask (``zeros(..., C).scatter_(-1, idx[..., None],
        1)``, what ``F.one_hot`` runs), that mask summed over tokens and slots (tokens per
        expert), compared with 0 (experts hit). Whether the op was one of them (a scatter also
        writes: the caller forgets what it knew of the target)."""
        if func is aten.topk.default:
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            x, idx = args[0], out[1]
            if type(k) is not int or x.dim() == 0:
                return False
            n = x.shape[dim]
            if type(n) is not int or dim % x.dim() != x.dim() - 1:
                return False
            tokens = 1
            for d in x.shape[:-1]:
                tokens = tokens * d
            from .data_dependent import Route
            self.routes[idx.untyped_storage()] = Route(k, n, tokens)
            return False
        if func in (aten.scatter_.value, aten.scatter.value):
            # one-hot: (tokens..., k, C) from idx[..., None]; several-hot: (tokens, C) from idx
            target, dim, index = args[0], args[1], args[2]
            value = args[3] if len(args) > 3 else kwargs.get("value")
            route = self.routes.get(index.untyped_storage()) if self.routes else None
            made = target if func is aten.scatter_.value else out
            if (route is not None and value == 1 and dim % target.dim() == target.dim() - 1
                    and index.shape[-1] in (1, route.k) and self.exact(target) == 0
                    and type(target.shape[-1]) is int and target.shape[-1] >= route.n
                    and made.stride(-1) == 1 and made.dim() >= 2
                    and made.stride(-2) == made.shape[-1]):
                self.onehot[made.untyped_storage()] = (route, target.shape[-1])
            return False
        if func is aten._to_copy.default:
            mask = self.onehot.get(args[0].untyped_storage()) if self.onehot else None
            if mask is not None and isinstance(out, torch.Tensor) and out.is_contiguous():
                self.onehot[out.untyped_storage()] = mask
            return False
        if func in _SUMS:
            mask = self.onehot.get(args[0].untyped_storage()) if self.onehot else None
            if mask is None or not isinstance(out, torch.Tensor):
                return False
            route, classes = mask
            kept = [d for d in range(args[0].dim()) if d not in
                    {x % args[0].dim() for x in (args[1] if len(args) > 1 else ())}]
            if func is aten.sum.dim_IntList and len(kept) == 1 \
                    and args[0].stride(kept[0]) == 1 and args[0].shape[kept[0]] == classes:
                self.per_expert[out.untyped_storage()] = route
                return True
            return False
        if func in (aten.gt.Scalar, aten.ne.Scalar):
            route = self.per_expert.get(args[0].untyped_storage()) if self.per_expert else None
            if route is not None and args[1] == 0 and isinstance(out, torch.Tensor):
                self.hit[out.untyped_storage()] = route
                return True
        return False

    def tokens_per_expert(self, t: torch.Tensor):
        """``(Route, expert)`` where ``t`` is one element of a routing's tokens per expert
        (read as a number: JetMoE's ``.tolist()``), or None."""
        route = self.per_expert.get(t.untyped_storage()) if self.per_expert else None
        if route is None or t.numel() != 1 or type(t.storage_offset()) is not int:
            return None
        return route, t.storage_offset()   # the counts are (C,), one per expert, contiguous

    def routed(self, t: torch.Tensor):
        """``(Route, expert)`` where ``t`` is one expert's slice of a routing's one-hot mask
        (its slots and tokens, whole), ``(Route, None)`` where it is the experts hit, or
        None."""
        st = t.untyped_storage()
        if self.hit and st in self.hit:
            return self.hit[st], None
        mask = self.onehot.get(st) if self.onehot else None
        if mask is None:
            return None
        route, classes = mask
        # the mask is (tokens..., k, classes), contiguous: a slice of one expert is every dim
        # but the classes', starting at that expert's column
        import sympy
        if any(type(s) is int and s == 1 and type(n) is int and n == classes
               for s, n in zip(t.stride(), t.shape)) or type(t.storage_offset()) is not int \
                or sympy.expand(_expr(t.numel()) - _expr(route.tokens) * route.k) != 0:
            return None
        return route, t.storage_offset()


# counts followed element by element where some are sizes (:class:`Tallies`)
_TALLY_OPS = frozenset({aten.scatter_add_.default, aten.scatter_add.default,
                        aten.sum.dim_IntList, aten.stack.default, aten.cat.default,
                        aten.clone.default, aten._to_copy.default})


def _alltoall():
    ns = getattr(torch.ops, "c10d", None)
    try:
        return ns.alltoall_base_.default
    except (AttributeError, RuntimeError):
        return None


_ALLTOALL = _alltoall()
if _ALLTOALL is not None:
    _TALLY_OPS = _TALLY_OPS | {_ALLTOALL}


class Tallies:
    """Tokens per expert element by element, where the elements are sizes (``int`` or
    ``SymInt``): the tracker's ``tallies``, storage -> one value per element of the storage.

    Expert parallelism counts each expert's tokens (``zeros(n).scatter_add_(0, expert_ids,
    ones)``, what Hugging Face's ``AllToAllEP`` does), exchanges the counts with an
    all-to-all, sums them per rank and reads them as split sizes (``.tolist()``). Each
    expert's count is the routing's at the run's bound (:class:`~memsim.tracer.data_dependent.
    Route`); the all-to-all gives each rank what every rank's routing sends its experts, every
    rank routing its tokens as this one does (the bound is the same on every rank)."""

    def _tally(self, func, args, kwargs, out) -> bool:
        """A step of the counts above: whether the op was one (its outputs then known)."""
        if func in (aten.scatter_add_.default, aten.scatter_add.default):
            return self._tally_scatter(func, args, out)
        if func is _ALLTOALL:
            return self._tally_exchange(args)
        if not self.tallies:
            return False
        ins = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
        if not ins or any(self.tallies.get(a.untyped_storage()) is None for a in ins):
            return False
        arrays = [self._tally_array(a) for a in ins]
        if any(a is None for a in arrays) or not isinstance(out, torch.Tensor):
            return False
        with _real():
            if func is aten.sum.dim_IntList:
                dims = args[1] if len(args) > 1 else kwargs.get("dim")
                if kwargs.get("keepdim") or (len(args) > 2 and args[2]) or not dims:
                    return False
                vals, at = arrays[0]
                gone = sorted({d % at.dim() for d in dims})
                kept = [d for d in range(at.dim()) if d not in gone]
                rows = at.permute(*kept, *gone).reshape(*[at.shape[d] for d in kept], -1)
                sums = [sum(vals[i] for i in row) for row in rows.reshape(-1, rows.shape[-1])
                        .tolist()]
                got = sums, torch.arange(len(sums)).reshape(rows.shape[:-1])
            elif func in (aten.stack.default, aten.cat.default):
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                vals, ats = [], []
                for v, at in arrays:
                    ats.append(at + len(vals))
                    vals = vals + v
                got = vals, (torch.stack if func is aten.stack.default else torch.cat)(ats, dim)
            else:   # a copy keeps the counts
                got = arrays[0]
        self._set_tallies(out, *got, self.why(*ins))
        return True

    def _tally_scatter(self, func, args, out) -> bool:
        """``zeros(n).scatter_add_(0, expert_ids, ones_like(expert_ids))`` with the routing's
        expert ids: the tokens per expert at the run's bound (noted)."""
        target, dim, index, src = (args + (None,) * 4)[:4]
        made = target if func is aten.scatter_add_.default else out
        route = self.routes.get(index.untyped_storage()) if self.routes else None
        if route is None or not isinstance(made, torch.Tensor) or made.dim() != 1 \
                or dim not in (0, -1) or self.exact(target) != 0 or self.exact(src) != 1:
            return False
        n = made.shape[0]
        if type(n) is not int or n < route.n or index.dim() != 1 \
                or _expr(index.shape[0]) != _expr(route.tokens * route.k):
            return False
        from .data_dependent import _route_noted
        bound = _route_noted(route, "tokens per expert")
        counts = [route.tokens_of(e, bound) if e < route.n else 0 for e in range(n)]
        with _real():
            self._set_tallies(made, counts, torch.arange(n), self.why(index))
        return True

    def _tally_exchange(self, args) -> bool:
        """``all_to_all_single(out, counts)`` in equal splits over ``g`` ranks: what each rank
        sends this one is its counts for this rank's experts, every rank routing as this one
        does (noted)."""
        out, inp, group = args[0], args[1], args[2]
        splits = (args[3] if len(args) > 3 else (), args[4] if len(args) > 4 else ())
        counts = self._tally_array(inp)
        if counts is None or any(len(s) for s in splits):
            return False
        if isinstance(group, torch.ScriptObject):
            group = torch._C._distributed_c10d.ProcessGroup.unbox(group)
        g, me = group.size(), group.rank()
        vals, at = counts
        if at.numel() % g:
            return False
        each = at.numel() // g
        with _real():
            mine = at.reshape(-1)[me * each:(me + 1) * each]
            got = torch.cat([mine] * g).reshape(at.shape)
        from .sources import model_line
        why = (f"data-dependent size: the tokens per expert exchanged{model_line()}: every one "
               f"of the {g} ranks routes its tokens as this one does")
        from . import known
        known.assume(why)
        self._set_tallies(out, vals, got, why)
        return True

    def _tally_array(self, t: torch.Tensor):
        """``(values, at)``: ``t``'s counts, ``at`` a real tensor of ``t``'s shape indexing
        ``values`` (a list), or None."""
        flat = self.tallies.get(t.untyped_storage())
        layout = _layout(t)
        if flat is None or layout is None:
            return None
        n, shape, stride, offset = layout
        with _real():
            return flat, torch.arange(n).as_strided(shape, stride, offset)

    def _set_tallies(self, t: torch.Tensor, values: list, at, why: str | None) -> None:
        """``t``'s elements are ``values[i]`` for ``i`` in ``at`` (a real index tensor of
        ``t``'s shape)."""
        layout = _layout(t)
        if layout is None or layout[0] > SMALL or tuple(at.shape) != layout[1]:
            return
        n, shape, stride, offset = layout
        flat = [0] * n
        with _real():
            where = torch.arange(n).as_strided(shape, stride, offset)
            for pos, i in zip(where.reshape(-1).tolist(), at.reshape(-1).tolist()):
                flat[pos] = values[i]
        st = t.untyped_storage()
        for other in (self.values, self.contents, self.counts, self.exactly):
            other.pop(st, None)   # what was known of the storage before (zeros) no longer holds
        self.tallies[st] = flat
        if why is not None:
            self.because[st] = why

    def tally(self, t: torch.Tensor):
        """The size one element ``t`` holds, where its storage holds such counts, or None."""
        if not self.tallies or t.numel() != 1:
            return None
        got = self._tally_array(t)
        if got is None:
            return None
        vals, at = got
        with _real():
            return vals[at.reshape(-1)[0].item()]


def _real():
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()
