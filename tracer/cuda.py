"""Kernel choices of a CUDA run, reproduced while the fake tensors live on the CPU.

Autograd cannot run fake CUDA tensors in a CPU build of torch, so every run uses fake CPU
tensors; this module switches the few ops whose CUDA kernel keeps different memory.

- ``F.scaled_dot_product_attention``: CUDA picks a kernel as ``select_sdp_backend`` does on an
  sm80+ GPU (:func:`_backend`). Flash attention (fp16/bf16, no mask) and memory-efficient
  attention (fp32, or a mask) save the output and a float32 log-sum-exp of (B, H, S) (flash;
  here the CPU flash kernel, which saves the same) or (B, H, 32 * ceil(S / 32)) (memory-efficient,
  its ATen op run on fake tensors), dropout included (they regenerate the mask from a seed),
  not the (B, H, S, S) probabilities of the math path; a bool mask becomes an additive copy per
  call, padded where its rows are not 8-aligned (``attention.cpp``). The math path remains
  where neither fused kernel takes the call (fp32 with grouped-query heads). Not measured on a
  GPU; the kernels' internal workspaces (memory-efficient attention's fp32 accumulator above a
  head size of 128, flash backward's fp32 dq accumulator) are not modelled. A mask that
  requires grad gets the padded gradient the memory-efficient backward allocates
  (:func:`_efficient_backward`).
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


def _backend(query, key, value, mask: bool, is_causal: bool, gqa: bool) -> str:
    """The kernel CUDA's ``select_sdp_backend`` (``sdp_utils.cpp``) picks on an sm80+ GPU in its
    default order flash, memory-efficient, math: ``"flash"``, ``"efficient"`` or ``"math"``.

    - flash (``can_use_flash_attention``): no mask, fp16/bf16, 4-D, the same head size <= 256 for
      q, k and v, ``is_causal`` only with as many queries as keys; grouped-query heads allowed.
    - memory-efficient (``can_use_mem_efficient_attention``): fp16/bf16/fp32, any mask, q and k
      of one head size, head sizes divisible by ``minimum_gemm_alignment`` (8 for fp16/bf16, 4 for
      fp32); the same number of heads in q, k and v (no grouped-query heads).
    - math otherwise (fp32 with grouped-query heads: Hugging Face passes ``enable_gqa`` without a
      mask, so an fp32 Llama-3 on CUDA takes it and keeps the (B, H, S, S) probabilities).

    cuDNN attention, which PyTorch puts first on sm90/sm100 with cuDNN >= 9.9, keeps the same
    output and (B, H, S) fp32 log-sum-exp as flash; it is not told apart here."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"
    d, dk, dv = query.size(-1), key.size(-1), value.size(-1)
    half = query.dtype in (torch.float16, torch.bfloat16)
    if (not mask and half and d == dk == dv and d <= 256
            and (not is_causal or query.size(-2) == key.size(-2))):
        return "flash"
    align = 8 if half else 4
    if (query.dtype in (torch.float16, torch.bfloat16, torch.float32) and not gqa
            and d == dk and d % align == 0 and dv % align == 0):
        return "efficient"
    return "math"


def _bool_to_additive(mask, dtype):
    """``convert_boolean_attn_mask`` (attention.cpp): a bool mask becomes an additive one of the
    query's dtype, ``where(mask.logical_not(), -inf, 0)``, a new tensor on every call."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=dtype))


def _aligned(mask, alignment: int = 8) -> bool:
    """``aligned_tensor<8>`` (attention.cpp): every stride but the last a multiple of 8, the last
    1. (Eager CUDA sees concrete strides; a symbolic one makes a condition of the code path,
    which memsim turns into regimes.)"""
    return all(mask.stride(i) % alignment == 0 for i in range(mask.dim() - 1)) \
        and mask.stride(-1) == 1


def _efficient_mask(mask, query, key):
    """``preprocess_mask`` (attention.cpp) before memory-efficient attention: a mask whose rows
    are not 8-aligned is padded to a new tensor (``pad_bias<8>``: ``8 - n % 8`` more columns,
    then sliced back), and expanded to (B, H, L, S) (a view)."""
    if not _aligned(mask):
        n = mask.size(-1)
        mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


@rule(Kind.FUNCTION, F.scaled_dot_product_attention, device="cuda",
      doc="SDPA picks a kernel on CUDA as select_sdp_backend does (flash, memory-efficient, "
          "math): the fused kernels save the output and a (B, H, S) fp32 log-sum-exp, not the "
          "(B, H, S, S) probabilities; a bool mask is converted to an additive copy per call")
def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False):
    """The attention kernel CUDA would run, or None to leave the call as it is."""
    gqa = bool(enable_gqa) and key.size(-3) != query.size(-3)
    if torch.is_autocast_enabled("cpu"):
        # SDPA is on autocast's lower-precision list (CPU and CUDA alike), which casts every
        # floating argument, an additive mask included; calling a kernel directly bypasses
        # autocast, so cast as autocast would
        low = torch.get_autocast_dtype("cpu")
        query, key, value, attn_mask = (
            t.to(low) if t is not None and t.is_floating_point() else t
            for t in (query, key, value, attn_mask))
    backend = _backend(query, key, value, attn_mask is not None, is_causal, gqa)
    if backend == "flash":
        if gqa:
            return None  # the CPU's own choice, flash with grouped-query heads, saves the same
        # the CPU flash kernel saves what CUDA's does: the output and a (B, H, S) fp32
        # log-sum-exp (CUDA's own op, whose meta kernel also makes a (2,) rng-state tensor on
        # the device, is not used: where CUDA keeps that state is not checked)
        out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, scale=scale)
        return out
    mask = _bool_to_additive(attn_mask, query.dtype)
    if backend == "efficient":
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out, _lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, lse, dropout_p, is_causal, scale=scale)
        # _efficient_attention_forward makes the philox seed and offset 0-d int64 tensors in
        # host memory (at::empty({}, at::dtype(at::kLong)) without a device; with dropout
        # at::scalar_tensor, also on the host): not device memory
        from .recorder import current

        rec = current()
        if rec is not None:
            rec.set_host(seed)
            rec.set_host(offset)
        return out
    out, _attn = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=bool(gqa))
    return out


@rule(Kind.ATEN, torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
      device="cuda",
      doc="memory-efficient attention's backward with a mask that requires grad (Doge's learned "
          "dynamic mask): the meta kernel slices the padded bias gradient inside itself, which "
          "fails under fake tensors (an internal assert in torch's argument parser); the same "
          "tensors, the slice taken outside")
def _efficient_backward(recorder, func, args, kwargs):
    """``_scaled_dot_product_efficient_attention_backward``: the gradients of q, k and v in
    (B, S, H, D) memory order, and of the mask (when asked for) as ``_efficient_attention_
    backward`` makes it: its last dimension padded to 16 elements, then sliced back (a view of
    the padded storage)."""
    names = ("grad_out", "query", "key", "value", "attn_bias", "out", "logsumexp",
             "philox_seed", "philox_offset", "dropout_p", "grad_input_mask")
    a = dict(zip(names, args), **kwargs)
    q, k, v, bias = a["query"], a["key"], a["value"], a["attn_bias"]

    def permuted(t, rows, dim):   # (batch and heads are the query's, as the kernel's)
        return torch.empty_permuted((q.size(0), q.size(1), rows, dim), (0, 2, 1, 3),
                                    dtype=t.dtype, device=t.device)

    grads = [permuted(q, q.size(2), q.size(3)), permuted(k, k.size(2), q.size(3)),
             permuted(v, k.size(2), v.size(3)), None]
    if bias is not None and a["grad_input_mask"][3]:
        n = bias.size(-1)
        padded = torch.empty([*bias.shape[:-1], (n + 15) // 16 * 16], dtype=bias.dtype,
                             device=bias.device)
        grads[3] = padded.narrow(-1, 0, n)
    return tuple(grads)
