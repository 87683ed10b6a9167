"""Models the accuracy tests run: each a factory, its inputs, and the points to check.

Each entry is built twice: on the meta device for memsim, and for real on CPU for the oracle.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d=16, h=32, out=4):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, out)

    def forward(self, x):  # (B, d)
        return self.fc3(F.gelu(self.fc2(torch.tanh(self.fc1(x)))))


class CNN(nn.Module):
    """Conv + BatchNorm + pooling, on images (B, 3, H, W)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: explicit softmax (sdpa=False) or F.scaled_dot_product_attention."""

    def __init__(self, d=32, heads=4, sdpa=False, dropout=0.0):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.heads, self.sdpa, self.p = heads, sdpa, dropout
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.p if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    """A nanoGPT block: LayerNorm, attention, LayerNorm, GELU MLP, residuals."""

    def __init__(self, d=32, heads=4, sdpa=False, dropout=0.0):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, sdpa, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x):  # (B, T, d)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, blocks, tied LM head, cross-entropy loss."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, block=64, sdpa=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):  # (B, T)
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class InPlaceViews(nn.Module):
    """In-place activations, views, slicing, transposes, cat and an in-place add."""

    def __init__(self, d=24):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x):  # (B, S, d)
        h = self.a(x)
        h[..., : h.size(-1) // 2].relu_()          # in place on a slice view
        u, v = h.chunk(2, dim=-1)
        w = (u * torch.sigmoid(v)).transpose(0, 1).contiguous().transpose(0, 1)
        w = w[:, 1:] if w.size(1) > 1 else w
        w = torch.cat([w, w[:, :1]], dim=1)
        y = self.b(w)
        y.mul_(0.5).add_(x)
        return y.view(-1).sum()


class FullSlices(nn.Module):
    """Slices that keep whole dimensions (``h[:, 0:]``, ``h[..., :n]`` with n the full size), as
    Hugging Face's LM head does: an alias in a real run, a ``slice`` with symbolic sizes."""

    def __init__(self, d: int = 24):
        super().__init__()
        self.d = d
        self.up = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, 16 * d)

    def forward(self, x):
        h = self.up(x)[:, 0:]
        h = torch.relu(h)[..., : 2 * self.d]
        return torch.tanh(self.out(h)[:, 0:])


class TinyUNet(nn.Module):
    """A UNet's shape: a convolution, a strided down path, and an up path through
    ``F.interpolate(scale_factor=...)`` (diffusers' ``Upsample2D``: nearest, x2) joined by a
    skip connection; a bilinear x2 and a fractional x0.5 resize besides."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.inc = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.Conv2d(2 * c, c, 3, padding=1)
        self.out = nn.Conv2d(2 * c, 3, 1)

    def forward(self, x):
        h = torch.relu(self.inc(x))
        d = torch.relu(self.mid(self.down(h)))
        u = self.up(F.interpolate(d, scale_factor=2.0, mode="nearest"))
        y = self.out(torch.cat([u, h], dim=1))
        z = F.interpolate(y, scale_factor=0.5, mode="bilinear", align_corners=False)
        return F.interpolate(z, scale_factor=2, mode="bilinear", align_corners=False)


class Resize(nn.Module):
    """A per-channel scale, then ``F.interpolate(scale_factor=...)`` in ``mode`` over ``dims``
    spatial dimensions (its backward runs: the input of the resize needs a gradient)."""

    def __init__(self, mode: str = "bilinear", dims: int = 2, scale: float = 2.0):
        super().__init__()
        self.mode, self.dims, self.scale = mode, dims, scale
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        x = x * self.w.view(1, 4, *[1] * self.dims)
        kw = {} if "nearest" in self.mode else {"align_corners": False}
        return F.interpolate(x, scale_factor=self.scale, mode=self.mode, **kw)


class GRULM(nn.Module):
    """A two-layer GRU language model: PyTorch's RNN kernels read concrete sizes (the batch and
    the time steps are pinned)."""

    def __init__(self, vocab: int = 100, d: int = 32, hidden: int = 64,
                 bidirectional: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, hidden, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


class GroupedExperts(nn.Module):
    """MoE-style experts through ``torch._grouped_mm``, the first weight stored transposed so
    that the output's rows (``out`` wide) are padded to 16 bytes by the real kernel. Tokens are
    split evenly over the experts (static offsets, as a capacity-based router gives)."""

    def __init__(self, experts: int = 3, d: int = 32, out: int = 34):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, out, d) * 0.1)   # used as (E, d, out)
        self.down = nn.Parameter(torch.randn(experts, 32, d) * 0.1)

    def forward(self, x):  # (B, E, d): B tokens per expert
        b, e, d = x.shape
        flat = x.transpose(0, 1).reshape(b * e, d)
        offs = torch.arange(1, e + 1, device=x.device, dtype=torch.int32) * b
        h = torch._grouped_mm(flat, self.up.transpose(1, 2), offs=offs)  # kept to the end
        y = torch._grouped_mm(h.relu()[:, :32].contiguous(), self.down, offs=offs)
        return y.relu() + h[:, :32]


class DeadBranch(nn.Module):
    """A value computed in forward and dropped at once, by an op that saves its own output for
    backward (exp): MambaMixer's ``A = -torch.exp(self.A_log.float())``, which only the CUDA
    fused kernel reads. Autograd frees it with the dead branch of the graph."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(64, 8))
        self.lin = nn.Linear(8, 512)

    def forward(self, x):  # (B, 8)
        -torch.exp(self.p)
        return self.lin(x)


class Scan(nn.Module):
    """A recurrent scan written as a Python loop over the time steps (pins S), with a linear
    read-out."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.out = nn.Linear(d, 16)

    def forward(self, x):  # (B, S, d)
        h = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            h = torch.tanh(h * self.w + x[:, t])
            outs.append(h)
        return self.out(torch.stack(outs, 1))


class LSTMLM(nn.Module):
    """A two-layer LSTM language model: on CPU PyTorch runs oneDNN's LSTM
    (``mkldnn_rnn_layer``), whose C++ entry reads concrete sizes."""

    def __init__(self, vocab: int = 100, d: int = 32, hidden: int = 64,
                 bidirectional: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, hidden, num_layers=2, batch_first=True,
                           bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


class FlexAttention(nn.Module):
    """Self-attention through FlexAttention (a causal ``score_mod``): eager PyTorch runs its
    unfused implementation, which materializes the (B, H, S, S) scores."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):  # (B, S, d)
        from torch.nn.attention.flex_attention import flex_attention

        def causal(score, b, h, q, k):
            return torch.where(q >= k, score, -float("inf"))
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, score_mod=causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class TwoGuards(nn.Module):
    """Two guards of the code path in a row on the batch size (diffusers' upsampler makes a
    tensor contiguous from a batch of 64; a conv backend changes below 16), neither changing
    memory."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # (B, 8)
        if x.shape[0] >= 16:
            x = x.contiguous()
        if x.shape[0] >= 64:
            x = x.contiguous()
        return self.lin(x)


class RNNSum(nn.Module):
    """Token embeddings into ``nn.LSTM`` or ``nn.GRU`` (batch first), the output summed: the
    loss reads the output only, so the final states' gradients are cuDNN's zeros."""

    def __init__(self, kind: str = "LSTM", vocab: int = 50, d: int = 16, hidden: int = 24,
                 layers: int = 1, bidirectional: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = getattr(nn, kind)(d, hidden, num_layers=layers, batch_first=True,
                                     bidirectional=bidirectional)

    def forward(self, x):  # (B, S) token ids
        return self.rnn(self.emb(x))[0].sum()


_COMPILED_FLEX = []


def compiled_flex_attention():
    """``torch.compile(flex_attention, dynamic=True)``, made once: a real run compiles it once
    for every size (memsim's trace compiles nothing)."""
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=True))
    return _COMPILED_FLEX[0]


class CompiledFlexAttention(nn.Module):
    """Self-attention through ``torch.compile(flex_attention)``, FlexAttention's documented use
    (Inductor's fused kernel), with a causal ``score_mod`` and head dimension 16 (the least the
    CUDA kernel takes); ``kv_heads`` below ``heads`` is grouped-query attention."""

    def __init__(self, d: int = 64, heads: int = 4, kv_heads: int = 4):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd)
        self.proj = nn.Linear(d, d)

    def forward(self, x):  # (B, S, d)
        def causal(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx >= kv_idx, score, -float("inf"))
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        y = compiled_flex_attention()(q, k, v, score_mod=causal,
                                      enable_gqa=self.kv_heads != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class CondBlock(nn.Module):
    """A block with its own conditioning embedding (DiT's AdaLayerNormZero holds one and
    embeds the timestep itself)."""

    def __init__(self, d: int = 16, c: int = 8):
        super().__init__()
        self.emb = nn.Linear(c, d)
        self.lin = nn.Linear(d, d)

    def forward(self, x, t, cond):
        return self.lin(x).relu() * self.emb(t) + cond


class Conditioned(nn.Module):
    """DiT's shape: the top level calls the first block's embedding for the conditioning every
    block adds (diffusers' ``self.transformer_blocks[0].norm1.emb(timestep, ...)``)."""

    def __init__(self, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(CondBlock() for _ in range(blocks))

    def forward(self, x, t):  # x (B, 16), t (B, 8)
        cond = self.blocks[0].emb(t)
        for b in self.blocks:
            x = b(x, t, cond)
        return x.pow(2).mean()


class SpareBlock(nn.Module):
    """A linear the block uses, and one it does not."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.used = nn.Linear(d, d)
        self.spare = nn.Linear(d, d)

    def forward(self, x):
        return self.used(x).relu()


class WithSpare(nn.Module):
    """Blocks, and trainable parameters the forward never uses (a spare head, and a spare
    linear inside each block; wav2vec2's ``masked_spec_embed`` without SpecAugment)."""

    def __init__(self, d: int = 16, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(SpareBlock(d) for _ in range(blocks))
        self.head = nn.Linear(d, 2)
        self.spare_head = nn.Linear(d, 4)

    def forward(self, x):  # (B, d)
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


class PerSample(nn.Module):
    """A loop over the batch (``for s in x``), as LLaVA's ``list(image_features)``: pins B."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, x):  # (B, S, 12)
        return torch.stack([self.lin(s).relu() for s in x]).pow(2).sum()


class Layouts(nn.Module):
    """Kernels whose outputs the fake (meta) kernels lay out or size differently from the real
    ones, in a regression head with each reduced loss: BatchNorm over a transposed input
    (PatchTST), LayerNorm and log-softmax whose incoming gradient is transposed (Swin's final
    norm), GroupNorm, and the losses whose scalar keeps their elementwise storage."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.bn = nn.BatchNorm1d(d)
        self.ln = nn.LayerNorm(d)
        self.gn = nn.GroupNorm(2, d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):  # (B, S, d)
        h = self.bn(x.transpose(1, 2)).transpose(1, 2)        # (B, S, d), transposed layout
        h = self.q(h)                                          # a copy for the matmul, real
        n = self.ln(h).transpose(1, 2).mean(-1)                # LayerNorm's gradient transposed
        g = self.gn(h.transpose(1, 2)).transpose(1, 2)
        p = F.log_softmax(self.k(g), -1).transpose(1, 2).mean(-1)
        t = x.transpose(1, 2)[..., :1].mean(-1)                # a (B, d) target
        y = torch.sigmoid(n)
        return (F.mse_loss(n.transpose(0, 1), t.transpose(0, 1))
                + F.smooth_l1_loss(n, t) + F.huber_loss(p, t, reduction="sum")
                + F.binary_cross_entropy(y, torch.sigmoid(t)) + F.soft_margin_loss(p, t))


class FiniteChecks(nn.Module):
    """Branches on checks of its activations' values, as Hugging Face models do in training
    (DETR's encoder: ``if not torch.isfinite(h).all(): clamp``; fp16 models: ``if
    torch.isinf(h).any()``): a healthy step takes neither branch. And asserts on values."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):  # (B, S, d)
        h = self.a(x).relu()
        assert (h >= 0).all().item(), "ReLU's output is not negative"   # ProphetNet asserts so
        if not torch.isfinite(h).all():
            h = h.clamp(-1e4, 1e4)
        h = self.b(h)
        if torch.isinf(h).any() or torch.isnan(h).any():
            h = torch.nan_to_num(h)
        return h.pow(2).mean()


class ToInForward(nn.Module):
    """Casts a submodule to the dtype it has, in forward (Switch Transformers' router does
    ``self.classifier = self.classifier.to(self.dtype)``): eager PyTorch changes nothing."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):  # (B, d)
        self.lin = self.lin.to(torch.float32)
        return self.lin(x).relu().pow(2).mean()


# sizes that depend on tensor values (tests/test_data_dependent.py)

class MaskedSum(nn.Module):
    """Boolean indexing, ``masked_select`` and ``torch.where(mask)`` of a mask that real data
    decides: ``x > 0`` of the input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        keep = x > 0
        rows, cols = torch.where(keep)
        return (h[keep].sum() + torch.masked_select(h, keep).square().sum()
                + h[rows, cols].exp().sum())


class KnownMask(nn.Module):
    """A mask whose values the run knows (made of ones): counted exactly, nothing assumed."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        keep = torch.ones_like(h, dtype=torch.bool)
        drop = torch.zeros_like(h, dtype=torch.bool)
        return h[keep].sum() + h[drop].sum()


class ExpertLoop(nn.Module):
    """A loop over the values of a small data-dependent tensor (Hugging Face's mixture-of-
    experts loop iterates over ``mask.nonzero()`` of the experts hit): under the bound every
    expert is hit, and the loop runs over each, as on data that routes to all of them."""

    def __init__(self, experts=4):
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(8, experts)
        self.w = nn.Parameter(torch.randn(experts, 8, 8) / 8)

    def forward(self, x):
        logits = self.router(x)
        hit = (logits.abs().sum(0) > 0).nonzero()
        out = torch.zeros_like(x)
        for e in hit:
            e = e[0]
            if e == self.experts:   # a value read from the known indices
                continue
            tokens = (logits[:, e] > -1e9).nonzero().squeeze(-1)
            out = out.index_add(0, tokens, F.linear(x[tokens], self.w[e]))
        return out.square().sum()


class Branchy(nn.Module):
    """Two truth values read in Python: a check that raises on one branch, and a choice of
    path whose first branch holds more."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if (x.abs() > 1e6).any():
            raise ValueError("inputs out of range")
        h = self.fc(x)
        if (x > 0).all():
            h = torch.cat([h, h.exp(), h.sin()], -1)
        return h.square().sum()


class MaskedAssign(nn.Module):
    """``x[mask] = v`` (``index_put_`` with a boolean mask) on a copy of the input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        y = x.clone()
        y[x > 0] = 0.0
        return (h * y).sum()


class Uniques(nn.Module):
    """``unique`` (sorted, with inverse and counts, by rows) and ``unique_consecutive``: as
    many values as the data holds distinct ones (random floats: every element)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        u = torch.unique(x)
        v, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
        rows = torch.unique(x, dim=0)
        c = torch.unique_consecutive(x)
        return (h.sum() + u.sum() + v.sum() + inverse.sum() + counts.sum() + rows.sum()
                + c.sum())


class CTC(nn.Module):
    """CTC loss with the lengths as tensors, the targets selected by a mask (Hugging Face's
    CTC heads do so): ``log_alpha`` is sized by the longest target."""

    def __init__(self, classes=6):
        super().__init__()
        self.fc = nn.Linear(8, classes)

    def forward(self, x, labels):  # x (B, T, 8), labels (B, S)
        log_probs = F.log_softmax(self.fc(x), -1).transpose(0, 1)
        keep = labels > 0
        lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels.masked_select(keep), lengths, keep.sum(-1))


class TopKExperts(nn.Module):
    """A mixture of experts as Hugging Face's eager expert loop runs it: top-k routing, a
    one-hot mask of the choices, a loop over the experts hit, each expert's tokens picked with
    ``torch.where``. ``force``: the routing real data would give (None: the router's own)."""

    def __init__(self, d=16, experts=4, k=2, hidden=24, force=None):
        super().__init__()
        self.experts, self.k, self.force = experts, k, force
        self.router = nn.Linear(d, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, hidden, d) / d)
        self.down = nn.Parameter(torch.randn(experts, d, hidden) / hidden)

    def forward(self, x):  # (B, S, d)
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(h).softmax(-1), self.k, dim=-1)
        if self.force == "same":        # every token to experts 0..k-1
            for j in range(self.k):
                chosen.data[:, j].fill_(j)
        elif self.force == "spread":    # token t's slot j to expert (k t + j) mod experts
            chosen.data.view(-1).copy_(torch.arange(chosen.numel()).remainder_(self.experts))
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(chosen, num_classes=self.experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            slot, token = torch.where(mask[e])
            y = F.linear(F.silu(F.linear(h[token], self.up[e])), self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.reshape(x.shape).square().sum()


class TorchTransformer(nn.Module):
    """``nn.Transformer`` with a source padding mask and a causal target mask: its layers read
    the masks' values in Python (whether the target mask is causal, whether the padding is
    left-aligned)."""

    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=64, batch_first=True, dropout=0.0)

    def forward(self, src, tgt, src_key_padding_mask):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.t(src, tgt, src_key_padding_mask=src_key_padding_mask, tgt_mask=causal)


class GroupNormBlock(nn.Module):
    """conv 3x3, GroupNorm, SiLU."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(4, cout)

    def forward(self, x):
        return F.silu(self.norm(self.conv(x)))


class GroupNormUNet(nn.Module):
    """Three levels (c, 2c, 4c channels): max-pool down, nearest x2 up and a 1x1 convolution,
    the skip concatenated, an MSE loss against ``y`` returned as the output."""

    def __init__(self, c=16):
        super().__init__()
        self.e1, self.e2 = GroupNormBlock(3, c), GroupNormBlock(c, 2 * c)
        self.mid = GroupNormBlock(2 * c, 4 * c)
        self.up2, self.d2 = nn.Conv2d(4 * c, 2 * c, 1), GroupNormBlock(4 * c, 2 * c)
        self.up1, self.d1 = nn.Conv2d(2 * c, c, 1), GroupNormBlock(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x, y):
        h1 = self.e1(x)
        h2 = self.e2(F.max_pool2d(h1, 2))
        m = self.mid(F.max_pool2d(h2, 2))
        u2 = self.d2(torch.cat([self.up2(F.interpolate(m, scale_factor=2)), h2], 1))
        u1 = self.d1(torch.cat([self.up1(F.interpolate(u2, scale_factor=2)), h1], 1))
        return F.mse_loss(self.out(u1), y)


class PadToWindows(nn.Module):
    """A convolution, then the feature map padded to whole 4 x 4 windows as a windowed
    attention pads it (``(-h) % 4`` rows and columns: a remainder of the image size), the
    windows' contents mixed by a linear layer and the padding cropped."""

    def __init__(self, c: int = 4, window: int = 4):
        super().__init__()
        self.window = window
        self.conv = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.mix = nn.Linear(window * window, window * window)

    def forward(self, x):
        y = self.conv(x)
        b, c, h, w = y.shape
        k = self.window
        y = F.pad(y, (0, (-w) % k, 0, (-h) % k))
        hp, wp = y.shape[-2:]
        win = y.view(b, c, hp // k, k, wp // k, k).permute(0, 1, 2, 4, 3, 5)
        win = self.mix(win.reshape(b, c, hp // k, wp // k, k * k)).relu()
        out = win.view(b, c, hp // k, wp // k, k, k).permute(0, 1, 2, 4, 3, 5)
        return out.reshape(b, c, hp, wp)[..., :h, :w].square().mean()


class WholeTens(nn.Module):
    """A model that takes sequences of whole tens only and says so without naming a size (its
    own check, as a model with a chunked layout has)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        if x.shape[1] % 10:
            raise ValueError("the sequence must be whole chunks")
        b, s, d = x.shape
        return self.proj(x).view(b, s // 10, 10, d).softmax(2).square().sum()


class Quarters(nn.Module):
    """A view into quarters of the sequence: PyTorch's error at a size that is no multiple of
    4 names the sizes (``shape '[5, 1, 4, 8]' is invalid for input of size 280``)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        return self.proj(x).view(b, s // 4, 4, d).relu().square().sum()


class MessagePassing(nn.Module):
    """One graph convolution over N nodes and E edges (``src -> dst``): messages gathered from
    the source nodes, summed into their targets with ``index_add`` and counted with
    ``scatter_add``, a mean aggregation as PyTorch Geometric's does it."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.msg = nn.Linear(d, d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x, src, dst):
        m = self.msg(x)[src]
        agg = torch.zeros_like(x).index_add(0, dst, m)
        deg = torch.zeros(x.shape[0], dtype=x.dtype).scatter_add(
            0, dst, torch.ones(dst.shape[0], dtype=x.dtype))
        h = torch.cat([x, agg / deg.clamp(min=1).unsqueeze(1)], 1)
        return self.out(h).relu().square().mean()


def pipeline_two_ways():
    """A ``Sequential`` whose first three children hold wide activations and few parameters,
    and the last three many parameters and narrow activations: split after the third child
    over 2 pipeline ranks, rank 1 holds more at small batches and rank 0 at large ones."""
    return nn.Sequential(nn.Linear(4, 16384), nn.GELU(), nn.Linear(16384, 4),
                         nn.Linear(4, 2000), nn.Linear(2000, 2000), nn.Linear(2000, 4))
