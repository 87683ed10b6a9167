"""Check: folded traces equal whole traces at real widths. Run on demand (not a test; about
3 minutes on 2 cores):

    python -m benchmarks.fold_check

- Llama-2-7B at full size (32 blocks), training step and inference, CUDA modelled: the run
  derived from two cut runs (memsim.tracer.fold) against the run traced block by block,
  field by field (every storage, event and op), and the time of each.
- A 16-block model of Llama-2-7B's width under FSDP2 over 8 ranks, checkpointed blocks and
  bf16-mixed: the same comparison, and the peaks.
"""

from __future__ import annotations

import time

import torch
import transformers

from memsim.strategies import FSDP
from memsim.strategies.compose import analyze
from memsim.tracer import fold, trace
from memsim.tracer.hf import adapt

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def llama(layers: int):
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=layers, num_attention_heads=32,
                                   num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def main() -> None:
    m = llama(32)
    patches, limits = adapt(m, LM)
    for train in (True, False):
        t0 = time.perf_counter()
        a = trace(m, LM, patches=patches, limits=limits, train=train, device="cuda")
        t1 = time.perf_counter()
        b = trace(m, LM, patches=patches, limits=limits, train=train, device="cuda",
                  fold=False)
        t2 = time.perf_counter()
        print(f"Llama-2-7B, {'training' if train else 'inference'}: "
              f"{'folded' if a.folded and a.folded.reason is None else 'NOT folded'}; "
              f"difference from the whole run: {fold.difference(a.run, b.run)}; "
              f"{len(b.run.events)} events; folded {t1 - t0:.1f} s, whole {t2 - t1:.1f} s",
              flush=True)
    m = llama(16)
    for name, kw in [("FSDP2 dp 8", dict(fsdp=FSDP(8))), ("checkpointed blocks",
                                                           dict(checkpoint="blocks")),
                     ("bf16-mixed", dict(precision="bf16-mixed"))]:
        got = []
        for f in (True, False):
            rep = analyze(m, LM, device="cuda", inference=False, explore=False, fold=f, **kw)
            got.append(rep.train)
        a, b = got
        why = a.trace.folded.reason if a.trace.folded else "no stack"
        print(f"16 blocks of Llama-2-7B width, {name}: "
              f"{'folded' if why is None else 'NOT folded: ' + why}; difference: "
              f"{fold.difference(a.trace.run, b.trace.run)}; peaks equal: {a.peak == b.peak}",
              flush=True)


if __name__ == "__main__":
    main()
