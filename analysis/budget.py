"""The per-device budget: tensor peak + named overhead terms, against a GPU, and the limits.

``total = allocated + fragmentation + cuda_context + cublas_workspace + comm_buffers``

- ``allocated``: the step's exact peak of live tensor storages (512-byte blocks on CUDA): what
  ``torch.cuda.max_memory_allocated`` reports. This is the exact part.
- ``fragmentation``: the caching allocator reserves more than it hands out (split blocks,
  unsplit remainders of up to 1 MiB, segments per stream); a configurable fraction of
  ``allocated`` (default 5%). An estimate.
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

from .gpus import GPU, MiB
from .search import largest_true

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
        Reserved-but-not-allocated memory as a fraction of the allocated peak.
    cuda_context, cublas_workspace : int or None
        Bytes.
    comm_buffers : int
        Bytes of communication buffers (strategies fill this in).
    """

    fragmentation: float = 0.05
    cuda_context: int | None = None
    cublas_workspace: int | None = None
    comm_buffers: int = 0

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


class _Model:
    """``total(point)`` for one report and step, exact and fast (integer arithmetic)."""

    def __init__(self, report, step: str, overheads: Overheads, family: str):
        self.report, self.step_name = report, step
        self.overheads = overheads
        self.fixed = overheads.fixed(report.device, family)

    def step_of(self, report):
        return report.train if self.step_name == "train" else report.inference

    def allocated(self, point: dict[str, int]) -> int:
        if getattr(self.report, "fit", None) is not None:   # fitted: traces only where needed
            return self.report.at(**point)[self.step_name]["peak"]
        report, pt = self.report.for_point(point)
        step = self.step_of(report)
        step.check_point(pt)
        return step.value("peak", pt)

    def overhead(self, allocated: int) -> dict[str, int]:
        frag = int(allocated * self.overheads.fragmentation) if self.report.device == "cuda" else 0
        return {"fragmentation": frag, **self.fixed}

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
        return a + sum(self.overhead(a).values())


def plan(report, point: dict[str, int] | None, *, gpu: GPU | None = None,
         capacity: int | None = None, margin: float = 0.10,
         overheads: Overheads | None = None, batch: str = "B", seq: str = "S") -> Budget:
    """The budget of ``report``'s training step (or inference, if no training was analysed)."""
    if gpu is None and capacity is None:
        raise InputError("no capacity to check against", hint="give a GPU or a capacity")
    if not 0 <= margin < 1:
        raise InputError(f"margin={margin!r} must be in [0, 1)", hint="e.g. 0.10 for 10%")
    capacity = gpu.bytes if capacity is None else capacity
    overheads = overheads or Overheads()
    step_name = "train" if report.train is not None else "inference"
    model = _Model(report, step_name, overheads, gpu.family if gpu else "unknown")
    point = dict(point or {})
    notes: list[str] = []
    missing = [n for n in report.symbols if n not in point]
    if missing:
        raise InputError(f"the budget needs a size for {', '.join(missing)}",
                         hint="give --at with every symbol, e.g. --at B=4,S=2048")
    allocated = model.allocated(point)
    overhead = model.overhead(allocated)
    total = allocated + sum(overhead.values())
    usable = int(capacity * (1 - margin))
    sub, pt = report.for_point(point)
    bd = model.step_of(sub).breakdown(pt)
    dominant = max(bd, key=bd.get) if any(bd.values()) else "-"
    b = Budget(step_name, gpu, capacity, margin, allocated, overhead, total, total <= usable,
               (capacity - total) / capacity, dominant, bd, notes=notes,
               basis=report.basis)
    b.max_batch = _solve(model, report, point, batch, usable, notes)
    b.max_seq = _solve(model, report, point, seq, usable, notes)
    return b


def _solve(model: _Model, report, point: dict, name: str, usable: int, notes: list):
    """Largest integer value of symbol ``name`` whose total fits ``usable`` (others fixed).

    Exponential search then bisection over the exact total; the answer is checked: it fits and
    the next size does not (or is beyond the model's limit). The peak grows with every size in
    the models seen; a model whose peak shrinks as a size grows could fit again beyond the
    answer, which the check at answer+1 cannot see.
    """
    if name not in report.symbols:
        return None
    lo, hi = report.extent.get(name, (2, None))

    def fits(v: int) -> bool:
        return model.total({**point, name: v}) <= usable

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
            notes.append(f"{name}: every size up to the model's limit {hi} fits")
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
    model = _Model(report, step_name, overheads or Overheads(), gpu.family if gpu else "unknown")
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
