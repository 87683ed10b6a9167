"""The classic question: a 13B Llama, ZeRO-3 over 8 H100s, bf16, activation checkpointing: how
much memory per GPU, and what is the largest micro-batch at S=4096?

    python examples/llama13b_zero3.py               # FSDP2, ZeRO-3's equivalent in PyTorch
    python examples/llama13b_zero3.py --deepspeed   # DeepSpeed's own ZeRO-3 engine (~45 s)
    python examples/llama13b_zero3.py --small       # a 2-layer, 64-wide Llama over 2 ranks, CPU
    python examples/llama13b_zero3.py --small --deepspeed   # the same through DeepSpeed

The default form answers with FSDP2, PyTorch's equivalent of ZeRO stage 3 (parameters,
gradients and optimizer states sharded over the 8 ranks, each layer's parameters all-gathered
for its forward and again for its backward): about 10 s on 2 cores. Tracing DeepSpeed's own
engine (``--deepspeed``) takes about 45 s on 2 cores (one rank traced, with one warm-up step,
the caching allocator's replay walking the step once more for the second: every rank's
partitions hold the same data); both are shown in docs/examples.md.

Modelled (traced), both forms: the layout of examples/llama13b.py (Llama-2-13B: 40 layers,
hidden 5120, 40 heads, MLP 13824, vocab 32000; Hugging Face's own non-reentrant checkpointing of
every decoder layer) built on the meta device; the plain loop (the output kept to the end of the
step); AdamW; CUDA's kernel choices and the caching allocator's reserve (replayed).
- FSDP2: PyTorch's own ``fully_shard`` on each decoder layer and the root, on a fake process
  group of 8 ranks; fp32 sharded parameters (the master weights), bf16 all-gathered parameters
  for compute and fp32 reduce-scatter (``MixedPrecisionPolicy``); every rank is equal.
- DeepSpeed: ``deepspeed.initialize`` with ZeRO stage 3 on a fake process group of 8 ranks, its
  loop (``engine(**inputs)``, ``engine.backward(loss)``, ``engine.step()``) after a warm-up
  step (and in the allocator's replay, a second); DeepSpeed's bf16 mode
  (``precision="bf16-master"``: bf16 parameters, fp32 master partitions), its default buckets (a 5e8-element reduce bucket), gathered parameters and
  prefetches; torch's fused AdamW in place of DeepSpeed's FusedAdam (both update in place);
  one rank traced (stage 3 partitions each parameter on its own; every parameter's size
  divides by 8, so every rank's partitions hold the same data).
Assumed: the CUDA context and cuBLAS workspace (PyTorch's defaults); NCCL's own buffers and the
overlap of streams are not modelled; FSDP2 and ZeRO were checked against real runs on CPU (gloo)
only, not on a GPU. The small form uses small DeepSpeed buckets (10,000 elements), so that the
toy model is not dwarfed by the default 2 GB bucket.
"""

import argparse
import importlib.util
import os
import time

import torch
import transformers

import memsim
from memsim.analysis.budget import against
from memsim.analysis.gpus import gpu
from memsim.render import human, largest, verdict

INPUTS = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
SMALL_BUCKETS = dict(reduce_bucket_size=10_000, allgather_bucket_size=10_000,
                     stage3_prefetch_bucket_size=10_000, stage3_param_persistence_threshold=100)


def llama13b() -> torch.nn.Module:
    """examples/llama13b.py's model (imported by path: this file may be run from anywhere)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama13b.py")
    spec = importlib.util.spec_from_file_location("llama13b", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.model()


def tiny() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=128,
                                   vocab_size=1000, max_position_embeddings=256)
    m = transformers.LlamaForCausalLM(cfg)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m


def main(small: bool = False, deepspeed: bool = False) -> None:
    start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = tiny() if small else llama13b()
    n = sum(p.numel() for p in model.parameters())
    dp, device = (2, "cpu") if small else (8, "cuda")
    point = {"B": 2, "S": 32} if small else {"B": 4, "S": 4096}
    if deepspeed:
        how = f"DeepSpeed ZeRO-3 over {dp} ranks, bf16 parameters with fp32 master partitions"
        report = memsim.analyze(model, INPUTS, device=device, precision="bf16-master",
                                inference=False, zero=memsim.ZeRO(
                                    stage=3, dp=dp, **(SMALL_BUCKETS if small else {})))
    else:
        how = (f"FSDP2 (ZeRO-3's equivalent) over {dp} ranks, fp32 shards, bf16 compute, "
               "fp32 reduce")
        report = memsim.analyze(model, INPUTS, device=device, inference=False,
                                fsdp=memsim.FSDP(dp=dp, param_dtype="bfloat16",
                                                 reduce_dtype="float32"))
    card = None if small else gpu("h100-80gb")
    bud = against(report, point, gpu=card, capacity=6 * 2 ** 20 if small else None)
    sub, pt = report.for_point(point)  # traces again where the formulas do not cover it
    f = sub.at(**pt)["train"]
    print(f"Llama: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
          f"{n:,} parameters; {how}; every layer checkpointed, AdamW, device {device}")
    print("against " + ("a 6 MiB budget per rank (CPU: the exact peak of live tensors)" if small
                        else f"{card.name} ({card.mib:,} MiB) per GPU; fits when total <= 90% "
                             f"of it"))
    print(f"  per rank at B={point['B']}, S={point['S']}: parameters {human(f['parameters'])}, "
          f"optimizer states {human(f['optimizer_states'])}, activation peak "
          f"{human(f['activation_peak'])}")
    print(f"  {verdict(bud)}")
    print(f"  largest micro-batch at S={point['S']}: {largest(bud, 'batch')}")
    print(f"(analysed in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny configuration that runs in seconds")
    p.add_argument("--deepspeed", action="store_true",
                   help="trace DeepSpeed's own ZeRO-3 engine instead of FSDP2 (slower)")
    a = p.parse_args()
    main(a.small, a.deepspeed)
