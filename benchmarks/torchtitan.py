"""Benchmark: memsim against the one published FSDP2 GPU measurement with a complete configuration.

Source: pytorch/torchtitan pull request #165 (FSDP2 for Llama), its memory table: Llama-2-7B
shape (dim 4096, 32 layers, 32 heads, FFN 11008, vocab 32000), FSDP2 on 8 H100s, local batch 8 x
sequence 2048, bf16 parameters with fp32 reduce-scatter, AdamW, eager SDPA. Peak **active**
memory (``torch.cuda.memory_stats()["active_bytes.all.peak"]``): 22.73 GiB with full activation
checkpointing of every block, 49.54 GiB with op-level selective checkpointing (FSDP1: 23.58 and
50.35).

memsim traces Hugging Face's Llama built from that config on the meta device (torchtitan's own
Llama is the same architecture written differently: its rotary tables and attention call are
not HF's) with ``FSDP(dp=8, param_dtype="bfloat16", reduce_dtype="float32")``, ``--device
cuda``, in two loops:

* ``titan``: the loop of PR #165's ``train.py`` (pytorch/torchtitan commit 83c879f, read on
  2026-12-06): ``pred = model(input_ids)``, whose model ends ``self.output(h).float()`` (fp32
  logits; the bf16 ones die at once), then ``F.cross_entropy(pred.flatten(0, 1),
  labels.flatten(0, 1))``, backward and step, ``pred`` never deleted: held through the step
  and, rebound by the next forward, alive through that forward too. Here a wrapper returns
  Hugging Face's logits ``.float()`` and the loss is that cross-entropy; the output is kept
  (memsim's default loop). torchtitan deletes ``pred`` before backward since June 2024 (PR
  #391, "del logits ... to save 3.9G memory"); PR #165's loop did not. Its
  ``parallelize_llama.py`` shards every block with ``reshard_after_forward=layer_id <
  n_layers - 1`` (the last block's backward comes first), then the root:
  ``FSDP(reshard_after_forward="not-last")``;
* ``titan-model`` (with ``--titan-checkout DIR``, a clone of pytorch/torchtitan at commit
  83c879f; not run otherwise): the ``titan`` loop over torchtitan's own Llama, loaded from
  ``DIR/torchtrain/models/llama/model.py`` (``ModelArgs(dim=4096, n_heads=32, vocab_size=32000)``,
  ``max_seq_len`` its default 32768: a 32 MiB complex ``freqs_cis`` buffer; batch and sequence
  folded into one dimension between blocks; fp32 complex rotary; its RMSNorm): whether the
  model's code, not the mechanisms, explains a gap;
* ``hf-dropped``: what this benchmark compared until 2026-12-06: Hugging Face's own loss
  (bf16 logits out, upcast inside the loss), the output dropped after the loss, every block
  resharded.

Both with:

* full: ``checkpoint="blocks"`` (each decoder layer under non-reentrant ``torch.utils.checkpoint``,
  the KV cache off as Hugging Face's own gradient checkpointing sets it);
* op-level SAC: each decoder layer under ``torch.utils.checkpoint`` with
  ``create_selective_checkpoint_contexts`` and torchtitan's published policy, written out here
  from its description: save the outputs of matmuls (every second one recomputed), of the
  attention kernels and of the reduce-scatter, recompute the rest.

What is compared: memsim's allocated peak (tensor bytes, 512-byte blocks) against torchtitan's
peak active bytes (the same quantity: bytes of allocated blocks in use); and memsim's predicted
``max_memory_reserved`` (the step replayed through the CUDA caching allocator,
:mod:`memsim.analysis.reserved`, with the cuBLAS workspace of an H100) against torchtitan's peak
reserved (31.02 and 59.41 GiB), as the ratio reserved / active of each. PR #165 does not state
the allocator settings: both PyTorch's defaults and ``expandable_segments:True`` are printed.
The FSDP1 rows of the table (23.58 / 32.14 and 50.35 / 63.90) are not compared: memsim
models FSDP2, not FSDP1. Not measured here: no
GPU. memsim's trace of the full plan equals real CPU runs of the same mechanisms
(tests/test_widths.py, tests/test_checkpoint.py::test_blocks_plan_equals_hugging_faces_own_
checkpointing), and so does its trace of torch's SAC with this policy (the CPU flash-attention
kernel saved in place of the CUDA ones) on a small Llama
(tests/test_checkpoint.py::test_selective_checkpointing_policy_real_run).

    python -m benchmarks.torchtitan [--layers 32] [--loops titan,hf-dropped]   # ~2 min, 2 cores
    python -m benchmarks.torchtitan --loops titan,titan-model --titan-checkout DIR
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict

import torch
import transformers
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

GIB = 2**30
PUBLISHED = {"full": 22.73, "op-sac": 49.54}  # GiB, torchtitan PR #165, FSDP2 rows, active
RESERVED = {"full": 31.02, "op-sac": 59.41}   # the same runs, peak reserved
CUBLAS_H100 = 32 * 2**20 + 2**20  # analysis.budget.CUBLAS_BYTES["hopper"]

_SAVED_OPS = {torch.ops.aten.mm.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _op_sac_context():
    seen = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            seen[phase] += 1
        save = func in _SAVED_OPS and not (func == torch.ops.aten.mm.default
                                           and seen[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _op_sac_forward(layer, *args, **kwargs):
    return checkpoint(type(layer).forward, layer, *args, use_reentrant=False,
                      context_fn=_op_sac_context, **kwargs)


class TitanOutput(torch.nn.Module):
    """Hugging Face's Llama with torchtitan's output (PR #165): fp32 logits, returned with the
    labels for the loss (:func:`titan_loss`)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        # torchtitan's Llama has no KV cache
        return self.model(input_ids=input_ids, use_cache=False).logits.float(), labels


def titan_loss(out):
    pred, labels = out
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))


class TitanModelLoop(torch.nn.Module):
    """torchtitan's own Llama (its forward takes the tokens alone), returned with the labels for
    :func:`titan_loss`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids), labels


def titan_llama(checkout: str, layers: int, op_sac: bool) -> torch.nn.Module:
    """torchtitan's Llama-2-7B at PR #165 from ``checkout`` (its model file, loaded as is)."""
    import importlib.util
    import os
    path = os.path.join(checkout, "torchtrain", "models", "llama", "model.py")
    spec = importlib.util.spec_from_file_location("titan_llama_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.ModelArgs(dim=4096, n_layers=layers, n_heads=32, vocab_size=32000)
    with torch.device("meta"):
        m = mod.Transformer.from_model_args(args)
    if op_sac:
        for layer in m.layers:
            layer.forward = functools.partial(_op_sac_forward, layer)
    with torch.device("meta"):
        return TitanModelLoop(m)


def llama_2_7b(layers: int, op_sac: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=layers, num_attention_heads=32,
                                   num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096, use_cache=not op_sac)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(cfg)
    if op_sac:
        for layer in m.model.layers:
            layer.forward = functools.partial(_op_sac_forward, layer)
    return m


def run(plan: str, layers: int, loop: str, checkout: str | None = None
        ) -> tuple[float, dict, float]:
    from memsim.analysis.alloc_conf import AllocConf
    from memsim.analysis.reserved import replay
    from memsim.strategies import FSDP, analyze

    if loop == "titan-model":
        model = titan_llama(checkout, layers, op_sac=plan == "op-sac")
    else:
        model = llama_2_7b(layers, op_sac=plan == "op-sac")
    loop_kw = dict(keep_outputs=False) if loop == "hf-dropped" else dict(loss_fn=titan_loss)
    if loop == "titan":
        with torch.device("meta"):
            model = TitanOutput(model)
    t0 = time.perf_counter()
    # PR #165's parallelize_llama.py: every block resharded after forward but the last
    reshard = "not-last" if loop.startswith("titan") else True
    report = analyze(model, {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])},
                     fsdp=FSDP(dp=8, param_dtype="bfloat16", reduce_dtype="float32",
                               reshard_after_forward=reshard),
                     checkpoint="blocks" if plan == "full" else None,
                     device="cuda", inference=False, **loop_kw)
    sub, pt = report.for_point({"B": 8, "S": 2048})
    peak = sub.train.value("peak", pt)
    reserved = {conf: replay(sub.train, pt, conf=AllocConf.parse(conf), workspace=CUBLAS_H100)
                for conf in ("", "expandable_segments:True")}
    return peak / GIB, reserved, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--loops", default="titan,hf-dropped",
                    help="comma-separated: titan (PR #165's loop), titan-model (that loop over "
                         "torchtitan's own model: needs --titan-checkout), hf-dropped (the "
                         "earlier one)")
    ap.add_argument("--titan-checkout", metavar="DIR",
                    help="a clone of pytorch/torchtitan at commit 83c879f (PR #165)")
    args = ap.parse_args()
    if "titan-model" in args.loops.split(",") and not args.titan_checkout:
        ap.error("the titan-model loop needs --titan-checkout DIR")
    print(f"Llama-2-7B shape, {args.layers} layers, FSDP2 dp 8, bf16 params / fp32 reduce, "
          "B 8, S 2048, --device cuda")
    rows = []
    print(f"{'checkpointing':<14} {'loop':<11} {'memsim GiB':>11} {'published GiB':>14} "
          f"{'ratio':>7} {'trace s':>8}   (peak allocated / active)")
    for plan in ("full", "op-sac"):
        for loop in args.loops.split(","):
            gib, reserved, secs = run(plan, args.layers, loop, args.titan_checkout)
            pub = PUBLISHED[plan] if args.layers == 32 else float("nan")
            print(f"{plan:<14} {loop:<11} {gib:>11.2f} {pub:>14.2f} {gib / pub:>7.3f} "
                  f"{secs:>8.1f}", flush=True)
            rows.append((plan, loop, reserved))
    print()
    print("(allocated: the replay's max_memory_allocated, whole unsplit blocks counted)")
    print(f"{'checkpointing':<14} {'loop':<11} {'allocator':<12} {'allocated GiB':>14} "
          f"{'reserved GiB':>13} {'published':>10} {'reserved/allocated':>19} {'published':>10} "
          f"{'ratio':>7}")
    for plan, loop, reserved in rows:
        pub_r = RESERVED[plan] if args.layers == 32 else float("nan")
        pub_ratio = pub_r / PUBLISHED[plan]
        for conf, r in reserved.items():
            ratio = r.reserved / r.allocated
            print(f"{plan:<14} {loop:<11} {'expandable' if conf else 'default':<12} "
                  f"{r.allocated / GIB:>14.2f} {r.reserved / GIB:>13.2f} {pub_r:>10.2f} "
                  f"{ratio:>19.3f} {pub_ratio:>10.3f} {ratio / pub_ratio:>7.3f}")


if __name__ == "__main__":
    main()
