"""The per-device budget: tensor peak + named overhead terms, against a GPU, and the limits.

``total = allocated + allocator_cache + cublas_workspace + cuda_context + comm_buffers
+ fragmentation``

- ``allocated``: the step's exact peak of live tensor storages (512-byte blocks on CUDA): what
  ``torch.cuda.max_memory_allocated`` reports, but for the allocator's whole unsplit blocks
  (:mod:`memsim.analysis.caching`). This is the exact part.
- ``allocator_cache``: what the CUDA caching allocator reserves beyond that: the step's
  allocations and frees replayed through the allocator's rules at the point
  (:func:`memsim.analysis.reserved.replay`), ``max_memory_reserved - allocated - cublas``.
  ``allocated + cublas_workspace + allocator_cache`` is the predicted
  ``torch.cuda.max_memory_reserved()`` (:attr:`Budget.reserved`). The replay confines the
  allocator to the budget, ``capacity * (1 - margin)`` less the fixed terms outside it, as
  ``torch.cuda.set_per_process_memory_fraction`` confines a real one: a cache that would grow
  past it is released and the request retried. So the step fits exactly where that replay
  does not run out of memory; unconfined, the cache grows while the card has room, and its
  size near the margin says nothing of whether the step runs (:attr:`Budget.reserved_card`
  keeps that figure where the two differ).
- ``fragmentation``: a margin of the user's own, a fraction of ``allocated`` (default 0; it was
  the flat stand-in for the reserve before the replay). Where the replay cannot run (a fitted
  symbol) it is at least 5% and a note says so.
- ``cuda_context``: the CUDA context, kernels and driver state outside PyTorch's allocator; a
  default per GPU family, overridable. An estimate.
- ``cublas_workspace``: the workspaces PyTorch gives cuBLAS/cuBLASLt per handle and stream
  (from the caching allocator, so inside ``memory_allocated``; PyTorch's defaults, one stream).
- ``comm_buffers``: the communication buffers of a parallel strategy (0 on one device).

With ``device="cpu"`` every overhead term is 0: the budget is then the exact peak, so a CPU run
checks the solver. ``fits`` is ``total <= capacity * (1 - margin)``; ``headroom`` is the
fraction of the capacity left after ``total``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memsim.tracer import InputError

from .alloc_conf import AllocConf
from .gpus import GPU, MiB
from .reserved import Reserved, replay
from .search import largest_true, last_true

# CUDA context + loaded kernels with lazy module loading (the default since CUDA 12.2), per
# family: estimates. Measured publicly: 287,047,680 B with lazy loading after one small tensor
# (pytorch/pytorch PR #86509, GPU not named); "~300 MB" / "around 400 MB" with lazy loading
# (PyTorch forum answers in pytorch/pytorch #107667, #109888). No per-generation measurement was
# found: older families take 300 MiB, the rest 400 MiB. Override with Overheads(cuda_context=...).
CONTEXT_MIB = {"volta": 300, "turing": 300, "ampere": 400, "ada": 400, "hopper": 400,
               "blackwell": 400, "cdna2": 400, "cdna3": 400, "unknown": 400}
# cuBLAS workspace PyTorch takes from the caching allocator per (handle, stream)
# (aten/src/ATen/cuda/CublasHandlePool.cpp): 4096 KiB * 8 = 32 MiB on sm90 (and sm100/sm120 in
# recent releases), else 4096 KiB * 2 + 16 KiB * 8 = 8,519,680 B; ROCm 32 MiB. Plus cuBLASLt's own
# workspace, 1024 KiB by default (CUBLASLT_WORKSPACE_SIZE). One stream assumed.
_LT = 1024 * 1024
CUBLAS_BYTES = {"hopper": 32 * 2 ** 20 + _LT, "blackwell": 32 * 2 ** 20 + _LT,
                "cdna2": 32 * 2 ** 20 + _LT, "cdna3": 128 * 2 ** 20 + _LT}
CUBLAS_DEFAULT_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8 + _LT


@dataclass(frozen=True)
class Overheads:
    """The estimated terms of the budget; ``None`` takes the default for the GPU's family.

    Attributes
    ----------
    fragmentation : float
        An extra margin, a fraction of the allocated peak, on top of the replayed reserve.
    cuda_context, cublas_workspace : int or None
        Bytes.
    comm_buffers : int
        Bytes of communication buffers (strategies fill this in).
    alloc_conf : AllocConf or None
        The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``); None: PyTorch's
        defaults.
    """

    fragmentation: float = 0.0
    cuda_context: int | None = None
    cublas_workspace: int | None = None
    comm_buffers: int = 0
    alloc_conf: AllocConf | None = None

    def __post_init__(self):
        if not 0 <= self.fragmentation < 1:
            raise InputError(f"fragmentation={self.fragmentation!r} must be in [0, 1)",
                             hint="a fraction of the allocated peak, e.g. 0.05")
        for name in ("cuda_context", "cublas_workspace", "comm_buffers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise InputError(f"{name}={v!r} must be a non-negative int (bytes)")

    def fixed(self, device: str, family: str) -> dict[str, int]:
        """The terms that do not scale with the tensor peak, in bytes."""
        if device != "cuda":
            return {"cuda_context": 0, "cublas_workspace": 0, "comm_buffers": self.comm_buffers}
        ctx = self.cuda_context if self.cuda_context is not None else CONTEXT_MIB.get(
            family, CONTEXT_MIB["unknown"]) * MiB
        ws = self.cublas_workspace if self.cublas_workspace is not None else CUBLAS_BYTES.get(
            family, CUBLAS_DEFAULT_BYTES)
        return {"cuda_context": ctx, "cublas_workspace": ws, "comm_buffers": self.comm_buffers}


@dataclass
class Budget:
    """One step's memory on one device against a capacity.

    Attributes
    ----------
    step : "train" or "inference"
    gpu : GPU or None
    capacity, allocated, total : int (bytes)
    overhead : dict of str to int
        Each estimated term, bytes.
    margin : float
        Safety margin: the configuration fits when ``total <= capacity * (1 - margin)``.
    fits : bool
    headroom : float
        ``(capacity - total) / capacity`` (negative when it does not fit at all).
    dominant : str
        The category with the most bytes live at the peak.
    breakdown : dict of str to int
        Bytes live at the peak by category.
    max_batch, max_seq : int or None
        Largest size of the batch / sequence symbol that fits (others at the point); None
        when the symbol is absent; 0 when not even size 1 fits.
    max_batch_no_release, max_seq_no_release : int or None
        Where the caching allocator is replayed: the largest sizes at which it also never
        releases its cache to stay within the budget. Above them the step fits, but frees
        cached segments and retries (``cudaFree`` synchronizes): slower steps.
    reserved : int or None
        Predicted ``torch.cuda.max_memory_reserved()`` (CUDA, replayed) with the caching
        allocator confined to the budget (the capacity less the margin, as
        ``torch.cuda.set_per_process_memory_fraction(1 - margin)`` confines it): where the cache
        would grow past it, the allocator releases cache and retries (a note says how often);
        None elsewhere, or where it runs out of memory.
    reserved_card : int or None
        Where the confined replay released its cache or ran out: the reserved bytes of a replay
        that may grow to the whole card (what ``torch.cuda.max_memory_reserved()`` reads on a
        real run without that fraction set), when that one does not run out.
    replay : Reserved or None
        The caching allocator replay at the point (:class:`memsim.analysis.reserved.Reserved`).
    notes : list of str
    basis : str
        ``"exact"`` when ``allocated`` comes from the trace alone; ``"traced; ... modelled"``
        when a strategy's edit (DDP buckets) models part of it (:attr:`Report.basis`).
    """

    step: str
    gpu: GPU | None
    capacity: int
    margin: float
    allocated: int
    overhead: dict[str, int]
    total: int
    fits: bool
    headroom: float
    dominant: str
    breakdown: dict[str, int]
    max_batch: int | None = None
    max_seq: int | None = None
    notes: list[str] = field(default_factory=list)
    basis: str = "exact"  # how "allocated" was obtained (Report.basis)
    reserved: int | None = None
    replay: Reserved | None = None
    overheads: Overheads | None = None  # the settings the terms were computed with
    reserved_card: int | None = None
    max_batch_no_release: int | None = None
    max_seq_no_release: int | None = None
    # where it does not fit: what would make it fit, each option traced (memsim.suggest)
    options: list = field(default_factory=list)

    @property
    def usable(self) -> int:
        """The bytes the step may take: ``capacity * (1 - margin)``."""
        return int(self.capacity * (1 - self.margin))

    @property
    def limit(self) -> int:
        """What the caching allocator may reserve: :attr:`usable` less what lives outside it
        (:func:`allocator_limit`), the limit its replay is confined to."""
        return allocator_limit(self.usable, self.overhead)


def allocator_limit(usable: int, overhead) -> int:
    """What the caching allocator may reserve of ``usable`` bytes: less what lives outside it,
    the CUDA context and communication libraries' own buffers (``overhead``'s terms)."""
    return usable - overhead["cuda_context"] - overhead["comm_buffers"]


class TotalModel:
    """``total(point)`` for one report and step, exact and fast (integer arithmetic)."""

    def __init__(self, report, step: str, overheads: Overheads, family: str,
                 budget: int | None = None):
        self.report, self.step_name = report, step
        self.overheads = overheads
        self.fixed = overheads.fixed(report.device, family)
        # what the caching allocator may reserve: the budget (the card less the margin kept
        # free, as torch.cuda.set_per_process_memory_fraction confines a real allocator) less
        # what lives outside the allocator. Confined, a cache that would grow past it is
        # released and the request retried, as at a card's end: the step fits where the
        # replay does not run out of memory, whatever the cache would take on a whole card
        # (which grows while memory is free, so that it would otherwise decide the verdict:
        # Llama-3-8B QLoRA on an H100 at S=2048 reserved 75.6 GiB at B=13 without a release,
        # and 66.9 GiB at B=14 after one)
        self.limit = None if budget is None else allocator_limit(budget, self.fixed)
        self._replays: dict[tuple, Reserved | None] = {}

    def step_of(self, report):
        return report.train if self.step_name == "train" else report.inference

    def allocated(self, point: dict[str, int]) -> int:
        if getattr(self.report, "fit", None) is not None:   # fitted: traces only where needed
            return self.report.at(**point)[self.step_name]["peak"]
        report, pt = self.report.for_point(point)
        step = self.step_of(report)
        step.check_point(pt)
        return step.value("peak", pt)

    def replayed(self, point: dict[str, int]) -> Reserved | None:
        """The caching allocator replayed at ``point`` (None off CUDA, or for a fitted
        report, which has no trace at every point)."""
        if self.report.device != "cuda" or getattr(self.report, "fit", None) is not None:
            return None
        key = tuple(sorted(point.items()))
        if key not in self._replays:
            report, pt = self.report.for_point(point)
            self._replays[key] = replay(self.step_of(report), pt,
                                        conf=self.overheads.alloc_conf, limit=self.limit,
                                        workspace=self.fixed["cublas_workspace"])
        return self._replays[key]

    def overhead(self, allocated: int, point: dict[str, int]) -> dict[str, int]:
        if self.report.device != "cuda":
            return {"fragmentation": 0, **self.fixed}
        r = self.replayed(point)
        frac = self.overheads.fragmentation
        cache = 0
        if r is None:
            frac = max(frac, 0.05)
        elif r.oom is not None:  # at least what the failed request needed past the limit
            cache = max(self.limit + r.oom - allocated - self.fixed["cublas_workspace"], 0)
        else:
            cache = max(r.reserved - allocated - self.fixed["cublas_workspace"], 0)
        return {"allocator_cache": cache, "fragmentation": int(allocated * frac), **self.fixed}

    def floor(self, point: dict[str, int]) -> int:
        """Bytes no size can go below: model states live for the whole step + fixed terms."""
        step = self.step_of(self.report)
        sizes = {n: step.ranges.get(n, (2, None))[0] for n in self.report.symbols}
        pt = {n: v for n, v in {**point, **sizes}.items() if n in step.trace.symbols}
        states = sum(step.evaluate(e, pt) for e in (step.parameters, step.gradients,
                                                    step.optimizer_states, step.buffers))
        return states + sum(self.fixed.values())

    def total(self, point: dict[str, int]) -> int:
        a = self.allocated(point)
        return a + sum(self.overhead(a, point).values())


def against(report, point: dict[str, int] | None, *, gpu: GPU | None = None,
            capacity: int | None = None, margin: float = 0.10,
            overheads: Overheads | None = None, batch: str = "B", seq: str = "S") -> Budget:
    """The budget of ``report``'s training step (or inference, if no training was analysed)
    at ``point``, against ``gpu`` or ``capacity`` bytes: does it fit, with what headroom, and
    the largest batch and sequence that do."""
    if gpu is None and capacity is None:
        raise InputError("no capacity to check against", hint="give a GPU or a capacity")
    if not 0 <= margin < 1:
        raise InputError(f"margin={margin!r} must be in [0, 1)", hint="e.g. 0.10 for 10%")
    capacity = gpu.bytes if capacity is None else capacity
    overheads = overheads or Overheads()
    step_name = "train" if report.train is not None else "inference"
    usable = int(capacity * (1 - margin))
    model = TotalModel(report, step_name, overheads, _family(gpu), usable)
    point = dict(point or {})
    notes: list[str] = []
    missing = [n for n in report.symbols if n not in point]
    if missing:
        raise InputError(f"the budget needs a size for {', '.join(missing)}",
                         hint="give --at with every symbol, e.g. --at B=4,S=2048")
    allocated = model.allocated(point)
    overhead = model.overhead(allocated, point)
    total = allocated + sum(overhead.values())
    r = model.replayed(point)
    card = None
    if report.device == "cuda":
        notes.extend(_replay_notes(r, overheads, model.limit, margin))
        if r is not None and (r.retries or r.oom is not None):
            # what the cache takes where it may grow to the whole card
            whole = TotalModel(report, step_name, overheads, _family(gpu), capacity)
            card = whole.replayed(point)
            if card is not None and card.oom is None:
                notes.append(f"on the whole card (no margin kept free) the caching allocator "
                             f"would reserve {card.reserved:,} B, what "
                             "torch.cuda.max_memory_reserved() reads there; the verdict keeps "
                             f"{margin:.0%} free, as torch.cuda.set_per_process_memory_fraction"
                             f"({1 - margin:.2f}) would")
    sub, pt = report.for_point(point)
    bd = model.step_of(sub).breakdown(pt)
    dominant = max(bd, key=bd.get) if any(bd.values()) else "-"
    b = Budget(step_name, gpu, capacity, margin, allocated, overhead, total, total <= usable,
               (capacity - total) / capacity, dominant, bd, notes=notes,
               basis=report.basis, replay=r, overheads=overheads,
               reserved=(allocated + overhead["allocator_cache"] + overhead["cublas_workspace"]
                         if r is not None and r.oom is None else None),
               reserved_card=(card.reserved if card is not None and card.oom is None else None))
    memo: dict[str, dict] = {batch: {}, seq: {}}
    b.max_batch = largest_fitting(model, report, point, batch, usable, notes, memo=memo[batch])
    b.max_seq = largest_fitting(model, report, point, seq, usable, notes, memo=memo[seq])
    if r is not None:   # replayed: where the cache needs no release, every step runs alike
        b.max_batch_no_release = largest_fitting(model, report, point, batch, usable, [], True,
                                        memo[batch])
        b.max_seq_no_release = largest_fitting(model, report, point, seq, usable, [], True, memo[seq])
        for name, full, clean in ((batch, b.max_batch, b.max_batch_no_release),
                                  (seq, b.max_seq, b.max_seq_no_release)):
            if full and clean is not None and full - clean >= 2:
                notes.append(_NOT_MONOTONE.format(name=name, first=clean + 1, full=full))
    return b


# where the replayed allocator releases its cache, its live blocks fall across segments
# otherwise from one size to the next, and running out of memory is not monotone in the size
# (python -m benchmarks.limit_band)
_NOT_MONOTONE = (
    "{name}: from {first} to {full} the replayed allocator releases its cache at some "
    "sizes, where whether a size fits need not be monotone in the size (python "
    "benchmarks/limit_band.py shows sizes that do not fit below one that does), and the "
    "search replayed its answer and the next size, not every size below: check the size you "
    "choose (--at)")


def cache_fraction(report, point: dict[str, int], *, overheads: Overheads | None = None,
                   family: str = "unknown") -> float:
    """What the caching allocator reserves beyond the allocated peak of ``report``'s step at
    ``point``, as a fraction of that peak (no capacity limit: the step may not fit); 0 off
    CUDA, and 5% where the replay cannot run (a fitted report)."""
    if report.device != "cuda":
        return 0.0
    ov = overheads or Overheads()
    step = "train" if report.train is not None else "inference"
    m = TotalModel(report, step, ov, family, None)
    alloc = m.allocated(point)
    over = m.overhead(alloc, point)
    return (over["allocator_cache"] + over["fragmentation"]) / alloc if alloc else 0.0


def _family(gpu: GPU | None) -> str:
    return gpu.family if gpu else "unknown"


def _replay_notes(r: Reserved | None, overheads: Overheads, limit: int | None,
                  margin: float = 0.0) -> list[str]:
    if r is None:
        return ["reserved memory is not replayed for a report with fitted symbols: the "
                "allocator's reserve is taken as 5% of the allocated peak (an estimate)"]
    conf = overheads.alloc_conf
    how = f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf and conf.text else "default settings"
    out = [f"reserved memory: the step's allocations replayed through PyTorch 2.13's CUDA "
           f"caching allocator ({how}), "
           "after a first step; the rules are read from its source, the replay has not been "
           "compared with a GPU run"]
    within = f"the card less {margin:.0%} kept free" if margin else "the card"
    if r.oom is not None:
        out.append(f"the caching allocator runs out of memory: a request of {r.oom:,} B cannot "
                   f"be reserved within {limit:,} B ({within}, less the CUDA context) even "
                   "after releasing its cache")
    elif r.retries:
        out.append(f"the caching allocator released its cache {r.retries} time(s) to stay "
                   f"within {within} (slow steps: cudaFree synchronizes)")
    return out


class _Steps:
    """A report's symbol counted in steps of ``step``: its extent and multiples as
    :func:`largest_fitting` reads them."""

    def __init__(self, report, name: str, step: int):
        lo, hi = report.extent.get(name, (2 * step, None))
        self.symbols = report.symbols
        self.extent = {name: (-(-lo // step), None if hi is None else hi // step)}
        self.config = report.config.replace(multiples={})


def largest_fitting(model: TotalModel, report, point: dict, name: str, usable: int, notes: list,
           no_release: bool = False, memo: dict | None = None, scale: int = 1):
    """Largest integer value of symbol ``name`` whose total fits ``usable`` (others fixed);
    ``no_release``: and whose replay never releases the allocator's cache. ``memo`` keeps what
    each size probed showed (fits, fits without a release), so that the second search starts
    between the sizes the first one probed.

    Exponential search then bisection over the exact total; the answer is checked: it fits and
    the next size does not (or is beyond the model's limit). The peak grows with every size in
    the models seen; a model whose peak shrinks as a size grows could fit again beyond the
    answer, which the check at answer+1 cannot see.
    """
    if name not in report.symbols:
        return None
    # a symbol traced at multiples of a step (--multiple-of, micro-batches of a pipeline) is
    # searched over its multiples: sizes between them are padded or refused by the model
    step = report.config.multiples.get(name, 1)
    if step > 1:
        counts = {v // step: m for v, m in (memo or {}).items() if v % step == 0}
        found = largest_fitting(model, _Steps(report, name, step), point, name, usable, notes,
                                no_release, counts, step)
        if memo is not None:
            memo.update({c * step: m for c, m in counts.items()})
        return found * step if found is not None else None
    lo, hi = report.extent.get(name, (2, None))

    memo = {} if memo is None else memo

    def fits(v: int) -> bool:
        if v not in memo:
            pt = {**point, name: v * scale}
            ok = model.total(pt) <= usable   # replays at pt (cached), where there is one
            memo[v] = (ok, ok and not getattr(model.replayed(pt), "retries", 0))
        return memo[v][no_release]

    if no_release:
        clean = [v for v, (_, c) in memo.items() if c and v >= lo]
        above = [v for v, (_, c) in memo.items() if not c and clean and v > max(clean)]
        if clean and above:
            a = last_true(fits, max(clean), min(above))
            assert fits(a) and not fits(a + 1)
            return a

    if model.floor(point) > usable:
        notes.append(f"{name}: the model states and fixed overheads alone exceed the usable "
                     "memory: no size fits")
        return 0
    if not fits(lo):
        v = lo - 1
        while v >= 1 and not fits(v):
            v -= 1
        return v if v >= 1 else 0
    cap = hi if hi is not None else 2 ** 40
    a = largest_true(fits, lo, cap)
    if a is None:
        if hi is not None:
            notes.append(f"{name}: every size up to the model's limit {hi * scale} fits")
            return hi
        notes.append(f"{name}: the peak does not grow with {name} (fits up to 2**40)")
        return None
    assert fits(a) and not fits(a + 1)
    return a


def sweep(report, point: dict[str, int], *, gpu: GPU | None = None, capacity: int | None = None,
          margin: float = 0.10, overheads: Overheads | None = None, batch: str = "B",
          seq: str = "S", batches=None, seqs=(512, 1024, 2048, 4096, 8192, 16384, 32768)):
    """Total bytes for each (batch, sequence) pair within the formula's range.

    Returns ``(batches, seqs, rows)`` where ``rows[i][j]`` is the total at
    ``batches[i], seqs[j]`` (None outside the model's range).
    """
    if seq not in report.symbols:
        return [], [], []
    capacity = gpu.bytes if (capacity is None and gpu is not None) else capacity
    step_name = "train" if report.train is not None else "inference"
    model = TotalModel(report, step_name, overheads or Overheads(), _family(gpu),
                   None if capacity is None else int(capacity * (1 - margin)))
    s_lo, s_hi = report.extent.get(seq, (2, None))
    seqs = [s for s in seqs if s >= s_lo and (s_hi is None or s <= s_hi)]
    if s_hi is not None and s_hi not in seqs and (not seqs or s_hi > seqs[-1]):
        seqs.append(s_hi)
    if batch in report.symbols:
        b_lo = report.extent.get(batch, (2, None))[0]
        base = point.get(batch, b_lo)
        batches = batches or sorted({max(b_lo, v) for v in (base, 2, 4, 8, 16, 32)})
    else:
        batches = [None]
    rows = []
    for bv in batches:
        row = []
        for sv in seqs:
            pt = {**point, seq: sv}
            if bv is not None:
                pt[batch] = bv
            row.append(model.total(pt))
        rows.append(row)
    return batches, seqs, rows
