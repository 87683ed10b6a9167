"""Kernel choices of a CUDA run, reproduced while the fake tensors live on the CPU.

Autograd cannot run fake CUDA tensors in a CPU build of torch, so every run uses fake CPU
tensors; this module switches the few ops whose CUDA kernel keeps different memory.

- ``F.scaled_dot_product_attention``: on CUDA, torch picks flash attention (fp16/bf16) or
  memory-efficient attention (fp32, or with a mask), both of which save the output and a
  float32 log-sum-exp of shape (B, H, S) for backward, dropout included (they regenerate the
  mask from a seed). A CPU run takes the math path with dropout and keeps the (B, H, S, S)
  probabilities. Here the call is routed to the CPU flash kernel, whose saved tensors are the
  output and the (B, H, S) float32 log-sum-exp, like CUDA's. Not yet measured on a GPU.
- ``F.dropout`` (training, p > 0): CUDA runs ``native_dropout`` and saves a bool mask (1 byte per
  element); the CPU path saves a float mask (4 bytes). Routed to ``native_dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rules import Kind, rule

# applied by memsim.tracer.functions.function_rules("cuda")


@rule(Kind.FUNCTION, F.dropout, device="cuda",
      doc="training dropout runs native_dropout on CUDA: a bool mask (1 byte per element) "
          "where the CPU path keeps a float one")
def _native_dropout(input, p=0.5, training=True, inplace=False):
    """CUDA's dropout kernel (bool mask), or None to leave the call as it is."""
    if not training or p == 0.0 or inplace:
        return None
    out, _mask = torch.native_dropout(input, p, True)
    return out


@rule(Kind.FUNCTION, F.scaled_dot_product_attention, device="cuda",
      doc="SDPA runs a fused kernel on CUDA (flash / memory-efficient): saves the output and a "
          "(B, H, S) fp32 log-sum-exp, not the (B, H, S, S) probabilities of the math path")
def _flash_like(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    """The fused-attention kernel CUDA would run, or None to leave the call as it is."""
    if enable_gqa and key.size(-3) != query.size(-3):
        return None
    if attn_mask is not None:
        return None  # memory-efficient attention on CUDA; the CPU kernel takes no such mask here
    if torch.is_autocast_enabled("cpu"):
        # SDPA is on autocast's lower-precision list (CPU and CUDA alike); calling the kernel
        # directly bypasses autocast, so cast as autocast would
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(low) if t.is_floating_point() else t
                             for t in (query, key, value))
    out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale)
    return out
