"""The model's forward as ``torch.compile(model, fullgraph=True)`` would run it.

:class:`CompiledForward` compiles the forward with AOTAutograd exactly as Inductor configures it
(Inductor's decomposition table, its joint-graph passes and its min-cut rematerialization
partitioner, ``torch._inductor.compile_fx.partition_fn``), on the trace's fake, symbolic inputs.
The partitioned forward and backward graphs then run op by op inside the recorded step: the
forward keeps exactly the tensors the partitioner saves for backward, cheap ops are recomputed
in backward as the partitioner decided, and every intermediate is freed at its last use (fx's
generated code drops each value after its last use; AOTAutograd's boxed calls release the
inputs and the saved tensors as the backward consumes them).

Kernel fusion is modelled by the rule Inductor's lowering starts from (:func:`fuse`): a
pointwise op (or view) whose every user is pointwise, a view, a reduction or a concatenation,
and which is not a graph output, is inlined into its users' kernels and never allocated;
everything else (the results of matmuls, convolutions and other library kernels, reductions,
graph outputs) is a buffer, allocated when its kernel runs and freed after its last use. A
pointwise kernel writes its result over an input buffer of the same size and dtype that it reads
for the last time (Inductor's ``inplace_buffers``), in backward including the saved activations
AOTAutograd hands over. Inductor's layout optimization (with convolutions, on CPU always) is
modelled by its memory effect: each graph input a convolution reads (the batch, the weights) is
copied once (to channels-last) and the copy is what backward keeps (:func:`_channels_last_inputs`).
Not modelled: Inductor's scheduler reordering kernels for peak memory, and its finer realization
heuristics (on the zoo CNN, max-pool backward's scatter is written into its zero buffer: the
peak is 9-10% high). The saved-for-backward bytes are exact for the partition
chosen at the example sizes; the peak is close to, not equal to, a compiled run's
(``benchmarks/compiled.py`` prints the gaps; ``tests/test_compiled.py`` checks them).

Activation checkpointing (non-reentrant ``torch.utils.checkpoint`` regions in the model) is
compiled as Dynamo rewrites it (:func:`compiled_checkpoint`): the region's ops are tagged for the
partitioner to recompute, random ops in it save and replay the generator's state.

Dynamo is not run: the forward is traced as one graph, which is what ``fullgraph=True`` demands.
A model that needs graph breaks (data-dependent Python control flow) is reported, not split.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import TraceError
from .rules import ANY, Kind, lookup, register


class _Flat(torch.nn.Module):
    """``model(**kwargs)`` with positional tensor inputs and a tuple of tensor outputs, the form
    AOTAutograd compiles. The output's structure and its non-tensor leaves are kept aside."""

    def __init__(self, model: torch.nn.Module, names: list[str], constants: dict):
        super().__init__()
        self.model = model
        self.names = names
        self.constants = constants
        self.spec = None
        self.leaves: list = []

    def forward(self, *tensors):
        out = self.model(**dict(zip(self.names, tensors)), **self.constants)
        leaves, self.spec = tree_flatten(out)
        self.leaves = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        return tuple(v for v in leaves if isinstance(v, torch.Tensor))

    def rebuild(self, tensors) -> object:
        it = iter(tensors)
        return tree_unflatten([next(it) if v is None else v for v in self.leaves], self.spec)


class CompiledForward:
    """Calls ``model(**kwargs)`` through AOTAutograd as Inductor configures it.

    Compiled at the first call (one graph per grad mode), with the recorder paused so that the
    compiler's own tracing is not recorded.
    """

    def __init__(self, model: torch.nn.Module, recorder):
        self.model = model
        self.recorder = recorder
        self._compiled: dict = {}

    def __call__(self, **kwargs):
        names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        tensors = [kwargs[k] for k in names]
        key = (torch.is_grad_enabled(), tuple(names))
        if key not in self._compiled:
            flat = _Flat(self.model, names, constants)
            with self.recorder.paused():
                fn = _compile(flat, tensors, self.recorder)
            self._compiled[key] = (flat, fn)
        flat, fn = self._compiled[key]
        out = fn(*tensors)
        tensors = kwargs = None
        return flat.rebuild(out)


_AC_GRAPH_IDS = itertools.count(1)


def compiled_checkpoint(generator, fn, context_fn, rest: tuple, kwargs: dict):
    """Non-reentrant checkpointing's ``generator`` for one region, run as Dynamo rewrites
    ``torch.utils.checkpoint`` (``torch._higher_order_ops.wrap.tag_activation_checkpoint``):
    every op of the region is tagged ``PREFER_RECOMPUTE`` with the region's ``ac_graph_id`` (a
    user's selective policy, given as ``context_fn``, tags as it decides), its outputs are
    cached rather than run again, and the partitioner then recomputes the tagged ops in
    backward instead of saving them. The tags reach the graph's nodes through fx's node
    metadata, kept for this region only. ``rest`` is ``(determinism_check, debug, early_stop,
    *args)``."""
    with torch.fx.traceback.preserve_node_meta():
        yield from generator(fn, *_compiled_args(context_fn, rest), **kwargs)


def _compiled_args(context_fn, rest: tuple) -> tuple:
    from torch.utils.checkpoint import (CheckpointPolicy, create_selective_checkpoint_contexts,
                                        noop_context_fn)

    graph_id = next(_AC_GRAPH_IDS)

    def tagging():
        if context_fn is noop_context_fn:
            fwd, rec = create_selective_checkpoint_contexts(
                lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
        else:
            fwd, rec = context_fn()
        fwd.ac_graph_id = graph_id
        return fwd, rec

    determinism_check, debug, _early_stop, *args = rest
    return (False, tagging, determinism_check, debug, False, *args)


@contextlib.contextmanager
def _compiling():
    """``torch.compiler.is_compiling()`` is True while the forward is traced, as under Dynamo:
    libraries take their compile-friendly paths (Hugging Face skips data-dependent checks)."""
    was = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = was


def _compile(flat: _Flat, tensors: list, recorder):
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch.fx.graph import _BoxedCodeGen
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    def keep(gm, example_inputs, backward=False):
        fuse(gm, recorder, backward)
        # Inductor's calling convention: the graph takes its inputs in a list and clears it, so
        # each input (a saved tensor, in backward) is freed after its last use, not at the end.
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
        def fn(args):
            return gm.forward(args)
        fn._boxed_call = True
        return fn

    fake_mode = torch._guards.detect_fake_mode(tensors)
    try:
        with V.set_fake_mode(fake_mode) if fake_mode is not None else contextlib.nullcontext(), \
                _compiling():
            return aot_module_simplified(flat, tensors, fw_compiler=keep,
                                         bw_compiler=functools.partial(keep, backward=True),
                                         inference_compiler=keep, partition_fn=partition_fn,
                                         decompositions=select_decomp_table(),
                                         keep_inference_input_mutations=True)
    except Exception as e:  # noqa: BLE001 - re-raised with what to do about it
        raise TraceError(
            f"compiled: AOTAutograd could not trace {type(flat.model).__name__}.forward as one "
            f"graph: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            hint="--compiled models torch.compile(model, fullgraph=True); a model that needs "
                 "graph breaks cannot be predicted this way; analyse it without --compiled"
        ) from e


# How Inductor lowers ops beyond their tags (torch.Tag.pointwise marks most pointwise ops)
for _name in ("sum", "mean", "amax", "amin", "var_mean", "var", "prod", "argmax", "argmin",
              "any", "all", "max", "min", "logsumexp", "std", "norm", "linalg_vector_norm"):
    register(Kind.INDUCTOR, _name, "reduction", doc="a reduction kernel: its pointwise inputs "
             "are computed inside it")
for _name in ("convert_element_type", "_to_copy", "clone", "full", "scalar_tensor", "full_like",
              "zeros_like", "ones_like", "empty_like", "where", "masked_fill", "inductor_random",
              "iota", "copy", "rand_like", "randn_like", "fill"):
    register(Kind.INDUCTOR, _name, "pointwise", doc="lowered as a pointwise kernel (untagged)")
register(Kind.INDUCTOR, "cat", "concat",
         doc="Inductor computes pointwise inputs straight into the output's slices")


def _kind(node: torch.fx.Node) -> str:
    """How Inductor lowers ``node``: ``pointwise``, ``view``, ``reduction``, ``concat`` or
    ``other``."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or node.meta.get("memsim_extern"):
        return "other"
    op = node.target
    schema = op._schema
    if schema.returns and schema.returns[0].alias_info is not None \
            and not schema.returns[0].alias_info.is_write and not schema.is_mutable:
        return "view"
    if schema.is_mutable:
        return "other"
    if torch.Tag.pointwise in op.tags:
        return "pointwise"
    entry = lookup(Kind.INDUCTOR, op._opname, ANY)
    return entry.value if entry is not None else "other"


def fuse(gm: torch.fx.GraphModule, recorder, backward: bool = False) -> None:
    """Rewrite ``gm`` so that each kernel Inductor would generate is one node.

    A pointwise op or view is *inlined* when it is not a graph output and every user is
    pointwise, a view or a reduction; each other node becomes a kernel that evaluates its inlined
    producers itself (recomputing one shared by several kernels, as Inductor does) with the
    recorder paused, so that only its result is allocated. The kernel's inputs stay alive until
    it runs; fx's generated code frees each value after its last use. A pointwise kernel writes
    its result over an input buffer of the same size and dtype that dies in it; in backward
    that includes the saved activations AOTAutograd hands over (not parameters or tangents).
    """
    graph = gm.graph
    regions = {n.meta.get("ac_graph_id") for n in graph.nodes} - {None}
    recorder.run.checkpoint_regions = max(recorder.run.checkpoint_regions, len(regions))
    _unwrap_rng(graph)
    if not backward:
        _channels_last_inputs(gm)
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target in _SIZE_QUERIES:
            # A size read does not need its tensor computed: the (symbolic) size is known.
            with graph.inserting_before(n):
                const = graph.call_function(_Const(n.meta["val"]), ())
            n.replace_all_uses_with(const)
            graph.erase_node(n)
    out_node = graph.output_node()
    outputs = set(out_node.all_input_nodes)
    kinds = {n: _kind(n) for n in graph.nodes}
    inlined: set = set()
    for n in reversed(graph.nodes):
        if kinds[n] in ("pointwise", "view") and n not in outputs and n.users and all(
                kinds[u] in ("pointwise", "view", "reduction", "concat") for u in n.users):
            inlined.add(n)
    order = {m: i for i, m in enumerate(graph.nodes)}
    # Each kernel: its root (a node that is not inlined), the inlined producers it evaluates,
    # and the buffers it reads.
    kernels = []
    last_read: dict = {}
    for n in graph.nodes:
        if n.op != "call_function" or n in inlined:
            continue
        seen: set = set()
        stack = [n]
        while stack:
            for a in stack.pop().all_input_nodes:
                if a in inlined and a not in seen:
                    seen.add(a)
                    stack.append(a)
        members = sorted(seen, key=order.__getitem__)
        ext = list(dict.fromkeys(a for m in members + [n] for a in m.all_input_nodes
                                 if a not in seen))
        for a in ext:
            last_read[a] = n
        kernels.append((n, members, ext))
    replaced: dict = {}   # root -> its kernel node (members' arguments now point there)
    for n, members, ext0 in kernels:
        if not members:
            continue
        ext = [replaced.get(a, a) for a in ext0]
        sub = torch.fx.Graph()
        env = {a: sub.placeholder(a.name) for a in ext}
        for m in members + [n]:
            env[m] = sub.node_copy(m, env.__getitem__)
        sub.output(env[n])
        # Inductor writes a pointwise kernel's result over a buffer of the same size and dtype
        # that this kernel reads for the last time (config.inplace_buffers).
        reuse = None
        if kinds[n] in ("pointwise", "view") and _nbytes(n) is not None:
            for i, (a0, a) in enumerate(zip(ext0, ext)):
                if ((a.op == "call_function" or (backward and _donated(a)))
                        and a0 not in outputs and last_read.get(a0) is n
                        and _nbytes(a) == _nbytes(n) and _dtype(a) == _dtype(n)):
                    reuse = i
                    break
        kernel = _Kernel(torch.fx.GraphModule(gm, sub), recorder, f"fused:{n.target}", reuse)
        with graph.inserting_before(n):
            new = graph.call_function(kernel, tuple(ext))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        replaced[n] = new
        graph.erase_node(n)
    graph.eliminate_dead_code()
    gm.recompile()


def _unwrap_rng(graph: torch.fx.Graph) -> None:
    """Random ops in checkpointed regions: the partitioner wraps each one that backward
    recomputes in ``run_and_save_rng_state`` (forward: the generator's state is saved with the
    result) and ``run_with_rng_state`` (backward). Inductor runs both as fallback kernels, so
    here the op becomes an unfused kernel of its own and the saved state an allocation of the
    generator's state size (CPU: ``torch.get_rng_state()``, 5,056 bytes). Any other
    higher-order op is reported, not guessed."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    for n in list(graph.nodes):
        if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator):
            continue
        saves = n.target is run_and_save_rng_state
        if not saves and n.target is not run_with_rng_state:
            raise TraceError(f"compiled: the partitioned graph calls {n.target.name()}, which "
                             "memsim has no memory rule for",
                             hint="analyse the model without --compiled")
        op, args = (n.args[0], n.args[1:]) if saves else (n.args[1], n.args[2:])
        fake = torch.fx.node.map_arg((tuple(args), dict(n.kwargs)), lambda a: a.meta["val"])
        with graph.inserting_before(n):
            if saves:
                call = graph.call_function(op, tuple(args), dict(n.kwargs))
            else:   # the saved state is read here, and freed after
                call = graph.call_function(_WithState(op), (n.args[0], *args), dict(n.kwargs))
            call.meta = {"val": op(*fake[0], **fake[1]), "memsim_extern": True}
            if saves:
                size = torch.get_rng_state().numel()
                empty = graph.call_function(
                    torch.ops.aten.empty.memory_format, ([size],),
                    {"dtype": torch.uint8, "device": torch.device("cpu")})
                empty.meta = {"val": torch.empty(size, dtype=torch.uint8, device="meta")}
                for u in list(n.users):
                    if u.target is not operator.getitem:
                        raise TraceError("compiled: unexpected use of run_and_save_rng_state")
                    u.replace_all_uses_with(empty if u.args[1] == 0 else call)
                    graph.erase_node(u)
            else:
                n.replace_all_uses_with(call)
        graph.erase_node(n)


def _channels_last_inputs(gm: torch.fx.GraphModule) -> None:
    """Inductor's layout optimization (``GraphLowering.decide_layout_opt``; on CPU with oneDNN
    always on when the graph has convolutions): each graph input (the batch, a weight) that a
    convolution reads is converted to channels-last once, a copy that every use reads, the
    saved-for-backward one included. Other tensors only change strides (same bytes)."""
    from torch._inductor.graph import GraphLowering

    try:
        on = GraphLowering.decide_layout_opt(gm, is_inference=False)
    except Exception:  # noqa: BLE001 - its heuristics read metadata we may lack: no copies then
        on = False
    if not on:
        return
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    convs = [n for n in graph.nodes if n.target is torch.ops.aten.convolution.default]
    for p in dict.fromkeys(a for c in convs for a in c.args[:2]):
        if not isinstance(p, torch.fx.Node) or p.op != "placeholder":
            continue
        v = p.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() != 4 \
                or v.is_contiguous(memory_format=torch.channels_last):
            continue
        with graph.inserting_before(min(p.users, key=order.__getitem__)):
            # (a copy of the same bytes; its strides stay, so the graph's views stay valid)
            copy = graph.call_function(torch.ops.aten.clone.default, (p,))
        copy.meta = {"val": v, "memsim_extern": True}
        p.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)


class _WithState:
    """``run_with_rng_state(state, op, *args)``: ``op(*args)``, reading ``state``."""

    def __init__(self, op):
        self.op = op
        self.__name__ = f"with_rng_state_{op._opname}" if hasattr(op, "_opname") else "op"

    def __call__(self, state, *args, **kwargs):
        return self.op(*args, **kwargs)


_SIZE_QUERIES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                 torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default}


class _Const:
    """A value known when the graph was traced (a symbolic size of this very run)."""

    __name__ = "size"

    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


class _Kernel:
    """One fused kernel: its ops run unrecorded, its result is recorded as one allocation."""

    def __init__(self, sub: torch.fx.GraphModule, recorder, name: str, reuse: int | None):
        self.sub = sub
        self.recorder = recorder
        self.reuse = reuse      # index of the input whose buffer the result is written over
        self.__name__ = name.replace(".", "_").replace(":", "_")

    def __call__(self, *inputs):
        with self.recorder.paused():
            out = self.sub(*inputs)
        if self.reuse is not None:
            self.recorder.release(inputs[self.reuse])
        self.recorder.record_fused(self.__name__,
                                   [t for t in inputs if isinstance(t, torch.Tensor)], out)
        return out


def _donated(node) -> bool:
    """A backward input whose buffer Inductor may write over: a saved activation (AOTAutograd
    names those after their forward node; parameters are ``primals_*``, grads ``tangents_*``)."""
    return node.op == "placeholder" and not node.name.startswith(("primals", "tangents"))


def _val(node):
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _nbytes(node):
    v = _val(node)
    return None if v is None else v.untyped_storage().nbytes()


def _dtype(node):
    v = _val(node)
    return None if v is None else v.dtype
