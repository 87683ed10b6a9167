"""The CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) and sizes, as
``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/core/AllocatorConfig`` of PyTorch 2.13 define
them; the allocator's replay is :mod:`memsim.analysis.caching`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AllocConf", "roundup_power2", "MiB", "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER",
           "MIN_LARGE_ALLOC", "ROUND_LARGE", "LARGE_BUFFER", "ROUNDUP_INTERVALS", "NO_LIMIT"]

MiB = 1 << 20
MIN_BLOCK = 512                # kMinBlockSize
SMALL_SIZE = 1 * MiB           # kSmallSize: largest small request
SMALL_BUFFER = 2 * MiB         # kSmallBuffer: small segments
MIN_LARGE_ALLOC = 10 * MiB     # kMinLargeAlloc: below it a large request takes a large segment
ROUND_LARGE = 2 * MiB          # kRoundLarge
LARGE_BUFFER = 20 * MiB        # kLargeBuffer / large_segment_size default
ROUNDUP_INTERVALS = 16         # roundup_power2_divisions: intervals from 1 MiB up to 64 GiB
NO_LIMIT = 1 << 62            # SIZE_MAX stand-in



@dataclass(frozen=True)
class AllocConf:
    """The caching allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` spells them.

    >>> c = AllocConf.parse("expandable_segments:True,max_split_size_mb:128")
    >>> c.expandable_segments, c.max_split_size // MiB
    (True, 128)
    >>> AllocConf.parse("roundup_power2_divisions:[256:1,512:2,>:4]").divisions(300 * MiB)
    1
    >>> str(AllocConf.parse("roundup_power2_divisions:4"))
    'roundup_power2_divisions:4'
    """

    max_split_size: int = NO_LIMIT
    max_non_split_rounding: int | None = None  # None: the large segment size
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    large_segment_size: int = LARGE_BUFFER
    text: str = ""

    def __str__(self) -> str:
        return self.text or "default"

    @classmethod
    def parse(cls, text: str | None) -> "AllocConf":
        """Parse ``key:value,...`` (``c10/core/AllocatorConfig.cpp``, ``parseArgs``)."""
        from memsim.tracer import InputError

        if not text or not text.strip():
            return cls()
        toks = _tokens(text)
        kw: dict = {}
        i = 0

        def bad(msg: str):
            return InputError(f"--alloc-conf {text!r}: {msg}",
                              hint="e.g. expandable_segments:True,max_split_size_mb:128 "
                                   "(PYTORCH_CUDA_ALLOC_CONF's syntax)")

        def number(tok: str, kind=int):
            try:
                return kind(tok)
            except ValueError:
                raise bad(f"{tok!r} is not a number") from None

        def tok(j: int, key: str) -> str:
            """Token ``j``; running out of them means ``key`` lacks its value."""
            if j >= len(toks):
                raise bad(f"{key!r} has no value")
            return toks[j]

        while i < len(toks):
            key = toks[i]
            if tok(i + 1, key) != ":":
                raise bad(f"expected ':' after {key!r}")
            i += 2
            if key == "roundup_power2_divisions":
                divs = [0] * ROUNDUP_INTERVALS
                if tok(i, key) == "[":
                    i += 1
                    last = 0
                    while i < len(toks) and toks[i] != "]":
                        lo, val = toks[i], number(tok(i + 2, key))
                        if tok(i + 1, key) != ":" or not _pow2(val):
                            raise bad("roundup_power2_divisions takes [size_mb:divisions,...] "
                                      "with power-of-2 divisions")
                        if lo == ">":
                            divs[last + 1:] = [val] * (ROUNDUP_INTERVALS - last - 1)
                        else:
                            mb = number(lo)
                            if not _pow2(mb):
                                raise bad(f"interval {mb} MiB is not a power of 2")
                            idx = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
                            if last == 0:
                                divs[:idx] = [val] * idx
                            divs[idx] = val
                            last = idx
                        i += 3
                        if i < len(toks) and toks[i] == ",":
                            i += 1
                    if i >= len(toks):
                        raise bad("unclosed '['")
                    i += 1
                else:
                    val = number(tok(i, key))
                    if not _pow2(val):
                        raise bad("roundup_power2_divisions must be a power of 2")
                    divs = [val] * ROUNDUP_INTERVALS
                    i += 1
                kw["roundup_power2_divisions"] = tuple(divs)
            else:
                val = tok(i, key)
                i += 1
                if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                    kw[key] = number(val)
                elif key == "large_segment_size_mb":
                    mb = number(val)
                    if mb <= MIN_LARGE_ALLOC // MiB:
                        raise bad(f"large_segment_size_mb must be > {MIN_LARGE_ALLOC // MiB}")
                    kw["large_segment_size"] = mb * MiB
                elif key == "expandable_segments":
                    if val not in ("True", "False"):
                        raise bad("expandable_segments takes True or False")
                    kw["expandable_segments"] = val == "True"
                elif key == "garbage_collection_threshold":
                    raise bad("garbage_collection_threshold (cached blocks freed early once "
                              "the usage passes that fraction of the per-process limit) is "
                              "not modelled")
                elif key in ("backend", "release_lock_on_cudamalloc",
                             "pinned_use_cuda_host_register", "pinned_num_register_threads",
                             "pinned_use_background_threads", "pinned_max_round_threshold",
                             "pinned_max_cached_size", "graph_capture_record_stream_reuse",
                             "per_process_memory_fraction"):
                    if key == "backend" and val != "native":
                        raise bad("only the native caching allocator is modelled")
                    if key == "per_process_memory_fraction":
                        raise bad("per_process_memory_fraction: give the budget's margin "
                                  "instead (--margin 1-FRACTION: the budget confines the "
                                  "allocator to the capacity x (1 - margin))")
                else:
                    raise bad(f"unknown option {key!r}")
            if i < len(toks):
                if toks[i] != ",":
                    raise bad(f"expected ',' before {toks[i]!r}")
                i += 1
        seg = kw.get("large_segment_size", LARGE_BUFFER)
        for key, field in (("max_split_size_mb", "max_split_size"),
                           ("max_non_split_rounding_mb", "max_non_split_rounding")):
            if key in kw:
                mb = kw.pop(key)
                if mb < seg // MiB:
                    raise bad(f"{key} must be at least the large segment size, {seg // MiB}")
                kw[field] = mb * MiB
        return cls(**kw, text=text.strip())

    @property
    def non_split_rounding(self) -> int:
        """``max_non_split_rounding_size``: defaults to the large segment size."""
        return (self.max_non_split_rounding if self.max_non_split_rounding is not None
                else self.large_segment_size)

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)``: the divisions of the interval ``size`` is in."""
        log = size.bit_length() - 1
        idx = log - 20 if log > 20 else 0
        return self.roundup_power2_divisions[min(idx, ROUNDUP_INTERVALS - 1)]

    def round_size(self, size: int) -> int:
        """``round_size``: the bytes a request of ``size`` asks the pools for."""
        if size < MIN_BLOCK:
            return MIN_BLOCK
        div = self.divisions(size)
        if div > 1 and size > MIN_BLOCK * div:
            return roundup_power2(size, div)
        return -(-size // MIN_BLOCK) * MIN_BLOCK

    def segment_size(self, size: int) -> int:
        """``get_allocation_size``: the segment reserved for a rounded request ``size``."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self.large_segment_size
        return -(-size // ROUND_LARGE) * ROUND_LARGE


def _tokens(text: str) -> list[str]:
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf.strip():
                out.append(buf.strip())
            buf = ""
            out.append(ch)
        else:
            buf += ch
    if buf.strip():
        out.append(buf.strip())
    return out


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def roundup_power2(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``."""
    if _pow2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step
