"""The CUDA caching allocator replay, rule by rule, against sequences derived by hand.

Each test names the function of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.13) whose rule
it checks, and derives the expected figures in its comments from that rule alone. No GPU has
checked the replay; these tests pin that it does what the source says.
"""

from __future__ import annotations

import pytest

from memsim.analysis.alloc_conf import AllocConf, MiB, roundup_power2
from memsim.analysis.caching import AllocatorOOM, CachingAllocator
from memsim.tracer import InputError

M = MiB


def test_round_size_512_byte_blocks():
    # round_size: below kMinBlockSize (512) -> 512; else up to a multiple of 512
    c = AllocConf()
    assert [c.round_size(n) for n in (1, 512, 513, 1000, 3 * M + 1)] == \
        [512, 512, 1024, 1024, 3 * M + 512]


def test_roundup_power2_divisions():
    # roundup_power2_next_division(1200, 4): between 1024 and 2048, steps of 256 -> 1280
    assert roundup_power2(1200, 4) == 1280
    assert roundup_power2(4096, 4) == 4096  # a power of two stays
    c = AllocConf.parse("roundup_power2_divisions:4")
    # round_size applies it only above 512 * divisions = 2048 B: 1200 -> 1536 (512 rounding)
    assert c.round_size(1200) == 1536
    # 5 MiB + 1 is in [4, 8) MiB: steps of 1 MiB -> 6 MiB
    assert c.round_size(5 * M + 1) == 6 * M


def test_roundup_power2_divisions_per_interval():
    # parseRoundUpPower2Divisions: the first key fills the table below it; '>' fills the rest
    # after the last key. [256:1,512:2,>:4] -> intervals 0..8 -> 1, 9 -> 2, 10..15 -> 4
    c = AllocConf.parse("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert c.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    # the interval of a size: floor(log2(size)) - 20; 600 MiB -> 9 (512 MiB..1 GiB) -> 2
    assert c.divisions(600 * M) == 2 and c.divisions(300 * M) == 1 and c.divisions(5 << 30) == 4
    # 600 MiB with 2 divisions of [512 MiB, 1 GiB): 768 MiB
    assert c.round_size(600 * M) == 768 * M


def test_small_requests_share_a_2_mib_segment():
    # get_pool: <= 1 MiB -> small pool; get_allocation_size: kSmallBuffer (2 MiB); should_split
    # (small pool): a remainder >= 512 B is split off
    a = CachingAllocator()
    a.malloc(1000)
    a.malloc(1000)
    a.malloc(1 * M)
    assert (a.allocated, a.reserved, a.segments) == (1024 + 1024 + M, 2 * M, 1)


def test_large_request_under_10_mib_takes_a_20_mib_segment_and_splits():
    # get_allocation_size: 1 MiB < size < kMinLargeAlloc (10 MiB) -> large_segment_size (20 MiB);
    # should_split (large): the remainder 17 MiB is > kSmallSize -> split; the next 3 MiB
    # request is served from that remainder
    a = CachingAllocator()
    a.malloc(3 * M)
    a.malloc(3 * M)
    assert (a.allocated, a.reserved, a.segments) == (6 * M, 20 * M, 1)


def test_unsplit_block_is_allocated_whole():
    # get_allocation_size: 19.5 MiB >= 10 MiB -> rounded up to 2 MiB: a 20 MiB segment; the
    # remainder 0.5 MiB is not > kSmallSize -> not split: alloc_found_block hands out (and
    # allocated_bytes counts) the whole 20 MiB block
    a = CachingAllocator()
    b = a.malloc(19 * M + M // 2)
    assert (b.size, a.allocated, a.reserved) == (20 * M, 20 * M, 20 * M)


def test_best_fit_smallest_block_of_the_stream():
    # get_free_block: lower_bound on (stream, size, address): the smallest cached block that
    # fits. Cached: 12 MiB and 14 MiB segments; an 11 MiB request takes the 12 MiB block,
    # unsplit (remainder 1 MiB is not > 1 MiB): nothing new reserved
    a = CachingAllocator()
    x, y = a.malloc(12 * M), a.malloc(14 * M)
    a.free(x)
    a.free(y)
    z = a.malloc(11 * M)
    assert (z.size, a.allocated, a.reserved) == (12 * M, 12 * M, 26 * M)


def test_a_freed_block_serves_only_its_own_stream():
    # "Once freed, blocks can be re-allocated on the same stream, but not on any other": a
    # 12 MiB block freed on stream 0 does not serve stream 1, which reserves its own segment
    a = CachingAllocator()
    a.free(a.malloc(12 * M, stream=0))
    a.malloc(12 * M, stream=1)
    assert a.reserved == 24 * M
    a.malloc(12 * M, stream=0)  # the cached one
    assert a.reserved == 24 * M


def test_freed_neighbours_merge():
    # free_block -> try_merge_blocks with prev and next: three 4 MiB blocks split from one
    # 20 MiB segment, freed out of order, merge back into one 20 MiB free block, which then
    # serves an 18 MiB request (split: remainder 2 MiB > 1 MiB) without a new segment
    a = CachingAllocator()
    x, y, z = a.malloc(4 * M), a.malloc(4 * M), a.malloc(4 * M)
    a.free(x)
    a.free(z)
    a.free(y)
    assert a.largest_free() == 20 * M
    w = a.malloc(18 * M)
    assert (w.size, a.reserved, a.segments) == (18 * M, 20 * M, 1)


def test_max_split_size():
    # get_free_block under max_split_size_mb:20: a cached block >= 20 MiB serves no request
    # below 20 MiB; a request >= 20 MiB takes a cached block only if it is less than
    # max_non_split_rounding (default: the 20 MiB large segment size) larger, whole
    a = CachingAllocator(AllocConf.parse("max_split_size_mb:20"))
    a.free(a.malloc(40 * M))
    a.malloc(12 * M)                      # not the 40 MiB block: a new 12 MiB segment
    assert a.reserved == 52 * M
    b = a.malloc(30 * M)                  # 40 < 30 + 20: the cached 40 MiB block, unsplit
    assert (b.size, a.reserved) == (40 * M, 52 * M)
    a.free(b)
    a.malloc(20 * M)                      # 40 >= 20 + 20: refused, a new 20 MiB segment
    assert a.reserved == 72 * M


def test_release_available_cached_blocks_under_max_split_size():
    # release_available_cached_blocks (only with max_split_size): when a new segment does not
    # fit, release cached oversize segments, largest first, towards max(request, 20 MiB).
    # Limit 70 MiB, one cached 40 MiB segment, a 60 MiB request: no cached block fits it;
    # 40 + 60 > 70 fails; the 40 MiB segment is released (it stays released although 40 < 60
    # makes the call return false); release_cached_blocks finds nothing more; the retry
    # reserves 60 MiB
    a = CachingAllocator(AllocConf.parse("max_split_size_mb:20"), limit=70 * M)
    a.free(a.malloc(40 * M))
    a.malloc(60 * M)
    assert (a.reserved, a.peak_reserved, a.retries) == (60 * M, 60 * M, 1)


def test_release_cached_blocks_before_out_of_memory():
    # malloc: alloc_block fails past the device (limit 30 MiB: 12 cached + 20 new > 30);
    # release_cached_blocks returns every wholly free segment (the 12 MiB one), the retry fits
    a = CachingAllocator(limit=30 * M)
    a.free(a.malloc(12 * M))
    a.malloc(20 * M)
    assert (a.reserved, a.peak_reserved, a.retries) == (20 * M, 20 * M, 1)


def test_out_of_memory_when_nothing_can_be_released():
    # the 12 MiB block is still allocated: nothing to release; 12 + 20 > 30 -> OutOfMemory
    a = CachingAllocator(limit=30 * M)
    a.malloc(12 * M)
    with pytest.raises(AllocatorOOM) as e:
        a.malloc(20 * M)
    assert e.value.nbytes == 20 * M and e.value.reserved == 12 * M


def test_split_segments_are_not_released():
    # release_blocks frees only blocks with no prev/next (whole segments): a 20 MiB segment
    # with one 3 MiB block still allocated keeps its 17 MiB free remainder reserved
    a = CachingAllocator()
    a.malloc(3 * M)
    a.release_cached()
    assert a.reserved == 20 * M


def test_expandable_segments_map_whole_pages():
    # try_allocate_expandable_block / map_block: the large pool's segment grows in pages of the
    # large segment size (20 MiB). 30 MiB maps 2 pages (40 MiB); should_split with expandable
    # segments splits any remainder >= 512 B: a 10 MiB free block remains, which then serves
    # 8 MiB (2 MiB left). A second 30 MiB request starts at that free 2 MiB block (it precedes
    # the unmapped range: find_expandable_block) and maps 28 MiB more -> 2 pages: 80 MiB
    # reserved, and 42 - 30 = 12 MiB free at the end
    a = CachingAllocator(AllocConf.parse("expandable_segments:True"))
    x = a.malloc(30 * M)
    assert (a.reserved, a.allocated) == (40 * M, 30 * M)
    y = a.malloc(8 * M)
    assert (a.reserved, a.allocated, a.largest_free()) == (40 * M, 38 * M, 2 * M)
    z = a.malloc(30 * M)
    assert (a.reserved, a.allocated, a.largest_free()) == (80 * M, 68 * M, 12 * M)
    # release_cached_blocks -> unmap_block: only whole free pages go back. Freeing x frees
    # [0, 30) MiB, which holds one whole page [0, 20): 60 MiB stay reserved
    a.free(x)
    a.release_cached()
    assert a.reserved == 60 * M
    a.free(y)
    a.free(z)
    a.release_cached()
    assert a.reserved == 0


def test_expandable_small_pool_pages_are_2_mib():
    a = CachingAllocator(AllocConf.parse("expandable_segments:True"))
    for _ in range(5):
        a.malloc(512 * 1024)  # 5 x 0.5 MiB: 2.5 MiB in 2 MiB pages -> 4 MiB
    assert (a.reserved, a.allocated) == (4 * M, 5 * 512 * 1024)


@pytest.mark.parametrize("text, match", [
    ("expandable_segments:yes", "True or False"),
    ("max_split_size_mb:10", "at least the large segment size"),
    ("garbage_collection_threshold:0.6", "per-process limit\\) is not modelled"),
    ("per_process_memory_fraction:0.8", "--margin 1-FRACTION"),
    ("nosuchkey:1", "unknown option 'nosuchkey'"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("max_split_size_mb", "has no value"),
    ("max_split_size_mb:", "has no value"),
    ("roundup_power2_divisions:[256:", "has no value"),
    ("backend:cudaMallocAsync", "native caching allocator"),
])
def test_alloc_conf_errors_name_the_option(text, match):
    with pytest.raises(InputError, match=match):
        AllocConf.parse(text)


def test_alloc_conf_values():
    c = AllocConf.parse("expandable_segments:True, max_split_size_mb:128,"
                        "max_non_split_rounding_mb:64,large_segment_size_mb:32")
    assert (c.expandable_segments, c.max_split_size, c.non_split_rounding,
            c.large_segment_size) == (True, 128 * M, 64 * M, 32 * M)
    # max_non_split_rounding defaults to the large segment size
    assert AllocConf.parse("large_segment_size_mb:32").non_split_rounding == 32 * M
    assert AllocConf.parse("") == AllocConf()


# -- the replay of a traced step -------------------------------------------------------------

def _cuda_report(factory, inputs, **kw):
    import torch

    from memsim.analysis import analyze
    with torch.device("meta"):
        m = factory()
    return analyze(m, inputs, device="cuda", inference=False, **kw)


SEQ = {"x": ("float32", ["B", "S", 32])}


@pytest.mark.parametrize("point", [{"B": 2, "S": 8}, {"B": 4, "S": 64}, {"B": 3, "S": 300}])
def test_replay_hands_out_the_traced_blocks(point):
    """With expandable segments every remainder of 512 B or more is split off, so the blocks
    handed out are the traced requests rounded to 512 B: the steady step's allocated peak in
    the replay is the traced peak (which equals real CPU runs, tests/test_accuracy.py) plus the
    cuBLAS workspace, exactly; the first step (optimizer state made lazily, no previous
    gradients) and the carry-over of gradients between the steps leave it unchanged. Under
    the default settings large blocks may be handed out whole. Every figure, in both
    settings, is that of the same steps run through tests/support/oracles/cuda_cache.py's
    independent simulation of the allocator until they settle; at B = 2, S = 8 they are
    derived below."""
    from tests.support import zoo

    from memsim.analysis.reserved import replay
    from tests.support.oracles.cuda_cache import loop_of, steady, train
    r = _cuda_report(zoo.Block, SEQ)
    sub, pt = r.for_point(point)
    peak = sub.train.value("peak", pt)
    ws = 33 * M
    exp = replay(sub.train, pt, conf=AllocConf.parse("expandable_segments:True"), workspace=ws)
    assert exp.allocated == peak + ws
    default = replay(sub.train, pt, workspace=ws)
    trace = sub.train.trace
    subs = {trace.symbols[n]: v for n, v in pt.items()}
    nbytes = [int(s.nbytes.xreplace(subs)) if s.device == "cuda" else 0
              for s in trace.run.storages]
    loop = loop_of(trace.run, nbytes, ws)
    # the simulation's last of 12 steps: (max_memory_reserved, the most allocated in a steady
    # step, the reserved bytes and the largest free block when that was first reached, ...)
    want = steady(train(**loop, steps=12))[-1]
    assert (default.reserved, default.allocated, default.reserved_at_peak,
            default.largest_free_at_peak, default.oom) == (*want[:4], None)
    assert exp.reserved == steady(train(**loop, steps=12, expandable=True))[-1][0]
    if point == {"B": 2, "S": 8}:
        # every storage is at most 1 MiB (small pool) and no more than the traced peak,
        # 270,848 B, is live at once: one 2 MiB small segment serves them. The 33 MiB
        # workspace (>= 10 MiB) takes a segment rounded up to 2 MiB, 34 MiB; the 1 MiB left
        # is not over 1 MiB, so the whole 34 MiB block is handed out: reserved 2 + 34 MiB,
        # allocated the traced peak + 34 MiB. With expandable segments the workspace maps
        # 2 pages of 20 MiB (7 MiB split off, free) and the small pool one page of 2 MiB:
        # 42 MiB.
        assert max(nbytes) <= M and peak == 270848
        assert (default.reserved, default.allocated) == (36 * M, peak + 34 * M)
        assert exp.reserved == 42 * M


def test_fsdp2_side_streams_are_recorded():
    """FSDP2 allocates its all-gather buffers under its copy-in stream and the reduce-scatter
    output under its reduce-scatter stream (torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py, foreach_all_gather / foreach_reduce): the trace records the stream
    of each storage, and the replay keeps each stream's blocks apart (three 2 MiB small
    segments for a model whose every request is small)."""
    import collections

    from tests.support import zoo

    from memsim.analysis.reserved import replay
    from memsim.strategies import FSDP, analyze
    import torch
    with torch.device("meta"):
        m = zoo.MLP()
    r = analyze(m, {"x": ("float32", ["B", 16])}, fsdp=FSDP(dp=2), device="cuda",
                inference=False)
    sub, pt = r.for_point({"B": 4})
    run = sub.train.trace.run
    on = collections.Counter((s.stream, s.phase.value) for s in run.storages if s.stream)
    # one all-gather per FSDP group in forward and in backward; one reduce-scatter in backward
    assert set(on) == {(1, "forward"), (1, "backward"), (2, "backward")}
    rr = replay(sub.train, pt)
    assert (rr.reserved, rr.segments) == (3 * 2 * M, 3)


def test_budget_runs_out_of_memory_in_the_replay(capsys):
    """A capacity the allocated peak fits but the allocator's segments do not: the budget says
    it does not fit, and why."""
    import json
    from tests.support import zoo

    from memsim.analysis.budget import Overheads, against
    r = _cuda_report(zoo.Block, SEQ)
    base = against(r, {"B": 4, "S": 64}, capacity=2 ** 40, margin=0.0,
                overheads=Overheads(cuda_context=0, cublas_workspace=0))
    assert base.reserved > base.allocated
    cap = base.allocated + (base.reserved - base.allocated) // 2
    b = against(r, {"B": 4, "S": 64}, capacity=cap, margin=0.0,
             overheads=Overheads(cuda_context=0, cublas_workspace=0))
    assert not b.fits and b.reserved is None and b.replay.oom is not None
    assert b.total > cap
    assert any("runs out of memory" in n for n in b.notes)


def test_cli_alloc_conf(capsys):
    import json

    from memsim.cli import main
    args = ["analyze", "examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]",
            "--at", "B=2,S=8", "--gpu", "h100-80gb", "--train", "--json"]
    assert main(args + ["--alloc-conf", "expandable_segments:True"]) == 0
    b = json.loads(capsys.readouterr().out)["budget"]
    rp = b["replay"]
    assert rp["alloc_conf"] == "expandable_segments:True"
    assert b["reserved"] == rp["reserved"] == (b["allocated"] + b["overhead"]["allocator_cache"]
                                               + b["overhead"]["cublas_workspace"])
    assert b["total"] == b["reserved"] + b["overhead"]["cuda_context"]
    assert main(args + ["--alloc-conf", "expandable_segments:maybe"]) == 2
    assert "expandable_segments takes True or False" in capsys.readouterr().err
    assert main(args[:6] + ["--device", "cpu", "--memory", "1GiB",
                            "--alloc-conf", "expandable_segments:True"]) == 2
    assert "--alloc-conf configures the CUDA caching allocator" in capsys.readouterr().err


@pytest.mark.parametrize("view", [False, True])
def test_ddp_buckets_are_replayed(view):
    """DDP is a modelled edit of the traced timeline (its buckets added, with
    gradient_as_bucket_view each gradient dropped when copied in): the replay applies the same
    edit, so with expandable segments its steady-step allocated peak is the edited peak plus
    the cuBLAS workspace, exactly."""
    import torch
    from tests.support import zoo

    from memsim.analysis.reserved import replay
    from memsim.strategies import DDP, analyze
    with torch.device("meta"):
        m = zoo.MLP()
    r = analyze(m, {"x": ("float32", ["B", 16])}, ddp=DDP(dp=2, gradient_as_bucket_view=view),
                device="cuda", inference=False)
    sub, pt = r.for_point({"B": 8})
    rr = replay(sub.train, pt, conf=AllocConf.parse("expandable_segments:True"), workspace=M)
    assert sub.train.rank.edit
    assert rr.allocated == sub.train.value("peak", pt) + M
