"""The CUDA caching-allocator replay against an independent simulation of the allocator.

``tests/support/oracles/cuda_cache.py`` restates the rules of PyTorch's
``CUDACachingAllocator.cpp`` and runs a training loop's steps through them, one step after another,
without memsim. The same event streams go through memsim: single requests and frees through
:class:`memsim.analysis.caching.CachingAllocator`, and whole steps (a traced one, and
training steps built by hand as a trace records them) through
:func:`memsim.analysis.reserved.replay`. Every figure must be equal: after each request; for
a replayed step, after as many simulated steps as the replay walks (by its rule: until a
steady walk changes none of its figures, at most 6); and, for the traced step, in the long
run. A step whose long run the replay stops short of is kept as an expected failure.
"""

from __future__ import annotations

import types

import pytest
import sympy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memsim.analysis import reserved as R
from memsim.analysis.alloc_conf import AllocConf
from memsim.analysis.caching import AllocatorOOM, CachingAllocator
from memsim.analysis.reserved import replay
from memsim.tracer import Category, Event, Phase, RunRecord, Storage

from tests.support.oracles.cuda_cache import Allocator, loop_of, OutOfMemory, steady, train

MiB = 1 << 20
# simulated steps: the replay walks at most 7 (the first and 6 steady ones); the last of 12
# stands for the long run
STEPS = 12

# request sizes around every threshold of the rules: the 512 B block, the 1 MiB small-pool
# limit and split remainder, the 10 MiB large-segment limit, the 20 MiB large segment
EDGES = [1, 511, 512, 513, 1024, MiB - 512, MiB, MiB + 1, 2 * MiB, 2 * MiB + 1,
         10 * MiB - 1, 10 * MiB, 10 * MiB + 1, 19 * MiB, 20 * MiB, 20 * MiB + 1, 21 * MiB]
SIZES = st.one_of(st.sampled_from(EDGES), st.integers(1, 64 * 1024),
                  st.integers(64 * 1024, 3 * MiB), st.integers(3 * MiB, 24 * MiB))


# -- single requests ---------------------------------------------------------------------------

@st.composite
def streams(draw):
    """Requests and frees: ``("malloc", bytes, stream)`` or ``("free", k)`` (the k-th live
    block, modulo their number), and a limit on the reserved bytes (None: none)."""
    ops = draw(st.lists(st.one_of(st.tuples(st.just("malloc"), SIZES, st.sampled_from([0, 0, 1])),
                                  st.tuples(st.just("free"), st.integers(0, 50))),
                        min_size=1, max_size=40))
    limit = draw(st.one_of(st.none(), st.integers(2, 40).map(lambda m: m * 2 * MiB)))
    return ops, limit


def _state(a) -> tuple:
    return (a.allocated, a.reserved, a.peak_allocated, a.peak_reserved, a.largest_free(),
            a.retries)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(streams())
@example(([("malloc", 3 * MiB, 0), ("malloc", 3 * MiB, 0)], None))      # one 20 MiB segment
# best fit: of the cached 14 and 12 MiB blocks (in address order), 11 MiB takes the 12 MiB
# one whole (1 MiB left is not over 1 MiB), not the first that fits, split
@example(([("malloc", 14 * MiB, 0), ("malloc", 12 * MiB, 0), ("free", 0), ("free", 0),
           ("malloc", 11 * MiB, 0)], None))
# the cached 12 MiB segment is released for a 20 MiB one under a 30 MiB limit
@example(([("malloc", 12 * MiB, 0), ("free", 0), ("malloc", 20 * MiB, 0)], 30 * MiB))
def test_requests_match_the_simulation(case):
    """After every request and free, memsim's allocator has the simulation's allocated and
    reserved bytes, their peaks, largest free block and retries; a request past the limit
    is out of memory in both."""
    ops, limit = case
    ours, ref = CachingAllocator(limit=limit), Allocator(limit)
    held = []
    for op in ops:
        if op[0] == "malloc":
            try:
                b = ours.malloc(op[1], op[2])
            except AllocatorOOM as e:
                with pytest.raises(OutOfMemory):
                    ref.malloc(op[1], op[2])
                assert e.nbytes == op[1]
                return
            held.append((b, ref.malloc(op[1], op[2])))
            assert b.size == _block_size(ref, held[-1][1])
        elif held:
            b, h = held.pop(op[1] % len(held))
            ours.free(b)
            ref.free(h)
        assert _state(ours) == _state(ref), op
        assert ours.segments == len(ref.segments)


def _block_size(ref, handle) -> int:
    seg, addr = handle
    return next(b[1] for b in seg.blocks if b[0] == addr)


# -- whole steps -------------------------------------------------------------------------------

def _figures(r) -> tuple:
    return (r.reserved, r.allocated, r.reserved_at_peak, r.largest_free_at_peak)


# the replay walks the steady step again until a walk changes none of its figures and leaves
# the blocks as an earlier steady walk left them, at most 6 walks (reserved.py's STEADY_WALKS:
# pinned here, not read from there, so that changing it is seen)
WALKS = 6


def walked(walks: list[tuple], figs: list) -> int | None:
    """How many steady walks the replay makes, by its rule, given the simulation's figures
    after each simulated steady step (``walks``, from :func:`steady`) and its steps
    (``figs``: steady walk ``w`` is step ``w``): the first walk whose figures are the walk
    before's and whose layout an earlier steady walk left (None: none of the first
    :data:`WALKS`, or of those given)."""
    return next((w for w in range(2, min(WALKS, len(walks)) + 1)
                 if walks[w - 1] == walks[w - 2]
                 and figs[w].layout in {figs[k].layout for k in range(1, w)}), None)


def _check_replay(step, point, nbytes, *, workspace=0, limit=None, expandable=False):
    """memsim's replay of ``step`` at ``point`` against :func:`train` over :data:`STEPS` steps:
    the replay's figures are the simulation's after as many steady steps as the replay walks,
    and it runs out of memory where the simulation does within them. Returns the simulation's
    steady figures, step by step (None: out of memory)."""
    conf = AllocConf.parse("expandable_segments:True") if expandable else None
    rec: list = []
    got = replay(step, point, conf=conf, limit=limit, workspace=workspace, record=rec)
    args = loop_of(step.trace.run, nbytes, workspace)
    try:
        figs, oom = train(**args, steps=STEPS, limit=limit, expandable=expandable), None
    except OutOfMemory as e:
        figs, oom = e.done, e
    walks = steady(figs)
    w = walked(walks, figs)
    if w is None and oom is not None and len(figs) <= WALKS:
        # out of memory in the first step, or in a steady one the replay walks
        assert got.oom == oom.nbytes
        return None
    w = w or WALKS
    assert got.oom is None
    # max_memory_reserved from the start, the most allocated in a steady step, and the
    # reserved bytes and largest free block when that was first reached
    assert _figures(got) == walks[w - 1][:4]
    # the last walk's reserved bytes after each event; what it leaves
    assert rec == figs[w].reserved
    assert (got.segments, got.retries) == (figs[w].segments, figs[w].retries)
    return walks


def _fake_step(run: RunRecord):
    """A step as :func:`replay` reads it: a CUDA training trace of ``run``, no symbols."""
    return types.SimpleNamespace(trace=types.SimpleNamespace(run=run, device="cuda",
                                                             symbols={}, train=True))


class _Run:
    """Builds a :class:`RunRecord` as the plain loop's trace records a training step."""

    def __init__(self):
        self.run = RunRecord()

    def new(self, n: int, category=Category.TEMPORARY, phase=Phase.FORWARD, op="op",
            held="", stream=0) -> int:
        sid = len(self.run.storages)
        self.run.storages.append(Storage(sid, sympy.Integer(n), "cuda", len(self.run.events),
                                         phase, None, op, category, stream=stream, held=held))
        self.run.events.append(Event(1, sid, len(self.run.events)))
        return sid

    def free(self, sid: int) -> None:
        self.run.storages[sid].free = len(self.run.events)
        self.run.events.append(Event(-1, sid, len(self.run.events)))

    def mark(self, phase) -> None:
        self.run.phase_ends[phase] = len(self.run.events)


def training_run(params, inputs, forward, backward, out, optimizer) -> RunRecord:
    """A training step's run: ``params`` (bytes each) with Adam's two states each, the
    previous step's gradients (freed by ``zero_grad``), output and loss alive before it;
    ``forward``: ``(bytes, kept)`` made in order, a not-kept one freed after the next is made,
    a kept one (saved for backward) freed in backward; ``backward``: ``(bytes, params
    whose gradient it makes next)`` per kept storage, in reverse; ``out``: the output's bytes;
    ``optimizer``: bytes of a temporary per parameter."""
    b = _Run()
    for n in params:
        b.new(n, Category.PARAMETER, Phase.SETUP, "<parameter>")
    for n in inputs:
        b.new(n, Category.INPUT, Phase.SETUP, "<input>")
    prev_grads = [b.new(n, Category.GRADIENT, Phase.SETUP) for n in params]
    for n in params:
        b.new(n, Category.OPTIMIZER_STATE, Phase.SETUP)
        b.new(n, Category.OPTIMIZER_STATE, Phase.SETUP)
    prev_out = b.new(out, Category.ACTIVATION, Phase.SETUP, "<previous output>")
    prev_loss = b.new(4, Category.ACTIVATION, Phase.SETUP, "<previous loss>")
    b.mark(Phase.SETUP)
    b.run.start = len(b.run.events)
    for sid in prev_grads:
        b.free(sid)
    b.mark(Phase.ZERO_GRAD)
    kept, pending = [], None
    for n, keep in forward:
        sid = b.new(n, Category.ACTIVATION if keep else Category.TEMPORARY)
        if pending is not None:
            b.free(pending)
            pending = None
        if keep:
            kept.append(sid)
        else:
            pending = sid
    b.new(out, Category.ACTIVATION, held="output")
    if pending is not None:
        b.free(pending)
    b.free(prev_out)
    b.mark(Phase.FORWARD)
    b.new(4, Category.ACTIVATION, Phase.LOSS, held="loss")
    b.free(prev_loss)
    b.mark(Phase.LOSS)
    todo = list(range(len(params)))[::-1]
    for sid, (n, grads) in zip(reversed(kept), backward):
        tmp = b.new(n, phase=Phase.BACKWARD)
        b.free(sid)
        for _ in range(min(grads, len(todo))):
            b.new(params[todo.pop(0)], Category.GRADIENT, Phase.BACKWARD)
        b.free(tmp)
    for p in todo:
        b.new(params[p], Category.GRADIENT, Phase.BACKWARD)
    for sid in kept[:len(kept) - len(backward)]:
        b.free(sid)
    b.mark(Phase.BACKWARD)
    for n in optimizer:
        b.free(b.new(n, phase=Phase.OPTIMIZER))
    b.mark(Phase.OPTIMIZER)
    return b.run


@st.composite
def training_runs(draw):
    """:func:`training_run` of random sizes (:data:`SIZES`): 1 to 4 parameters, up to 2
    inputs, 1 to 8 forward storages, up to 4 optimizer temporaries."""
    params = draw(st.lists(SIZES, min_size=1, max_size=4))
    forward = draw(st.lists(st.tuples(SIZES, st.booleans()), min_size=1, max_size=8))
    kept = sum(k for _, k in forward)
    backward = draw(st.lists(st.tuples(SIZES, st.integers(0, 2)), min_size=kept,
                             max_size=kept))
    return training_run(params, draw(st.lists(SIZES, max_size=2)), forward, backward,
                        draw(SIZES), draw(st.lists(SIZES, max_size=4)))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(training_runs(), st.sampled_from([0, 3 * MiB]),
       st.sampled_from(["unlimited", "expandable", 0.9, 0.97, 0.99]))
def test_replayed_steps_match_the_simulation(run, workspace, mode):
    """Hand-built training steps: the replay's figures are the simulation's after as many
    steady steps as the replay walks. ``mode``: unlimited; expandable segments; or a limit of
    that fraction of the reserved bytes the simulation reaches unlimited (the cache released
    and the request retried, or out of memory)."""
    nbytes = [int(s.nbytes) for s in run.storages]
    limit = None
    if isinstance(mode, float):
        unlimited = train(**loop_of(run, nbytes, workspace), steps=STEPS)
        limit = int(unlimited[-1].peak_reserved * mode)
    _check_replay(_fake_step(run), {}, nbytes, workspace=workspace, limit=limit,
                  expandable=mode == "expandable")


def _traced_mlp(point: dict):
    """zoo.MLP's CUDA training step at ``point``, and each storage's bytes there."""
    import torch
    from tests.support import zoo

    from memsim.analysis import analyze
    with torch.device("meta"):
        m = zoo.MLP()
    report = analyze(m, {"x": ("float32", ["B", 16])}, device="cuda", inference=False)
    sub, pt = report.for_point(point)
    trace = sub.train.trace
    subs = {trace.symbols[n]: v for n, v in pt.items()}
    nbytes = [int(s.nbytes.xreplace(subs)) if s.device == "cuda" else 0
              for s in trace.run.storages]
    return sub.train, pt, nbytes


def test_traced_step_reaches_the_simulated_steady_state(monkeypatch):
    """zoo.MLP at B = 100,000 (activations of 12.8 MB, each in a large segment of its own or
    a block of one): the previous step's output, alive into the next forward, moves blocks,
    so the second steady step allocates more than the first, and the third is as the
    second. The replay's figures are the simulation's long run (its last of 12 steps), with
    and without a cuBLAS workspace; capped at 1, 2 and 3 walks, they are the simulation's
    after that many steady steps."""
    step, pt, nbytes = _traced_mlp({"B": 100_000})
    for ws in (0, 33 * MiB):
        walks = _check_replay(step, pt, nbytes, workspace=ws)
        assert walks[0][1] < walks[1][1] and walks[1] == walks[2] == walks[-1]
    walks = steady(train(**loop_of(step.trace.run, nbytes), steps=STEPS))
    for cap in (1, 2, 3):
        monkeypatch.setattr(R, "STEADY_WALKS", cap)
        assert _figures(replay(step, pt)) == walks[cap - 1][:4]


# steps whose figures stay the same for a steady walk or more, then change: the cache's blocks
# were still moving. (training_run's arguments, cuBLAS workspace, what the simulation shows)
QUIET = [
    # one 3,037,697 B parameter (its gradient and two Adam states the same), a 1,048,577 B
    # forward temporary, a 2,311,681 B output: the most allocated is 17,934,336 B in steady
    # steps 1 and 2, and 18,659,840 B in every step from the third on, where the output is
    # handed a 3,037,696 B free block whole (the 725,504 B left is not over 1 MiB)
    pytest.param(([3037697], [], [(1048577, False)], [], 2311681, []), 3 * MiB,
                 (1, [17934336, 17934336, 18659840]), id="allocated"),
    # one 6,990,337 B parameter, a 10,485,759 B output; in forward 1 B kept, a 12,582,913 B
    # temporary, 1 B kept, a 4,194,305 B temporary: max_memory_reserved is 56 MiB after
    # steady steps 1 and 2, and 70 MiB from the third on (a 14 MiB segment more)
    pytest.param(([6990337], [], [(1, True), (12582913, False), (1, True), (4194305, False)],
                  [(1, 0), (1, 0)], 10485759, []), 0,
                 (0, [56 * MiB, 56 * MiB, 70 * MiB]), id="reserved"),
]


@pytest.mark.parametrize("args, workspace, shows", QUIET)
def test_replay_reaches_the_long_run_after_a_quiet_walk(args, workspace, shows):
    """Steps whose simulated figures stay the same for two steady steps, then change for
    good: the replay's figures are the long run's (the simulation's last of 12 steps). A
    replay that stopped at the first walk changing none of its figures, with the cache's
    blocks still moving, reported the lower figures of steps 1 and 2."""
    run = training_run(*args)
    nbytes = [int(s.nbytes) for s in run.storages]
    walks = _check_replay(_fake_step(run), {}, nbytes, workspace=workspace)
    figure, first = shows
    assert [w[figure] for w in walks[:3]] == first and walks[2] == walks[-1]
    # the long run's figures, where the figures of the first steady walks are not
    assert _figures(replay(_fake_step(run), {}, workspace=workspace)) == walks[-1][:4]
