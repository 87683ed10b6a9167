"""Fold a stack of repeated blocks: trace a few of them, derive the whole model's run.

A decoder repeats one block (same class, same parameter shapes, same code path) dozens of
times, and a symbolic run costs about the same per block.
:func:`~memsim.tracer.fold_stack.find_stack` finds the stack (the ``nn.ModuleList`` or
``nn.Sequential`` holding most parameters) and its pattern: ``prefix`` blocks that differ
(DeepSeek's first dense layers, a ResNet stage's downsampling block), then a *unit* of
``period`` blocks repeated (one block; two for Gemma2's alternating sliding and full
attention). Blocks are compared by class, parameter and buffer shapes, dtypes and
``requires_grad``, and every plain attribute of every submodule except per-block identifiers
(an attribute whose value differs in every block, such as ``layer_idx``).

The model is then run with its stack cut to ``prefix + 4`` units (run A) and ``prefix + 5``
units (run B). :func:`construct` (:class:`Folder`) derives a run with more units from run A
by copying what unit 1 does, everywhere in the step, as often as needed:

- every op, leaf and event is attributed to a unit (:mod:`~memsim.tracer.fold_units`): by its
  module path in forward, by the module whose forward made the running autograd node in
  backward (:attr:`~memsim.tracer.records.OpRecord.origin`), otherwise by the units of its
  inputs (an optimizer's per-parameter ops; a foreach op's outputs one by one);
- in each phase, a *pass* is a run over the units in one direction (forward and the optimizer's
  foreach ops ascend, backward descends); in each pass the *region* of unit 1 (from its first
  item to the first item of the next unit) is one period of the timeline
  (:mod:`~memsim.tracer.fold_regions`), and its copies are inserted after it: in ascending
  passes copy ``k`` is unit ``1 + k``, in descending ones the copies come in the order the
  units run backward;
- every reference (an event's storage, an op's input) is resolved by the unit it names relative
  to the item (an offset: the previous block's residual is unit ``u - 1``) and its *role* in
  that unit (the k-th storage of the same op, module, phase, category and size), so that a copy
  reads and frees its own tensors and its neighbours' (:mod:`~memsim.tracer.fold_copy`).

A construction is used only when it is proven on the model itself: run A with one unit added
must equal run B exactly (every storage, size, category, stream, event and op, in order), or
the model is traced whole (:class:`~memsim.tracer.fold_stack.CannotFold` names why). Tests
compare folded and whole runs of real models at their real depth (``tests/test_fold.py``).
"""

from __future__ import annotations

from .fold_copy import Copier
from .fold_regions import find_regions
from .fold_stack import CannotFold, Stack
from .fold_units import TEMPLATE, Attribution, merged_items, positions
from .records import RunRecord


class Folder:
    """Run ``run`` (the model with its stack cut to ``units`` units) attributed to its units
    once, to derive runs with more units from (:meth:`construct`, any number of times). After
    a construction, :attr:`last_copies` says where the last copy of each region lies
    (``(first event, end event)``): with one unit more, between the two copies of a region a
    model with ``k`` more units runs ``k - 1`` more, each changing the live bytes by as much
    as that copy does (:func:`memsim.analysis.memory.depth_peak`)."""

    def __init__(self, run: RunRecord, stack: Stack, units: int):
        self.run, self.stack, self.n = run, stack, units
        if units < TEMPLATE + 3:
            raise CannotFold(f"{units} units traced; the construction needs {TEMPLATE + 3}")
        self.units = Attribution(run, stack)
        self.last_copies: list = []

    def construct(self, extra: int) -> RunRecord:
        """The run with ``extra`` more units (the module docstring)."""
        run, units = self.run, self.units
        items = merged_items(run, positions(run))
        for it in items:
            it.unit = units.unit_of(it)
        regions, sigma_of = find_regions(items, self.n, extra)
        # storages made by an op of no unit inside a region belong to the region's unit
        units.claim(items, regions)
        copier = Copier(units, units.roles(), extra)
        out = copier.build(items, regions, sigma_of)
        self.last_copies = copier.last_copies
        return out


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
              "assumed", "branches", "owners", "resized"):
        if getattr(a, f) != getattr(b, f):
            return f"{f}: {getattr(a, f)} against {getattr(b, f)}"
    return None


def _diff(x, y) -> str:
    for f in x.__dataclass_fields__:
        if getattr(x, f) != getattr(y, f):
            return f"{f} {getattr(x, f)!r} against {getattr(y, f)!r}"
    return "?"
