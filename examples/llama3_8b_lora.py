"""Llama-3-8B with LoRA (r=16) and QLoRA (r=16, 4-bit base) on one GPU at S=2048: does it fit a
24 GB RTX 4090 or an 80 GB H100, and what is the largest batch?

    python examples/llama3_8b_lora.py            # the question
    python examples/llama3_8b_lora.py --small    # a 2-layer, 64-wide Llama, CPU, small budgets

Modelled (traced): Hugging Face's LlamaForCausalLM with Llama-3-8B's config (hidden 4096, 32
layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256) built on the meta device; adapters as
peft makes them on the default targets (q/k/v/o projections: every linear layer of the
attention), everything else frozen; activation checkpointing of every decoder layer (as
``gradient_checkpointing_enable`` in a fine-tuning script); a Trainer-style loop (the logits
released once the loss exists); AdamW on the adapters; CUDA's kernel choices and the caching
allocator's reserve (replayed).
- LoRA: the model in bf16 (``precision="bf16-true"``: weights, adapters, activations and
  optimizer states in bf16).
- QLoRA: every linear layer but the head held as bitsandbytes NF4 with double quantization and
  run through bitsandbytes' own ``matmul_4bit`` (bf16 compute); fp32 adapters (peft's default);
  the other parameters (embeddings, norms, LM head) in fp32, as peft's
  ``prepare_model_for_kbit_training`` leaves them, so the residual stream is fp32.
Assumed: the CUDA context and cuBLAS workspace (PyTorch's defaults); not measured on a GPU.
Needs bitsandbytes for QLoRA. B and S are symbols; B=1 is traced once more (size-1 dimensions
take other code paths); the largest batch is solved from the formulas at S=2048. The small form
runs at B=2 on the CPU, against budgets standing in for the two cards.
"""

import argparse
import time

import torch
import transformers

import memsim
from memsim.analysis.budget import against
from memsim.analysis.gpus import gpu
from memsim.render import human, largest, verdict

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=1000, max_position_embeddings=256)
INPUTS = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def main(small: bool = False) -> None:
    start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    cfg = TINY if small else LLAMA3_8B
    device, point = ("cpu", {"B": 2, "S": 32}) if small else ("cuda", {"B": 1, "S": 2048})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    n = sum(p.numel() for p in model.parameters())
    # the small form stands two CPU budgets in for the two cards
    targets = ([("a 6 MiB budget", dict(capacity=6 * 2 ** 20)),
                ("a 24 MiB budget", dict(capacity=24 * 2 ** 20))] if small else
               [(f"{g.name} ({g.mib:,} MiB)", dict(gpu=g))
                for g in (gpu("rtx-4090"), gpu("h100-80gb"))])
    print(f"Llama: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {n:,} "
          f"parameters; every layer checkpointed, logits dropped after the loss, AdamW, "
          f"device {device}, at B={point['B']}, S={point['S']} (fits when total <= 90% of "
          f"the capacity)")
    runs = [("LoRA r=16, bf16 model", dict(lora=memsim.LoRA(r=16), precision="bf16-true")),
            ("QLoRA r=16, NF4 base, bf16 compute", dict(lora=memsim.QLoRA(r=16)))]
    for label, kw in runs:
        report = memsim.analyze(model, INPUTS, device=device, keep_outputs=False,
                                inference=False, checkpoint="blocks", **kw)
        sub, pt = report.for_point(point)  # traces again where the formulas do not cover it
        trainable = sub.at(**pt)["train"]["gradients"]
        print(f"  {label} (adapter gradients {human(trainable)}):")
        for where, cap in targets:
            bud = against(report, point, **cap)
            print(f"    {where}: {verdict(bud)}; largest batch at S={point['S']}: "
                  f"{largest(bud, 'batch')}")
    print(f"(analysed in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny configuration that runs in seconds")
    main(p.parse_args().small)
