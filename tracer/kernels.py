"""The built-in memory rules (see :mod:`memsim.tracer.rules`)."""

from __future__ import annotations

import torch

from . import known
from .errors import DataDependentError
from .records import Phase
from .rules import Kind, rule
from .sources import calling_frame

aten = torch.ops.aten


def _from_grad_scaler() -> bool:
    """True when the innermost torch.amp / torch.optim frame calling is the GradScaler's."""
    f = calling_frame(lambda name: "/torch/amp/" in name or "/torch/optim/" in name)
    return f is not None and f.f_code.co_filename.endswith("grad_scaler.py")


@rule(Kind.ATEN, aten._local_scalar_dense.default,
               doc="a value known in the run (tracer/known.py: a mask of ones, a healthy "
                   "step's finite check); optimizer step counters read with .item(): value 1; "
                   "GradScaler's found_inf: 0 (no overflow, the step runs); memory never "
                   "depends on them")
def _local_scalar(recorder, func, args, kwargs):
    """``.item()``: allowed only in the optimizer, where it reads the step count (or the
    GradScaler's overflow flag: the steady-state step has none). A :class:`memsim.tracer.Driver`
    may answer first (DeepSpeed's overflow checks read 0)."""
    hook = getattr(recorder, "scalar_hook", None)
    if hook is not None:
        value = hook(args[0])
        if value is not None:
            return value
    v = known.read(args[0])
    if v is not None:   # every element known (tracer/known.py): a mask of ones, a finite check
        t = args[0]
        return bool(v) if t.dtype == torch.bool else (float(v) if t.is_floating_point() else v)
    if recorder.phase is Phase.OPTIMIZER or recorder.phase is Phase.SETUP:
        t = args[0]
        if _from_grad_scaler():
            return 0.0 if t.is_floating_point() else 0
        return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
    if args[0].dtype == torch.bool and _asserted():
        return True
    from .data_dependent import decide, routed_tokens, site_here
    tokens = routed_tokens(args[0])
    if tokens is not None:
        return tokens
    v = decide(args[0])
    if v is not None:
        t = args[0]
        return bool(v) if t.dtype == torch.bool else (float(v) if t.is_floating_point()
                                                      else int(v))
    here = site_here()
    raise DataDependentError(
        "the model reads a tensor value with .item() / int() / float(), which a symbolic run "
        "does not have", module=recorder.module, op=str(func),
        hint=(f"give the value it takes: --assume {here[0]}=VALUE (Python "
              f"assume={{'{here[0]}': VALUE}})" if here else
              "move the read out of forward, or give that value as a constant"))


def _asserted() -> bool:
    """Whether the model's line reading a boolean is an ``assert`` (ProphetNet: ``assert
    torch.all(shifted_input_ids >= 0).item()``): it holds in any run that goes on past it,
    and the run records that it took it to hold."""
    from .sources import model_frame, model_line
    fr = model_frame()
    code = (fr.line or "").lstrip() if fr is not None else ""
    if not code.startswith("assert ") and not code.startswith("assert("):
        return False
    known.assume(f"assumed: the model's assertion on tensor values{model_line()} holds, as in "
                 "any run that goes past it")
    return True


@rule(Kind.ATEN, aten.constant_pad_nd.default,
               doc="F.pad: its C++ kernel reads concrete sizes and would pin symbols; the same "
                   "output, computed symbolically: where no pad is positive, a clone of the "
                   "input (narrowed by negative pads) with its strides, as ATen returns it; "
                   "else one new tensor of the padded shape. Each symbolic pad is guarded "
                   "(Qwen3-Next pads S to 64-token chunks: S % 64 == 0 takes the clone, and a "
                   "transposed input stays transposed), in the input's suggested memory format "
                   "(channels-last-like inputs give channels-last outputs)")
def _constant_pad(recorder, func, args, kwargs):
    """``constant_pad_nd(x, pad, value)``, with ATen's ``all_pads_non_positive`` branch: a
    ``clone`` (strides preserved) of the input narrowed by the negative pads, or one output
    storage of the padded shape."""
    x, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    n = x.dim()
    c, positive = x, False
    for i in range(n - len(pad) // 2, n):
        at = 2 * (n - i - 1)
        if pad[at] < 0:
            c = c.narrow(i, -pad[at], c.shape[i] + pad[at])
        elif pad[at] != 0:
            positive = True
        if pad[at + 1] < 0:
            c = c.narrow(i, 0, c.shape[i] + pad[at + 1])
        elif pad[at + 1] != 0:
            positive = True
    if not positive:
        return c.clone()
    shape = list(x.shape)
    src = [slice(None)] * x.dim()
    dst = [slice(None)] * x.dim()
    for i in range(len(pad) // 2):
        d = x.dim() - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        shape[d] = shape[d] + lo + hi
        src[d] = slice(max(-lo, 0), x.shape[d] - max(-hi, 0))
        dst[d] = slice(max(lo, 0), shape[d] - max(hi, 0))
    # ATen allocates the output in the input's suggested memory format: a channels-last-like
    # input (a Mamba-2 scan pads a transposed (B, S, heads, dim) tensor) gives a
    # channels-last output, whose strides decide whether later reshapes view or copy
    from torch._prims_common import suggest_memory_format
    out = torch.empty(shape, dtype=x.dtype, device=x.device,
                      memory_format=suggest_memory_format(x))
    out.fill_(value if value is not None else 0)
    out[tuple(dst)] = x[tuple(src)]
    return out


@rule(Kind.ATEN, aten.pad.default,
               doc="F.pad reaching the recorder whole (DTensor pads uneven shards inside its "
                   "own dispatch): constant mode as constant_pad_nd")
def _pad(recorder, func, args, kwargs):
    """``pad(x, pad, mode, value)``: constant mode is one ``constant_pad_nd`` allocation."""
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    if mode != "constant":
        return func(*args, **kwargs)
    value = args[3] if len(args) > 3 else kwargs.get("value")
    return _constant_pad(recorder, aten.constant_pad_nd.default,
                         (args[0], list(args[1]), 0 if value is None else value), {})


def _expr(x):
    node = getattr(x, "node", None)
    return node.expr if node is not None else x


def _covers(start, end, step, size) -> bool:
    """True when ``[start:end:step]`` provably keeps all of a dimension of ``size``."""
    import sympy
    s, e, st, n = (_expr(v) for v in (start, end, step, size))
    if s is not None and sympy.sympify(s) != 0 or st is not None and sympy.sympify(st) != 1:
        return False
    if e is None or (isinstance(e, int) and e >= 2 ** 62):
        return True
    diff = sympy.simplify(sympy.sympify(e) - sympy.sympify(n))
    return diff.is_nonnegative is True


@rule(Kind.ATEN, aten.slice_backward.default,
               doc="a slice that keeps the whole dimension (x[:, 0:] with a symbolic size) is "
                   "an alias in a real run, whose backward allocates nothing")
def _slice_backward(recorder, func, args, kwargs):
    """With concrete sizes Python clamps ``x[:, 0:]`` to the size and returns an alias; with
    symbolic sizes it dispatches ``slice``, whose backward would allocate a zero-filled copy."""
    names = ("grad_output", "input_sizes", "dim", "start", "end", "step")
    a = dict(zip(names, args), **kwargs)
    grad, sizes, dim = a["grad_output"], list(a["input_sizes"]), a["dim"]
    dim = dim % len(sizes) if sizes else dim
    if (len(grad.shape) == len(sizes)
            and all(_expr(g) == _expr(s) for g, s in zip(grad.shape, sizes))
            and _covers(a["start"], a["end"], a["step"], sizes[dim])):
        return aten.alias.default(grad)
    return func(*args, **kwargs)


@rule(Kind.ATEN, aten.native_layer_norm.default,
               doc="bf16/fp16 input: mean and rstd are fp32 on CUDA (layer_norm_cuda allocates "
                   "them in the accumulate type) and on CPU with an fp32 weight (autocast); "
                   "the fake kernel makes them the input dtype")
def _layer_norm(recorder, func, args, kwargs):
    """``native_layer_norm(x, shape, w, b, eps)``: fp32 statistics where the kernel keeps them."""
    x = args[0]
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    low = x.dtype in (torch.bfloat16, torch.float16)
    mixed = w is not None and w.dtype == torch.float32
    if not (low and (mixed or recorder.device == "cuda")):
        return func(*args, **kwargs)
    n = len(args[1])
    stat = list(x.shape[: x.dim() - n]) + [1] * n
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(stat, dtype=torch.float32, device=x.device)
    rstd = torch.empty(stat, dtype=torch.float32, device=x.device)
    return out, mean, rstd


@rule(Kind.ATEN, aten.native_batch_norm.default,
               doc="CPU: the output is allocated in the input's suggested memory format "
                   "(contiguous unless channels-last), where the fake kernel keeps the input's "
                   "strides (a transposed input: PatchTST's BatchNorm over (B, d, patches)); "
                   "bf16/fp16 input with fp32 weight (autocast), training: save_mean and "
                   "save_invstd are fp32 in the real kernel; the fake kernel makes them the "
                   "input dtype")
def _batch_norm(recorder, func, args, kwargs):
    """``native_batch_norm(x, w, b, running_mean, running_var, training, momentum, eps)``."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training")
    a = dict(zip(names, args), **kwargs)
    x, w = a["input"], a.get("weight")
    if a.get("training") and x.dtype in (torch.bfloat16, torch.float16) and w is not None \
            and w.dtype == torch.float32:
        c = x.shape[1]
        out = torch.empty_like(x)
        mean = torch.empty((c,), dtype=torch.float32, device=x.device)
        invstd = torch.empty((c,), dtype=torch.float32, device=x.device)
    else:
        out, mean, invstd = func(*args, **kwargs)
    return _cpu_layout(recorder, out, x), mean, invstd


@rule(Kind.ATEN, aten.native_batch_norm_backward.default,
               doc="a gradient the output mask leaves out is not allocated (the fake kernel "
                   "allocates the input's gradient whatever the mask: BatchNorm over an input "
                   "that needs no gradient); CPU: the input's gradient is allocated in the "
                   "input's suggested memory format, where the fake kernel keeps its strides")
def _batch_norm_backward(recorder, func, args, kwargs):
    """``native_batch_norm_backward(grad_out, x, w, running_mean, running_var, save_mean,
    save_invstd, train, eps, output_mask)`` as the real kernels allocate it."""
    outs = func(*args, **kwargs)
    mask = args[9] if len(args) > 9 else kwargs.get("output_mask", (True, True, True))
    outs = [t if m else None for t, m in zip(outs, mask)]
    x = args[1] if len(args) > 1 else kwargs["input"]
    outs[0] = _cpu_layout(recorder, outs[0], x)
    return tuple(outs)


def _cpu_layout(recorder, out, x):
    """``out`` as the CPU batch- and group-norm kernels allocate it (``empty_like(x,
    x.suggest_memory_format())``)."""
    if recorder.device != "cpu":
        return out
    return _in_format(out, _memory_format(x))


def _in_format(out, fmt):
    """``out``, or a fresh tensor like it laid out in memory format ``fmt`` where ``out`` is
    not (same bytes: what differs is the layout, and with it whether later ops copy)."""
    if not isinstance(out, torch.Tensor) or out.is_contiguous(memory_format=fmt):
        return out
    return torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=fmt)


# losses whose kernel computes the elementwise loss into the output, then reduces it into the
# same tensor resized to 0-dim (structured mse_loss / smooth_l1_loss; binary_cross_entropy and
# soft_margin_loss ``resize_`` their output): the scalar keeps the elementwise storage
_REDUCED_LOSSES = {aten.mse_loss.default: 2, aten.smooth_l1_loss.default: 2,
                   aten.binary_cross_entropy.default: 3, aten.soft_margin_loss.default: 2}


def _reduced_loss(recorder, func, args, kwargs):
    """``loss(input, target, ..., reduction)``: under a mean or sum reduction the 0-dim result
    holds a storage of the broadcast inputs' size (a real CPU run: F.mse_loss of a (5, 7)
    prediction returns a scalar over 140 bytes); the fake kernel allocates 4."""
    out = func(*args, **kwargs)
    at = _REDUCED_LOSSES[func]
    reduction = args[at] if len(args) > at else kwargs.get("reduction", 1)
    if reduction == 0 or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    buf = torch.empty(shape, dtype=out.dtype, device=out.device)
    return buf.as_strided((), ())


for _op in _REDUCED_LOSSES:
    rule(Kind.ATEN, _op,
         doc="mean or sum reduction: the 0-dim loss keeps the elementwise loss's storage (the "
             "kernel reduces into its output resized to a scalar); the fake kernel allocates "
             "a fresh scalar")(_reduced_loss)


def _contiguous_first(recorder, func, args, kwargs):
    """An op whose kernel allocates its first output contiguous (layer norm's backward makes
    the input's gradient ``empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``; log-softmax's
    structured backward sets it without strides), where the fake kernel keeps the strides of a
    transposed gradient (Swin's final norm gets one): same bytes, but later views copy or
    not."""
    out = func(*args, **kwargs)
    if isinstance(out, tuple):
        return (_in_format(out[0], torch.contiguous_format), *out[1:])
    return _in_format(out, torch.contiguous_format)


for _op in (aten.native_layer_norm_backward.default, aten._log_softmax_backward_data.default):
    rule(Kind.ATEN, _op, doc="the input's gradient is contiguous whatever the incoming "
                             "gradient's layout; the fake kernel keeps its strides"
         )(_contiguous_first)
# the regression losses' backward: ``zeros_like(input, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`` (a
# real CPU run of PatchTST's head copies it where the fake layout would not)
for _op in (aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default,
            aten.huber_loss_backward.default):
    rule(Kind.ATEN, _op, doc="the input's gradient is contiguous whatever the input's layout; "
                             "the fake kernel keeps the input's strides")(_contiguous_first)


@rule(Kind.ATEN, aten.native_group_norm.default, device="cpu",
      doc="bf16/fp16 input with an fp32 weight or bias (autocast keeps GroupNorm's "
          "parameters fp32): mean and rstd are fp32 (the kernel keeps them in the "
          "parameters' type); the fake kernel makes them the input dtype")
def _group_norm(recorder, func, args, kwargs):
    """``native_group_norm(x, w, b, N, C, HxW, group, eps)`` on the CPU: its statistics in
    ``param_scalar_type(X, is_mixed_type(X, w, b))``."""
    out, mean, rstd = func(*args, **kwargs)
    a = dict(zip(("input", "weight", "bias"), args), **kwargs)
    if a["input"].dtype in (torch.bfloat16, torch.float16) and any(
            p is not None and p.dtype == torch.float32 for p in (a.get("weight"), a.get("bias"))):
        mean = torch.empty(mean.shape, dtype=torch.float32, device=mean.device)
        rstd = torch.empty(rstd.shape, dtype=torch.float32, device=rstd.device)
    return out, mean, rstd


@rule(Kind.ATEN, aten.native_group_norm_backward.default, device="cpu",
      doc="the input's gradient is allocated in the input's dtype and suggested memory "
          "format; the fake kernel (a decomposition computing in fp32) makes it the dtype "
          "that input, statistics and fp32 weight promote to (fp32 under autocast, which "
          "autograd then copies to bf16) and follows the incoming gradient's layout")
def _group_norm_backward(recorder, func, args, kwargs):
    """``native_group_norm_backward(grad_out, x, ...)`` on the CPU: ``empty_like(X,
    X.suggest_memory_format())``."""
    grad_in, *rest = func(*args, **kwargs)
    x = args[1] if len(args) > 1 else kwargs["input"]
    if grad_in is not None and grad_in.dtype != x.dtype:
        grad_in = torch.empty(grad_in.shape, dtype=x.dtype, device=grad_in.device)
    return (_cpu_layout(recorder, grad_in, x), *rest)


def _functional(name: str):
    ns = getattr(torch.ops, "_c10d_functional", None)
    try:
        return getattr(ns, name).default
    except (AttributeError, RuntimeError):
        return None


if _functional("wait_tensor") is not None:
    @rule(Kind.ATEN, _functional("wait_tensor"),
                   doc="_c10d_functional.wait_tensor returns its input (the real kernel waits "
                       "and aliases it; the fake kernel allocates a copy)")
    def _wait_tensor(recorder, func, args, kwargs):
        """Waiting on a collective's result allocates nothing: the output is the input."""
        func(*args, **kwargs)
        return args[0]


# -- resizing (F.interpolate): PyTorch's meta kernels for these take concrete sizes only -------
def _memory_format(x):
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
            and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) \
            and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def _upsample(recorder, func, args, kwargs):
    """``upsample_*(input, output_size, ...)``: one output of (N, C, *output_size), in the
    input's memory format."""
    x, size = args[0], list(args[1] if len(args) > 1 else kwargs["output_size"])
    return torch.empty([*x.shape[:2], *size], dtype=x.dtype, device=x.device,
                       memory_format=_memory_format(x))


def _upsample_backward(recorder, func, args, kwargs):
    """``upsample_*_backward(grad_output, output_size, input_size, ...)``: one gradient of
    ``input_size``."""
    grad = args[0]
    size = list(args[2] if len(args) > 2 else kwargs["input_size"])
    return torch.empty(size, dtype=grad.dtype, device=grad.device,
                       memory_format=_memory_format(grad))


for _name in ("upsample_nearest1d", "upsample_nearest3d", "_upsample_nearest_exact1d",
              "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
              "upsample_bicubic2d", "upsample_trilinear3d"):
    rule(Kind.ATEN, getattr(aten, _name).default,
         doc=f"{_name}: its meta kernel takes concrete sizes only; one output of the size asked "
             "for")(_upsample)
    rule(Kind.ATEN, getattr(aten, _name + "_backward").default,
         doc=f"{_name}_backward: its meta kernel takes concrete sizes only; one input-sized "
             "gradient")(_upsample_backward)


# -- batched matmul added to a broadcast input -----------------------------------------------
@rule(Kind.ATEN, aten.baddbmm.default,
      doc="baddbmm with a broadcast input (BLOOM's ALiBi bias, (B*H, 1, S) + Q @ K^T): the meta "
          "kernel expands it with a non-symbolic call and fails on symbolic sizes; the CPU and "
          "CUDA kernels allocate one output of (batch, rows, cols) and copy the input into it")
def _baddbmm(recorder, func, args, kwargs):
    """``baddbmm(input, batch1, batch2, *, beta, alpha)``: one contiguous output of
    ``(batch1.size(0), batch1.size(1), batch2.size(2))`` (ATen's structured kernel); ``input``
    only broadcasts into it."""
    x, b1, b2 = args[:3]
    torch._check(b1.dim() == 3 and b2.dim() == 3, lambda: "batch1 and batch2 must be 3D tensors")
    torch._check(x.dtype == b1.dtype == b2.dtype, lambda: (
        f"Input dtypes must be the same, got: input: {x.dtype}, batch1: {b1.dtype}, "
        f"batch2: {b2.dtype}"))
    size = (b1.shape[0], b1.shape[1], b2.shape[2])
    torch._check(b2.shape[0] == size[0] and b2.shape[1] == b1.shape[2], lambda: (
        f"Expected size for first two dimensions of batch2 tensor to be: "
        f"[{size[0]}, {b1.shape[2]}] but got: [{b2.shape[0]}, {b2.shape[1]}]."))
    torch.broadcast_shapes(tuple(x.shape), size)   # input must broadcast (the kernel's expand)
    return torch.empty(size, dtype=b2.dtype, device=b2.device)


@rule(Kind.ATEN, aten.polar.default,
      doc="torch.polar (DeepSeek-V2's rotary frequencies): its decomposition writes the real and "
          "imaginary parts through complex views whose stride checks pin symbolic sizes; the CPU "
          "and CUDA kernels allocate one complex output of the broadcast shape")
def _polar(recorder, func, args, kwargs):
    """``polar(abs, angle)``: one complex output (TensorIterator) of the inputs' broadcast
    shape."""
    a, angle = args[0], args[1] if len(args) > 1 else kwargs["angle"]
    torch._check(a.dtype == angle.dtype and a.dtype in (torch.float32, torch.float64,
                                                        torch.float16), lambda: (
        f"Expected both inputs to be Half, Float or Double tensors but got {a.dtype} and "
        f"{angle.dtype}"))
    size = torch.broadcast_shapes(tuple(a.shape), tuple(angle.shape))
    complex_of = {torch.float32: torch.complex64, torch.float64: torch.complex128,
                  torch.float16: torch.complex32}
    return torch.empty(size, dtype=complex_of[a.dtype], device=a.device)


@rule(Kind.ATEN, aten.linalg_solve_triangular.default,
      doc="torch.linalg.solve_triangular (Qwen3-Next's gated delta rule): its meta kernel "
          "broadcasts the batch with a non-symbolic expand and fails on symbolic sizes; the "
          "CPU and CUDA kernels allocate one column-major output of B's broadcast shape")
def _solve_triangular(recorder, func, args, kwargs):
    """``linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False)``: ATen makes
    ``out`` from ``A``'s options, resized to ``B``'s broadcast shape, column-major in the last
    two dimensions (the LAPACK/cuBLAS layout); row-major only when ``A`` is a conjugated
    transposed contiguous matrix (the kernel then solves in place of a copy)."""
    a, b = args[0], args[1]
    left = kwargs.get("left", args[3] if len(args) > 3 else True)
    torch._check(a.dim() >= 2 and b.dim() >= 2, lambda: (
        "linalg.solve_triangular: The input tensor A must have at least 2 dimensions."))
    torch._check(a.shape[-1] == a.shape[-2], lambda: (
        "linalg.solve_triangular: A must be batches of square matrices, but they are "
        f"{a.shape[-2]} by {a.shape[-1]} matrices"))
    torch._check(a.dtype == b.dtype, lambda: (
        f"linalg.solve_triangular: Expected A and B to have the same dtype, but found A of "
        f"type {a.dtype} and B of type {b.dtype} instead"))
    k = b.shape[-2] if left else b.shape[-1]
    torch._check(a.shape[-1] == k, lambda: (
        "linalg.solve_triangular: Incompatible shapes of A and B for the equation "
        f"{'AX = B' if left else 'XA = B'} ({a.shape[-2]}x{a.shape[-1]} and "
        f"{b.shape[-2]}x{b.shape[-1]})"))
    batch = tuple(torch.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])))
    m, n = b.shape[-2], b.shape[-1]
    if a.is_conj() and a.transpose(-2, -1).is_contiguous():
        return torch.empty(batch + (m, n), dtype=a.dtype, device=a.device)
    return torch.empty(batch + (n, m), dtype=a.dtype, device=a.device).transpose(-2, -1)


@rule(Kind.ATEN, aten.masked_scatter.default,
      doc="masked_scatter (a vision-language model puts its image features at its image "
          "tokens): the meta kernel expands with a non-symbolic call; ATen clones the input, "
          "broadcast with the mask, contiguous, and scatters into it")
def _masked_scatter(recorder, func, args, kwargs):
    """``masked_scatter(self, mask, source)``: one contiguous output of the broadcast shape."""
    x, mask, source = args[:3]
    torch._check(mask.dtype == torch.bool, lambda: (
        f"masked_scatter_ only supports boolean masks, but got mask with dtype {mask.dtype}"))
    torch._check(x.dtype == source.dtype, lambda: (
        "masked_scatter: expected self and source to have same dtypes but got "
        f"{x.dtype} and {source.dtype}"))
    shape = tuple(torch.broadcast_shapes(tuple(x.shape), tuple(mask.shape)))
    return torch.empty(shape, dtype=x.dtype, device=x.device)


# -- grouped GEMM (MoE experts) --------------------------------------------------------------
def _grouped_strides(name, m):
    """The kernels' own stride check: one of the last two dimensions contiguous, the other's
    stride a multiple of 16 bytes (else the real run fails, so the trace must)."""
    st, sz, align = m.stride(), m.shape, 16 // m.element_size()
    if st[-2] == 1 and st[-1] >= max(1, sz[-2]):
        lead = st[-1]
    elif st[-1] == 1 and st[-2] >= max(1, sz[-1]):
        lead = st[-2]
    else:
        raise RuntimeError(f"grouped_mm: invalid strides {tuple(st)} for sizes {tuple(sz)} "
                           f"of {name}")
    torch._check(lead % align == 0, lambda: f"grouped_mm: {name}'s strides should be a "
                 f"multiple of 16 bytes, got {lead} elements of {m.element_size()} bytes")


@rule(Kind.ATEN, aten._grouped_mm.default,
      doc="MoE experts (torch._grouped_mm / F.grouped_mm): the meta kernel accepts bf16 only, "
          "the CPU and CUDA kernels also fp32 and fp16; every kernel pads the output's last "
          "dimension to 16 bytes (create_grouped_gemm_output_tensor), the meta kernel of a "
          "CPU build does not")
def _grouped_mm(recorder, func, args, kwargs):
    """``_grouped_mm(mat_a, mat_b, offs, bias, out_dtype)``: one output, its rows padded to a
    multiple of 16 bytes as ATen's ``create_grouped_gemm_output_tensor`` allocates it."""
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    a = dict(zip(names, args), **kwargs)
    x, w, offs = a["mat_a"], a["mat_b"], a.get("offs")
    dtype = a.get("out_dtype") or x.dtype
    torch._check(dtype == x.dtype, lambda: "grouped_mm: the output dtype must match mat_a's")
    for name, m in (("mat_a", x), ("mat_b", w)):
        _grouped_strides(name, m)
    if x.dim() == 2 and w.dim() == 2:
        size = [offs.shape[0], x.shape[0], w.shape[1]]
    elif x.dim() == 2:
        size = [x.shape[0], w.shape[-1]]
    elif w.dim() == 2:
        size = [x.shape[1], w.shape[1]]
    else:
        size = [x.shape[0], x.shape[1], w.shape[-1]]
    align = 16 // dtype.itemsize
    padded = (size[-1] + align - 1) // align * align
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=x.device)


@rule(Kind.ATEN, torch.ops.c10d._reduce_scatter_base_.default, device="cpu",
      doc="reduce_scatter_tensor on CPU (gloo): the backend allreduces a copy of the whole "
          "input and frees it when the collective completes (not added on CUDA: NCCL, not "
          "measured)")
def _gloo_reduce_scatter(recorder, func, args, kwargs):
    """``_reduce_scatter_base_(output, input, group, op, async_op, timeout)``: gloo has no
    reduce-scatter of one tensor. ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``
    (PyTorch 2.13) allreduces a copy of the whole input (``input.clone()``) and returns a
    work whose ``wait`` copies this rank's chunk into ``output``; the copy dies with the
    work. The fake process group makes no copy: it is a scratch storage of the input's size
    at this op, released there, as the synchronous calls of DeepSpeed and FSDP2 release it
    before they return (a real 2-rank run shows it first at the ``aten.split`` of that
    ``wait``, freed two ops later)."""
    out = func(*args, **kwargs)
    inp = args[1] if len(args) > 1 else kwargs["input"]
    recorder.scratch(torch.empty_like(inp, memory_format=torch.contiguous_format))
    return out
