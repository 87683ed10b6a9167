"""memsim against Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (section 4.1): the activation memory of one Megatron GPT layer, term by term.

The paper (tensor parallel size t = 1, 16-bit activations, 1-byte dropout masks) counts per layer

    no recomputation                          sbh(34 + 5as/h) = 34sbh + 5as^2b  bytes
    selective recomputation (attention core)  34sbh

Below, ``Layer`` is that layer (pre-LN, sequence first [S, B, h], Megatron's QKV layout
[S, B, a, 3d] split into Q, K, V views, explicit Q K^T / sqrt(d), softmax, dropout, .V), run in
``bf16-true`` (module and input in bf16: every activation is 16-bit, as the paper assumes). The
expected figures are derived from what PyTorch's autograd really saves, one storage per row, and
asserted storage by storage against the trace (who saves it, how many bytes), in total against
memsim's formula, and against a real eager CPU run (``oracle.check`` and the bytes live when
backward starts).

One layer, what is saved (s = S, b = B; "m" is the dropout-mask element size: 2 on CPU, 1 on
CUDA):

====================================  ===========  ===========  ====================================
storage (saved by)                    memsim       paper        why
====================================  ===========  ===========  ====================================
ln1 input x (ln1)                     2sbh         2sbh         native_layer_norm saves its input
ln1 mean, rstd (ln1)                  2sb + 2sb    --           ... and its statistics, (s, b, 1)
                                                                each, bf16 on CPU (CUDA: fp32,
                                                                4sb + 4sb, read in layer_norm_cuda)
ln1 output (attn.qkv)                 2sbh         2sbh         addmm saves its input (QKV proj.)
QKV output [S, B, 3h] (attn.core)     6sbh         4sbh + 2sbh  Q K^T: bmm saves Q and K; .V: bmm
                                                                saves V. With Megatron's interleaved
                                                                layout Q, K, V are *views* of the
                                                                one QKV storage (the reshape to
                                                                [B*a, S, d] is an alias), so the
                                                                paper's Q, K (4sbh) + V (2sbh) are
                                                                one 6sbh storage
softmax output (attn.core)            2as^2b       2as^2b       _softmax saves its result
attention dropout mask (attn.core)    m*as^2b      as^2b        CPU: F.dropout = input * (bernoulli
                                                                noise / (1-p)), the noise in the
                                                                input dtype (2 bytes) saved by mul;
                                                                CUDA: native_dropout's bool mask
attention dropout output (attn.core)  2as^2b       2as^2b       saved by the .V bmm
context [S, B, h] (attn.proj)         2sbh         2sbh         the permute + reshape back copies
                                                                it; addmm saves it
drop1 mask (drop1)                    m*sbh        sbh          as the attention dropout mask
residual sum (ln2)                    2sbh         2sbh         ln2 input (the paper's "4sbh" for
                                                                the two LayerNorms)
ln2 mean, rstd (ln2)                  2sb + 2sb    --           as ln1
ln2 output (mlp.fc1)                  2sbh         2sbh         h -> 4h input
fc1 output (mlp: GELU)                8sbh         8sbh         gelu saves its input
GELU output (mlp.fc2)                 8sbh         8sbh         4h -> h input
drop2 mask (drop2)                    m*sbh        sbh          as the attention dropout mask
====================================  ===========  ===========  ====================================

Totals per layer, memsim minus paper:

- no recomputation, ``device="cpu"``:  36sbh + 6as^2b + 8sb; paper + 2sbh + as^2b + 8sb (the
  three dropout masks are bf16, not 1 byte: +sbh +sbh +as^2b; the LayerNorm statistics: +8sb).
  The real CPU run agrees to the byte.
- no recomputation, ``device="cuda"``: 34sbh + 5as^2b + 16sb before the caching allocator's
  512-byte rounding (bool masks, fp32 LayerNorm statistics); paper + 16sb, and exactly that
  where every storage is a multiple of 512 bytes. Not measured on a GPU.
- attention core checkpointed (the plan ``[f"layers.{i}.attn.core"]``, not memsim's "selective"
  named plan, which checkpoints the whole attention module with its projections): the three
  as^2b rows go; the QKV storage stays, now held as the checkpoint's inputs (Megatron's
  ``CheckpointFunction`` keeps the same Q, K, V). CPU: 36sbh + 8sb = paper + 2sbh + 8sb;
  CUDA: 34sbh + 16sb = paper + 16sb.

Whole model: the first layer's input is the model input (an input, not an activation), so
``saved_activations`` = L * layer - 2sbh; ``layers.1`` (its input is layer 0's output) is the
per-layer figure.
"""

from __future__ import annotations

import collections
import functools
import math

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

from memsim.analysis.allocator import block_bytes
from memsim.strategies.checkpoint import apply_checkpointing
from memsim.tracer import Category

from tests.support.oracles.measure import example_inputs, materialize, measure_train
from tests.support.predict import check, predict

PREC = "bf16-true"
H, A = 64, 4          # CPU runs (head size 16)
H_CUDA, A_CUDA = 96, 3  # CUDA model (head size 32): the formula is not tied to one (h, a)
LAYERS = 2
POINTS = [{"B": 2, "S": 8}, {"B": 3, "S": 17}]


class CoreAttention(nn.Module):
    """The part the paper recomputes: Q K^T / sqrt(d), softmax, dropout, .V."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, q, k, v):                     # [S, B, a, d] views of the QKV output
        d = q.shape[-1]
        scores = torch.matmul(q.permute(1, 2, 0, 3), k.permute(1, 2, 3, 0)) / math.sqrt(d)
        probs = F.dropout(torch.softmax(scores, dim=-1), self.p, self.training)
        return torch.matmul(probs, v.permute(1, 2, 0, 3))   # [B, a, S, d]


class SelfAttention(nn.Module):
    def __init__(self, h, heads, p):
        super().__init__()
        self.a = heads
        self.qkv = nn.Linear(h, 3 * h)
        self.core = CoreAttention(p)
        self.proj = nn.Linear(h, h)

    def forward(self, x):                           # [S, B, h]
        s, b, h = x.shape
        d = h // self.a
        q, k, v = self.qkv(x).view(s, b, self.a, 3 * d).split(d, dim=-1)  # Megatron's layout
        ctx = self.core(q, k, v)
        return self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, h))


class MLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    """Megatron GPT layer, pre-LN."""

    def __init__(self, h, heads, p=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(h)
        self.attn = SelfAttention(h, heads, p)
        self.drop1 = nn.Dropout(p)
        self.ln2 = nn.LayerNorm(h)
        self.mlp = MLP(h)
        self.drop2 = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class Stack(nn.Module):
    def __init__(self, h=H, heads=A, layers=LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(Layer(h, heads) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


CORE_PLAN = [f"layers.{i}.attn.core" for i in range(LAYERS)]


def factory(h=H, heads=A, core=False):
    def build():
        m = Stack(h, heads)
        return apply_checkpointing(m, CORE_PLAN) if core else m
    return build


def inputs(h):
    return {"x": ("bfloat16", ["S", "B", h])}


# ---------------------------------------------------------------------------------------------
# The expected figures


def expected_storages(s, b, h, a, mask_bytes, core=False, stat_bytes=2):
    """Per layer: (saving submodule, bytes) for every storage autograd keeps; see the table.
    ``stat_bytes``: LayerNorm mean/rstd element size (bf16 on CPU, fp32 on CUDA)."""
    sbh, sb, as2b = s * b * h, s * b, a * s * s * b
    st = stat_bytes * sb
    rows = [
        ("ln1", 2 * sbh),                 # LayerNorm input
        ("ln1", st), ("ln1", st),         # its mean and rstd
        ("attn.qkv", 2 * sbh),            # ln1 output = QKV projection input
        ("attn.core", 6 * sbh),           # QKV output: Q, K (Q K^T) and V (.V) are its views
    ]
    if not core:
        rows += [
            ("attn.core", 2 * as2b),          # softmax output
            ("attn.core", mask_bytes * as2b),  # attention dropout mask
            ("attn.core", 2 * as2b),          # attention dropout output = .V input
        ]
    rows += [
        ("attn.proj", 2 * sbh),           # context, copied back to [S, B, h]
        ("drop1", mask_bytes * sbh),      # dropout mask
        ("ln2", 2 * sbh),                 # residual sum = LayerNorm input
        ("ln2", st), ("ln2", st),         # mean, rstd
        ("mlp.fc1", 2 * sbh),             # ln2 output
        ("mlp", 8 * sbh),                 # fc1 output, saved by the (functional) GELU
        ("mlp.fc2", 8 * sbh),             # GELU output
        ("drop2", mask_bytes * sbh),      # dropout mask
    ]
    return rows


def paper(s, b, h, a, core=False):
    """Korthikanti et al. 2022, bytes per layer (t = 1)."""
    return 34 * s * b * h + (0 if core else 5 * a * s * s * b)


def saved_by_layer(report, layer):
    """(innermost saving module relative to the layer, bytes) of each saved activation storage
    the layer's modules keep, from the trace."""
    prefix = f"layers.{layer}."
    out = []
    for st in report.train.trace.run.storages:
        if st.saved and st.category is Category.ACTIVATION:
            inner = [m for m in st.saved_by if m.startswith(prefix)]
            if inner:
                out.append((inner[0][len(prefix):], st.nbytes))
    return out


def module_saved(report, path):
    return next(m.saved for m in report.modules if m.path == path)


def syms(report):
    return report.symbols["S"], report.symbols["B"]


@functools.lru_cache(maxsize=None)
def report(device, core):
    h, a = (H, A) if device == "cpu" else (H_CUDA, A_CUDA)
    with torch.device("meta"):
        model = factory(h, a, core)()
    from memsim.analysis import analyze
    return analyze(model, inputs(h), device=device, inference=False, precision=PREC)


def _same(x, y):
    return sympy.expand(x - y) == 0


# ---------------------------------------------------------------------------------------------
# CPU: formula, term by term, and a real run


@pytest.mark.parametrize("core", [False, True], ids=["no_recompute", "core_checkpointed"])
def test_cpu_layer_term_by_term_and_real_run(core):
    r = report("cpu", core)
    S, B = syms(r)
    rows = expected_storages(S, B, H, A, mask_bytes=2, core=core)
    # storage by storage: who saves it and how many bytes (layer 1: its input is an activation)
    assert collections.Counter(saved_by_layer(r, 1)) == collections.Counter(rows)
    layer = sympy.Add(*[n for _, n in rows])
    assert _same(module_saved(r, "layers.1"), layer)
    # layer 0's input is the model's input: not an activation
    assert _same(module_saved(r, "layers.0"), layer - 2 * S * B * H)
    assert _same(r.train.saved_activations, LAYERS * layer - 2 * S * B * H)

    # versus the paper: bf16 dropout masks (one byte more per element) and LayerNorm statistics
    sbh, sb, as2b = S * B * H, S * B, A * S * S * B
    diff = (sbh + sbh) + (0 if core else as2b) + 8 * sb
    assert _same(layer - paper(S, B, H, A, core), diff)
    assert _same(layer, 36 * sbh + 8 * sb + (0 if core else 6 * as2b))

    # a real eager CPU step: peak, parameters, gradients, optimizer states equal...
    check(r, factory(H, A, core), inputs(H), POINTS, precision=PREC)
    # ...and the bytes live when backward starts are the saved activations + the output
    # (the last layer's result, 2sbh, which nothing saves) + the bf16 loss scalar
    for pt in POINTS:
        torch.manual_seed(0)
        real = materialize(factory(H, A, core)())
        m = measure_train(real, example_inputs(inputs(H), pt), precision=PREC)
        want = r.at(**pt)["train"]["saved_activations"] + 2 * pt["S"] * pt["B"] * H + 2
        assert m.saved_at_backward == want, (pt, m.saved_at_backward, want)


def test_cpu_kernels_save_what_the_table_says():
    """Eager PyTorch on CPU (no tracing): the facts the table relies on."""
    x = torch.randn(4, 3, 2 * 3 * 8, dtype=torch.bfloat16, requires_grad=True)
    # CPU dropout is input * noise: the saved noise is bf16 (2 bytes), not a bool mask
    g = F.dropout(x, 0.1, True).grad_fn
    assert type(g).__name__ == "MulBackward0" and g._saved_other.dtype == torch.bfloat16
    # native_dropout (what CUDA's F.dropout runs) returns a bool mask
    assert torch.native_dropout(x.detach(), 0.1, True)[1].dtype == torch.bool
    # bf16 LayerNorm with bf16 weights on CPU: bf16 mean and rstd, (4, 3, 1) each
    ln = nn.LayerNorm(x.shape[-1]).to(torch.bfloat16)
    g = ln(x).grad_fn
    assert g._saved_result1.dtype == torch.bfloat16 and g._saved_result1.shape == (4, 3, 1)
    # Megatron's QKV layout: Q and K reach bmm as views of the QKV output (no copies)
    q, k, _ = x.view(4, 3, 2, 3 * 8).split(8, dim=-1)
    g = torch.matmul(q.permute(1, 2, 0, 3), k.permute(1, 2, 3, 0)).grad_fn.next_functions[0][0]
    assert type(g).__name__ == "BmmBackward0"
    assert g._saved_self.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert g._saved_mat2.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# device="cuda": bool dropout masks, 512-byte blocks: the paper's figures + the LN statistics


@pytest.mark.parametrize("core", [False, True], ids=["no_recompute", "core_checkpointed"])
def test_cuda_layer_is_paper_plus_layer_norm_stats(core):
    r = report("cuda", core)
    S, B = syms(r)
    h, a = H_CUDA, A_CUDA
    rows = expected_storages(S, B, h, a, mask_bytes=1, core=core, stat_bytes=4)
    assert collections.Counter(saved_by_layer(r, 1)) == collections.Counter(rows)
    # each storage is charged in 512-byte blocks (the caching allocator)
    blocks = sympy.Add(*[block_bytes(n, "cuda") for _, n in rows])
    assert _same(module_saved(r, "layers.1"), blocks)
    unrounded = sympy.Add(*[n for _, n in rows])
    assert _same(unrounded - paper(S, B, h, a, core), 16 * S * B)  # only the LN statistics
    # where every storage is a multiple of 512 bytes (B*S = 512 here) it is exact
    pt = {S: 8, B: 64}
    assert int(blocks.xreplace(pt)) == int(paper(S, B, h, a, core).xreplace(pt)) + 16 * 8 * 64


def test_cuda_layer_norm_stats():
    """CUDA's layer_norm_cuda allocates mean/rstd in the accumulate type (fp32) for bf16 input:
    16sb per layer (the CPU kernel: bf16, 8sb)."""
    r = report("cuda", False)
    S, B = syms(r)
    stats = [n for mod, n in saved_by_layer(r, 1) if mod in ("ln1", "ln2")
             and not _same(n, 2 * S * B * H_CUDA)]
    assert len(stats) == 4 and all(_same(n, 4 * S * B) for n in stats)
