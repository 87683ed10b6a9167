"""Which unit of a folded stack each item of a run belongs to (:mod:`memsim.tracer.fold`).

Every op, leaf and event is attributed to a unit: by its module path in forward, by the module
whose forward made the running autograd node in backward
(:attr:`~memsim.tracer.records.OpRecord.origin`), otherwise by the units of its inputs (an
optimizer's per-parameter ops; a foreach op's outputs one by one). Each storage and op also has
a *role* in its unit (the k-th storage of the same op, module, phase, category and size), by
which a copy of the unit finds its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .fold_stack import Stack
from .records import LeafRecord, OpRecord, Phase, RunRecord

TEMPLATE = 1       # the unit copied: its neighbours 0 and 2 are blocks like it


class UnitNames:
    """Unit numbers of module paths and names inside the stack, and their renaming."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.pattern = re.compile(r"(^|[.<])" + re.escape(stack.path) + r"\.(\d+)(?=\.|$|>)")

    def unit(self, path: str | None) -> int | None:
        if not path:
            return None
        m = self.pattern.search(path)
        if m is None:
            return None
        i = int(m.group(2))
        return None if i < self.stack.prefix else (i - self.stack.prefix) // self.stack.period

    def inside(self, path: str | None) -> bool:
        return bool(path) and self.pattern.search(path) is not None

    def shift(self, path, by: int):
        if not path or not by:
            return path
        st = self.stack

        def move(m):
            i = int(m.group(2))
            if i < st.prefix:
                return m.group(0)
            u, o = divmod(i - st.prefix, st.period)
            return f"{m.group(1)}{st.path}.{st.prefix + (u + by) * st.period + o}"
        return self.pattern.sub(move, path)


@dataclass
class Item:
    kind: str        # "op" (an op or leaf record), "ev" (an event), "gr" (grad ready), "mk"
    ref: int         # index into ops / events / grad_ready, or the marker's payload index
    phase: object
    unit: int | None = None


def merged_items(run: RunRecord, marks: list) -> list[Item]:
    """Ops, events, gradient-ready notes and phase marks in execution order (the events an op
    makes come before its record; a mark before the event it was taken at)."""
    at: dict[int, list] = {}
    for k, (_, i) in enumerate(marks):
        at.setdefault(i, []).append(("mk", k))
    for k, (i, _) in enumerate(run.grad_ready):
        at.setdefault(i, []).append(("gr", k))
    items: list[Item] = []
    nxt = 0
    phase = Phase.SETUP
    marks_phase = {k: p[1] for k, (p, _) in enumerate(marks) if p[0] == "mark"}
    for i in range(len(run.events) + 1):
        t = run.events[i].time if i < len(run.events) else len(run.ops)
        here = at.get(i, ())
        # ops recorded before the event; where a mark falls among them, those of the phase
        # it ends come first (an op's record says its phase)
        while nxt < len(run.ops) and nxt < t and not (
                here and isinstance(run.ops[nxt], OpRecord) and run.ops[nxt].phase is not phase):
            items.append(Item("op", nxt, phase))
            nxt += 1
        for kind, k in here:
            if kind == "mk" and k in marks_phase:
                phase = marks_phase[k]
            items.append(Item(kind, k, phase))
        while nxt < len(run.ops) and nxt < t:
            items.append(Item("op", nxt, phase))
            nxt += 1
        if i < len(run.events):
            items.append(Item("ev", i, phase))
    return items


def positions(run: RunRecord) -> list:
    """Every position the run keeps as an index into its events: phase marks, the end of each
    phase, and the start of the measured step (payloads of "mk" items)."""
    out = [("mark", p, i) for p, i in run.marks]
    out += [("end", p, i) for p, i in run.phase_ends.items()]
    out.append(("start", None, run.start))
    return [(x, x[2]) for x in out]


class Attribution:
    """The unit of each op (None: global), of each of its outputs and inputs, and of each
    storage (its maker's output) in ``run``, the model with its stack cut short. A
    construction gives ops and storages of no unit inside a copied region to the template
    (:meth:`claim`); the units stay so for the constructions after it."""

    def __init__(self, run: RunRecord, stack: Stack):
        self.run, self.stack = run, stack
        self.names = UnitNames(stack)
        self.op_unit: list = []
        self.out_units: list[list] = []
        self.in_units: list[list] = []
        sid_unit: dict[int, int | None] = {}
        self._single_reads = _single_reads(run)   # producer -> ops that read it once
        self._read_so_far: dict[int, int] = {}
        for rec in run.ops:
            if isinstance(rec, LeafRecord):
                u = self._leaf(rec, sid_unit)
                outs, ins = [u], []
            else:
                ins = self.reads(rec)
                u, outs = self._op(rec, ins)
            self.op_unit.append(u)
            self.out_units.append(outs)
            self.in_units.append(ins)
            metas = (rec.meta,) if isinstance(rec, LeafRecord) else rec.outputs
            for m, ou in zip(metas, outs):
                if m.fresh:
                    sid_unit.setdefault(m.sid, ou)
        self._read_by_one_unit(sid_unit)
        for new, old in sorted(run.resized.items()):
            sid_unit.setdefault(new, sid_unit.get(old))
        self.sid_unit = [sid_unit.get(s.sid, None) for s in run.storages]

    def _leaf(self, rec: LeafRecord, sid_unit: dict):
        """The unit of a leaf: a parameter by its name; a constant by the module running when
        it was made; another tensor over a storage already recorded: that storage's unit."""
        run, names = self.run, self.names
        owner = run.owners.get(rec.meta.sid)
        return names.unit(rec.name) if names.inside(rec.name) else \
            sid_unit.get(rec.meta.sid) if not rec.meta.fresh else \
            names.unit(owner) if owner is not None else \
            names.unit(run.storages[rec.meta.sid].module)

    def _op(self, rec: OpRecord, ins: list):
        """``(unit, units of its outputs)`` of an op whose inputs' units are ``ins``."""
        run, names = self.run, self.names
        path = rec.module if rec.module is not None else rec.origin
        u = names.unit(path)
        n_out = len(rec.outputs)
        owned = [names.unit(run.owners.get(m.sid)) for m in rec.outputs if m.fresh]
        if u is not None:
            outs = [u] * n_out
        elif owned and None not in owned and len(owned) == n_out:
            outs = owned    # optimizer state made from no tensor of its parameter
            u = owned[0] if len(set(owned)) == 1 else None
        elif path and not _ancestor(path, self.stack.path):
            outs = [None] * n_out   # a module outside the stack: global
        elif n_out >= 2 and len(ins) % n_out == 0:
            outs = [_only(ins[k::n_out]) for k in range(n_out)]
            u = outs[0] if len(set(outs)) == 1 else None
        else:
            u = _only(ins)
            outs = [u] * n_out
        return u, outs

    def _read_by_one_unit(self, sid_unit: dict) -> None:
        """A tensor of no unit that only one unit's ops read is that unit's (AdamW's step
        counter is made from a constant; a constant made for one block)."""
        run = self.run
        readers: dict[int, list] = {}
        for k, rec in enumerate(run.ops):
            if isinstance(rec, OpRecord):
                for i in rec.inputs:
                    readers.setdefault(i, []).append(k)
        for k in range(len(run.ops) - 1, -1, -1):   # readers come later: settled first
            got = {self.op_unit[r] for r in readers.get(k, ())}
            if self.op_unit[k] is not None or not got or None in got or len(got) != 1 or \
                    any(o is not None for o in self.out_units[k]):
                continue
            rec = run.ops[k]
            if isinstance(rec, OpRecord) and rec.module is not None and \
                    not _ancestor(rec.module, self.stack.path):
                continue
            u = next(iter(got))
            self.op_unit[k] = u
            self.out_units[k] = [u] * len(self.out_units[k])
            for m in ((rec.meta,) if isinstance(rec, LeafRecord) else rec.outputs):
                if m.fresh and sid_unit.get(m.sid) is None:
                    sid_unit[m.sid] = u

    def reads(self, rec: OpRecord) -> list:
        """The unit of each input of ``rec``: its producer's. Of a producer with several
        outputs (a foreach op's list), the k-th read by an op that reads them all is its k-th
        output, and so is the k-th op that reads one of them, where as many ops read one as
        it has outputs (a loop over the list)."""
        ins, seen = [], {}
        for i in rec.inputs:
            c = seen[i] = seen.get(i, -1) + 1
            pu = self.out_units[i]
            if len(pu) > 1 and rec.inputs.count(i) == len(pu):
                ins.append(pu[c])
            elif len(pu) > 1 and rec.inputs.count(i) == 1 and \
                    self._single_reads.get(i) == len(pu):
                k = self._read_so_far[i] = self._read_so_far.get(i, -1) + 1
                ins.append(pu[k])
            else:
                ins.append(self.op_unit[i])
        return ins

    def unit_of(self, item: Item):
        """The unit of an item (an op's, an event's or a gradient's storage's); None: global."""
        if item.kind == "op":
            return self.op_unit[item.ref]
        if item.kind == "ev":
            return self.sid_unit[self.run.events[item.ref].sid]
        if item.kind == "gr":
            sid = self.run.grad_ready[item.ref][1]
            return None if sid is None else self.sid_unit[sid]
        return None

    def claim(self, items: list[Item], regions: list) -> None:
        """Storages made by an op of no unit inside a region, and such ops, belong to the
        region's unit (:data:`TEMPLATE`); the units of events and of every op's inputs are
        then read again."""
        run, j = self.run, TEMPLATE
        for (a, b, _) in regions:
            for it in items[a:b]:
                if it.kind == "ev" and run.events[it.ref].sign > 0 and it.unit is None:
                    self.sid_unit[run.events[it.ref].sid] = j
                    it.unit = j
                elif it.kind == "op" and it.unit is None and \
                        len(set(self.out_units[it.ref])) <= 1:
                    self.op_unit[it.ref] = j
                    self.out_units[it.ref] = [j] * len(self.out_units[it.ref])
                    it.unit = j
        for it in items:
            if it.kind in ("ev", "gr"):
                it.unit = self.unit_of(it)
        self._read_so_far = {}
        self.in_units = [[] if isinstance(rec, LeafRecord) else self.reads(rec)
                         for rec in run.ops]

    def roles(self):
        """Role of each storage and op: its k-th occurrence, in its unit, of the same
        signature (sizes, op, module path without the block number...)."""
        run, names = self.run, self.names
        count: dict = {}
        sroles = []
        for s in run.storages:
            sig = ("s", s.nbytes, s.op, _norm(names, s.module), s.phase, s.category, s.device,
                   s.stream)
            key = (self.sid_unit[s.sid], sig)
            count[key] = count.get(key, 0) + 1
            sroles.append((sig, count[key]))
        oroles = []
        for rec, u in zip(run.ops, self.op_unit):
            if isinstance(rec, LeafRecord):
                sig = ("l", _norm(names, rec.name), rec.category)
            else:
                sig = ("o", rec.op, _norm(names, rec.module), _norm(names, rec.origin),
                       rec.phase, len(rec.outputs))
            key = (u, sig)
            count[key] = count.get(key, 0) + 1
            oroles.append((sig, count[key]))
        # as small ints: the construction looks roles up tens of thousands of times, and a
        # tuple does not keep its hash
        ids: dict = {}
        return ([ids.setdefault(r, len(ids)) for r in sroles],
                [ids.setdefault(r, len(ids)) for r in oroles])


def _single_reads(run: RunRecord) -> dict[int, int]:
    """For each op, how many ops read it once."""
    out: dict[int, int] = {}
    for rec in run.ops:
        if isinstance(rec, OpRecord):
            for i in set(rec.inputs):
                if rec.inputs.count(i) == 1:
                    out[i] = out.get(i, 0) + 1
    return out


def _only(units):
    got = {u for u in units if u is not None}
    return got.pop() if len(got) == 1 else None


def _ancestor(path: str, stack_path: str) -> bool:
    return path == "" or stack_path == path or stack_path.startswith(path + ".")


def _norm(names: UnitNames, path):
    if not path:
        return path
    return names.pattern.sub(lambda m: f"{m.group(1)}{names.stack.path}.#", path)
