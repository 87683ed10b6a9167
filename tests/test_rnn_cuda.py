"""nn.LSTM / nn.GRU on --device cuda: cuDNN's tensors (memsim.tracer.rnn_cuda), B and S symbolic.

The oracle is an account written here from PyTorch's sources, not from memsim's code:
``aten/src/ATen/native/cudnn/RNN.cpp`` (the shapes ``_cudnn_rnn`` and ``_cudnn_rnn_backward``
allocate, and when they are freed), ``tools/autograd/derivatives.yaml`` (``_cudnn_rnn`` saves
input, hx, cx, result0 = output, result3 = reserve and result4 = weight_buf), and, for the reserve space that cuDNN
does not document, the sizes cuDNN reported in pytorch/pytorch#2895 and
SeanNaren/deepspeech.pytorch#172. On CUDA every storage is a caching-allocator block: its size
rounded up to 512 bytes. The parameters are memsim's own figure (one storage each; after
``flatten_parameters`` a real fp32 or fp16 RNN keeps its weights in one buffer, rounded once).
"""

import functools

import pytest
import torch

from memsim.analysis import analyze
from memsim.render import to_json, to_text
from memsim.tracer.rnn_cuda import RESERVE_NOTE, reserve_bytes

from tests.support import zoo

TOKENS = {"x": ("int64", ["B", "S"])}
V, D_IN, H = 50, 16, 24  # zoo.RNNSum's defaults: vocab, embedding width, hidden size
GATES = {"LSTM": 4, "GRU": 3}  # weight rows per hidden unit (PyTorch's w_ih: (gates*H, in))


def test_reserve_estimate_reproduces_cudnns_reported_sizes():
    # deepspeech.pytorch#172: GRU(800, bidirectional), one layer, input (326, 64, *), fp32
    assert reserve_bytes("GRU", 326, 64, 800, 1, 2, 4) == 801_177_600
    # pytorch#2895: nn.GRU / nn.LSTM(123, 320, num_layers=4) (from the parameter
    # counts); 864,000,000 and 736,000,000 B, which seq * batch = 25,000 gives both
    assert reserve_bytes("GRU", 25_000, 1, 320, 4, 1, 4) == 864_000_000
    assert reserve_bytes("LSTM", 25_000, 1, 320, 4, 1, 4) == 736_000_000


def _r(n: int) -> int:
    """A CUDA caching-allocator block: ``n`` bytes rounded up to 512 (0 stays 0)."""
    return -(-n // 512) * 512


def _rnn_weights(kind, layers, dirs):
    """Elements of the RNN's weights: cuDNN's ``num_weights`` (biases included)."""
    g = GATES[kind] * H
    return sum(dirs * (g * (D_IN if layer == 0 else dirs * H) + g * H + 2 * g)
               for layer in range(layers))


def _account(kind, layers, dirs, e, b, s):
    """Bytes of the training step's figures, from RNN.cpp's shapes (e bytes per element)."""
    # bf16 weights are not flattened (torch.backends.cudnn.is_acceptable takes fp16/32/64):
    # _cudnn_rnn copies them into weight_buf, which it returns and backward keeps (result4)
    weight_buf = _r(_rnn_weights(kind, layers, dirs) * e) if e == 2 else 0
    states = _r(layers * dirs * b * H * e)        # hx/hy/cx/cy, dhx, dcx: (L*D, B, H)
    n_states = 2 if kind == "LSTM" else 1         # h (and c for an LSTM)
    k = {"LSTM": 5, "GRU": 6}[kind]               # the reserve's elements per (t, b, dir, h)
    emb = _r(b * s * D_IN * e)                    # the embedding's output: the RNN's input
    out = _r(s * b * dirs * H * e)                # output (S, B, D*H), saved
    reserve = _r(s * b * dirs * H * (k * layers + layers - 1) * e)
    saved = emb + n_states * states + out + reserve + weight_buf  # input, hx, cx,
    # result0, result3, result4
    # backward, in _cudnn_rnn_backward_input after dcx: the zeros for the final states'
    # gradients, x = input.contiguous() and dy = grad.contiguous() (copies: batch_first),
    # dx, dhx, dcx; also the token ids (int64), the loss and backward's seed (one element each)
    tokens, scalar = _r(b * s * 8), _r(e)
    x_copy, dy, dx = emb, out, emb                # (S, B, I), (S, B, D*H), (S, B, I)
    zeros = dhx_dcx = n_states * states
    step2 = tokens + saved + 2 * scalar + zeros + x_copy + dy + dx + dhx_dcx
    # every RNN weight's gradient is a view of one dw = zeros(num_weights)
    dw = _r(_rnn_weights(kind, layers, dirs) * e)
    grads = _r(V * D_IN * e) + dw
    # _cudnn_rnn_backward_weight: dy gone, x copied again, dw
    step3 = step2 - dy + dw
    # inference (eval, no grad): no reserve; the peak is inside _cudnn_rnn: token ids,
    # embedding, zero states, x copy, output, hy (and cy), weight_buf (bf16), and the loop's
    # previous output (the sum: one element), alive until this forward returns
    inference = tokens + 2 * emb + 2 * n_states * states + out + weight_buf + scalar
    return {"saved_activations": saved, "activation_peak": step2, "gradients": grads,
            "peak_backward": max(step2, step3), "inference": inference}


def _sgd(params):
    """Plain SGD: no state, updates in place (the peak stays in the RNN's backward)."""
    return torch.optim.SGD(params, lr=0.1)


CASES = [(kind, layers, bi, precision) for kind in ("LSTM", "GRU") for layers in (1, 2)
         for bi in (False, True) for precision in ("32-true", "bf16-true")]


@pytest.mark.parametrize("kind,layers,bidirectional,precision", CASES, ids=[
    f"{k}-{n}layer-{'bi' if bi else 'uni'}-{p}" for k, n, bi, p in CASES])
def test_cudnn_tensors_equal_rnn_cpp_account(kind, layers, bidirectional, precision):
    factory = functools.partial(zoo.RNNSum, kind, layers=layers, bidirectional=bidirectional)
    with torch.device("meta"):
        model = factory()
    report = analyze(model, TOKENS, device="cuda", precision=precision, optimizer=_sgd)
    assert set(report.symbols) == {"B", "S"} and report.basis == "exact"
    e = 4 if precision == "32-true" else 2
    dirs = 2 if bidirectional else 1
    for b, s in ((3, 7), (5, 20)):
        got = report.at(B=b, S=s)
        want = _account(kind, layers, dirs, e, b, s)
        train = got["train"]
        p = train["parameters"]
        assert {k: train[k] for k in ("saved_activations", "activation_peak", "gradients")} \
            == {k: want[k] for k in ("saved_activations", "activation_peak", "gradients")}
        # SGD keeps no state: the peak is in the RNN's backward, on top of the parameters
        assert train["peak"] == p + want["peak_backward"], (b, s)
        assert got["inference"]["peak"] == p + want["inference"], (b, s)


def test_reserve_note_in_text_and_json():
    with torch.device("meta"):
        model = zoo.RNNSum("GRU")
    report = analyze(model, TOKENS, device="cuda", inference=False)
    assert RESERVE_NOTE in to_text(report, {"B": 2, "S": 5})
    assert RESERVE_NOTE in to_json(report, {"B": 2, "S": 5})["notes"]
    with torch.device("meta"):
        model = zoo.RNNSum("LSTM")  # oneDNN on the CPU: no cuDNN, no note
    assert "notes" not in to_json(analyze(model, TOKENS, device="cpu", inference=False),
                                  {"B": 2, "S": 5})
