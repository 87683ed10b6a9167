"""A 70B Llama with tensor parallelism 8 inside each node and FSDP2 across 8 nodes (a 2-D mesh of
64 H100s): how much memory per GPU at a local batch of 2 and S=4096?

    python examples/llama70b_tp_fsdp.py            # the question (~2 min on 2 cores)
    python examples/llama70b_tp_fsdp.py --small    # a 2-layer, 64-wide Llama, TP 2 x FSDP 2, CPU

Modelled (traced): Hugging Face's LlamaForCausalLM with a Llama-3-70B config (hidden 8192, 80
layers, 64 heads, 8 KV heads, MLP 28672, vocab 128256) built on the meta device; PyTorch's own
``parallelize_module`` with the model's Hugging Face tensor-parallel plan over 8 ranks
(column-wise q/k/v, gate and up projections, row-wise o and down projections), then PyTorch's own
``fully_shard`` (FSDP2) of each decoder layer and the root over 8 data-parallel ranks, inside the
symbolic run on a fake process group of 64 ranks (``TensorParallel(8)`` with ``FSDP(dp=8)``):
fp32 sharded parameters, bf16 all-gathered parameters for compute and fp32 reduce-scatter
(``MixedPrecisionPolicy``), AdamW on the shards, activation checkpointing of every decoder layer,
a torchtitan-style loop (the logits released once the loss exists), CUDA's kernel choices and the
caching allocator's reserve (replayed, FSDP2's streams kept apart). B is the batch of one
data-parallel rank (each TP group of 8 GPUs runs it), S the sequence; both are symbols. Without
sequence parallelism, the residual stream (and so each checkpointed layer's saved input) is whole
on every rank of a TP group (``TensorParallel(8, sequence_parallel=True)`` splits it). Hugging
Face's plan shards the decoder layers only: the embedding and the LM head are sharded by FSDP2
alone, and the logits are whole on every rank. Assumed:
the CUDA context and cuBLAS workspace (PyTorch's defaults); NCCL's own buffers and stream overlap
are not modelled; not measured on a GPU.
"""

import argparse
import time

import torch
import transformers

import memsim
from memsim.analysis.budget import against
from memsim.analysis.gpus import gpu
from memsim.render import human, largest, verdict

LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=1000, max_position_embeddings=256)
INPUTS = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def main(small: bool = False) -> None:
    start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    cfg = TINY if small else LLAMA_70B
    tp, dp = (2, 2) if small else (8, 8)
    device, point = ("cpu", {"B": 2, "S": 32}) if small else ("cuda", {"B": 2, "S": 4096})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    n = sum(p.numel() for p in model.parameters())
    report = memsim.analyze(
        model, INPUTS, device=device, keep_outputs=False, inference=False, checkpoint="blocks",
        tp=memsim.TensorParallel(tp),
        fsdp=memsim.FSDP(dp=dp, param_dtype="bfloat16", reduce_dtype="float32"))
    card = None if small else gpu("h100-80gb")
    bud = against(report, point, gpu=card, capacity=4 * 2 ** 20 if small else None)
    sub, pt = report.for_point(point)  # traces again where the formulas do not cover it
    f = sub.at(**pt)["train"]
    print(f"Llama: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {n:,} "
          f"parameters; TP {tp} x FSDP2 {dp} ({tp * dp} ranks), bf16 compute with fp32 "
          f"shards and reduce, every layer checkpointed, AdamW, device {device}")
    print("against " + ("a 4 MiB budget per rank (CPU: the exact peak of live tensors)" if small
                        else f"{card.name} ({card.mib:,} MiB) per GPU; fits when total <= 90% "
                             f"of it"))
    print(f"  per rank at B={point['B']}, S={point['S']}: parameters {human(f['parameters'])}, "
          f"gradients {human(f['gradients'])}, optimizer states {human(f['optimizer_states'])}, "
          f"activation peak {human(f['activation_peak'])}")
    print(f"  {verdict(bud)}")
    print(f"  largest batch at S={point['S']}: {largest(bud, 'batch')}; largest sequence at "
          f"B={point['B']}: {largest(bud, 'seq')}")
    print(f"(analysed in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny configuration that runs in seconds")
    main(p.parse_args().small)
