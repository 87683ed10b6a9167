"""The data a trace produces: storages with symbolic sizes and lifetimes, and the ops that ran.

Everything here is plain, frozen data (sympy expressions in the *raw* ShapeEnv symbols until
:func:`memsim.tracer.trace` maps them to the user's names). No tensors are held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import sympy


class Word(str, Enum):
    """A mode or label that is a word: equal to its value, printed as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__  # Enum hashes the member's name: equal to its value, hash as it


class Category(Word):
    """What a storage is, in the vocabulary of ``torch.distributed._tools.mem_tracker``.

    - ``parameter``: a module parameter (trainable or frozen).
    - ``buffer``: a module buffer (BatchNorm running stats, rotary tables...).
    - ``input``: a tensor given to ``forward``.
    - ``gradient``: a tensor that ends up as some parameter's ``.grad``.
    - ``optimizer_state``: a tensor held in ``optimizer.state`` (moments, step counters).
    - ``activation``: allocated in forward (or the loss) and still alive when backward starts,
      i.e. kept for backward (or the model's output).
    - ``temporary``: everything else: freed within its phase, or made by backward / the optimizer.
    """

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"


MODEL_STATE = frozenset({Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE})


class Phase(Word):
    """Where in the step an allocation happened."""

    SETUP = "setup"            # before the step: parameters, inputs, warm-up of optimizer state
    ZERO_GRAD = "zero_grad"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass
class Storage:
    """One untyped storage and its lifetime, in op-index time.

    Attributes
    ----------
    sid : int
        Storage id, dense from 0 in allocation order.
    nbytes : sympy.Expr
        Size in bytes (symbolic).
    device : str
        Device type the storage lives on (``"cuda"``, ``"cpu"``).
    alloc : int
        Index of the op (or registration) that created it; registrations take index -1.
    free : int or None
        Index of the event after which it was released; None if alive at the end of the run.
    phase : Phase
    module : str or None
        Dotted module path running when it was allocated ("" is the root; None outside modules).
    op : str
        The op that returned it (or the registration kind).
    category : Category
    saved_by : tuple of str
        Module paths whose forward saved it for backward (innermost first), empty if never saved.
    stream : int
        The stream current when it was allocated: 0 is the default stream, others are numbered
        in order of first use. A CUDA caching allocator reuses a freed block only for
        allocations on the stream it was allocated on (FSDP2's all-gather and reduce-scatter
        streams; on fake CPU tensors they are ``torch.cpu.Stream`` objects, recorded the same).
    held : str
        ``"output"`` or ``"loss"`` for a storage the step makes and the loop's ``out`` or
        ``loss`` still holds at its end (:mod:`memsim.tracer.previous`), else ``""``.
    """

    sid: int
    nbytes: sympy.Expr
    device: str
    alloc: int
    phase: Phase
    module: str | None
    op: str
    category: Category = Category.TEMPORARY
    free: int | None = None
    saved_by: tuple[str, ...] = ()
    saved: bool = False
    stream: int = 0
    held: str = ""


@dataclass(frozen=True)
class TensorMeta:
    """An op's output: shape (sympy), dtype, and the storage it lives in."""

    shape: tuple
    dtype: str
    sid: int
    fresh: bool  # True if the op allocated this storage, False for a view / in-place result


@dataclass(frozen=True)
class OpRecord:
    """One ATen op call, in execution order."""

    index: int
    op: str
    inputs: tuple[int, ...]        # indices of records (ops or leaves) producing the tensor args
    outputs: tuple[TensorMeta, ...]
    module: str | None
    phase: Phase
    autograd_node: str | None = None
    flops: object = 0  # sympy: floating-point operations (torch.utils.flop_counter's formulas)
    # backward: the module whose forward made the autograd node running (None elsewhere)
    origin: str | None = None


@dataclass(frozen=True)
class LeafRecord:
    """A tensor that no recorded op produced: a parameter, buffer, input or state tensor."""

    index: int
    name: str
    category: Category
    meta: TensorMeta


@dataclass
class Event:
    """An allocation (+) or release (-) of one storage, in execution order."""

    sign: int
    sid: int
    time: int


@dataclass
class RunRecord:
    """Everything one symbolic run recorded."""

    storages: list[Storage] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    ops: list = field(default_factory=list)  # OpRecord | LeafRecord, index == position
    start: int = 0                           # index into events where the measured step begins
    phase_ends: dict = field(default_factory=dict)  # Phase -> index into events at its end
    marks: list = field(default_factory=list)       # (Phase, index into events) at each start
    other_ops: dict = field(default_factory=dict)   # op name -> count, ops outside aten/prims
    specialized: list = field(default_factory=list)  # (raw symbol, value, op, module, source)
    checkpoint_regions: int = 0   # --compiled: regions torch.compile recomputes (tagged)
    # (index into events, storage id) each time a parameter's gradient is accumulated in the
    # measured step (its post-accumulate-grad hook, where DDP's and DeepSpeed's hooks run)
    grad_ready: list = field(default_factory=list)
    # True when whole warm-up steps were traced before ``start`` (a library's loop, a
    # Driver): the run's history is then real, not the plain loop's synthetic warm-up
    warmed: bool = False
    # with ``warmed``: how many more times the caching-allocator replay
    # (analysis/reserved.py) walks the measured step before the one it measures, standing in
    # for warm-up steps that were not traced (DeepSpeed's stage 3 on CUDA: one traced, one
    # replayed)
    replays: int = 0
    # True when the loop's forward interleaves the backward of its parts (a pipeline
    # schedule's micro-batches): what forward keeps for backward is an activation while alive,
    # not only what is alive when the loss is taken
    interleaved: bool = False
    # checks of tensor values the run took to hold, in words (tracer/known.py: assume)
    assumed: list = field(default_factory=list)
    # values the model read in Python control flow that the run had no data for, and what it
    # went on with (tracer/data_dependent.py: Branch), in the order first read
    branches: list = field(default_factory=list)
    # storage id -> name of the parameter whose optimizer state or gradient it is (the plain
    # loop's warm-up; a storage made by an op that names no parameter)
    owners: dict = field(default_factory=dict)
    # storage id -> id of the storage it re-allocates (``UntypedStorage.resize_``: FSDP2 frees
    # and re-allocates unsharded parameters so)
    resized: dict = field(default_factory=dict)
