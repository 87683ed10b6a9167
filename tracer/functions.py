"""Python-level functions a rule replaces for the modelled device (``function`` rules of
:mod:`memsim.tracer.rules`), and the rules that hold on every device.

A torch-function mode routes each function with a rule for the device (or for any device) to
it; the rule returns the output, or None to leave the call as it is. Device-specific kernel
choices live with their device (:mod:`memsim.tracer.cuda`); here:

- ``F.interpolate`` with ``scale_factor``: PyTorch computes the output size in C++ from concrete
  sizes (``upsample_*.vec``), which pins every symbol of the input to its example size. The
  rule computes ``floor(size * scale)`` symbolically and calls the kernel's ATen overload with
  that size and the same scales, as the ``.vec`` overload does: the same output and gradient
  storages (the backward saves nothing but sizes).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .config import CpuIsa
from .known import assume
from .rules import Kind, keys, lookup, rule

aten = torch.ops.aten
# the modelled CPU's instruction set, for the rules whose kernel choice depends on it (set by
# function_rules for the run)
_CPU_ISA: contextvars.ContextVar[CpuIsa] = contextvars.ContextVar("cpu_isa",
                                                                  default=CpuIsa.AVX512)


class FunctionRules(TorchFunctionMode):
    """Routes the functions with a ``function`` rule for ``device`` (or any device)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = str(device)
        self._keys = keys(Kind.FUNCTION, self.device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._keys:
            out = lookup(Kind.FUNCTION, func, self.device).value(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def function_rules(device: str, cpu_isa: CpuIsa = CpuIsa.AVX512):
    """Inside: functions with a rule for ``device`` run as the rule says (and FlexAttention as
    eager PyTorch runs it there: :func:`flex_attention_eager`); ``cpu_isa`` is the modelled
    CPU's instruction set where a CPU kernel depends on it."""
    from . import cuda, rnn_cuda  # noqa: F401  (register CUDA's kernel choices, cuDNN's RNNs)

    token = _CPU_ISA.set(CpuIsa(cpu_isa))
    try:
        with FunctionRules(device), flex_attention_eager(device):
            yield
    finally:
        _CPU_ISA.reset(token)


# (mode, spatial dims) -> the ATen overload upsample_*.vec calls, and whether it takes
# align_corners
_UPSAMPLE = {
    ("nearest", 1): (aten.upsample_nearest1d.default, False),
    ("nearest", 2): (aten.upsample_nearest2d.default, False),
    ("nearest", 3): (aten.upsample_nearest3d.default, False),
    ("nearest-exact", 1): (aten._upsample_nearest_exact1d.default, False),
    ("nearest-exact", 2): (aten._upsample_nearest_exact2d.default, False),
    ("nearest-exact", 3): (aten._upsample_nearest_exact3d.default, False),
    ("linear", 1): (aten.upsample_linear1d.default, True),
    ("bilinear", 2): (aten.upsample_bilinear2d.default, True),
    ("bicubic", 2): (aten.upsample_bicubic2d.default, True),
    ("trilinear", 3): (aten.upsample_trilinear3d.default, True),
}


def _scaled(size, scale: float):
    """``floor(size * scale)`` as the kernel computes it, kept symbolic: an integer scale
    multiplies, a fractional one is an exact fraction (``limit_denominator``) and a floor
    division."""
    f = Fraction(scale).limit_denominator(1 << 16)
    if isinstance(size, torch.SymInt) and size.node.expr.is_number:
        size = int(size)  # a constant: the kernels take plain ints where they can
    return size * f.numerator if f.denominator == 1 else (size * f.numerator) // f.denominator


@rule(Kind.FUNCTION, F.interpolate,
      doc="F.interpolate: by scale_factor, the output size floor(size * scale) computed "
          "symbolically (PyTorch's C++ reads concrete sizes and pins every symbol); by a "
          "symbolic size, that size (the composite's C++ takes concrete ones only); the same "
          "ATen kernel and storages")
def _interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None, antialias=False):
    """The ``upsample_*`` overload with a symbolic output size, or None (concrete sizes,
    ``recompute_scale_factor``, antialiasing or a mode without a plain kernel)."""
    dim = input.dim() - 2
    entry = _UPSAMPLE.get((mode, dim))
    if entry is None or recompute_scale_factor or antialias:
        return None
    if size is not None and scale_factor is None:
        out = list(size) if isinstance(size, (list, tuple, torch.Size)) else [size] * dim
        if len(out) != dim or not any(isinstance(s, torch.SymInt) for s in out):
            return None
        op, corners = entry
        return op(*((input, out) + ((bool(align_corners),) if corners else ())))
    if size is not None or scale_factor is None:
        return None
    scales = list(scale_factor) if isinstance(scale_factor, (list, tuple)) else [scale_factor] * dim
    if len(scales) != dim:
        return None
    out = [_scaled(input.shape[i + 2], float(s)) for i, s in enumerate(scales)]
    op, corners = entry
    args = (input, out) + ((bool(align_corners),) if corners else ()) + tuple(map(float, scales))
    return op(*args)


def _one_hot(checked: bool):
    def one_hot(tensor, num_classes=-1):
        """``F.one_hot`` as ATen's kernel runs it: ``zeros(..., C).scatter_(-1, idx[..., None],
        1)``, after (on the CPU) one ``aminmax`` of the indices to check their range; a fake
        tensor takes a comparison path instead (a boolean (..., C) tensor, then its copy)."""
        if type(num_classes) is not int or num_classes < 0:
            return None
        if checked and tensor.numel() != 0:
            torch.aminmax(tensor)   # its two values are read to check them, then dropped
        out = torch.zeros(tuple(tensor.shape) + (num_classes,), dtype=tensor.dtype,
                          device=tensor.device)
        return out.scatter_(-1, tensor.unsqueeze(-1), 1)
    return one_hot


rule(Kind.FUNCTION, F.one_hot, device="cpu",
     doc="F.one_hot: zeros and a scatter, after an aminmax of the indices (their range "
         "check), as the CPU kernel runs it (a fake tensor compares instead)")(_one_hot(True))
rule(Kind.FUNCTION, F.one_hot, device="cuda",
     doc="F.one_hot: zeros and a scatter (CUDA checks the range in the scatter), as the "
         "kernel runs it (a fake tensor compares instead)")(_one_hot(False))


@contextlib.contextmanager
def flex_attention_eager(device: str):
    """FlexAttention as PyTorch runs it on ``device``. Eagerly: the unfused implementation (the
    HOP's dense forward and backward, which materialize the (B, H, S, S) scores), called
    directly rather than through the ``torch.compile(backend="eager")`` wrapper eager mode
    uses (the same ops; no compile inside a trace). Fake tensors live on the CPU, where
    PyTorch refuses FlexAttention's backward (a real CPU run does too); for ``cuda`` the
    device check and the kernel options are the modelled device's. A call that ``torch.compile`` compiles with
    Inductor (``torch.compile(flex_attention)``, Hugging Face's wrapper) runs the fused
    kernel's buffers instead (:mod:`memsim.tracer.flex`)."""
    try:
        import torch.nn.attention.flex_attention as fa
    except ImportError:  # pragma: no cover - older torch
        yield
        return
    import types

    from . import flex

    check, debug = fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    call, empty_mask = fa.flex_attention_hop, fa._create_empty_block_mask
    options = fa._apply_kernel_options
    modelled = types.SimpleNamespace(device=torch.device(device))
    hop = sys.modules.get("torch._higher_order_ops.flex_attention")
    create = getattr(hop, "create_fw_bw_graph", None)

    def validate(query, key, value):
        if device == "cpu":
            check(query, key, value)

    def create_apart(*args, **kwargs):
        # Tracing score_mod into its forward and joint graphs is FlexAttention's compiler work,
        # not the run's: a real run traces on fake tensors of a FakeTensorMode of its own (meta
        # storages, no memory) and the graphs' node.meta["val"] keep those alive. Under
        # memsim's fake mode every tensor made there is fake and would be counted, and kept
        # for the whole step where a node holds it (scalar_tensor of where's -inf).
        from .recorder import current

        rec = current()
        with rec.paused() if rec is not None else contextlib.nullcontext():
            return create(*args, **kwargs)

    def apply_options(query, key, value, *args, **kwargs):
        # the kernel options of the modelled device (on CUDA the log-sum-exp is written with
        # grad enabled, and max scores can be returned): only the inputs' device is read
        return options(modelled, modelled, modelled, *args, **kwargs)

    def call_hop(*args, **kwargs):
        if flex.inductor_compiled():
            return flex.compiled_flex_attention(device, call, *args, **kwargs)
        return call(*args, **kwargs)

    def empty_block_mask(query, key):
        if flex.inductor_compiled():
            return flex.empty_block_mask(empty_mask, query, key)
        return empty_mask(query, key)

    fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = validate, True
    fa.flex_attention_hop, fa._create_empty_block_mask = call_hop, empty_block_mask
    fa._apply_kernel_options = apply_options
    if create is not None:
        hop.create_fw_bw_graph = create_apart
    try:
        with flex.dynamo_unmarked():
            yield
    finally:
        fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = check, debug
        fa.flex_attention_hop, fa._create_empty_block_mask = call, empty_mask
        fa._apply_kernel_options = options
        if create is not None:
            hop.create_fw_bw_graph = create


def rnn_layout(params, has_biases, num_layers: int, bidirectional: bool):
    """``(directions, weights per layer and direction)`` of ``_VF``'s flat weights, or None
    where they are not the plain layout (a projection: five per layer and direction)."""
    if not isinstance(has_biases, bool):  # a packed sequence: another overload
        return None
    dirs, per = (2 if bidirectional else 1), (4 if has_biases else 2)
    return (dirs, per) if len(params) == num_layers * dirs * per else None


def _mkldnn_lstm_used(input, hx, params) -> bool:
    """Whether PyTorch's CPU LSTM runs oneDNN (``use_mkldnn`` in aten's RNN.cpp) on the modelled
    CPU: oneDNN on, fp32 (or bf16 where the modelled CPU has AVX-512: ``cpu_isa``, never the
    host's) everywhere, no projection (two or four weights per layer and direction)."""
    dtypes = {input.dtype, *(h.dtype for h in hx), *(p.dtype for p in params)}
    isa = _CPU_ISA.get()
    ok = {torch.float32} | ({torch.bfloat16} if isa is CpuIsa.AVX512 else set())
    if torch.bfloat16 in dtypes:
        assume(f"modelled: a CPU {'with' if isa is CpuIsa.AVX512 else 'without'} AVX-512 "
               f"(cpu_isa={isa.value!r}): nn.LSTM in bf16 runs "
               + ("oneDNN's kernel" if isa is CpuIsa.AVX512 else "PyTorch's native kernel")
               + " there; "
               + ("'avx2' models a CPU without AVX-512" if isa is CpuIsa.AVX512
                  else "'avx512' models one with it"))
    return (torch._C._get_mkldnn_enabled() and torch.backends.mkldnn.is_available()
            and len(dtypes) == 1 and dtypes <= ok and hx[0].shape[-1] == hx[1].shape[-1])


@rule(Kind.FUNCTION, torch._VF.lstm, device="cpu",
      doc="nn.LSTM on CPU: PyTorch's C++ entry (lstm_mkldnn) reads concrete sizes; the same "
          "calls issued from Python (transpose, contiguous, one mkldnn_rnn_layer per layer and "
          "direction, cat, dropout, stack), so that B and S stay symbolic")
def _lstm_mkldnn(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                 batch_first):
    """``aten::lstm.input`` as its oneDNN path issues ATen ops, or None (a packed sequence, a
    projection: left to PyTorch). Where the modelled CPU does not run oneDNN (another dtype,
    bf16 on a CPU without AVX-512), PyTorch's native kernel with oneDNN off: its C++ entry
    would ask the host's CPU instead."""
    layout = rnn_layout(params, has_biases, num_layers, bidirectional)
    if layout is None or not isinstance(hx, (tuple, list)):
        return None
    if not _mkldnn_lstm_used(input, hx, params):
        with torch.backends.mkldnn.flags(enabled=False):
            return torch._VF.lstm(input, hx, params, has_biases, num_layers, dropout, train,
                                  bidirectional, batch_first)
    dirs, per = layout
    x = input.transpose(0, 1) if batch_first else input
    x = first = x.contiguous()  # a C++ local there: alive to the end of the call (``first``)
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden = h0.shape[2]
    hy, cy = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            i = layer * dirs + d
            w = params[i * per:(i + 1) * per]
            b_ih, b_hh = (w[2], w[3]) if has_biases else (torch.zeros_like(w[0][:, 0]),
                                                          torch.zeros_like(w[0][:, 0]))
            out, h, c, _ = torch.ops.aten.mkldnn_rnn_layer(
                x, w[0], w[1], b_ih, b_hh, h0[i], c0[i], d > 0, [], 2, hidden, num_layers,
                has_biases, bidirectional, batch_first, train)
            outs.append(out)
            hy.append(h)
            cy.append(c)
        x = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    out = (x.transpose(0, 1) if batch_first else x), torch.stack(hy, 0), torch.stack(cy, 0)
    del first
    return out


def _gru_cell(gates_i, hidden, w_hh, b_hh):
    """PyTorch's CPU ``GRUCell`` with the input projection precomputed (aten's RNN.cpp), op
    for op: three chunks, in-place gates, ``(h - n) * z + n``."""
    # unsafe_chunk reads every size concretely in C++ (pinning B); unsafe_split, which it
    # dispatches, does not
    third = w_hh.shape[0] // 3
    ig = gates_i.unsafe_split(third, 1)
    hg = F.linear(hidden, w_hh, b_hh).unsafe_split(third, 1)
    reset = hg[0].add_(ig[0]).sigmoid_()
    update = hg[1].add_(ig[1]).sigmoid_()
    new = ig[2].add(hg[2].mul_(reset)).tanh_()
    return (hidden - new).mul_(update).add_(new)


def _gru_steps(steps, h, w_hh, b_hh):
    outs = []
    for g in steps:
        h = _gru_cell(g, h, w_hh, b_hh)
        outs.append(h)
    return outs, h


def _gru_layer(x, h, w_ih, w_hh, b_ih, b_hh):
    """One layer, one direction (``FullLayer``): the input projection of every step at once,
    the cells, the step outputs stacked (the step list lives to the end, a C++ local)."""
    input_w = F.linear(x, w_ih, b_ih)
    steps = input_w.unbind(0)
    outs, h = _gru_steps(steps, h, w_hh, b_hh)
    out = torch.stack(outs, 0)
    del input_w, steps, outs
    return out, h


def _gru_bidirectional(x, h_fw, h_rev, fw, rev):
    """One layer both ways (``FullBidirectionalLayer``), with its C++ locals' lifetimes: each
    direction's step outputs and the second input projection live to the end of the call."""
    input_w = F.linear(x, fw[0], fw[2])
    steps = input_w.unbind(0)
    fw_outs, fw_h = _gru_steps(steps, h_fw, fw[1], fw[3])
    fw_output = torch.stack(fw_outs, 0)
    input_w = F.linear(x, rev[0], rev[2])
    steps = input_w.unbind(0)
    rev_outs, rev_h = _gru_steps(steps[::-1], h_rev, rev[1], rev[3])
    rev_outs.reverse()
    rev_output = torch.stack(rev_outs, 0)
    out = torch.cat([fw_output, rev_output], fw_output.dim() - 1)
    del input_w, steps, fw_outs, rev_outs, fw_output, rev_output
    return out, fw_h, rev_h


@rule(Kind.FUNCTION, torch._VF.gru, device="cpu",
      doc="nn.GRU on CPU: PyTorch's C++ loop (_rnn_impl_with_concat) reads the batch size; the "
          "same ops issued from Python keep B symbolic (the loop over time steps pins S)")
def _gru_cpu(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
             batch_first):
    """``aten::gru.input`` as its CPU path issues ATen ops, or None (a packed sequence: left to
    PyTorch)."""
    layout = rnn_layout(params, has_biases, num_layers, bidirectional)
    if layout is None or not isinstance(hx, torch.Tensor):
        return None
    dirs, per = layout
    x = input.transpose(0, 1) if batch_first else input
    hiddens = hx.unbind(0)
    finals = []
    for layer in range(num_layers):
        ws = [list(params[i * per:(i + 1) * per]) + ([None, None] if not has_biases else [])
              for i in range(layer * dirs, (layer + 1) * dirs)]
        if dirs == 1:
            x, h = _gru_layer(x, hiddens[layer], ws[0][0], ws[0][1], ws[0][2], ws[0][3])
            finals.append(h)
        else:
            x, h_fw, h_rev = _gru_bidirectional(x, hiddens[2 * layer], hiddens[2 * layer + 1],
                                                ws[0], ws[1])
            finals += [h_fw, h_rev]
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    hy = torch.stack(finals, 0)
    if batch_first:  # PyTorch transposes in place (transpose_), which pins B under fake
        x = x.transpose(0, 1)  # tensors; the view holds the same storage, no memory either way
    return x, hy
