"""FlexAttention as ``torch.compile(flex_attention)`` runs it: Inductor's fused kernels.

Eager PyTorch runs FlexAttention unfused, materializing the (B, H, S, S) scores
(:func:`memsim.tracer.functions.flex_attention_eager`). Its documented use compiles it
(torchtitan; Hugging Face's ``attn_implementation="flex_attention"`` calls
``torch.compile(flex_attention)``, ``transformers/integrations/flex_attention.py``
``WrappedFlexAttention``), and Inductor lowers the higher-order op to one fused kernel each way
that never materializes the scores. A call is compiled when Dynamo would compile it with
Inductor (:func:`inductor_compiled`); it then runs :func:`compiled_flex_attention`, which
allocates the buffers of Inductor's lowering for the modelled device as fake tensors, recorded
as one op each way (``fused_flex_attention``, ``fused_flex_attention_backward``).

How a compiled call is recognised: under memsim's trace Dynamo compiles nothing, because
``ConvertFrame.__call__`` (torch/_dynamo/convert_frame.py) skips every frame while a dispatch
mode is on the stack ("non-infra torch dispatch mode present"); the compiled function runs
eagerly, inside Dynamo's ``compile_wrapper`` (torch/_dynamo/eval_frame.py), which has set
the eval-frame callback that a real run would compile each frame with. That callback, not the
function's name, decides: set and backed by Inductor means compiled (``torch.compile(fn)`` of
``flex_attention`` itself, of a function or module calling it, HF's wrapper); cleared by
``torch.compiler.disable`` or another backend (``"eager"``, ``"aot_eager"``, which run the
unfused implementation) means eager.

CUDA (Triton templates, ``torch/_inductor/kernel/flex/flex_attention.py``), not measured on a
GPU:

- forward (lowering ``flex_attention``): ``out`` (B, Hq, Sq, Dv) in the query's dtype, dense
  strides in the query's fill order (``infer_dense_strides``); ``logsumexp`` and
  ``max_scores``, (B, Hq, Sq) float32 each (``empty_strided``, always allocated, the kernel's
  mutated inputs; log2 scale). ``max_scores`` dies after the kernel unless
  ``return_aux=AuxRequest(max_scores=True)``; ``logsumexp`` too at inference unless returned.
- saved for backward (AOTAutograd's partition of the joint graph: what the backward op
  reads): query, key, value, ``out``, ``logsumexp``, the BlockMask's tensors and the tensors
  ``score_mod`` captures; ``max_scores`` is not saved (eager's ``FlexAttentionAutogradOp``
  saves it).
- backward (lowering ``flex_attention_backward``): ``delta = sum(out * grad_out, -1)`` (B, Hq,
  Sq) float32, and, when the loss reads the log-sum-exp, ``grad_lse_exp2`` (B, Hq, Sq) float32;
  ``grad_query`` shaped and strided like the query; ``grad_key`` and ``grad_value`` of
  (Bq, Hkv, Skv, D), strided like key and value (under GQA the kernel sums the query heads of
  each KV head itself: no Hq-head gradient exists), each in its input's dtype. Where the key
  and value have batch 1 and the query more, those are summed to batch 1 (``aten.sum``, two
  more buffers). A tangent whose strides differ from ``out``'s is first copied to them
  (AOTAutograd's ``coerce_to_expected_memory_format``, static shapes).

CPU (C++ template, ``torch/_inductor/kernel/flex/flex_cpu.py`` ``lower_cpu`` and
``torch/_inductor/codegen/cpp_flex_attention_template.py``): inference only (PyTorch refuses a
CPU backward before compiling, and the lowering refuses a log-sum-exp output). ``out`` as on
CUDA, no log-sum-exp; a contiguous copy of query, key or value whose last stride is not 1
(``contiguous_last_dim``); and the kernel's work buffers from the CPU allocator
(``codegen_allocate_buffer``): per thread ``qs*kvs + 2*qs + qs*Dv`` float32 values,
``qs*kvs``, ``kvs*D`` and ``qs*D`` values of the input's dtype, and key and value reordered
(``Bkv*Hkv*Skv*D`` values each), where ``qs = min(Q_BLOCK, Sq)`` and ``kvs = min(KV_BLOCK,
Skv)`` (a BlockMask's block sizes; without one a single block of 2**30, so ``S*S`` per thread)
and the thread count is this process's (``torch._inductor.utils.parallel_num_threads``).
Equal to a real compiled run's allocations, ``tests/test_flex.py``.

Not modelled, refused with a :class:`~memsim.tracer.errors.TraceError`: tensors captured by
``score_mod`` that require grad (the kernel accumulates their gradients in float32 buffers
through ``zeros_and_scatter``), ``BACKEND="FLASH"`` (CuteDSL) and ``"TRITON_DECODE"``, and on
CUDA a query length fixed below 128 (static shapes pick FlexDecoding, whose split-KV buffers
depend on the GPU's SM count). Where PyTorch itself fails (a head dimension below 16 on CUDA,
mixed dtypes in backward, a log-sum-exp on CPU) the error says so. Known differences, not
refused: a symbolic query length is modelled with the main kernel, as a dynamic-shape compile
runs it (a static compile below 128 would run FlexDecoding); under dynamic shapes AOTAutograd
coerces a non-contiguous tangent to contiguous (one more copy); a default BlockMask built
inside a compiled training graph may be recomputed in backward instead of saved (a few bytes);
on CPU, AMX packing of bf16/fp16 pads odd head and block sizes by one, and the work buffers
are counted for the analysing process's thread count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .errors import TraceError

_LARGE_BLOCK = 1 << 30  # torch.nn.attention.flex_attention._LARGE_SPARSE_BLOCK_SIZE


def inductor_compiled() -> bool:
    """Whether code running now is inside a function that torch.compile compiles with Inductor
    (Dynamo's eval-frame callback is set and its backend is Inductor).

    >>> inductor_compiled()
    False
    """
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # pragma: no cover - a torch without Dynamo
        return False
    cb = get_eval_frame_callback()
    for _ in range(8):  # CatchErrorsWrapper -> ConvertFrame -> WrapBackendDebug -> the backend
        if cb is None or isinstance(cb, bool):
            return False
        name = getattr(cb, "compiler_name", None)
        if name is not None:
            return name == "inductor"
        cb = getattr(cb, "_torchdynamo_orig_backend", None)
    return False


@contextlib.contextmanager
def dynamo_unmarked():
    """Inside: the code objects Dynamo first sees are reset on exit, and forgotten (so that
    the next run finds them new again). Under memsim's dispatch modes Dynamo skips every frame
    and marks its code to be skipped from then on (``ConvertFrameReturn``'s default
    ``apply_to_code``, torch/_dynamo/types.py); left marked, a later real call of
    ``torch.compile(flex_attention)`` in the same process runs ``flex_attention`` eagerly,
    and Dynamo fails on the higher-order op inside it."""
    def tracker():  # Dynamo's record of the code objects its callback saw, if Dynamo is loaded
        mod = sys.modules.get("torch._dynamo.convert_frame")
        return getattr(mod, "input_codes", None)

    codes = tracker()
    before = set(codes.seen_ids) if codes is not None else set()
    try:
        yield
    finally:
        codes = tracker()
        if codes is not None:
            from torch._C._dynamo.eval_frame import reset_code
            kept = []
            for ref in codes.seen:
                code = ref()
                if code is not None and id(code) not in before:
                    reset_code(code)
                    codes.seen_ids.discard(id(code))
                else:
                    kept.append(ref)
            codes.seen[:] = kept


def empty_block_mask(eager, query: torch.Tensor, key: torch.Tensor):
    """``_create_empty_block_mask`` (torch/nn/attention/flex_attention.py; ``eager``) as a
    compiled graph keeps it: at inference the forward kernel reads the key-side block tensors
    only, and Inductor drops the query-side ones the eager function builds (one int32 each of
    ``ones([1, 1, 1])`` and ``zeros([1, 1, 1, 1])`` remain, as a real compiled CPU run shows).
    With a backward, as eager builds it."""
    import torch.nn.attention.flex_attention as fa

    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return eager(query, key)
    return fa.BlockMask.from_kv_blocks(
        kv_num_blocks=torch.ones([1, 1, 1], dtype=torch.int32, device=query.device),
        kv_indices=torch.zeros([1, 1, 1, 1], dtype=torch.int32, device=query.device),
        BLOCK_SIZE=fa._LARGE_SPARSE_BLOCK_SIZE, seq_lengths=(1, 1), compute_q_blocks=False)


def _dense(like: torch.Tensor, shape, dtype) -> torch.Tensor:
    """An empty tensor of ``shape`` with dense strides in ``like``'s fill order, the last stride
    1 (``infer_dense_strides`` in torch/_inductor/kernel/flex/common.py)."""
    from torch._higher_order_ops.flex_attention import _construct_strides
    from torch._inductor.ir import get_fill_order

    order = list(get_fill_order(like.stride()))
    strides = _construct_strides(shape, order)
    if strides[-1] != 1:
        order.remove(len(shape) - 1)
        strides = _construct_strides(shape, [len(shape) - 1] + order)
    return torch.empty_strided(shape, strides, dtype=dtype, device=like.device)


def _error(message: str, rec, hint: str) -> TraceError:
    from .sources import model_source_stack
    return TraceError(message, module=rec.module if rec is not None else None,
                      op="flex_attention", source=model_source_stack(), hint=hint)


class _Captured(TorchFunctionMode):
    """Collects the tensors a function reads that it neither received nor made."""

    def __init__(self, own):
        super().__init__()
        self.made = list(own)   # held: ids stay unique while the scan runs
        self.captured: list[torch.Tensor] = []

    def _known(self, t) -> bool:
        return any(t is m for m in self.made) or any(t is c for c in self.captured)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and not self._known(t):
                self.captured.append(t)
        out = func(*args, **(kwargs or {}))
        self.made += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def captured_tensors(score_mod, query: torch.Tensor, rec) -> list[torch.Tensor]:
    """The tensors ``score_mod`` reads from its closure or globals, found by calling it once on
    0-d tensors as FlexAttention traces it (``create_fw_bw_graph``); under Dynamo these are the
    ``score_mod_other_buffers`` lifted into the graph."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    args = [query.new_zeros(())] + [query.new_zeros((), dtype=torch.int) for _ in range(4)]
    scan = _Captured(args)
    try:
        with torch.no_grad(), scan, TransformGetItemToIndex():
            score_mod(*args)
    except Exception as e:
        raise _error(f"score_mod could not be called on scalar tensors as FlexAttention traces "
                     f"it ({type(e).__name__}: {e})", rec,
                     "a compiled FlexAttention traces score_mod the same way") from e
    return scan.captured


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One compiled call: the modelled ``device``, the recorder, the BlockMask's tensors and
    block sizes, ``score_mod``'s captured tensors (saved for backward, as the compiled graph
    saves its lifted inputs), and which statistics are outputs."""

    device: str
    rec: object
    mask_tensors: tuple
    blocks: tuple  # (Q_BLOCK_SIZE, KV_BLOCK_SIZE)
    captured: tuple
    training: bool
    lse_out: bool
    max_out: bool


def _cuda_forward(plan: _Plan, query, key, value):
    """The Triton template's buffers: ``(out, logsumexp, max_scores)``."""
    b, hq, sq, _ = query.shape
    with plan.rec.paused():
        lse = query.new_empty((b, hq, sq), dtype=torch.float32)
        mx = query.new_empty((b, hq, sq), dtype=torch.float32)
        out = _dense(query, (b, hq, sq, value.shape[-1]), query.dtype)
    plan.rec.record_fused("fused_flex_attention", [query, key, value, *plan.mask_tensors],
                          (lse, mx, out))
    return out, lse, mx


def _split(size, block: int):
    """``min(block, size)`` as the C++ template computes its split size (a guard on the size
    where a real block is smaller than it can be; the no-op block of 2**30 is larger than any
    sequence)."""
    if block >= _LARGE_BLOCK:
        return size
    return min(block, size)


def cpu_scratch_bytes(query, key, value, q_block: int, kv_block: int, threads: int) -> list:
    """Bytes of each work buffer the C++ FlexAttention template allocates
    (``FLEX_ATTENTION_TEMPLATE`` in torch/_inductor/codegen/cpp_flex_attention_template.py,
    without AMX packing), in allocation order.

    >>> q = torch.empty(2, 4, 64, 8)
    >>> cpu_scratch_bytes(q, q, q, 1 << 30, 1 << 30, threads=2)
    [37888, 32768, 16384, 16384, 4096, 4096]
    """
    qs, kvs = _split(query.shape[2], q_block), _split(key.shape[2], kv_block)
    d, dv, isz = query.shape[3], value.shape[3], query.element_size()
    bk, hk, skv = key.shape[0], key.shape[1], key.shape[2]
    return [threads * (qs * kvs + 2 * qs + qs * dv) * 4,  # buf_data (accum_t)
            threads * qs * kvs * isz,                      # buf_reduced_data
            bk * hk * d * skv * isz,                        # key_reorder_ptr
            bk * hk * skv * dv * isz,                       # value_reorder_ptr
            threads * kvs * d * isz,                        # transpose_buffer_ptr
            threads * qs * d * isz]                         # query_padding_ptr


def _cpu_forward(plan: _Plan, query, key, value):
    """The C++ template's buffers: ``(out, None, None)``, its work buffers freed after it."""
    from torch._inductor.utils import parallel_num_threads

    rec = plan.rec
    with rec.paused():
        q, k, v = (t.contiguous() if t.stride()[-1] != 1 else t for t in (query, key, value))
        copies = [c for c, t in zip((q, k, v), (query, key, value)) if c is not t]
        out = _dense(q, (*q.shape[:3], v.shape[-1]), q.dtype)
        scratch = [torch.empty(n, dtype=torch.uint8, device=q.device) for n in cpu_scratch_bytes(
            q, k, v, *plan.blocks, parallel_num_threads())]
    rec.record_fused("fused_flex_attention", [query, key, value, *plan.mask_tensors],
                     (*copies, out, *scratch))
    return out, None, None


class _Fused(torch.autograd.Function):
    """FlexAttention as one fused kernel each way (see the module docstring). ``ctx`` keeps no
    tensor but the saved ones, which autograd releases once backward has run."""

    @staticmethod
    def forward(ctx, plan: _Plan, query, key, value):
        forward = _cuda_forward if plan.device == "cuda" else _cpu_forward
        out, lse, mx = forward(plan, query, key, value)
        ctx.rec, ctx.masks = plan.rec, len(plan.mask_tensors)
        ctx._materialize_non_diff_grads = False  # as AOTAutograd's CompiledFunction
        if plan.training:
            ctx.save_for_backward(query, key, value, out, lse, *plan.mask_tensors,
                                  *plan.captured)
        if plan.max_out:
            ctx.mark_non_differentiable(mx)
        return out, lse if plan.lse_out else None, mx if plan.max_out else None

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_max):
        saved = ctx.saved_tensors
        query, key, value, out, lse = saved[:5]
        if grad_out.stride() != out.stride():  # AOTAutograd restrides the tangent (static shapes)
            grad_out = torch.empty_strided(out.shape, out.stride(), dtype=grad_out.dtype,
                                           device=grad_out.device).copy_(grad_out)
        b, hq, sq, _ = query.shape
        bkv, hkv, skv = key.shape[:3]
        with ctx.rec.paused():
            stats = [query.new_empty((b, hq, sq), dtype=torch.float32)  # delta
                     for _ in range(1 if grad_lse is None else 2)]      # grad_lse_exp2
            gq = _dense(query, query.shape, query.dtype)
            gv = _dense(value, (b, hkv, skv, value.shape[-1]), value.dtype)
            gk = _dense(key, (b, hkv, skv, key.shape[-1]), key.dtype)
        reads = [query, key, value, out, lse, grad_out, *saved[5:5 + ctx.masks]]
        ctx.rec.record_fused("fused_flex_attention_backward",
                             reads + ([grad_lse] if grad_lse is not None else []),
                             (*stats, gq, gv, gk))
        del stats, saved, query, key, value, out, lse
        if bkv != b:  # key and value broadcast over the batch: their gradients summed to it
            gk, gv = gk.sum(0, keepdim=True), gv.sum(0, keepdim=True)
        return None, gq, gk, gv


def _decoding(query, key, block_mask, options: dict) -> bool:
    """Whether a static-shape compile on CUDA runs FlexDecoding (``_use_flex_decoding`` in
    torch/_inductor/kernel/flex/flex_decoding.py) for this call: the query length is fixed
    below 128 and the heads allow it."""
    sq, hq, hkv = query.shape[2], query.shape[1], key.shape[1]
    if (options.get("BACKEND", "AUTO") != "AUTO" or options.get("FORCE_USE_FLEX_ATTENTION")
            or options.get("OUTPUT_MAX") or not isinstance(sq, int) or sq >= 128
            or not isinstance(hq, int)):
        return False
    heads = block_mask[3].shape[1]  # kv_indices
    ratio = hq // hkv
    return (heads == 1 or (hq == hkv and heads == hq)) and ratio > 0 and ratio & (ratio - 1) == 0


def compiled_flex_attention(device: str, hop, query, key, value, score_mod, block_mask, scale,
                            kernel_options, score_mod_other_buffers=(),
                            mask_mod_other_buffers=()):
    """The FlexAttention higher-order op as Inductor's fused kernel runs it on ``device``:
    ``(out, logsumexp, max_scores)`` (the statistics None where the call does not return
    them). Without a memsim recorder, ``hop`` runs as it is."""
    from .recorder import current

    rec = current()
    if rec is None or rec._paused:  # not memsim's run (or a compiler tracing: --compiled)
        return hop(query, key, value, score_mod, block_mask, scale, kernel_options,
                   score_mod_other_buffers, mask_mod_other_buffers)
    options = dict(kernel_options)
    if torch.is_autocast_enabled("cpu"):  # the op's autocast rule: q, k, v cast first
        from torch.amp.autocast_mode import _cast
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (_cast(t, "cpu", low) for t in (query, key, value))
    captured = ()
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if device == "cuda":
        _check_cuda(rec, query, key, value, block_mask, options)
        if torch.is_grad_enabled():
            captured = tuple(captured_tensors(score_mod, query, rec))
            if any(t.requires_grad for t in captured):
                raise _error(
                    "score_mod reads a tensor that requires grad; the gradient Inductor's "
                    "FlexAttention kernel computes for it (float32 buffers filled by "
                    "zeros_and_scatter) is not modelled", rec,
                    "detach the tensor if it is not trained, or analyse with uncompiled "
                    "flex_attention (the unfused implementation, an upper bound)")
        if training and not query.dtype == key.dtype == value.dtype:
            raise _error("Inductor's FlexAttention backward refuses mixed query, key and value "
                         f"dtypes ({query.dtype}, {key.dtype}, {value.dtype}), as PyTorch does",
                         rec, "cast them to one dtype")
    else:
        _check_cpu(rec, query, key, value, options)
    plan = _Plan(device, rec, tuple(t for t in block_mask if isinstance(t, torch.Tensor)),
                 (block_mask[-3], block_mask[-2]), captured, training,
                 lse_out=device == "cuda" and _lse_requested(options),
                 max_out=bool(options.get("OUTPUT_MAX")))
    return _Fused.apply(plan, query, key, value)


def _lse_requested(options: dict) -> bool:
    """Whether the caller returns the log-sum-exp (``return_lse``, ``AuxRequest(lse=True)``):
    read from the calling ``flex_attention`` frame, since ``OUTPUT_LOGSUMEXP`` is set whenever
    grad is enabled. Called directly, the op returns it where ``OUTPUT_LOGSUMEXP`` says."""
    import torch.nn.attention.flex_attention as fa

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is fa.flex_attention.__code__:
            aux = frame.f_locals.get("return_aux")
            return bool(frame.f_locals.get("return_lse")) or bool(aux is not None and aux.lse)
        frame = frame.f_back
    return bool(options.get("OUTPUT_LOGSUMEXP"))


def _check_cuda(rec, query, key, value, block_mask, options: dict) -> None:
    """What Inductor's CUDA lowering refuses, and what it runs that is not modelled."""
    backend = options.get("BACKEND", "AUTO")
    if backend in ("FLASH", "TRITON_DECODE"):
        raise _error(f"FlexAttention's BACKEND={backend!r} kernels are not modelled", rec,
                     "use BACKEND='TRITON' or 'AUTO' (Inductor's Triton template, modelled)")
    dqk, dv = query.shape[-1], value.shape[-1]
    if dqk < 16 or dv < 16:
        raise _error("Inductor's FlexAttention kernel needs a head dimension of at least 16 on "
                     f"CUDA (got {dqk} and {dv}); a compiled run fails the same way "
                     "(NotImplementedError in torch/_inductor/kernel/flex/flex_attention.py)",
                     rec, "use a head dimension of 16 or more, or uncompiled flex_attention")
    if _decoding(query, key, block_mask, options):
        raise _error(
            f"a query length fixed at {query.shape[2]} (below 128) runs Inductor's FlexDecoding "
            "kernel on CUDA, whose split-KV buffers depend on the GPU's SM count: not modelled",
            rec, "give the sequence length a symbol (the main kernel, as a dynamic-shape compile "
                 "runs it), or pass kernel_options={'BACKEND': 'TRITON'}")


def _check_cpu(rec, query, key, value, options: dict) -> None:
    """What Inductor's CPU lowering refuses (``lower_cpu``; it ignores ``BACKEND``), and its
    decoding template."""
    if options.get("OUTPUT_LOGSUMEXP"):
        raise _error("torch.compile on CPU only supports FlexAttention inference without the "
                     "log-sum-exp (NotImplementedError in torch/_inductor/kernel/flex/"
                     "flex_cpu.py); a compiled run fails the same way", rec,
                     "do not request return_lse / AuxRequest(lse=True) on CPU")
    if not query.dtype == key.dtype == value.dtype or query.dtype not in (
            torch.float32, torch.bfloat16, torch.float16):
        raise _error(f"Inductor's CPU FlexAttention takes one dtype of float32, bfloat16 or "
                     f"float16 (got {query.dtype}, {key.dtype}, {value.dtype})", rec,
                     "cast query, key and value to one of them")
    if isinstance(query.shape[2], int) and query.shape[2] == 1:
        raise _error("a query of length 1 may run Inductor's CPU FlexDecoding template "
                     "(static shapes, a long KV sequence; choose_flex_template in torch/_inductor/"
                     "codegen/cpp_flex_attention_template.py): not modelled", rec,
                     "give the query length a symbol")
