"""``nn.LSTM`` and ``nn.GRU`` on ``--device cuda``: cuDNN's tensors, B and S symbolic.

On CUDA, ``_VF.lstm`` / ``_VF.gru`` (``aten::lstm.input``, ``aten::gru.input``) take cuDNN's
path where ``use_cudnn(input)`` holds (``aten/src/ATen/native/RNN.cpp``: cuDNN compiled and
enabled, a non-empty CUDA tensor of fp32, fp16 or fp64, or bf16 where
``supportsBFloat16RNNWithCuDNN``, cuDNN 9.13 and later, which the CUDA wheels of PyTorch's
recent releases bundle; with an older cuDNN bf16 runs PyTorch's own CUDA cells, not modelled
here). The path is ``_cudnn_impl`` then ``at::_cudnn_rnn``
(``aten/src/ATen/native/cudnn/RNN.cpp``), one call for all layers and directions, whose autograd
formula (``tools/autograd/derivatives.yaml``) saves ``input``, ``hx``, ``cx``, ``result0`` (the
output), ``result3`` (the reserve) and ``result4`` (``weight_buf``) and calls
``_cudnn_rnn_backward`` with them. A CPU build has neither kernel, the meta kernel of
``_cudnn_rnn`` gives the reserve 0 bytes and ``_cudnn_rnn_backward`` has none, so
:class:`CudnnRnn` allocates the same tensors from Python, in RNN.cpp's order, with ops the
recorder sees. Shapes (S time steps, B batch, I input size, H hidden size, L layers,
D directions, e bytes per element of the input's dtype)::

    forward  (_cudnn_rnn)          x = input.contiguous()   (S, B, I)  a copy when batch_first;
                                                                       freed at return
                                   output                   (S, B, D*H)  returned transposed
                                                                       (batch_first), saved
                                   hy, cy (cy: LSTM only)   (L*D, B, H)
                                   weight_buf               (num_weights,)  only where the
                                                            weights are not flattened (bf16),
                                                            saved
                                   reserve (uint8)          estimated (below), saved
                                   workspace (uint8)        not modelled (freed at return)
    backward (_cudnn_rnn_backward) grad_hy, grad_cy = zeros (L*D, B, H)  when not given
      _cudnn_rnn_backward_input    x, dy = .contiguous()   (S, B, I), (S, B, D*H)  copies when
                                                                       batch_first; freed
                                   dx (S, B, I), dhx, dcx (L*D, B, H)   returned
      _cudnn_rnn_backward_weight   x = input.contiguous()  again; freed
                                   dw = zeros(num_weights) one storage; the weights' gradients
                                                           are views of it (they become .grad)

The weights themselves are used in place where ``nn.RNNBase.flatten_parameters`` (run by
``.cuda()``) made them views of one buffer of the same total size: ``weight_buf`` is then that
buffer and costs nothing. It does so only for the dtypes ``torch.backends.cudnn.is_acceptable``
takes (fp16, fp32, fp64): bf16 weights stay apart, and every call copies them into a new
``weight_buf`` (PyTorch warns "RNN module weights are not part of single contiguous chunk of
memory"), which backward keeps.

The reserve space's size comes from ``cudnnGetRNNTempSpaceSizes``, which cuDNN does not
document. :func:`reserve_bytes` is an estimate fitted to the sizes cuDNN reported in public
(cuDNN 6/7 era, fp32); the report says so (:func:`reserve_notes`).

Not modelled (``None``: PyTorch's own call runs): packed sequences, projections
(``proj_size``), RNNs without biases (their flat buffer's layout is not checked), ``nn.RNN``
(no public reserve size), cuDNN switched off, autocast (its ``_cudnn_rnn`` wrapper casts the
weights into a new flat fp16 buffer each call). Neither cuDNN's workspace (a temporary of each
call) nor its dropout state (about 2 MB per device, made once when ``dropout > 0``) is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .functions import rnn_layout
from .rules import Kind, rule

# applied by memsim.tracer.functions.function_rules("cuda")

# cuDNN's reserve space, per time step, batch row, direction and hidden unit: k elements for
# each layer plus one for each layer's output that feeds the next (the last layer's output is
# ``output``, not the reserve). k is 5 for an LSTM (presumably its 4 gates and the cell state)
# and 6 for a GRU (3 gates and the 3 recurrent projections, which the reset gate scales).
# Evidence, cuDNN's own reported sizes (fp32):
# - SeanNaren/deepspeech.pytorch#172 (ngimel, 2017-11-08): GRU, hidden 800, bidirectional,
#   1 layer per call, input (326, 64, *): reserve 801,177,600 B
#   = 326*64 * 2*800 * (6*1 + 0) * 4, exactly.
# - pytorch/pytorch#2895 (ngimel, 2017-10-04): the model (its parameter counts,
#   RNN 761,930, GRU 2,279,370, LSTM 3,038,090, are nn.X(123, 320, num_layers=4) and a
#   Linear(320, 10), uniquely): GRU 864,000,000 B, LSTM 736,000,000 B, a ratio of 27/23
#   = (6*4 + 3) / (5*4 + 3), whatever seq*batch was (25,000 gives both exactly).
RESERVE_K = {"LSTM": 5, "GRU": 6}
NODE = "CudnnRnnBackward"  # the autograd node :class:`CudnnRnn` makes (its name in the graph)


def reserve_bytes(mode: str, seq, batch, hidden: int, layers: int, dirs: int, itemsize: int):
    """Estimated bytes of cuDNN's RNN reserve space (training): ``seq * batch * dirs * hidden *
    (k * layers + layers - 1) * itemsize``, k = 5 (LSTM) or 6 (GRU); symbolic in seq and batch.

    >>> reserve_bytes("GRU", 326, 64, 800, 1, 2, 4)   # deepspeech.pytorch#172: 801,177,600
    801177600
    >>> reserve_bytes("LSTM", 2, 3, 4, 2, 1, 4)       # 2*3 * 4 * (5*2 + 1) * 4
    1056
    """
    k = RESERVE_K[mode]
    return seq * batch * dirs * hidden * (k * layers + layers - 1) * itemsize


RESERVE_NOTE = (
    "cuDNN's RNN reserve space (nn.LSTM / nn.GRU on CUDA, saved for backward) is estimated, not "
    "measured: seq * batch * directions * hidden * (k * layers + layers - 1) elements of the "
    "input's dtype, k = 5 (LSTM) or 6 (GRU), fitted to the sizes cuDNN 6/7 reported in "
    "pytorch/pytorch#2895 and SeanNaren/deepspeech.pytorch#172 (cuDNN documents no formula; "
    "its persistent algorithms may differ); cuDNN's workspace (freed within each call) and "
    "dropout state are not counted")


def reserve_notes(ops) -> list[str]:
    """The note for a run whose ops (``RunRecord.ops``) include :class:`CudnnRnn`'s backward:
    its reserve space is an estimate."""
    used = any(getattr(o, "autograd_node", None) == NODE for o in ops)
    return [RESERVE_NOTE] if used else []


@dataclass(frozen=True)
class RnnConfig:
    """What ``_cudnn_rnn`` is told besides its tensors. ``hidden``: elements; ``mode``: "LSTM"
    or "GRU"; ``train``: the module's training flag (``fn_train``: a reserve is made only
    then); ``flat``: whether ``nn.RNNBase.flatten_parameters`` made the weights views of one
    buffer (else ``_cudnn_rnn`` copies them into a new ``weight_buf`` at every call)."""

    mode: str
    hidden: int
    layers: int
    dirs: int
    batch_first: bool
    train: bool
    flat: bool = True  # the weights are views of one buffer (flatten_parameters ran)


def _t(x, cfg: RnnConfig):
    """``input.transpose(0, 1)`` where RNN.cpp does it (batch_first, not packed)."""
    return x.transpose(0, 1) if cfg.batch_first else x


def _fresh(like, seq, batch, width, cfg: RnnConfig):
    """``at::empty({seq, batch, width})`` and, batch_first, ``.transpose_(0, 1)``: a new tensor
    (not a view: the model may write into it) of shape (B, S, width) over (S, B, width)."""
    if not cfg.batch_first:
        return like.new_empty(seq, batch, width)
    return like.new_empty_strided((batch, seq, width), (width, batch * width, 1))


class CudnnRnn(torch.autograd.Function):
    """``at::_cudnn_rnn`` and ``at::_cudnn_rnn_backward``: the tensors RNN.cpp allocates, in
    its order, each freed where its C++ local goes out of scope (see the module docstring).
    ``apply(cfg, input, hx, cx, *weights)``; ``cx`` is None for a GRU."""

    @staticmethod
    def forward(ctx, cfg: RnnConfig, input, hx, cx, *weights):
        x = _t(input, cfg).contiguous()  # (S, B, I)
        seq, batch = x.shape[0], x.shape[1]
        states = (cfg.layers * cfg.dirs, batch, cfg.hidden)
        output = _fresh(x, seq, batch, cfg.dirs * cfg.hidden, cfg)  # input.options()
        hy = hx.new_empty(states)
        cy = cx.new_empty(states) if cx is not None else None  # GRU: empty({0}), no bytes
        # weights not flattened: weight_buf = empty(num_weights, x.options()), the weights
        # copied in; returned as result4, which backward reads (saved to its end)
        weight_buf = None if cfg.flat else x.new_empty(sum(w.numel() for w in weights))
        n = reserve_bytes(cfg.mode, seq, batch, cfg.hidden, cfg.layers, cfg.dirs,
                          x.element_size()) if cfg.train else 0
        reserve = x.new_empty(n, dtype=torch.uint8)
        del x  # the copy goes at return (the workspace would, too)
        ctx.cfg, ctx.weights = cfg, weights  # _cudnn_rnn saves the weight list: the parameters
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(input, hx, cx, output, reserve, weight_buf)
        return (output, hy) if cy is None else (output, hy, cy)

    @staticmethod
    def backward(ctx, grad_output, grad_hy, grad_cy=None):
        cfg = ctx.cfg
        # the reserve and weight_buf are read by cuDNN's kernels; the node keeps them to the
        # end of backward
        input, hx, cx, output, _reserve, _weight_buf = ctx.saved_tensors
        if not cfg.train:
            raise RuntimeError("cudnn RNN backward can only be called in training mode")
        # _cudnn_rnn_backward: gradients autograd did not give are zeros (kept to its end)
        if grad_output is None:
            grad_output = torch.zeros_like(output, memory_format=torch.contiguous_format)
        if grad_hy is None:
            grad_hy = torch.zeros_like(hx, memory_format=torch.contiguous_format)
        if cx is not None and grad_cy is None:
            grad_cy = torch.zeros_like(cx, memory_format=torch.contiguous_format)
        dx, dhx, dcx = _backward_input(cfg, input, hx, cx, grad_output, grad_hy, grad_cy)
        weights = ctx.needs_input_grad[4:]
        dw = _backward_weight(cfg, input, ctx.weights) if any(weights) else \
            [None] * len(weights)
        return (None, dx, dhx, dcx, *dw)


def _backward_input(cfg, input, hx, cx, grad_output, grad_hy, grad_cy):
    """``_cudnn_rnn_backward_input``: dx, dhx, dcx, computed whatever the mask says (it
    mutates the reserve)."""
    x = _t(input, cfg).contiguous()
    dy = _t(grad_output, cfg).contiguous()
    seq, batch, width = x.shape
    dx = _fresh(x, seq, batch, width, cfg)  # empty_like (S, B, I), then dx.transpose_(0, 1)
    dhy = grad_hy.contiguous()
    dcy = grad_cy.contiguous() if grad_cy is not None else None
    dhx = hx.new_empty(hx.shape)
    dcx = cx.new_empty(cx.shape) if cx is not None else None
    del x, dy, dhy, dcy  # locals of the C++ function (and its workspace)
    return dx, dhx, dcx


def _backward_weight(cfg, input, weights):
    """``_cudnn_rnn_backward_weight``: ``dw = zeros(weight_buf.sizes())``, one storage, whose
    views (``get_parameters``, laid out as the weights) are the weights' gradients."""
    x = _t(input, cfg).contiguous()
    total = sum(w.numel() for w in weights)
    dw = torch.zeros(total, dtype=weights[0].dtype, device=weights[0].device)
    grads, at = [], 0
    for w in weights:
        grads.append(dw[at:at + w.numel()].view(w.shape))
        at += w.numel()
    del x, dw
    return grads


def _run(mode, input, hx, cx, params, has_biases, num_layers, train, bidirectional,
         batch_first):
    """:class:`CudnnRnn` for this call, or None where cuDNN would not run or this is not
    modelled: cuDNN off, autocast on, no biases, a packed sequence or projection (another
    weight layout)."""
    layout = rnn_layout(params, has_biases, num_layers, bidirectional)
    if layout is None or has_biases is not True or not torch.backends.cudnn.enabled \
            or torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return None
    # flatten_parameters runs only for dtypes torch.backends.cudnn.is_acceptable takes (not
    # bf16): other weights are copied into a flat buffer at every call
    flat = all(p.dtype in torch.backends.cudnn.CUDNN_TENSOR_DTYPES for p in params)
    cfg = RnnConfig(mode, int(params[1].shape[1]), int(num_layers), layout[0],
                    bool(batch_first), bool(train), flat)
    return CudnnRnn.apply(cfg, input, hx, cx, *params)


@rule(Kind.FUNCTION, torch._VF.lstm, device="cuda",
      doc="nn.LSTM on CUDA runs cuDNN (_cudnn_rnn): output, hy, cy, a reserve space saved for "
          "backward (estimated: cuDNN documents no size), batch_first copies; backward's dx, "
          "dhx, dcx and one flat weight gradient; B and S symbolic")
def _lstm_cudnn(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                batch_first):
    """``aten::lstm.input`` as cuDNN runs it, or None (see the module docstring)."""
    if not isinstance(hx, (tuple, list)) or hx[0].shape[-1] != hx[1].shape[-1]:
        return None  # a packed sequence, or a projection
    return _run("LSTM", input, hx[0], hx[1], params, has_biases, num_layers, train,
                bidirectional, batch_first)


@rule(Kind.FUNCTION, torch._VF.gru, device="cuda",
      doc="nn.GRU on CUDA runs cuDNN (_cudnn_rnn): output, hy, a reserve space saved for "
          "backward (estimated: cuDNN documents no size), batch_first copies; backward's dx, "
          "dhx and one flat weight gradient; B and S symbolic")
def _gru_cudnn(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
               batch_first):
    """``aten::gru.input`` as cuDNN runs it, or None (see the module docstring)."""
    if not isinstance(hx, torch.Tensor):
        return None
    return _run("GRU", input, hx, None, params, has_biases, num_layers, train, bidirectional,
                batch_first)
