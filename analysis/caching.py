"""A replay of PyTorch's CUDA caching allocator: what a step *reserves*, not only what it holds.

A CUDA job dies when the caching allocator cannot reserve a segment, not when its live tensors
reach the card's size. The allocator is deterministic given its sequence of requests and frees
on each stream, which the trace has; this module replays that sequence through the allocator's
rules and returns ``torch.cuda.max_memory_reserved`` and ``max_memory_allocated`` as they would
be.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/core/AllocatorConfig``
in PyTorch 2.13 (the release memsim targets), restated here (the function named in brackets):

* every request is rounded up to a multiple of 512 bytes, at least 512 [``round_size``]; with
  ``roundup_power2_divisions`` a request above ``512 * divisions`` bytes is rounded up to the
  next of ``divisions`` equal steps between two powers of two;
* requests up to 1 MiB come from the small pool, larger ones from the large pool
  [``get_pool``];
* a request is served from the smallest cached free block of its pool *on its stream* that is
  large enough, ties to the lowest address [``get_free_block``, ``BlockComparatorSize``];
  under ``max_split_size_mb`` a block at or above that size serves no request below it, and a
  request at or above it only a block less than ``max_non_split_rounding_mb`` (default 20 MiB)
  larger;
* otherwise a new segment is reserved [``alloc_block``, ``get_allocation_size``]: 2 MiB for a
  small request, the large segment size (20 MiB) for a request under 10 MiB, else the request
  rounded up to 2 MiB;
* a block larger than the request is split when what remains is at least 512 bytes (small
  pool, or expandable segments), or more than 1 MiB for a request under ``max_split_size``
  (large pool) [``should_split``]; an unsplit block is handed out whole, and
  ``memory_allocated`` counts all of it [``alloc_found_block``];
* a freed block goes back to its pool and merges with free neighbours of the same segment
  [``free_block``, ``try_merge_blocks``];
* when a segment cannot be reserved (the device is full) the allocator first releases cached
  segments no larger than needed under ``max_split_size`` [``release_available_cached_blocks``],
  then every cached segment that is wholly free [``release_cached_blocks``], and retries; then it
  raises out-of-memory;
* with ``expandable_segments:True`` each (stream, pool) has one segment that grows by mapping
  pages (2 MiB small, 20 MiB large) at its lowest free address [``try_allocate_expandable_block``,
  ``map_block``], and releasing unmaps whole free pages [``unmap_block``].

Not modelled: CUDA graphs' private pools, ``record_stream`` (its events delay a free until the
other stream's work ends: FSDP2 does not call it; DeepSpeed does on CUDA, not on the CPU path
memsim traces), ``garbage_collection_
threshold`` (acts only under a per-process limit, which the budget sets from its margin:
:mod:`memsim.analysis.budget`; refused by :meth:`AllocConf.parse`), and where ``cudaMalloc``
places a segment (addresses here increase; they only break ties between free blocks of equal
size).

>>> a = CachingAllocator()
>>> x = a.malloc(1000)            # 1,024 B block, from a new 2 MiB small segment
>>> y = a.malloc(3 * MiB)         # a 20 MiB large segment, split: 3 MiB handed out
>>> a.allocated, a.reserved
(3146752, 23068672)
>>> a.free(y); a.free(x)
>>> a.allocated, a.reserved, a.peak_reserved
(0, 23068672, 23068672)
"""

from __future__ import annotations

import bisect

from .alloc_conf import MIN_BLOCK, NO_LIMIT, SMALL_BUFFER, SMALL_SIZE, AllocConf
from .alloc_conf import MiB  # noqa: F401  (the doctest's unit)
class AllocatorOOM(Exception):
    """The replay could not reserve memory for a request, even after releasing the cache."""

    def __init__(self, nbytes: int, allocated: int, reserved: int):
        super().__init__(f"out of memory requesting {nbytes} B ({allocated} B allocated, "
                         f"{reserved} B reserved)")
        self.nbytes, self.allocated, self.reserved = nbytes, allocated, reserved


class Block:
    """A range of a segment: handed out (``allocated``) or cached free."""

    __slots__ = ("size", "addr", "stream", "small", "prev", "next", "allocated", "mapped",
                 "segment", "requested")

    def __init__(self, size: int, addr: int, stream: int, small: bool, segment=None):
        self.size, self.addr, self.stream, self.small = size, addr, stream, small
        self.prev = self.next = None
        self.allocated = False
        self.mapped = True
        self.segment = segment  # an _Expandable, or None for a cudaMalloc segment
        self.requested = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def split(self, size: int) -> "Block":
        """Keep the first ``size`` bytes; return the rest as a new block linked after."""
        rest = Block(self.size - size, self.addr + size, self.stream, self.small, self.segment)
        rest.prev, rest.next = self, self.next
        if self.next is not None:
            self.next.prev = rest
        self.next = rest
        self.size = size
        return rest

    def key(self) -> tuple:
        return (self.stream, self.size, self.addr)

    def __repr__(self) -> str:
        return (f"Block({self.size}, @{self.addr}, stream {self.stream}, "
                f"{'allocated' if self.allocated else 'free'})")


class _Expandable:
    """One expandable segment: a large virtual range whose pages are mapped on demand."""

    def __init__(self, addr: int, size: int, page: int):
        self.addr, self.size, self.page = addr, size, page


class _Pool:
    """Free blocks of one pool ordered as ``BlockComparatorSize``: (stream, size, address)."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple] = []
        self.blocks: dict[tuple, Block] = {}
        self.unmapped: list[tuple] = []   # (stream, address) of unmapped expandable ranges
        self.unmapped_blocks: dict[tuple, Block] = {}

    def insert(self, b: Block) -> None:
        k = b.key()
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: Block) -> None:
        k = b.key()
        i = bisect.bisect_left(self.keys, k)
        assert self.keys[i] == k, (k, b)
        del self.keys[i]
        del self.blocks[k]

    def insert_unmapped(self, b: Block) -> None:
        k = (b.stream, b.addr)
        bisect.insort(self.unmapped, k)
        self.unmapped_blocks[k] = b

    def remove_unmapped(self, b: Block) -> None:
        k = (b.stream, b.addr)
        i = bisect.bisect_left(self.unmapped, k)
        assert self.unmapped[i] == k
        del self.unmapped[i]
        del self.unmapped_blocks[k]

    def lower_bound(self, stream: int, size: int) -> int:
        return bisect.bisect_left(self.keys, (stream, size, -1))


class CachingAllocator:
    """One device's caching allocator, replayed.

    Parameters
    ----------
    conf : AllocConf
    limit : int or None
        Bytes the allocator may reserve in all (the device's memory less what lives outside
        the allocator: the CUDA context); a reservation past it fails as ``cudaMalloc`` would,
        and the allocator releases its cache and retries before raising :class:`AllocatorOOM`.
        None: unlimited.

    Attributes
    ----------
    allocated, reserved : int
        ``torch.cuda.memory_allocated`` / ``memory_reserved`` now.
    peak_allocated, peak_reserved : int
        Their maxima so far (``max_memory_*``).
    retries : int
        Times the cache was released to satisfy a request (``num_alloc_retries`` and the
        smaller release before it).
    """

    def __init__(self, conf: AllocConf | None = None, limit: int | None = None):
        self.conf = conf or AllocConf()
        self.limit = limit
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = 0
        self.segments = 0
        self._next_addr = 1 << 20   # new segments' addresses (cudaMalloc's are opaque)
        self._expandable: dict[tuple, _Expandable] = {}

    # -- the public calls ----------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        """``DeviceCachingAllocator::malloc``: a block of at least ``nbytes`` on ``stream``."""
        conf = self.conf
        size = conf.round_size(nbytes)
        pool = self.pools[size <= SMALL_SIZE]
        block = self._free_block(pool, stream, size)
        if block is None:
            alloc = conf.segment_size(size)
            block = self._new_block(pool, stream, size, alloc)
            if block is None:
                self.retries += 1
                if self._release_available(pool, stream, size):
                    block = self._new_block(pool, stream, size, alloc)
                if block is None:
                    self.release_cached()
                    block = self._new_block(pool, stream, size, alloc)
            if block is None:
                raise AllocatorOOM(nbytes, self.allocated, self.reserved)
        if self._should_split(block, size):
            pool.insert(block.split(size))
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: Block) -> None:
        """``free`` then ``free_block``: back to its pool, merged with free neighbours."""
        assert block.allocated, block
        block.allocated = False
        self.allocated -= block.size
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            self._merge(block, other, pool)
        pool.insert(block)

    def release_cached(self) -> None:
        """``release_cached_blocks`` (also ``torch.cuda.empty_cache``): return every cached
        segment that is wholly free; with expandable segments, unmap every free whole page."""
        for pool in self.pools.values():
            for k in list(pool.keys):
                b = pool.blocks.get(k)
                if b is None:
                    continue
                if b.segment is not None:
                    self._unmap(pool, b)
                elif not b.is_split:
                    self._release_segment(pool, b)

    def largest_free(self) -> int:
        """The largest cached free block (what ``torch.cuda.mem_get_info`` cannot show)."""
        return max((k[1] for p in self.pools.values() for k in p.keys), default=0)

    # -- the rules -------------------------------------------------------------------------
    def _free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        """``get_free_block``."""
        i = pool.lower_bound(stream, size)
        keys = pool.keys
        if i == len(keys) or keys[i][0] != stream:
            return None
        b = pool.blocks[keys[i]]
        if b.segment is not None:
            # an expandable block counts the unmapped range after it as its size
            def grow(x: Block) -> int:
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            j = i + 1
            while (b.segment is not None and j < len(keys) and keys[j][0] == stream
                   and grow(pool.blocks[keys[j]]) < grow(b)):
                b = pool.blocks[keys[j]]
                j += 1
        mss = self.conf.max_split_size
        if size < mss and b.size >= mss:
            return None
        if size >= mss and b.size >= size + self.conf.non_split_rounding:
            return None
        pool.remove(b)
        return b

    def _should_split(self, b: Block, size: int) -> bool:
        rest = b.size - size
        if b.small or self.conf.expandable_segments:
            return rest >= MIN_BLOCK
        return size < self.conf.max_split_size and rest > SMALL_SIZE

    def _new_block(self, pool: _Pool, stream: int, size: int, alloc: int) -> Block | None:
        """``alloc_block``: a new segment (or, expandable, newly mapped pages)."""
        if self.conf.expandable_segments:
            return self._expand(pool, stream, size)
        if self.limit is not None and self.reserved + alloc > self.limit:
            return None
        b = Block(alloc, self._next_addr, stream, pool.small)
        self._next_addr += alloc + SMALL_BUFFER
        self._reserve(alloc)
        self.segments += 1
        return b

    def _reserve(self, n: int) -> None:
        self.reserved += n
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _release_available(self, pool: _Pool, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``: under ``max_split_size``, return the smallest
        oversize cached segment that is large enough, else the largest ones until enough."""
        mss = self.conf.max_split_size
        if mss == NO_LIMIT:
            return False
        want = max(size, mss)
        i = pool.lower_bound(stream, want)
        keys = pool.keys
        if i < len(keys) and keys[i][0] == stream and pool.blocks[keys[i]].segment is None:
            self._release_segment(pool, pool.blocks[keys[i]])
            return True
        if i == 0:
            return False
        released = 0
        j = i - 1
        while released < want and j >= 0 and keys[j][0] == stream and keys[j][1] >= mss:
            b = pool.blocks[keys[j]]
            if b.segment is None:  # expandable blocks are passed over, not released
                released += b.size
                self._release_segment(pool, b)
            j -= 1
        return released >= want

    def _release_segment(self, pool: _Pool, b: Block) -> None:
        pool.remove(b)
        self.reserved -= b.size
        self.segments -= 1

    def _merge(self, dst: Block, src: Block | None, pool: _Pool) -> None:
        """``try_merge_blocks``: absorb a free neighbour of the same mapping state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- expandable segments ------------------------------------------------------------------
    def _expand(self, pool: _Pool, stream: int, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages at the segment's lowest free address
        that has room, merged with the free block before them."""
        cand = self._find_expandable(pool, stream, size)
        if not cand.mapped and not self._map(pool, cand, min(cand.size, size)):
            return None
        # `cand` is mapped and free (in the pool): map the unmapped range after it, which
        # absorbs it (map_block merges a mapped range with its free neighbours)
        while cand.size < size:
            nxt = cand.next
            if not self._map(pool, nxt, min(size - cand.size, nxt.size)):
                return None
            cand = nxt
        pool.remove(cand)
        return cand

    def _find_expandable(self, pool: _Pool, stream: int, size: int) -> Block:
        def free(b):
            return b is not None and not b.allocated

        def room(b):
            got = 0
            while got < size and free(b):
                got += b.size
                b = b.next
            return got >= size

        i = bisect.bisect_left(pool.unmapped, (stream, -1))
        while i < len(pool.unmapped) and pool.unmapped[i][0] == stream:
            c = pool.unmapped_blocks[pool.unmapped[i]]
            if free(c.prev):
                c = c.prev
            if room(c):
                return c
            i += 1
        page = SMALL_BUFFER if pool.small else self.conf.large_segment_size
        span = 1 << 44  # the address range reserved (the card's memory and then some)
        seg = _Expandable(self._next_addr, span, page)
        self._next_addr += span
        b = Block(span, seg.addr, stream, pool.small, seg)
        b.mapped = False
        pool.insert_unmapped(b)
        self.segments += 1
        return b

    def _map(self, pool: _Pool, b: Block, size: int) -> bool:
        """``map_block``: map the pages covering ``size`` bytes from ``b``'s start."""
        seg = b.segment
        off = b.addr - seg.addr
        first, last = off // seg.page, -(-(off + size) // seg.page)
        mapped = (last - first) * seg.page
        if self.limit is not None and self.reserved + mapped > self.limit:
            return False
        pool.remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = b.split(mapped)
            rest.mapped = False
            pool.insert_unmapped(rest)
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert(b)
        self._reserve(mapped)
        return True

    def _unmap(self, pool: _Pool, b: Block) -> None:
        """``unmap_block``: unmap the whole pages inside free block ``b``."""
        seg = b.segment
        lo = -(-(b.addr - seg.addr) // seg.page) * seg.page + seg.addr
        hi = ((b.addr + b.size - seg.addr) // seg.page) * seg.page + seg.addr
        if lo >= hi:
            return
        pool.remove(b)
        if b.addr + b.size > hi:          # a partial page at the end stays mapped and free
            pool.insert(b.split(hi - b.addr))
        if lo > b.addr:                   # and one at the start
            mid = b.split(lo - b.addr)
            pool.insert(b)
            b = mid
        b.mapped = False
        self.reserved -= b.size
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert_unmapped(b)
