"""The timeline of one step at a point: live bytes after every allocation and free, by category.

What PyTorch's memory_viz draws from a recorded GPU run, predicted from the trace: the
measured step's events in order (from the state it starts in to its end), the bytes live after
each one split by category (parameters, gradients, optimizer states, activations,
temporaries...), the phases (forward, loss, backward, optimizer) as ranges of events, the peak
with what is live there (by module and category), and on CUDA the bytes the caching allocator
holds reserved after each event (:func:`memsim.analysis.reserved.replay`).

The series are exact integers at the point: their largest total is the step's peak
(:meth:`StepMemory.value`), and the bytes by category there are :meth:`StepMemory.breakdown`.
Rendering (pictures, HTML) is the front door's (``memsim.plots``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memsim.tracer import Category

from .allocator import block_bytes_of
from .alloc_conf import AllocConf
from .memory import PeakPoint, peak_point_of, live_at
from .reserved import replay, sizes_at, timeline_edit, walk_events

ADDED = "strategy buffers"   # storages a modelled strategy adds (DDP's buckets)
# what the loop's ``out`` and ``loss`` hold: the step's output and loss from the moment they are
# made, and the previous step's while the loop has not rebound its names
# (:mod:`memsim.tracer.previous`); other views count them as activations or temporaries
OUTPUT = "output"


@dataclass(frozen=True)
class LiveGroup:
    """Bytes live at the peak that one module produced, in one category."""

    module: str
    category: str
    bytes: int
    count: int


@dataclass
class Timeline:
    """One step's live bytes after each event (see the module docstring).

    Attributes
    ----------
    step : "train" or "inference"
    point : dict of str to int
    device : str
    series : dict of str to list of int
        Live bytes of each category after each event (index ``j``: the ``j``-th event of the
        measured step; ``"output"``: what the loop's ``out`` and ``loss`` hold, this step's
        and the previous one's, which :meth:`StepMemory.breakdown` counts in its category;
        the step's starting state is before index 0).
    ops : list of int
        The op index of each event (what allocated or freed it).
    phases : list of (str, int, int)
        Each phase and its first and last event index (a phase that repeats, as forward and
        backward under gradient accumulation, appears once per run of it).
    peak, peak_index : int
        The largest total and the first event where it is reached (-1: at the start).
    peak_where : PeakPoint
    at_peak : list of LiveGroup
        What is live at the peak, by module and category, largest first (the ``top`` largest
        where :func:`timeline` is given one, else all).
    reserved : list of int or None
        The caching allocator's reserved bytes after each event (CUDA), else None.
    totals : list of int
        Live bytes in all categories after each event.
    """

    step: str
    point: dict
    device: str
    series: dict[str, list[int]]
    ops: list[int]
    phases: list[tuple[str, int, int]]
    peak: int
    peak_index: int
    peak_where: PeakPoint
    at_peak: list[LiveGroup] = field(default_factory=list)
    reserved: list[int] | None = None
    totals: list[int] = field(default_factory=list)


def timeline(report, point: dict[str, int], *, step: str | None = None,
             alloc_conf: AllocConf | None = None, workspace: int = 0,
             top: int | None = None) -> Timeline:
    """The timeline of ``report``'s training step (or ``step="inference"``) at ``point``."""
    sub, pt = report.for_point(point)
    name = step or ("train" if sub.train is not None else "inference")
    sm = sub.train if name == "train" else sub.inference
    sm.check_point(pt)
    trace = sm.trace
    run, dev = trace.run, trace.device
    subs = {trace.symbols[n]: v for n, v in pt.items() if n in trace.symbols}
    raw = sizes_at(run, dev, subs)
    charged = [None if n is None else block_bytes_of(n, dev) for n in raw]
    added, moved, keep = timeline_edit(sm, subs)

    def cat_of(key) -> str:
        if key[0] == "a":
            return ADDED
        st = run.storages[key[1]]
        return OUTPUT if st.held or st.op.startswith("<previous ") else st.category.value

    live: dict = {}
    sums: dict[str, int] = {}

    def take(key, n, stream=0):
        if not n:
            return
        b = charged[key[1]] if key[0] == "s" else block_bytes_of(n, dev)
        live[key] = b
        sums[cat_of(key)] = sums.get(cat_of(key), 0) + b

    def drop(key):
        b = live.pop(key, None)
        if b is not None:
            sums[cat_of(key)] -= b

    for sid in sorted(live_at(run, run.start)):
        take(("s", sid), raw[sid])
    for k, (n, at, _free) in enumerate(added):
        if at <= run.start:
            take(("a", k), n)
    cats = [c.value for c in Category] + [OUTPUT] + ([ADDED] if added else [])
    series: dict[str, list[int]] = {c: [] for c in cats}
    snapshots: list[int] = []

    def after(i):
        if i > run.start:
            for c in cats:
                series[c].append(sums.get(c, 0))
            snapshots.append(i - 1)

    walk_events(run, run.start, raw, take, drop, lambda k: k, added, moved, keep, {},
                before=after)
    n = len(snapshots)
    ops = [run.events[i].time for i in snapshots]
    totals = [sum(series[c][j] for c in cats) for j in range(n)]
    start_total = sum(sums.get(c, 0) for c in cats) if n == 0 else None
    peak, peak_index = (max(totals), totals.index(max(totals))) if totals else (start_total, -1)
    series = {c: v for c, v in series.items() if any(v)}
    where = peak_point_of(trace)(snapshots[peak_index] if peak_index >= 0 else -1)

    # what is live at the peak, by the module that made it and its category
    groups: dict[tuple, list] = {}
    at = live_at(run, snapshots[peak_index] + 1 if peak_index >= 0 else run.start)
    for sid in at:
        b = charged[sid]
        if not b or (keep is not None and not keep(run.storages[sid], 1)):
            continue
        s = run.storages[sid]
        g = groups.setdefault((s.module if s.module is not None else "-", cat_of(("s", sid))),
                              [0, 0])
        g[0] += b
        g[1] += 1
    at_peak = sorted((LiveGroup(m, c, b, k) for (m, c), (b, k) in groups.items()),
                     key=lambda g: (-g.bytes, g.module))[:top]

    phases = _phases(run, snapshots)
    reserved = None
    if dev == "cuda":
        rec: list[int] = []
        replay(sm, pt, conf=alloc_conf, workspace=workspace, record=rec)
        reserved = rec[:n] if len(rec) >= n else None
    return Timeline(name, dict(pt), dev, series, ops, phases, peak, peak_index, where,
                    at_peak, reserved, totals)


def _phases(run, snapshots: list[int]) -> list[tuple[str, int, int]]:
    """Runs of events by the phase they happened in (:attr:`RunRecord.marks`)."""
    marks = run.marks
    out: list[list] = []
    k = 0
    for j, ev in enumerate(snapshots):
        while k + 1 < len(marks) and marks[k + 1][1] <= ev:
            k += 1
        ph = marks[k][0].value if marks and marks[k][1] <= ev else "setup"
        if out and out[-1][0] == ph:
            out[-1][2] = j
        else:
            out.append([ph, j, j])
    return [tuple(p) for p in out]
