"""Reserved memory of a traced step: its allocations replayed through the CUDA caching allocator.

What is replayed, at one point (every symbol given a size):

1. the storages alive when the step starts, in the order they were made (parameters, buffers,
   inputs), but neither gradients nor optimizer states: a job's first step makes those;
2. the first step: the traced step's allocations and frees in order, with PyTorch's cuBLAS
   workspace taken at its start (it stays for the job), the optimizer state made when the
   optimizer first runs (``torch.optim`` creates it lazily, per parameter, in order);
3. the steady-state step, replayed again: what the first step leaves that the next one makes
   again is freed where the step frees its own (the previous step's output and loss as the
   loop rebinds them, its gradients at ``zero_grad``), else at its start; then again, until
   a walk changes no figure (at most :data:`STEADY_WALKS` steady walks: the previous step's
   output, alive into the next forward, moves blocks for a few steps).

A library's loop whose warm-up steps were traced (DeepSpeed's engine) is replayed as traced,
warm-up included, then its steady step the same way. Each storage is one request of its exact
byte size on the stream it was made on (:attr:`memsim.tracer.Storage.stream`).

What it returns is ``torch.cuda.max_memory_reserved()`` over those steps, the allocator's
``max_memory_allocated()`` over the steady steps (whole blocks as handed out: a large block
whose remainder is at most 1 MiB is not split), and, at the moment that peak is first reached,
the reserved bytes and the largest cached free block. Reserved memory only grows while nothing
is released, so the figure once the walks settle is the steady state's unless the cache had
to be released (then :attr:`Reserved.retries` says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from memsim.tracer import Category, Phase

from .alloc_conf import AllocConf
from .caching import AllocatorOOM, CachingAllocator
from .memory import live_at


@dataclass(frozen=True)
class Reserved:
    """The replay's figures at one point (bytes).

    Attributes
    ----------
    reserved : int
        ``max_memory_reserved`` over the first and the steady steps.
    allocated : int
        ``max_memory_allocated`` as the allocator counts it (blocks handed out), over the
        steady steps: the step is walked again until a walk changes no figure (at most
        ``STEADY_WALKS``).
    reserved_at_peak, largest_free_at_peak : int
        Reserved bytes and the largest cached free block when that allocated peak is first
        reached.
    workspace : int
        Bytes of the cuBLAS workspace included.
    segments : int
        Segments (cudaMalloc calls, or expandable segments) held at the end.
    retries : int
        Times a reservation failed and the cache was released to retry (0: never near the
        limit).
    oom : int or None
        The request (bytes) that could not be served even after releasing the cache: the step
        runs out of memory. None: it ran.
    conf : AllocConf
    """

    reserved: int
    allocated: int
    reserved_at_peak: int
    largest_free_at_peak: int
    workspace: int
    segments: int
    retries: int
    oom: int | None
    conf: AllocConf

    def as_dict(self) -> dict:
        return {"reserved": self.reserved, "allocated": self.allocated,
                "reserved_at_peak": self.reserved_at_peak,
                "largest_free_block_at_peak": self.largest_free_at_peak,
                "cublas_workspace": self.workspace, "segments": self.segments,
                "retries": self.retries, "oom_request": self.oom,
                "alloc_conf": str(self.conf)}


def timeline_edit(step, subs: dict) -> tuple[list, dict, object]:
    """A modelled strategy's edit of ``step``'s timeline (:attr:`RankMemory.edit` of DDP) as
    ``(added, moved, keep)``: added storages ``(bytes, alloc event, free event or None)`` at the
    point ``subs``, frees moved ``{sid: event}``, and the filter of the run's events."""
    edit = getattr(getattr(step, "rank", None), "edit", None) or {}
    added = [(int(sympy.sympify(a.nbytes).xreplace(subs)), a.alloc, a.free)
             for a in edit.get("added", ())]
    return added, dict(edit.get("frees") or {}), edit.get("keep")


def replay(step, point: dict[str, int], *, conf: AllocConf | None = None,
           limit: int | None = None, workspace: int = 0,
           record: list | None = None) -> Reserved:
    """Replay ``step`` (a :class:`~memsim.analysis.StepMemory` of a CUDA trace) at ``point``.

    ``limit``: the bytes the allocator may reserve (the card less the CUDA context); None is
    unlimited. ``workspace``: bytes of cuBLAS workspace taken at the start of the first step.
    ``record``: a list that receives the reserved bytes after each event of the measured step
    (``record[j]`` after event ``run.start + j``), for a timeline.
    """
    conf = conf or AllocConf()
    trace = step.trace
    run, dev = trace.run, trace.device
    subs = {trace.symbols[n]: v for n, v in point.items() if n in trace.symbols}
    nbytes = sizes_at(run, dev, subs)
    added, moved, keep = timeline_edit(step, subs)

    alloc = CachingAllocator(conf, limit)
    held: dict = {}            # key -> Block; keys are ("s", sid), ("a", k), ("ws",)
    state = {"peak": -1, "at_peak": (0, 0), "measure": False}

    def take(key, n: int | None, stream: int = 0) -> None:
        if not n:  # not on the device (None) or empty
            return
        held[key] = alloc.malloc(n, stream)
        if state["measure"] and alloc.allocated > state["peak"]:
            state["peak"] = alloc.allocated
            state["at_peak"] = (alloc.reserved, alloc.largest_free())

    def drop(key) -> None:
        b = held.pop(key, None)
        if b is not None:
            alloc.free(b)

    def added_at_start() -> None:
        for k, (n, at, _free) in enumerate(added):
            if at <= run.start:
                take(("a", k), n)

    def steady(i: int) -> None:
        """Before event ``i`` of the measured step's walk: measure from its start, and record
        the reserved bytes after each of its events."""
        if i == run.start:
            state["measure"] = True
        elif record is not None and i > run.start:
            record.append(alloc.reserved)

    first_event = _alloc_index(run)

    def made_in_step(sid: int) -> bool:
        return first_event[sid] >= run.start

    def again(measure: bool) -> None:
        """The measured step once more, from what the last walk left: the blocks of what
        the step frees (the previous step's gradients, output and loss) are the ones the last
        walk made in their place (:func:`_carry_over`); what else it made and still holds is
        dropped at the start."""
        alias = _carry_over(run, live0, held, nbytes, made_in_step)
        for key in [k for k in held if k[0] == "s"
                    and k not in alias.values() and made_in_step(k[1])]:
            drop(key)
        renamed: dict = {}
        walk_events(run, run.start, nbytes, take, drop,
                    lambda k: alias.get(k, renamed.get(k, k)), added, moved, keep, renamed,
                    before=steady if measure else None, fresh=True)
        # the blocks this walk made stand for their storages in the next one
        for key in [k for k in held if k[0] == "s2"]:
            if ("s", key[1]) not in held:
                held[("s", key[1])] = held.pop(key)

    def figures() -> tuple:
        return state["peak"], state["at_peak"], alloc.peak_reserved, alloc.reserved

    def layout() -> tuple:
        """Where every held storage is and which blocks are free: a walk that leaves the same
        layout walks the same way next time."""
        return (tuple(sorted((k, b.addr, b.size) for k, b in held.items())),
                *(tuple(p.keys) + tuple(p.unmapped) for p in alloc.pools.values()))

    def settle() -> None:
        """Walk the steady step again until a walk changes none of the figures, as a long run's
        counters see them (the most allocated over the steps, the reserved bytes and largest
        free block when it was first reached, the most reserved), and leaves the allocator's
        blocks as an earlier walk left them (the walks after it repeat walks already made:
        the previous output takes two blocks in turn), at most :data:`STEADY_WALKS` steady
        walks in all (equal figures with blocks still moving can grow at a later walk). The previous
        step's output, alive into the next forward, moves blocks for a few steps
        (``python -m benchmarks.replay_walks``)."""
        last, seen = figures(), {layout()}
        for _ in range(STEADY_WALKS - 1):
            if record is not None:
                record.clear()
            again(measure=True)
            now = layout()
            if figures() == last and now in seen:
                return
            last = figures()
            seen.add(now)

    live0 = live_at(run, run.start)
    try:
        if run.warmed:  # warm-up steps traced: the measured step follows them in the run
            take(("ws",), workspace)
            added_at_start()
            walk_events(run, 0, nbytes, take, drop, lambda k: k, added, moved, keep, {},
                        before=None if run.replays else steady)
            for k in range(run.replays):
                again(measure=k == run.replays - 1)
            settle()
        else:
            states = {sid for sid in live0 if run.storages[sid].category in
                      (Category.OPTIMIZER_STATE, Category.GRADIENT)}
            for sid in sorted(live0 - states):
                take(("s", sid), nbytes[sid], run.storages[sid].stream)
            added_at_start()
            take(("ws",), workspace)
            opt_at = run.phase_ends.get(Phase.BACKWARD) if trace.train else None
            lazy = sorted(sid for sid in states
                          if run.storages[sid].category is Category.OPTIMIZER_STATE)

            def first(i):
                if i == opt_at:
                    for sid in lazy:
                        take(("s", sid), nbytes[sid], run.storages[sid].stream)

            # first step: frees of what does not exist yet (the previous gradients) are skipped
            walk_events(run, run.start, nbytes, take, drop, lambda k: k, added, moved, keep,
                        {}, before=first, absent={("s", sid) for sid in states
                                          if run.storages[sid].category is Category.GRADIENT})
            again(measure=True)
            settle()
    except AllocatorOOM as e:
        return Reserved(alloc.peak_reserved, alloc.peak_allocated, alloc.reserved,
                        alloc.largest_free(), workspace, alloc.segments, alloc.retries,
                        e.nbytes, conf)
    r_at, free_at = state["at_peak"]
    return Reserved(alloc.peak_reserved, state["peak"] if state["peak"] >= 0 else
                    alloc.peak_allocated, r_at, free_at, workspace, alloc.segments,
                    alloc.retries, None, conf)


# the most steady steps the replay walks while its figures still change (:func:`replay`)
STEADY_WALKS = 6


def walk_events(run, start, nbytes, take, drop, name, added, moved, keep, renamed, *,
                before=None, absent=frozenset(), fresh=False):
    """Walk ``run.events[start:]`` with a strategy's timeline edit (:func:`timeline_edit`),
    calling ``take(key, bytes, stream)`` and ``drop(key)``; keys are ``("s", sid)`` for the
    run's storages and ``("a", k)`` for added ones. ``name`` maps a storage's key to the one
    that plays its part; with ``fresh`` a storage the step allocates gets a new key
    (``renamed``) so the previous step's block of that id survives until the step frees it.
    ``before(i)`` is called before event ``i`` (and once with ``len(run.events)``)."""
    storages = run.storages
    by_event: dict[int, list] = {}
    for sid, i in moved.items():
        by_event.setdefault(i, []).append(("free", ("s", sid)))
    for k, (n, at, free) in enumerate(added):
        if at > run.start:
            by_event.setdefault(at, []).append(("take", ("a", k), n))
        if free is not None:
            by_event.setdefault(free, []).append(("free", ("a", k)))
    events = run.events
    for i in range(start, len(events) + 1):
        if before is not None:
            before(i)
        for act in by_event.get(i, ()):
            if act[0] == "take":
                take(act[1], act[2])
            else:
                drop(name(act[1]))
        if i == len(events):
            break
        e = events[i]
        s = storages[e.sid]
        if nbytes[e.sid] is None:
            continue
        if keep is not None and not keep(s, e.sign):
            continue
        key = ("s", e.sid)
        if e.sign > 0:
            if fresh:
                renamed[key] = ("s2", e.sid)
                key = renamed[key]
            take(key, nbytes[e.sid], s.stream)
        else:
            if e.sid in moved or key in absent:
                continue
            drop(name(key))


def _carry_over(run, live0: set, held: dict, nbytes, made_in_step) -> dict:
    """For each storage alive when the step starts that the step frees, the block the first
    step left in its place (same category, stream and size, in allocation order): the
    previous step's gradients are this step's ``zero_grad`` frees."""
    freed0 = [sid for sid in sorted(live0) if run.storages[sid].free is not None]
    ends: dict[tuple, list] = {}
    for key in held:
        if key[0] == "s" and made_in_step(key[1]):
            s = run.storages[key[1]]
            ends.setdefault((s.category, s.stream, nbytes[key[1]]), []).append(key)
    alias = {}
    for sid in freed0:
        s = run.storages[sid]
        got = ends.get((s.category, s.stream, nbytes[sid]))
        if got:
            alias[("s", sid)] = got.pop(0)
    return alias


def _alloc_index(run) -> list[int]:
    """Each storage's allocation event index (-1: none)."""
    got = [-1] * len(run.storages)
    for i, e in enumerate(run.events):
        if e.sign > 0:
            got[e.sid] = i
    return got


def sizes_at(run, device: str, subs: dict) -> list:
    """Each storage's requested bytes at the point ``subs`` (None: not on ``device``)."""
    cache: dict = {}
    out = []
    for s in run.storages:
        if s.device != device:
            out.append(None)
            continue
        e = s.nbytes
        v = cache.get(e)
        if v is None:
            v = int(e) if e.is_Integer else int(e.xreplace(subs))
            cache[e] = v
        out.append(v)
    return out
