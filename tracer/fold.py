"""Fold a stack of repeated blocks: trace a few of them, derive the whole model's run.

A decoder repeats one block (same class, same parameter shapes, same code path) dozens of
times, and a symbolic run costs about the same per block. :func:`find_stack` finds the stack
(the ``nn.ModuleList`` or ``nn.Sequential`` holding most parameters) and its pattern: ``prefix``
blocks that differ (DeepSeek's first dense layers, a ResNet stage's downsampling block), then a
*unit* of ``period`` blocks repeated (one block; two for Gemma2's alternating sliding and full
attention). Blocks are compared by class, parameter and buffer shapes, dtypes and
``requires_grad``, and every plain attribute of every submodule except per-block identifiers
(an attribute whose value differs in every block, such as ``layer_idx``).

The model is then run with its stack cut to ``prefix + 4`` units (run A) and ``prefix + 5``
units (run B). :func:`construct` (:class:`Folder`) derives a run with more units from run A by copying what unit
1 does, everywhere in the step, as often as needed:

- every op, leaf and event is attributed to a unit: by its module path in forward, by the
  module whose forward made the running autograd node in backward
  (:attr:`~memsim.tracer.records.OpRecord.origin`), otherwise by the units of its inputs (an
  optimizer's per-parameter ops; a foreach op's outputs one by one);
- in each phase, a *pass* is a run over the units in one direction (forward and the optimizer's
  foreach ops ascend, backward descends); in each pass the *region* of unit 1 (from its first
  item to the first item of the next unit) is one period of the timeline, and its copies are
  inserted after it: in ascending passes copy ``k`` is unit ``1 + k``, in descending ones
  the copies come in the order the units run backward;
- every reference (an event's storage, an op's input) is resolved by the unit it names relative
  to the item (an offset: the previous block's residual is unit ``u - 1``) and its *role* in
  that unit (the k-th storage of the same op, module, phase, category and size), so that a copy
  reads and frees its own tensors and its neighbours'.

A construction is used only when it is proven on the model itself: run A with one unit added
must equal run B exactly (every storage, size, category, stream, event and op, in order), or
the model is traced whole (:class:`CannotFold` names why). Tests compare folded and whole runs
of real models at their real depth (``tests/test_fold.py``).
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from .records import Event, LeafRecord, OpRecord, Phase, RunRecord, Storage, TensorMeta

TRACED_UNITS = 4   # run A; run B has one more
# fold stacks of at least this many units: the two runs trace 9 units and each run's step
# outside the stack (embeddings, head, loss, optimizer) costs about as much as a few more
MIN_UNITS = 14
TEMPLATE = 1       # the unit copied: its neighbours 0 and 2 are blocks like it


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
    try:
        for cfg, name, _ in configs:
            setattr(cfg, name, n)
        yield
    finally:
        mod._modules = saved
        for cfg, name, v in configs:
            setattr(cfg, name, v)


# -- the construction ---------------------------------------------------------------------------

class _Units:
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
class _Item:
    kind: str        # "op" (an op or leaf record), "ev" (an event), "gr" (grad ready), "mk"
    ref: int         # index into ops / events / grad_ready, or the marker's payload index
    phase: object
    unit: int | None = None


def _merged(run: RunRecord, marks: list) -> list[_Item]:
    """Ops, events, gradient-ready notes and phase marks in execution order (the events an op
    makes come before its record; a mark before the event it was taken at)."""
    at: dict[int, list] = {}
    for k, (_, i) in enumerate(marks):
        at.setdefault(i, []).append(("mk", k))
    for k, (i, _) in enumerate(run.grad_ready):
        at.setdefault(i, []).append(("gr", k))
    items: list[_Item] = []
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
            items.append(_Item("op", nxt, phase))
            nxt += 1
        for kind, k in here:
            if kind == "mk" and k in marks_phase:
                phase = marks_phase[k]
            items.append(_Item(kind, k, phase))
        while nxt < len(run.ops) and nxt < t:
            items.append(_Item("op", nxt, phase))
            nxt += 1
        if i < len(run.events):
            items.append(_Item("ev", i, phase))
    return items


def _marks(run: RunRecord) -> list:
    """Every position the run keeps as an index into its events: phase marks, the end of each
    phase, and the start of the measured step (payloads of "mk" items)."""
    out = [("mark", p, i) for p, i in run.marks]
    out += [("end", p, i) for p, i in run.phase_ends.items()]
    out.append(("start", None, run.start))
    return [(x, x[2]) for x in out]


class Folder:
    """Run ``run`` (the model with its stack cut to ``units`` units) attributed to its units
    once, to derive runs with more units from (:meth:`construct`, any number of times). After
    a construction, :attr:`last_copies` says where the last copy of each region lies
    (``(first event, end event)``): with one unit more, between the two copies of a region a
    model with ``k`` more units runs ``k - 1`` more, each changing the live bytes by as much
    as that copy does (:func:`memsim.analysis.memory.depth_peak`)."""

    def __init__(self, run: RunRecord, stack: Stack, units: int):
        self.run, self.stack, self.n = run, stack, units
        self.names = _Units(stack)
        if units < TEMPLATE + 3:
            raise CannotFold(f"{units} units traced; the construction needs {TEMPLATE + 3}")
        self._attribute()

    # units of ops, storages, events
    def _attribute(self) -> None:
        """Units of each op (None: global), of each of its outputs and inputs, and of each
        storage (its maker's output)."""
        run, names = self.run, self.names
        self.op_unit: list = []
        self.out_units: list[list] = []
        self.in_units: list[list] = []
        sid_unit: dict[int, int | None] = {}
        self._single_reads: dict[int, int] = {}   # producer -> ops that read it once
        for rec in run.ops:
            if isinstance(rec, OpRecord):
                for i in set(rec.inputs):
                    if rec.inputs.count(i) == 1:
                        self._single_reads[i] = self._single_reads.get(i, 0) + 1
        self._read_so_far: dict[int, int] = {}
        for rec in run.ops:
            if isinstance(rec, LeafRecord):
                # a parameter by its name; a constant by the module running when it was made;
                # another tensor over a storage already recorded: that storage's unit
                owner = run.owners.get(rec.meta.sid)
                u = names.unit(rec.name) if names.inside(rec.name) else \
                    sid_unit.get(rec.meta.sid) if not rec.meta.fresh else \
                    names.unit(owner) if owner is not None else \
                    names.unit(run.storages[rec.meta.sid].module)
                outs, ins = [u], []
            else:
                ins = self._reads(rec)
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
            self.op_unit.append(u)
            self.out_units.append(outs)
            self.in_units.append(ins)
            metas = (rec.meta,) if isinstance(rec, LeafRecord) else rec.outputs
            for m, ou in zip(metas, outs):
                if m.fresh:
                    sid_unit.setdefault(m.sid, ou)
        # a tensor of no unit that only one unit's ops read is that unit's (AdamW's step
        # counter is made from a constant; a constant made for one block)
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
        for new, old in sorted(run.resized.items()):
            sid_unit.setdefault(new, sid_unit.get(old))
        self.sid_unit = [sid_unit.get(s.sid, None) for s in run.storages]

    def _reads(self, rec: OpRecord) -> list:
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

    def _unit_of(self, item: _Item):
        if item.kind == "op":
            return self.op_unit[item.ref]
        if item.kind == "ev":
            return self.sid_unit[self.run.events[item.ref].sid]
        if item.kind == "gr":
            sid = self.run.grad_ready[item.ref][1]
            return None if sid is None else self.sid_unit[sid]
        return None

    def construct(self, extra: int) -> RunRecord:
        run, j = self.run, TEMPLATE
        marks = _marks(run)
        items = _merged(run, marks)
        for it in items:
            it.unit = self._unit_of(it)
        # storages made by an op of no unit inside a region belong to the region's unit
        regions, sigma_of = self._regions(items, extra)
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
                it.unit = self._unit_of(it)
        self._read_so_far = {}
        self.in_units = [[] if isinstance(rec, LeafRecord) else self._reads(rec)
                         for rec in run.ops]
        roles = self._roles()
        return self._build(items, regions, sigma_of, roles, extra)

    def _regions(self, items: list[_Item], extra: int):
        """Regions ``(start, end, ascending)`` of unit ``TEMPLATE`` (indices into ``items``)
        and, for every item of a unit outside them, its shift: the units it names move by
        ``extra`` when it runs after the copies of a region.

        A region starts at an item of the template unit and ends at the first item of the next
        unit in the run's direction: ascending when the unit before it was the one below
        (forward, the optimizer's per-parameter lists), descending when it was the one above
        (backward; a Python list freed from its end).

        A phase may run over the units more than once (a model's forward makes a mask per
        block, then runs the blocks; the optimizer runs a foreach op per state): a new region
        starts where a new run does (the previous run got to its far end, and this one gets to
        its own). Items before the first region are its head, items after the last one its
        tail, however far a block's tensors outlive it (FSDP2 frees a block's reduce-scatter
        output a block later); between two regions, an item within one region's length after
        the first is its tail, else within one region's length before the second its head,
        else units below the template keep their number and units above it move."""
        j = TEMPLATE
        segments: list[list[int]] = []
        for k, it in enumerate(items):
            if not segments or items[segments[-1][-1]].phase is not it.phase:
                segments.append([])
            segments[-1].append(k)
        regions = []
        sigma: dict[int, int] = {}
        for idx in segments:
            phase = items[idx[0]].phase
            units = [items[k].unit for k in idx]
            if j not in units:
                for k, u in zip(idx, units):
                    if u is not None:
                        sigma[k] = 0 if u < j else extra
                continue
            first = {}
            for pos, u in enumerate(units):
                if u is not None:
                    first.setdefault(u, pos)
            reg = []        # (start, end, ascending) as positions in ``units``
            top = self.n - 1
            pos = 0
            last = None     # the last unit seen before ``pos`` other than the template
            reached: set = set()   # units seen since the last region closed
            while pos < len(units):
                u = units[pos]
                if u != j:
                    if u is not None:
                        last = u
                        reached.add(u)
                    pos += 1
                    continue
                if last in (j - 1, j + 1):
                    asc = last == j - 1
                else:
                    asc = first.get(j - 1, len(units)) <= first.get(j + 1, len(units))
                stop, far = (j + 1, top) if asc else (j - 1, 0)
                end = next((q for q in range(pos + 1, len(units)) if units[q] == stop), None)
                # a new run over the units: the previous one got to its far end, a descending
                # one starts from the top, and the run gets to its own far end; else the
                # template's tensors outlive its run (FSDP2 frees a block's buffers later)
                new_run = (not reg or (top if reg[-1][2] else 0) in reached) and \
                    (asc or not reg or top in reached) and \
                    end is not None and far in units[end:]
                if not new_run:
                    if not reg:
                        raise CannotFold(f"unit {j} of phase {phase} never hands over to "
                                         f"unit {stop}")
                    pos += 1
                    continue
                reg.append((pos, end, asc))
                last, reached = stop, {stop}
                pos = end
            for pos, (k, u) in enumerate(zip(idx, units)):
                if u is None or any(a <= pos < b for a, b, _ in reg):
                    continue
                prev = [r for r in reg if r[1] <= pos]
                nxt = [r for r in reg if r[0] > pos]
                if prev and (not nxt or pos - prev[-1][1] < prev[-1][1] - prev[-1][0]):
                    sigma[k] = extra if prev[-1][2] else 0
                elif nxt and (not prev or nxt[0][0] - pos <= nxt[0][1] - nxt[0][0]):
                    sigma[k] = 0 if nxt[0][2] else extra
                elif u == j:
                    raise CannotFold(f"unit {j} appears in phase {phase} away from its runs")
                else:
                    sigma[k] = 0 if u < j else extra
            regions += [(idx[a], idx[b - 1] + 1, asc) for a, b, asc in reg]
        regions.sort()
        return regions, sigma

    def _roles(self):
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

    def _build(self, items, regions, sigma, roles, extra) -> RunRecord:
        run, j, names = self.run, TEMPLATE, self.names
        sroles, oroles = roles
        # the sequence of (item, shift): each region followed by its copies
        seq: list[tuple[_Item, int | None]] = []
        bounds: list[int] = []      # where the last copy of each region starts and ends in seq
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
        # pass 1: storages and ops get their instances
        new_sid: dict = {}          # (old sid, instance or None) -> new storage
        sid_at: dict = {}           # (instance, role) -> new sid
        storages: list[Storage] = []
        events: list[Event] = []
        ops: list = []
        op_at: dict = {}            # (instance, role) -> new op index
        op_new: dict = {}           # (old op index, instance or None) -> new op index
        grad_ready = []
        markers = []
        origin_of: dict = {}        # new sid -> (old sid, unit shift)

        def inst(u, shift):
            return None if u is None or shift is None else u + shift

        def storage(old: int, where: int | None):
            u = self.sid_unit[old]
            if u is None:
                got = new_sid.get((old, None))
            else:
                got = sid_at.get((where, sroles[old]))
            if got is None:
                raise CannotFold(f"storage {old} ({run.storages[old].op}) of unit {u} has no "
                                 f"copy at unit {where}")
            return got

        def op_ref(old: int, where: int | None):
            u = self.op_unit[old]
            if u is None or where is None:
                got = op_new.get((old, None))
                if got is None and where is not None:
                    got = op_at.get((where, oroles[old]))
            else:
                got = op_at.get((where, oroles[old]))
            if got is None:
                raise CannotFold(f"op {old} ({_name(run.ops[old])}) has no copy at unit "
                                 f"{where}")
            return got

        def rel(target_unit, item_unit, item_inst):
            """The instance of a unit named by an item at ``item_inst``."""
            if target_unit is None:
                return None
            if item_inst is None:
                # a global item: units below the template stay, above it move
                return target_unit if target_unit < j else target_unit + extra
            return item_inst + (target_unit - item_unit)

        at_bound: dict[int, list] = {}
        for pos in bounds:
            at_bound.setdefault(pos, []).append(pos)
        edges: list[int] = []       # the same bounds as indices into the events
        for pos, (it, shift) in enumerate(seq):
            edges += [len(events)] * len(at_bound.get(pos, ()))
            if it.kind == "ev":
                e = run.events[it.ref]
                u = self.sid_unit[e.sid]
                where = inst(u, shift)
                if u is not None and where is None:
                    where = rel(u, None, None)
                if e.sign > 0:
                    s = run.storages[e.sid]
                    by = (where - u) if where is not None else 0
                    ns = len(storages)
                    saved_by = tuple(names.shift(m, by) for m in s.saved_by) if u is not None \
                        else self._widen_paths(s.saved_by, extra)
                    storages.append(replace(s, sid=ns, module=names.shift(s.module, by),
                                            saved_by=saved_by, free=None))
                    if u is None:
                        if (e.sid, None) in new_sid:
                            raise CannotFold(f"storage {e.sid} ({s.op}) of no unit is "
                                             "allocated in a copied region")
                        new_sid[(e.sid, None)] = ns
                        origin_of[ns] = (e.sid, 0)
                    else:
                        key = (where, sroles[e.sid])
                        if key in sid_at:
                            raise CannotFold(f"two storages {s.op} at unit {where}")
                        sid_at[key] = ns
                    origin_of[ns] = (e.sid, by)
                    events.append(Event(+1, ns, len(ops)))
                    storages[ns].alloc = len(ops)
                else:
                    ns = storage(e.sid, where)
                    if storages[ns].free is not None:
                        raise CannotFold(f"storage {e.sid} ({run.storages[e.sid].op}) is "
                                         "released twice")
                    storages[ns].free = len(ops)
                    events.append(Event(-1, ns, len(ops)))
            elif it.kind == "gr":
                i, sid = run.grad_ready[it.ref]
                u = self.sid_unit[sid] if sid is not None else None
                where = inst(u, shift)
                if u is not None and where is None:
                    where = rel(u, None, None)
                grad_ready.append((len(events), storage(sid, where) if sid is not None
                                   else None))
            elif it.kind == "mk":
                if shift is not None:
                    raise CannotFold("a phase boundary inside a copied region")
                markers.append((it.ref, len(events)))
            else:
                rec = run.ops[it.ref]
                u = self.op_unit[it.ref]
                where = inst(u, shift)
                by = (where - u) if where is not None else 0
                idx = len(ops)
                if isinstance(rec, LeafRecord):
                    if where is None and u is not None:
                        where = rel(u, None, None)
                        by = where - u
                    ns = storage(rec.meta.sid, where if u is not None else None)
                    ops.append(replace(rec, index=idx, name=names.shift(rec.name, by),
                                       meta=replace(rec.meta, sid=ns)))
                else:
                    if where is None and u is not None:
                        where = rel(u, None, None)
                        by = where - u
                    if where is None:   # global: lists over units are widened
                        outs = tuple(replace(m, sid=storage(m.sid, w)) for m, w in _widened(
                            rec.outputs, [self.sid_unit[m.sid] for m in rec.outputs], extra))
                        ins = tuple(op_ref(i, w) for i, w in _widened(
                            rec.inputs, self.in_units[it.ref], extra))
                    else:
                        outs = tuple(replace(m, sid=storage(
                            m.sid, rel(self.sid_unit[m.sid], u, where))) for m in rec.outputs)
                        ins = tuple(op_ref(i, rel(iu, u, where))
                                    for i, iu in zip(rec.inputs, self.in_units[it.ref]))
                    ops.append(replace(rec, index=idx, inputs=ins, outputs=outs,
                                       module=names.shift(rec.module, by),
                                       origin=names.shift(rec.origin, by)))
                if u is None or where is None:
                    if (it.ref, None) in op_new and where is None:
                        raise CannotFold(f"op {_name(rec)} of no unit in a copied region")
                    op_new[(it.ref, None)] = idx
                if where is not None:
                    key = (where, oroles[it.ref])
                    if key in op_at:
                        raise CannotFold(f"two ops {_name(rec)} at unit {where}")
                    op_at[key] = idx
        edges += [len(events)] * len(at_bound.get(len(seq), ()))
        self.last_copies = list(zip(edges[0::2], edges[1::2]))
        # storages are numbered in allocation order (each is made at its + event)
        out = RunRecord(storages=storages, events=events, ops=ops)
        payload = {k: v for k, v in markers}
        out.marks = []
        out.phase_ends = {}
        for k, (what, phase, _) in enumerate(m for m, _ in _marks(run)):
            i = payload[k]
            if what == "mark":
                out.marks.append((phase, i))
            elif what == "end":
                out.phase_ends[phase] = i
            else:
                out.start = i
        out.grad_ready = grad_ready
        out.owners = {ns: names.shift(run.owners[old], by)
                      for ns, (old, by) in origin_of.items() if old in run.owners}
        # a re-allocation names the storage of its own unit's instance that it replaces
        inst_of = {ns: (old, None if self.sid_unit[old] is None else
                        self.sid_unit[old] + by) for ns, (old, by) in origin_of.items()}
        out.resized = {ns: storage(run.resized[old], inst_of[ns][1] if self.sid_unit[
            run.resized[old]] is not None else None)
            for ns, (old, _) in origin_of.items() if old in run.resized}
        out.other_ops = {name: sum(1 for r in ops if isinstance(r, OpRecord) and r.op == name)
                         for name in run.other_ops}
        out.specialized = list(run.specialized)
        out.checkpoint_regions = run.checkpoint_regions
        out.warmed = run.warmed
        out.replays = run.replays
        out.assumed = list(run.assumed)
        return out

    def _widen_paths(self, paths, extra) -> tuple:
        """Module paths of a global storage's readers over every unit."""
        names = self.names
        return tuple(names.shift(m, w - u) if u is not None else m for m, w, u in _widened(
            paths, [names.unit(m) for m in paths], extra, with_unit=True))


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


def _only(units):
    got = {u for u in units if u is not None}
    return got.pop() if len(got) == 1 else None


def _ancestor(path: str, stack_path: str) -> bool:
    return path == "" or stack_path == path or stack_path.startswith(path + ".")


def _norm(names: _Units, path):
    if not path:
        return path
    return names.pattern.sub(lambda m: f"{m.group(1)}{names.stack.path}.#", path)


def _name(rec) -> str:
    return rec.name if isinstance(rec, LeafRecord) else rec.op


def construct(run: RunRecord, stack: Stack, units: int, extra: int) -> RunRecord:
    """Run ``run`` (the model with its stack cut to ``units`` units) with ``extra`` more
    units, derived by copying unit :data:`TEMPLATE` (module docstring)."""
    return Folder(run, stack, units).construct(extra)


def difference(a: RunRecord, b: RunRecord) -> str | None:
    """Where two runs differ (None when they are the same run, field by field)."""
    if len(a.storages) != len(b.storages):
        return f"{len(a.storages)} storages against {len(b.storages)}"
    for x, y in zip(a.storages, b.storages):
        if x != y:
            return f"storage {x.sid}: {_diff(x, y)}"
    if len(a.events) != len(b.events):
        return f"{len(a.events)} events against {len(b.events)}"
    for k, (x, y) in enumerate(zip(a.events, b.events)):
        if x != y:
            return f"event {k}: {x} against {y}"
    if len(a.ops) != len(b.ops):
        return f"{len(a.ops)} ops against {len(b.ops)}"
    for x, y in zip(a.ops, b.ops):
        if x != y:
            return f"op {x.index}: {_diff(x, y)}"
    for f in ("start", "phase_ends", "marks", "grad_ready", "other_ops", "warmed", "replays",
              "assumed", "owners", "resized"):
        if getattr(a, f) != getattr(b, f):
            return f"{f}: {getattr(a, f)} against {getattr(b, f)}"
    return None


def _diff(x, y) -> str:
    for f in x.__dataclass_fields__:
        if getattr(x, f) != getattr(y, f):
            return f"{f} {getattr(x, f)!r} against {getattr(y, f)!r}"
    return "?"
