"""A dispatch mode that records every storage's allocation and release as eager PyTorch does it.

It sits above ``FakeTensorMode``: each ATen op runs on fake tensors (symbolic sizes, no data), and
every *new* untyped storage it returns is recorded with its symbolic ``nbytes``. A
``weakref.finalize`` on the storage records the release at the moment Python (or autograd) drops
the last reference, exactly as in an eager run. Views and in-place results share their base's
storage and are not counted again. Storages resized in place (``resize_``) are re-recorded.

The same pass records each op (inputs, outputs, module path, phase) for the fx / networkx graph.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils._sympy.functions import CeilToInt, IntTrueDiv
from torch.utils.weak import WeakTensorKeyDictionary

from . import known, progress
from .records import Category, Event, LeafRecord, OpRecord, Phase, RunRecord, Storage, TensorMeta
from .rules import Kind, keys, lookup, register

# Op namespaces whose memory the tests check against real runs: ATen, and the collectives and
# FSDP2 copies of torch.distributed (gloo runs in tests/test_parallel.py).
for _ns in ("aten", "prims", "prim", "profiler", "_c10d_functional", "c10d", "fsdp"):
    register(Kind.NAMESPACE, _ns, "checked",
             doc="memory of its ops checked against real runs (tests/)")

_DEVICE = torch.ops.prim.device.default


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory: a DTensor's local shard, any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


@contextlib.contextmanager
def patched(cls, name: str, wrap):
    """For the block, ``cls.name`` is ``wrap(original)`` (``getattr``'s value: a
    staticmethod's function); after it, ``cls`` holds what it held itself (a
    ``staticmethod`` object as such), or nothing where it inherited the attribute."""
    own = getattr(cls, "__dict__", {}).get(name, _NOTHING)
    setattr(cls, name, wrap(getattr(cls, name)))
    try:
        yield
    finally:
        if own is _NOTHING:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


_NOTHING = object()


def swapped(changes):
    """For the block, each ``(owner, attr, new)`` of ``changes``: ``owner.attr`` is ``new``
    (:func:`patched`)."""
    stack = contextlib.ExitStack()
    try:
        for owner, attr, new in changes:
            stack.enter_context(patched(owner, attr, lambda _, new=new: new))
    except BaseException:
        stack.close()
        raise
    return stack


def outside_fake(fn):
    """``fn`` run outside any fake mode and unrecorded: device meshes are a few host integers
    that PyTorch computes with real tensors (under a fake mode their rank coordinates become
    data-dependent), bookkeeping on the host whatever the device (a mesh a pipeline rank builds
    while its step is recorded is not the step's memory)."""
    from torch.utils._python_dispatch import _disable_current_modes

    @functools.wraps(fn)
    def real(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return real


@contextlib.contextmanager
def real_meshes(wrap=None):
    """Build every ``DeviceMesh`` outside the fake mode (:func:`outside_fake`); FSDP2 builds one
    when it shards tensor-parallel parameters. ``wrap`` wraps the constructor first."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        yield
        return
    with patched(DeviceMesh, "__init__",
                  lambda fn: outside_fake(wrap(fn) if wrap is not None else fn)):
        yield


def as_expr(value) -> sympy.Expr:
    """A SymInt / int as a sympy expression, without adding guards. A kernel's ``math.ceil(n /
    k)`` (torch's ``CeilToInt(IntTrueDiv(n, k))``) becomes sympy's ``ceiling(n / k)``, which
    sympy knows to be a positive integer for positive ``n`` (so that ``Max(1, 32 * ceiling(S /
    32))`` simplifies and equal sizes compare equal)."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        if expr.has(CeilToInt):
            expr = expr.replace(IntTrueDiv, lambda a, b: a / b).replace(CeilToInt, sympy.ceiling)
        return expr
    return sympy.Integer(int(value))


def current() -> Recorder | None:
    """The innermost memsim :class:`Recorder` on the dispatch mode stack (the run a rule or a
    patched library function is called from), or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((m for m in reversed(_get_current_dispatch_mode_stack())
                 if isinstance(m, Recorder)), None)


def _tensors(x, out: list) -> list:
    """The tensors in an op's arguments or results, in ``tree_flatten``'s order (an ATen op's
    nest only lists, tuples and dicts), appended to ``out``: a fifth of the time pytree takes
    for it, twice on every op of a trace."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


class Recorder(TorchDispatchMode):
    """Records storages, their lifetimes and the op sequence of one run.

    Parameters
    ----------
    device : str
        The device type being modelled. Every fake tensor lives on the CPU (autograd cannot run
        fake CUDA tensors in a CPU build); storages are labelled with the modelled device, or
        "host" where the real run would keep them in host memory.
    """

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.run = RunRecord()
        # whether ``t.device`` queries go unrecorded: only in a run that is never folded
        # (memsim.tracer.fold places the units' regions by every op, these included)
        self.device_queries_unrecorded = False
        self.phase = Phase.SETUP
        self.module_stack: list[str] = []
        self.accumulated: set[int] = set()  # ids of the parameters whose gradient accumulated
        self.current_op: str | None = None
        self._live: dict[int, int] = {}           # id(python storage) -> sid
        self._default_stream = torch.cpu.current_stream()
        self._streams: list = []                  # side streams seen, numbered from 1
        self._producer = WeakTensorKeyDictionary()  # tensor -> record index
        self._finalizers: list[weakref.finalize] = []
        self.shape_env = None           # set by the driver: specializations are caught per op
        self.specialized: list[tuple] = []  # (raw symbol, value, op, module, source)
        self._n_repl = 0
        self._paused = False  # inside DTensor's sharding propagation: ops are not the run's
        self.scalar_hook = None  # a Driver's answer to .item() (tracer.kernels)
        self.host_device = None  # a Driver's host device: storages there are host memory
        self._checked = keys(Kind.NAMESPACE)  # op namespaces checked against real runs
        # autograd sequence number -> module whose forward created that node
        self._node_module: dict[int, str] = {}
        self._held: list | None = None  # releases held back (sorted_cache_frees)

    # -- storages -------------------------------------------------------------------------------
    @property
    def time(self) -> int:
        return len(self.run.ops)

    @property
    def module(self) -> str | None:
        return self.module_stack[-1] if self.module_stack else None

    def _track(self, t: torch.Tensor, op: str, category: Category) -> tuple[int, bool]:
        t = local(t)
        st = t.untyped_storage()
        key = id(st)
        sid = self._live.get(key)
        if sid is not None:
            self._check_resize(st, sid)
            return sid, False
        sid = len(self.run.storages)
        # a tensor on the meta device (a library's shape-only bookkeeping) holds no memory
        nbytes = 0 if t.device.type == "meta" else st.nbytes()
        host = self.host_device is not None and t.device == self.host_device
        self.run.storages.append(Storage(
            sid=sid, nbytes=as_expr(nbytes), device="host" if host else self.device,
            alloc=self.time, phase=self.phase, module=self.module, op=op, category=category,
            stream=self._stream()))
        self._live[key] = sid
        self.run.events.append(Event(+1, sid, self.time))
        self._finalizers.append(weakref.finalize(st, self._release, key, sid))
        return sid, True

    def _stream(self) -> int:
        """The number of the stream current now (0: the default). Device-agnostic code such as
        FSDP2 selects its side streams through ``torch.cpu.stream`` on the CPU path traced."""
        st = torch.cpu.current_stream()
        if st is self._default_stream:
            return 0
        for i, known in enumerate(self._streams):
            if known is st:
                return i + 1
        self._streams.append(st)  # held: a stream's id() is not reused while recorded
        return len(self._streams)

    def _release(self, key: int, sid: int) -> None:
        if self._held is not None:
            self._held.append((key, sid))
            return
        if self._live.get(key) == sid:
            del self._live[key]
            self.run.storages[sid].free = self.time
            self.run.events.append(Event(-1, sid, self.time))

    def _check_resize(self, st, sid: int) -> None:
        old = self.run.storages[sid]
        new = as_expr(st.nbytes())
        if new == old.nbytes:
            return
        # A resize is a release of the old size and an allocation of the new one.
        old.free = self.time
        self.run.events.append(Event(-1, sid, self.time))
        nsid = len(self.run.storages)
        self.run.storages.append(Storage(
            sid=nsid, nbytes=new, device=old.device, alloc=self.time, phase=self.phase,
            module=self.module, op="resize_", category=old.category, stream=self._stream()))
        self.run.events.append(Event(+1, nsid, self.time))
        self.run.resized[nsid] = sid
        for key, val in self._live.items():
            if val == sid:
                self._live[key] = nsid
                break

    @contextlib.contextmanager
    def sorted_cache_frees(self):
        """Inside: autocast's cached weight casts, freed when the outermost autocast exits in
        the order of its hash table, are recorded as freed in the order they were made. They
        are freed at one moment with nothing made between, so no figure depends on their
        order; a folded trace (:mod:`memsim.tracer.fold`) needs the same order every time."""
        orig = torch.clear_autocast_cache
        recorder = self

        def clear():
            recorder._held = []
            try:
                orig()
            finally:
                held, recorder._held = recorder._held, None
                for key, sid in sorted(held, key=lambda ks: ks[1]):
                    recorder._release(key, sid)

        torch.clear_autocast_cache = clear
        try:
            yield
        finally:
            torch.clear_autocast_cache = orig

    @contextlib.contextmanager
    def paused(self):
        """Inside: ops are not recorded (they are not the run's, e.g. a compiler tracing)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    @contextlib.contextmanager
    def skip_sharding_propagation(self):
        """Do not record what DTensor runs on the side, which a real run spends no device memory
        on: the ops it runs to derive output shapes (they reuse the run's own fake mode), and
        device meshes built during the step (see :func:`real_meshes`)."""
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:
            yield
            return
        recorder = self

        def pause(fn):
            def wrapper(*args, **kwargs):
                was, recorder._paused = recorder._paused, True
                try:
                    return fn(*args, **kwargs)
                finally:
                    recorder._paused = was
            return wrapper

        with patched(ShardingPropagator, "_propagate_tensor_meta_non_cached", pause), \
                real_meshes(pause):
            yield

    @contextlib.contextmanager
    def watch_resizes(self):
        """Record ``UntypedStorage.resize_`` calls as they happen (FSDP2 frees and re-allocates
        unsharded parameters this way): a storage method does not reach the dispatch mode."""
        def watched(orig):
            def resize_(st, size):
                out = orig(st, size)
                sid = self._live.get(id(st))
                if sid is not None:
                    self._check_resize(st, sid)
                return out
            return resize_

        with patched(torch.UntypedStorage, "resize_", watched):
            yield

    def sid_of(self, t: torch.Tensor) -> int | None:
        """The storage id of a tensor, if its storage is tracked and alive."""
        return self._live.get(id(local(t).untyped_storage()))

    def _meta(self, t: torch.Tensor, sid: int, fresh: bool) -> TensorMeta:
        return TensorMeta(tuple(as_expr(d) for d in t.shape), str(t.dtype).removeprefix("torch."),
                          sid, fresh)

    def register(self, t: torch.Tensor, name: str, category: Category) -> None:
        """Record a tensor that exists before the step (parameter, buffer, input, state)."""
        sid, fresh = self._track(t, f"<{category.value}>", category)
        if not fresh:
            return
        idx = len(self.run.ops)
        self.run.ops.append(LeafRecord(idx, name, category, self._meta(t, sid, True)))
        self._producer[t] = idx

    def set_host(self, t: torch.Tensor) -> None:
        """Mark ``t``'s storage as living in host memory (not counted on the device)."""
        sid = self.sid_of(t)
        if sid is not None:
            self.run.storages[sid].device = "host"

    def own(self, t: torch.Tensor, name: str | None) -> None:
        """``t``'s storage is the state (or gradient) of parameter ``name``."""
        sid = self.sid_of(t)
        if sid is not None and name is not None:
            self.run.owners[sid] = name

    def set_category(self, t: torch.Tensor, category: Category) -> None:
        sid = self.sid_of(t)
        if sid is not None:
            self.run.storages[sid].category = category

    def grad_ready(self, param: torch.Tensor) -> None:
        """Called by a post-accumulate-grad hook: ``param.grad`` is accumulated now."""
        if self.phase is Phase.BACKWARD and param.grad is not None:
            self.accumulated.add(id(param))
            self.run.grad_ready.append((len(self.run.events), self.sid_of(param.grad)))

    def mark_saved(self, t: torch.Tensor) -> None:
        """Called by the saved-tensor pack hook: ``t`` is kept for backward by the modules open."""
        sid = self.sid_of(t)
        if sid is None:
            return
        s = self.run.storages[sid]
        s.saved = True
        if self.module_stack:
            s.saved_by = tuple(dict.fromkeys(s.saved_by + tuple(reversed(self.module_stack))))

    def pack_saved(self, t: torch.Tensor):
        """The saved-tensor pack hook: mark ``t`` saved and return what autograd keeps of it.

        A hook that returned ``t`` itself would close a reference cycle for a tensor saved as
        its own node's output (exp, tanh, sigmoid, softmax...): ``t`` -> ``t.grad_fn`` -> its
        saved variable -> ``t``. C++ nodes are invisible to Python's gc, so the cycle never
        dies: where that node never runs backward (a dead branch, e.g. MambaMixer's unused
        ``A = -exp(A_log)`` on CPU) the storage would stay to the end of the step, while
        autograd without hooks keeps only the data of an output (no grad_fn) and frees it with
        the graph. A detached alias is kept instead: the same storage, no grad_fn; not recorded
        as an op, and mapped to ``t``'s producer so that backward's reads of it are edges to
        that op."""
        self.mark_saved(t)
        if t.grad_fn is None:
            return t
        with self.paused():
            d = t.detach()
        idx = self._producer.get(t)
        if idx is not None:
            self._producer[d] = idx
        return d

    def mark(self, phase: Phase) -> None:
        """Start a new phase; remembers where the previous one ended."""
        self.run.phase_ends[self.phase] = len(self.run.events)
        self.run.marks.append((phase, len(self.run.events)))
        self.phase = phase
        progress.report(phase.value)

    def finish(self) -> RunRecord:
        self.run.phase_ends[self.phase] = len(self.run.events)
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        return self.run

    def _note_specialization(self, op: str) -> None:
        from .sources import model_source_stack

        reps = self.shape_env.replacements
        self._n_repl = len(reps)
        src = model_source_stack()
        for sym, val in reps.items():
            if not any(x[0] == sym for x in self.specialized):
                self.specialized.append((sym, val, op, self.module, src))

    # -- ops ------------------------------------------------------------------------------------
    def _input_index(self, t: torch.Tensor) -> int:
        idx = self._producer.get(t)
        if idx is not None:
            return idx
        sid, fresh = self._track(t, "<constant>", Category.TEMPORARY)
        idx = len(self.run.ops)
        self.run.ops.append(LeafRecord(idx, "<constant>", self.run.storages[sid].category,
                                       self._meta(t, sid, fresh)))
        self._producer[t] = idx
        return idx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        if func is _DEVICE and self.device_queries_unrecorded and not kwargs and \
                len(args) == 1 and args[0] in self._producer:
            # ``t.device`` on a tensor already recorded allocates nothing and reads no data
            # (DeepSpeed's ZeRO-3 asks it about 80 times per parameter and step: two thirds of
            # the ops it issues). It still names the module of the autograd node last
            # numbered, as every op does (below)
            if self.module_stack:
                self._node_module.setdefault(torch._C._autograd._get_sequence_nr() - 1,
                                             self.module_stack[-1])
            t = args[0]
            if isinstance(t, FakeTensor):   # what FakeTensor's own handler answers, directly
                return torch.device("meta") if t.fake_mode.in_kernel_invocation else \
                    t.fake_device
            return func(*args)
        flat_in = _tensors((args, kwargs), [])
        if any(local(t) is not t for t in flat_in):
            # A DTensor op: let DTensor run it; the ops on local shards it issues come back here
            # and are recorded once (the wrapper itself owns no memory).
            return NotImplemented
        name = str(func)
        self.current_op = name
        if self.module_stack:
            # autograd numbers a node before the op below it runs: the number last taken is
            # this op's node, where it makes one (else an earlier op's, already mapped)
            self._node_module.setdefault(torch._C._autograd._get_sequence_nr() - 1,
                                         self.module_stack[-1])
        rule = lookup(Kind.ATEN, func, self.device)
        inputs = tuple(self._input_index(t) for t in flat_in)
        if rule is not None:
            out = rule.value(self, func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        known.observe(func, args, kwargs, out)
        if self.shape_env is not None and len(self.shape_env.replacements) != self._n_repl:
            self._note_specialization(name)
        if func.namespace not in self._checked and any(
                isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            self.run.other_ops[name] = self.run.other_ops.get(name, 0) + 1
        self._record(name, inputs, out, _flops(func, args, kwargs, out))
        return out

    def release(self, t: torch.Tensor) -> None:
        """``t``'s storage is released now, though Python still holds it for a moment (a
        compiled kernel writes its result over this buffer: :mod:`memsim.tracer.compiled`)."""
        sid = self.sid_of(t)
        if sid is not None:
            self._release(id(local(t).untyped_storage()), sid)

    def scratch(self, t: torch.Tensor) -> None:
        """``t`` is a buffer the current op allocates and frees before it returns (a
        collective backend's own copy): recorded as allocated and released at this op."""
        sid, fresh = self._track(t, self.current_op or "<scratch>", Category.TEMPORARY)
        if fresh:
            self._release(id(local(t).untyped_storage()), sid)

    def record_fused(self, name: str, inputs: list, out) -> None:
        """Record ``out`` as one op's result: a fused kernel whose inner ops ran unrecorded
        (:mod:`memsim.tracer.compiled`) reads ``inputs`` and allocates only ``out``."""
        self._record(name, tuple(self._input_index(t) for t in inputs), out, 0)

    def _record(self, name: str, inputs: tuple, out, flops) -> None:
        node = origin = None
        if self.phase is Phase.BACKWARD:
            n = torch._C._current_autograd_node()
            if n is not None:
                node = n.name()
                origin = self._node_module.get(n._sequence_nr())
        metas = []
        idx = len(self.run.ops)
        for t in _tensors(out, []):
            sid, fresh = self._track(t, name, Category.TEMPORARY)
            metas.append(self._meta(t, sid, fresh))
            self._producer[t] = idx
        self.run.ops.append(OpRecord(idx, name, inputs, tuple(metas), self.module, self.phase,
                                     node, flops, origin))
        self.current_op = None


def _flops(func, args, kwargs, out):
    """FLOPs of one op by ``torch.utils.flop_counter``'s formulas (0 for ops it has none for)."""
    from torch.utils.flop_counter import flop_registry

    fn = flop_registry.get(func._overloadpacket)
    if fn is None:
        return 0
    try:
        return as_expr(fn(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that cannot take these args counts nothing
        return 0


def _flex_attention_hops() -> None:
    """FlexAttention's higher-order ops, run under the recorder as eager PyTorch runs them
    without torch.compile: the unfused forward and backward (``sdpa_dense``,
    ``sdpa_dense_backward``), whose ops the recorder sees one by one. (A mode with no rule for
    a higher-order op fails with PyTorch's message naming the mode's object.) A call that
    torch.compile compiles with Inductor never reaches them: it allocates the fused kernels'
    buffers instead (:mod:`memsim.tracer.flex`); under ``--compiled`` the op nodes of the
    compiled graphs still run here, unfused."""
    import importlib
    try:  # the module (the package re-exports the operator under the module's name)
        importlib.import_module("torch._higher_order_ops.flex_attention")
        fa = sys.modules["torch._higher_order_ops.flex_attention"]
    except ImportError:  # pragma: no cover - older torch
        return

    @fa.flex_attention.py_impl(Recorder)
    def _forward(mode, *args, **kwargs):
        with mode:
            return fa.sdpa_dense(*args, **kwargs)

    @fa.flex_attention_backward.py_impl(Recorder)
    def _backward(mode, *args, **kwargs):
        with mode:
            return fa.sdpa_dense_backward(*args, **kwargs)


_flex_attention_hops()
