"""A run with more units, made from a run's items and its template's regions
(:mod:`memsim.tracer.fold`): each region followed by its copies, every copy's storages and ops
made anew, and every reference resolved by the unit it names relative to the item (an offset:
the previous block's residual is unit ``u - 1``) and its role in that unit, so that a copy
reads and frees its own tensors and its neighbours'.
"""

from __future__ import annotations

from dataclasses import replace

from .fold_stack import CannotFold
from .fold_units import TEMPLATE, Attribution, Item, positions
from .records import Event, LeafRecord, OpRecord, RunRecord, Storage


class Copier:
    """One construction from ``units`` (the run's attribution) with ``extra`` more units;
    ``roles``: the storages' and ops' roles (:meth:`Attribution.roles`). After
    :meth:`build`, :attr:`last_copies` says where the last copy of each region lies
    (``(first event, end event)``)."""

    def __init__(self, units: Attribution, roles: tuple, extra: int):
        self.at, self.run, self.names = units, units.run, units.names
        self.sroles, self.oroles = roles
        self.extra = extra
        self.new_sid: dict = {}          # (old sid, instance or None) -> new storage
        self.sid_at: dict = {}           # (instance, role) -> new sid
        self.storages: list[Storage] = []
        self.events: list[Event] = []
        self.ops: list = []
        self.op_at: dict = {}            # (instance, role) -> new op index
        self.op_new: dict = {}           # (old op index, instance or None) -> new op index
        self.grad_ready: list = []
        self.markers: list = []
        self.origin_of: dict = {}        # new sid -> (old sid, unit shift)
        self.last_copies: list = []

    def build(self, items: list[Item], regions: list, sigma: dict) -> RunRecord:
        """The run: ``items`` with each of ``regions`` followed by its copies (``sigma``: the
        shift of each item outside them, :func:`~memsim.tracer.fold_regions.find_regions`)."""
        seq, bounds = _sequence(items, regions, sigma, self.extra)
        at_bound: dict[int, list] = {}
        for pos in bounds:
            at_bound.setdefault(pos, []).append(pos)
        edges: list[int] = []       # the same bounds as indices into the events
        for pos, (it, shift) in enumerate(seq):
            edges += [len(self.events)] * len(at_bound.get(pos, ()))
            if it.kind == "ev":
                self._event(it, shift)
            elif it.kind == "gr":
                self._grad_ready(it, shift)
            elif it.kind == "mk":
                if shift is not None:
                    raise CannotFold("a phase boundary inside a copied region")
                self.markers.append((it.ref, len(self.events)))
            else:
                self._op(it, shift)
        edges += [len(self.events)] * len(at_bound.get(len(seq), ()))
        self.last_copies = list(zip(edges[0::2], edges[1::2]))
        return self._record()

    # where an item's copy is, and what it refers to
    def _where(self, u, shift):
        """The instance of unit ``u`` for an item shifted by ``shift`` (None: not copied, then
        as a global item names it)."""
        where = None if u is None or shift is None else u + shift
        if u is not None and where is None:
            where = self._rel(u, None, None)
        return where

    def _rel(self, target_unit, item_unit, item_inst):
        """The instance of a unit named by an item at ``item_inst``."""
        if target_unit is None:
            return None
        if item_inst is None:
            # a global item: units below the template stay, above it move
            return target_unit if target_unit < TEMPLATE else target_unit + self.extra
        return item_inst + (target_unit - item_unit)

    def _storage(self, old: int, where: int | None):
        """The new storage of storage ``old`` at instance ``where`` (of no unit: its one copy)."""
        u = self.at.sid_unit[old]
        got = self.new_sid.get((old, None)) if u is None else \
            self.sid_at.get((where, self.sroles[old]))
        if got is None:
            raise CannotFold(f"storage {old} ({self.run.storages[old].op}) of unit {u} has no "
                             f"copy at unit {where}")
        return got

    def _op_ref(self, old: int, where: int | None):
        """The new index of op ``old`` at instance ``where``: its one copy where it or the
        reference has no unit, else (or where it has none) its copy at ``where``."""
        got = None
        if self.at.op_unit[old] is None or where is None:
            got = self.op_new.get((old, None))
        if got is None and where is not None:
            got = self.op_at.get((where, self.oroles[old]))
        if got is None:
            raise CannotFold(f"op {old} ({_name(self.run.ops[old])}) has no copy at unit "
                             f"{where}")
        return got

    # the items
    def _event(self, it: Item, shift) -> None:
        e = self.run.events[it.ref]
        u = self.at.sid_unit[e.sid]
        where = self._where(u, shift)
        if e.sign > 0:
            self._allocate(e, u, where)
        else:
            ns = self._storage(e.sid, where)
            if self.storages[ns].free is not None:
                raise CannotFold(f"storage {e.sid} ({self.run.storages[e.sid].op}) is "
                                 "released twice")
            self.storages[ns].free = len(self.ops)
            self.events.append(Event(-1, ns, len(self.ops)))

    def _allocate(self, e: Event, u, where) -> None:
        names = self.names
        s = self.run.storages[e.sid]
        by = (where - u) if where is not None else 0
        ns = len(self.storages)
        saved_by = tuple(names.shift(m, by) for m in s.saved_by) if u is not None \
            else self._widen_paths(s.saved_by)
        self.storages.append(replace(s, sid=ns, module=names.shift(s.module, by),
                                     saved_by=saved_by, free=None))
        if u is None:
            if (e.sid, None) in self.new_sid:
                raise CannotFold(f"storage {e.sid} ({s.op}) of no unit is "
                                 "allocated in a copied region")
            self.new_sid[(e.sid, None)] = ns
        else:
            key = (where, self.sroles[e.sid])
            if key in self.sid_at:
                raise CannotFold(f"two storages {s.op} at unit {where}")
            self.sid_at[key] = ns
        self.origin_of[ns] = (e.sid, by)
        self.events.append(Event(+1, ns, len(self.ops)))
        self.storages[ns].alloc = len(self.ops)

    def _grad_ready(self, it: Item, shift) -> None:
        i, sid = self.run.grad_ready[it.ref]
        u = self.at.sid_unit[sid] if sid is not None else None
        where = self._where(u, shift)
        self.grad_ready.append((len(self.events), self._storage(sid, where)
                                if sid is not None else None))

    def _op(self, it: Item, shift) -> None:
        rec = self.run.ops[it.ref]
        u = self.at.op_unit[it.ref]
        where = self._where(u, shift)
        by = (where - u) if where is not None else 0
        idx = len(self.ops)
        if isinstance(rec, LeafRecord):
            ns = self._storage(rec.meta.sid, where if u is not None else None)
            self.ops.append(replace(rec, index=idx, name=self.names.shift(rec.name, by),
                                    meta=replace(rec.meta, sid=ns)))
        else:
            self.ops.append(self._op_copy(rec, it.ref, u, where, by, idx))
        if u is None or where is None:
            if (it.ref, None) in self.op_new and where is None:
                raise CannotFold(f"op {_name(rec)} of no unit in a copied region")
            self.op_new[(it.ref, None)] = idx
        if where is not None:
            key = (where, self.oroles[it.ref])
            if key in self.op_at:
                raise CannotFold(f"two ops {_name(rec)} at unit {where}")
            self.op_at[key] = idx

    def _op_copy(self, rec: OpRecord, ref: int, u, where, by: int, idx: int) -> OpRecord:
        """The op record ``rec`` (``ops[ref]``, of unit ``u``) at instance ``where``."""
        at, extra = self.at, self.extra
        if where is None:   # global: lists over units are widened
            outs = tuple(replace(m, sid=self._storage(m.sid, w)) for m, w in _widened(
                rec.outputs, [at.sid_unit[m.sid] for m in rec.outputs], extra))
            ins = tuple(self._op_ref(i, w) for i, w in _widened(
                rec.inputs, at.in_units[ref], extra))
        else:
            outs = tuple(replace(m, sid=self._storage(
                m.sid, self._rel(at.sid_unit[m.sid], u, where))) for m in rec.outputs)
            ins = tuple(self._op_ref(i, self._rel(iu, u, where))
                        for i, iu in zip(rec.inputs, at.in_units[ref]))
        return replace(rec, index=idx, inputs=ins, outputs=outs,
                       module=self.names.shift(rec.module, by),
                       origin=self.names.shift(rec.origin, by))

    def _widen_paths(self, paths) -> tuple:
        """Module paths of a global storage's readers over every unit."""
        names = self.names
        return tuple(names.shift(m, w - u) if u is not None else m for m, w, u in _widened(
            paths, [names.unit(m) for m in paths], self.extra, with_unit=True))

    # the run made
    def _record(self) -> RunRecord:
        run, names = self.run, self.names
        # storages are numbered in allocation order (each is made at its + event)
        out = RunRecord(storages=self.storages, events=self.events, ops=self.ops)
        self._positions(out)
        out.grad_ready = self.grad_ready
        out.owners = {ns: names.shift(run.owners[old], by)
                      for ns, (old, by) in self.origin_of.items() if old in run.owners}
        out.resized = self._resized()
        out.other_ops = {name: sum(1 for r in self.ops if isinstance(r, OpRecord)
                                   and r.op == name) for name in run.other_ops}
        out.specialized = list(run.specialized)
        out.checkpoint_regions = run.checkpoint_regions
        out.warmed = run.warmed
        out.replays = run.replays
        out.assumed = list(run.assumed)
        out.branches = list(run.branches)
        return out

    def _positions(self, out: RunRecord) -> None:
        """The phase marks, phase ends and start of ``out``, where the copy put them."""
        payload = {k: v for k, v in self.markers}
        out.marks = []
        out.phase_ends = {}
        for k, (what, phase, _) in enumerate(m for m, _ in positions(self.run)):
            i = payload[k]
            if what == "mark":
                out.marks.append((phase, i))
            elif what == "end":
                out.phase_ends[phase] = i
            else:
                out.start = i

    def _resized(self) -> dict:
        """A re-allocation names the storage of its own unit's instance that it replaces."""
        run, sid_unit = self.run, self.at.sid_unit
        inst_of = {ns: (old, None if sid_unit[old] is None else sid_unit[old] + by)
                   for ns, (old, by) in self.origin_of.items()}
        return {ns: self._storage(run.resized[old], inst_of[ns][1] if sid_unit[
            run.resized[old]] is not None else None)
            for ns, (old, _) in self.origin_of.items() if old in run.resized}


def _sequence(items: list[Item], regions: list, sigma: dict, extra: int):
    """The sequence of ``(item, shift)``: each region followed by its copies; and where the
    last copy of each region starts and ends in it."""
    seq: list[tuple[Item, int | None]] = []
    bounds: list[int] = []
    k = 0
    for a, b, asc in regions + [(len(items), len(items), True)]:
        while k < a:
            it = items[k]
            seq.append((it, sigma.get(k)))
            k += 1
        if a == len(items):
            break
        for c in range(extra + 1):
            s = c if asc else extra - c
            if c == extra:
                bounds.append(len(seq))
            for it in items[a:b]:
                seq.append((it, s))
        bounds.append(len(seq))
        k = b
    return seq, bounds


def _widened(entries, units, extra: int, with_unit: bool = False) -> list:
    """A global op's list over the units (a foreach op's, the modules saving a tensor) over
    every unit: ``(entry, instance)`` pairs, each run of entries of the template unit repeated
    for the copies (instances ``TEMPLATE .. TEMPLATE + extra``), entries above it moved by
    ``extra``."""
    out, k = [], 0
    while k < len(entries):
        u = units[k]
        if u != TEMPLATE:
            w = None if u is None else u if u < TEMPLATE else u + extra
            out.append((entries[k], w, u) if with_unit else (entries[k], w))
            k += 1
            continue
        end = k
        while end < len(entries) and units[end] == TEMPLATE:
            end += 1
        for c in range(extra + 1):
            out += [(e, TEMPLATE + c, u) if with_unit else (e, TEMPLATE + c)
                    for e in entries[k:end]]
        k = end
    return out



def _name(rec) -> str:
    return rec.name if isinstance(rec, LeafRecord) else rec.op
