"""nn.LSTM on CPU (oneDNN): the memory rules of its layer ops (see :mod:`memsim.tracer.rules`).
The fake kernels give the workspace 0 bytes and one bias gradient for two; the real kernels'
sizes are here."""

from __future__ import annotations

import torch

from .rules import Kind, rule

__all__ = ["lstm_workspace_bytes"]

aten = torch.ops.aten

_PAGE = 4096


def _round_up(x, m):
    return (x + (m - 1)) // m * m


def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's leading dimension for ``dim`` elements (rnn_utils ``get_good_ld``): a multiple
    of 64 bytes, 64 bytes more where that is a multiple of 256 elements."""
    ld = _round_up(int(dim), 64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def lstm_workspace_bytes(batch, steps, d: int, h: int, itemsize: int, c_itemsize: int):
    """Bytes of the workspace oneDNN 3.12 (PyTorch 2.13) allocates for one LSTM layer and
    direction whenever grad mode is on: seven parts (gates, hidden states, layer and cell
    states, three fp32 gradient buffers), each rounded up to a 4096-byte page (rnn_utils
    ``set_workspace_sizes``, ``set_offsets``). Derived from oneDNN's source and checked equal
    to the real kernel's at 2,480 random sizes (fp32, bf16, grad on and off; the LSTM tests in
    ``tests/test_accuracy.py`` compare whole steps)."""
    t1, acc = steps + 1, 4
    states_ld, diff_ld = _good_ld(max(d, h), itemsize), _good_ld(max(d, h), acc)
    parts = (steps * batch * _good_ld(4 * h, itemsize) * itemsize,
             steps * batch * _good_ld(h, itemsize) * itemsize,
             2 * t1 * batch * states_ld * itemsize,
             2 * t1 * batch * h * c_itemsize,
             2 * t1 * batch * diff_ld * acc,
             2 * t1 * batch * diff_ld * acc,
             2 * t1 * batch * h * acc)
    total = 0
    for p in parts:
        total = total + _round_up(p, _PAGE)
    return total


@rule(Kind.ATEN, aten.mkldnn_rnn_layer.default, device="cpu",
      doc="nn.LSTM on CPU (oneDNN): the fake kernel gives the workspace 0 bytes, the real "
          "one allocates it whenever grad mode is on (lstm_workspace_bytes)")
def _mkldnn_lstm(recorder, func, args, kwargs):
    """``mkldnn_rnn_layer(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode,
    hidden_size, num_layers, has_biases, bidirectional, batch_first, train)``: the outputs as
    the fake kernel makes them, the workspace (uint8) at its real size."""
    out = func(*args, **kwargs)
    if not torch.is_grad_enabled():
        return out
    x, w_ih, cx = args[0], args[1], args[6]
    # the layer op always gets its input time-major, (steps, batch, features): _VF.lstm
    # transposes a batch_first input before calling it and passes batch_first through, which
    # the kernel does not read for the layout (the meta kernel's output shape is the same
    # either way, as the real kernel's)
    steps, batch = x.shape[0], x.shape[1]
    nbytes = lstm_workspace_bytes(batch, steps, w_ih.shape[1], args[10], x.element_size(),
                                  cx.element_size())
    ws = torch.empty((nbytes,), dtype=torch.uint8, device=x.device)
    return (*out[:3], ws)


@rule(Kind.ATEN, aten.mkldnn_rnn_layer_backward.default, device="cpu",
      doc="nn.LSTM backward on CPU (oneDNN): the two bias gradients are two storages")
def _mkldnn_lstm_backward(recorder, func, args, kwargs):
    """``mkldnn_rnn_layer_backward`` returns ``(dx, dw_ih, dw_hh, db_ih, db_hh, dhx, dcx)``, all
    fp32; the meta kernel returns one ``diff_b`` tensor as both bias gradients, the real kernel
    two separate storages of the same shape (fp32, ``4 * hidden``)."""
    out = func(*args, **kwargs)
    return (*out[:4], torch.empty_like(out[4]), *out[5:])
