"""Where the template unit of a folded stack runs in a run, and how what runs outside it moves
(:mod:`memsim.tracer.fold`).

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
else units below the template keep their number and units above it move.
"""

from __future__ import annotations

from .fold_stack import CannotFold
from .fold_units import TEMPLATE, Item


def find_regions(items: list[Item], n: int, extra: int):
    """Regions ``(start, end, ascending)`` of unit ``TEMPLATE`` (indices into ``items``)
    and, for every item of a unit outside them, its shift: the units it names move by
    ``extra`` when it runs after the copies of a region (the module docstring). ``n``: the
    units of the run."""
    j = TEMPLATE
    regions = []
    sigma: dict[int, int] = {}
    for idx in _phases(items):
        phase = items[idx[0]].phase
        units = [items[k].unit for k in idx]
        reg = _runs(units, phase, n - 1) if j in units else []
        _shift_outside(idx, units, reg, phase, extra, sigma)
        regions += [(idx[a], idx[b - 1] + 1, asc) for a, b, asc in reg]
    regions.sort()
    return regions, sigma


def _phases(items: list[Item]) -> list[list[int]]:
    """The indices of ``items`` by phase, a list for each run of items of one phase."""
    segments: list[list[int]] = []
    for k, it in enumerate(items):
        if not segments or items[segments[-1][-1]].phase is not it.phase:
            segments.append([])
        segments[-1].append(k)
    return segments


def _runs(units: list, phase, top: int) -> list:
    """The template's regions in one phase's ``units`` (of its items): ``(start, end,
    ascending)`` as positions in ``units``; ``top``: the last unit."""
    j = TEMPLATE
    first = {}
    for pos, u in enumerate(units):
        if u is not None:
            first.setdefault(u, pos)
    reg = []        # (start, end, ascending) as positions in ``units``
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
    return reg


def _shift_outside(idx: list[int], units: list, reg: list, phase, extra: int,
                   sigma: dict) -> None:
    """The shift of every item of one phase (``idx``, of units ``units``) outside its regions
    ``reg``, into ``sigma``."""
    j = TEMPLATE
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
