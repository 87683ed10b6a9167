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

    def __init__(self, vocab: int = 100, d: int = 32, hidden: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])
