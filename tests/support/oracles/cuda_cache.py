"""A small, separate model of PyTorch's CUDA caching allocator, and of training steps run on it.

Written from the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.13), not from
memsim, which this module does not import. Each segment is a list of blocks in address order,
and blocks are found by scanning them all: slow, and plain to check against the C++ source.

* ``round_size``: a request is rounded up to a multiple of 512 B, at least 512 B.
* ``get_pool``: a rounded request of at most 1 MiB is served by the small pool, else by the
  large one. A freed block serves only its own pool and stream.
* ``get_free_block``: the smallest free block of the pool and stream that is large enough;
  of equal sizes, the one at the lowest address.
* ``get_allocation_size``: with no such block, a new segment (``cudaMalloc``) of 2 MiB for a
  small request, 20 MiB for a large request under 10 MiB, else the request rounded up to
  2 MiB. Segments get increasing addresses in the order they are made.
* ``should_split``: the block found is split when what is left is at least 512 B (small
  pool) or more than 1 MiB (large pool); else it is handed out whole, and
  ``memory_allocated`` counts all of it (``alloc_found_block``).
* ``free_block``: a freed block merges with its free neighbours in its segment.
* ``malloc`` past ``limit`` (bytes that may be reserved in all): ``release_cached_blocks``
  returns every segment that is one free block, the request is tried once more, then it is
  out of memory.
* ``expandable_segments:True`` (without a limit): each pool of each stream has one segment,
  mapped from its start in pages of 2 MiB (small pool) or 20 MiB (large pool). Every
  remainder of 512 B or more is split off. A request takes the smallest free block that fits
  other than the one at the segment's mapped end (``get_free_block`` ranks that one by the
  size it could grow to), else that one; else pages are mapped at the end, joined to the
  free block there (``try_allocate_expandable_block``).
"""

from __future__ import annotations

MiB = 1 << 20


class OutOfMemory(Exception):
    """A request that no segment could be reserved for, even after releasing the cache."""

    def __init__(self, nbytes: int):
        super().__init__(f"out of memory requesting {nbytes} B")
        self.nbytes = nbytes
        self.done: list = []   # :func:`train`: the figures of the steps before


class Segment:
    """One ``cudaMalloc`` (or expandable segment): ``blocks`` are ``[address, size, in_use]``
    covering its ``size`` bytes in order."""

    def __init__(self, addr: int, size: int, stream: int, small: bool):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.blocks = [[addr, size, False]] if size else []


class Allocator:
    """The caching allocator of one device. ``allocated``, ``reserved`` and their peaks are
    ``torch.cuda.memory_allocated``, ``memory_reserved`` and ``max_memory_*``."""

    def __init__(self, limit: int | None = None, expandable: bool = False):
        if expandable and limit is not None:
            raise NotImplementedError("expandable segments are modelled without a limit")
        self.limit, self.expandable = limit, expandable
        self.segments: list[Segment] = []
        self.next_addr = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = 0

    @staticmethod
    def round_size(n: int) -> int:
        return 512 if n < 512 else (n + 511) // 512 * 512

    @staticmethod
    def segment_size(size: int) -> int:
        if size <= 1 * MiB:
            return 2 * MiB
        if size < 10 * MiB:
            return 20 * MiB
        return (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)

    def malloc(self, n: int, stream: int = 0) -> tuple:
        """A block for ``n`` bytes on ``stream``; returns its handle ``(segment, address)``."""
        size = self.round_size(n)
        small = size <= 1 * MiB
        if self.expandable:
            seg, i = self._expandable_block(size, stream, small)
        else:
            seg, i = self._best_fit(size, stream, small) or self._new_segment(n, size, stream,
                                                                              small)
        block = seg.blocks[i]
        rest = block[1] - size
        split = rest >= 512 if small or self.expandable else rest > 1 * MiB
        if split:
            block[1] = size
            seg.blocks.insert(i + 1, [block[0] + size, rest, False])
        block[2] = True
        self.allocated += block[1]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return seg, block[0]

    def _best_fit(self, size: int, stream: int, small: bool):
        best, best_key = None, None
        for seg in self.segments:
            if seg.stream != stream or seg.small != small:
                continue
            for i, (addr, bsize, used) in enumerate(seg.blocks):
                if not used and bsize >= size and (best_key is None
                                                   or (bsize, addr) < best_key):
                    best, best_key = (seg, i), (bsize, addr)
        return best

    def _new_segment(self, n: int, size: int, stream: int, small: bool) -> tuple:
        seg_size = self.segment_size(size)
        if self.limit is not None and self.reserved + seg_size > self.limit:
            self.retries += 1
            self.release_cached()
            if self.reserved + seg_size > self.limit:
                raise OutOfMemory(n)
        seg = Segment(self.next_addr, seg_size, stream, small)
        self.next_addr += seg_size
        self.segments.append(seg)
        self._reserve(seg_size)
        return seg, 0

    def _reserve(self, n: int) -> None:
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _expandable_block(self, size: int, stream: int, small: bool) -> tuple:
        seg = next((s for s in self.segments if s.stream == stream and s.small == small), None)
        if seg is None:
            seg = Segment(self.next_addr, 0, stream, small)
            self.next_addr += 1 << 44
            self.segments.append(seg)
        blocks = seg.blocks
        end = len(blocks) - 1 if blocks and not blocks[-1][2] else None  # free at the end
        fits = [(b[1], b[0], i) for i, b in enumerate(blocks)
                if not b[2] and b[1] >= size and i != end]
        if fits:
            return seg, min(fits)[2]
        if end is not None and blocks[end][1] >= size:
            return seg, end
        page = 2 * MiB if small else 20 * MiB
        have = blocks[end][1] if end is not None else 0
        grow = (size - have + page - 1) // page * page
        if end is None:
            blocks.append([seg.addr + seg.size, 0, False])
        blocks[-1][1] += grow
        seg.size += grow
        self._reserve(grow)
        return seg, len(blocks) - 1

    def free(self, handle: tuple) -> None:
        seg, addr = handle
        i = next(k for k, b in enumerate(seg.blocks) if b[0] == addr)
        assert seg.blocks[i][2], "freeing a free block"
        seg.blocks[i][2] = False
        self.allocated -= seg.blocks[i][1]
        if i + 1 < len(seg.blocks) and not seg.blocks[i + 1][2]:
            seg.blocks[i][1] += seg.blocks.pop(i + 1)[1]
        if i > 0 and not seg.blocks[i - 1][2]:
            seg.blocks[i - 1][1] += seg.blocks.pop(i)[1]

    def release_cached(self) -> None:
        """``release_cached_blocks`` (``torch.cuda.empty_cache``): every segment that is one
        free block goes back to the device."""
        keep = []
        for seg in self.segments:
            if len(seg.blocks) == 1 and not seg.blocks[0][2]:
                self.reserved -= seg.size
            else:
                keep.append(seg)
        self.segments = keep

    def largest_free(self) -> int:
        return max((b[1] for s in self.segments for b in s.blocks if not b[2]), default=0)


class StepFigures:
    """What one step of :func:`train` saw: ``peak``, the most allocated during the step (from
    its start); ``reserved_at_peak`` and ``largest_free_at_peak`` when that was first
    reached; ``peak_reserved``, ``max_memory_reserved`` from the job's start to the step's
    end; ``reserved``, the reserved bytes after each of the step's events; ``segments`` held
    and ``retries`` (cache releases) so far at its end; ``layout``, every block of every
    segment and the block each held storage has at its end (equal layouts: the next step runs
    the same way)."""

    def __init__(self):
        self.peak = -1
        self.reserved_at_peak = self.largest_free_at_peak = 0
        self.peak_reserved = 0
        self.reserved: list[int] = []
        self.segments = self.retries = 0
        self.layout: tuple = ()


def train(before, step, steps: int, *, lazy=(), lazy_at: int | None = None,
          absent_first=frozenset(), carried=None, limit: int | None = None,
          expandable: bool = False) -> list[StepFigures]:
    """Run ``steps`` training steps through an :class:`Allocator`; one :class:`StepFigures`
    per step.

    ``before``: ``(key, bytes, stream)`` allocated before the first step, in order (parameters,
    inputs, a cuBLAS workspace). ``step``: one step's events, ``(+1, key, bytes, stream)`` or
    ``(-1, key)``, in order; a free names a storage the step made, or one alive before it.
    ``lazy``: ``(key, bytes, stream)`` the first step allocates just before its event
    ``lazy_at`` (the optimizer's state, made when it first runs). ``absent_first``: storages
    alive before a step that the first step does not have (the previous step's gradients):
    their frees are skipped in it. ``carried``: ``{key alive before the step: key the step
    makes}``: in every step after the first, freeing the first frees what the previous step
    made as the second (the previous step's gradients, output and loss). What the previous
    step made and still holds that plays no such part is freed when the next step starts.
    Zero-byte storages get no block. Out of memory, :class:`OutOfMemory` has the figures of
    the steps before (``done``).
    """
    alloc = Allocator(limit, expandable)
    carried = carried or {}
    live: dict = {}

    def take(into: dict, key, n: int, stream: int) -> None:
        if n:
            into[key] = alloc.malloc(n, stream)

    for key, n, stream in before:
        take(live, key, n, stream)
    out: list[StepFigures] = []
    try:
        _steps(alloc, live, take, out, step, steps, lazy, lazy_at, absent_first, carried)
    except OutOfMemory as e:
        e.done = out
        raise
    return out


def _steps(alloc, live, take, out, step, steps, lazy, lazy_at, absent_first, carried):
    previous: dict = {}    # what the previous step made and still holds: key -> handle
    for k in range(steps):
        fig = StepFigures()
        if k > 0:
            for key in [key for key in previous if key not in carried.values()]:
                alloc.free(previous.pop(key))
        made: dict = {}
        for i in range(len(step) + 1):
            if k == 0 and i == lazy_at:
                for key, n, stream in lazy:
                    take(live, key, n, stream)
            if i == len(step):
                break
            ev = step[i]
            if ev[0] > 0:
                take(made, *ev[1:])
                if alloc.allocated > fig.peak:
                    fig.peak = alloc.allocated
                    fig.reserved_at_peak = alloc.reserved
                    fig.largest_free_at_peak = alloc.largest_free()
            elif ev[1] in made:
                alloc.free(made.pop(ev[1]))
            elif k == 0 and ev[1] in absent_first:
                pass
            elif k > 0 and ev[1] in carried:
                if carried[ev[1]] in previous:
                    alloc.free(previous.pop(carried[ev[1]]))
            elif ev[1] in live:
                alloc.free(live.pop(ev[1]))
            fig.reserved.append(alloc.reserved)
        previous = made
        fig.layout = (tuple((seg.addr, tuple(map(tuple, seg.blocks))) for seg in alloc.segments),
                      tuple(sorted((repr(key), handle[0].addr, handle[1])
                                   for key, handle in {**live, **made}.items())))
        fig.peak_reserved = alloc.peak_reserved
        fig.segments, fig.retries = len(alloc.segments), alloc.retries
        out.append(fig)


def steady(figs: list[StepFigures]) -> list[tuple]:
    """After each step from the second on: ``(max_memory_reserved since the job started, the
    most allocated in any step from the second on, the reserved bytes and the largest free
    block when that most was first reached, the reserved bytes at the step's end)``."""
    out, best = [], None
    for f in figs[1:]:
        if best is None or f.peak > best.peak:
            best = f
        out.append((f.peak_reserved, best.peak, best.reserved_at_peak,
                    best.largest_free_at_peak, f.reserved[-1] if f.reserved else None))
    return out


def loop_of(run, nbytes: list, workspace: int = 0) -> dict:
    """:func:`train`'s arguments for a traced run (read as plain data: its ``storages``,
    ``events``, ``start`` and ``phase_ends``), with each storage's bytes ``nbytes[sid]`` (0 or
    None: not on the device).

    Before the first step: what is alive at ``start`` in the order it was made, except
    gradients and optimizer states, then ``workspace`` bytes. The optimizer state is made
    where the backward phase ends. A storage alive at ``start`` that the step frees is played,
    in later steps, by one the step makes and does not free, of the same part (gradient;
    ``"<previous output>"`` by the ``output``, ``"<previous loss>"`` by the ``loss``) and
    size, in the order they are made.
    """
    st = run.storages
    live: set = set()
    for e in run.events[:run.start]:
        (live.add if e.sign > 0 else live.discard)(e.sid)
    grads = {i for i in live if st[i].category == "gradient"}
    states = {i for i in live if st[i].category == "optimizer_state"}

    def item(i):
        return (i, nbytes[i] or 0, st[i].stream)

    step = [(1, *item(e.sid)) if e.sign > 0 else (-1, e.sid) for e in run.events[run.start:]]

    def part(i):
        s = st[i]
        held = {"<previous output>": "output", "<previous loss>": "loss"}.get(s.op, s.held)
        return (held or str(s.category), s.stream, nbytes[i] or 0)

    kept = [e.sid for e in run.events[run.start:] if e.sign > 0 and st[e.sid].free is None]
    carried = {}
    for i in sorted(live):
        if st[i].free is not None:
            j = next((j for j in kept if part(j) == part(i)), None)
            if j is not None:
                carried[i] = j
                kept.remove(j)
    return dict(before=[item(i) for i in sorted(live - grads - states)] + [("ws", workspace, 0)],
                step=step, lazy=[item(i) for i in sorted(states)],
                lazy_at=run.phase_ends["backward"] - run.start, absent_first=grads,
                carried=carried)
