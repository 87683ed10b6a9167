"""Benchmark: PyTorch's cache of fake kernels' results (``memsim.tracer.fake_cache.FAKE_CACHE``),
on and off, for one analysis each (same process, the model built once). Run on demand:

    python -m benchmarks.fake_cache [--deepspeed] [--repeat N]

- Qwen3-Next (the test suite's small config, B and S symbolic, fp32 on the CPU): a plain run,
  whose ops miss the cache;
- Llama with 2 blocks of 32 wide under FSDP2 over 2 ranks (a plain run under a strategy);
- a GRU language model (``tests/support/zoo.py``) on the CPU, whose loop over time steps pins
  S: traced at fixed sizes of S and fitted, the same ops again and again;
- ``--deepspeed``: Llama-2-7B's config under DeepSpeed ZeRO-3 over 8 ranks (a driven run,
  about 30 s each way).

A first analysis warms the process up; then each case runs without and with the cache in turn,
``--repeat`` times each way (2). Prints the fastest of each, the cache's hits and misses, and
whether the figures are the same at a point. Timings move with the machine's load: compare
within one run.
"""

from __future__ import annotations

import argparse
import time

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def cases(deepspeed: bool):
    import torch
    import transformers
    from memsim.strategies import FSDP, ZeRO

    def qwen3_next():
        from tests.support.hf_models import qwen3_next
        with torch.device("meta"):
            return qwen3_next(), LM, {}, {"B": 2, "S": 16}

    def llama_fsdp():
        with torch.device("meta"):
            m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
        return m, LM, {"fsdp": FSDP(2)}, {"B": 2, "S": 16}

    def gru():
        from tests.support import zoo
        with torch.device("meta"):
            return zoo.GRULM(), {"x": ("int64", ["B", "S"])}, {}, {"B": 2, "S": 16}

    def llama2_7b_zero3():
        from benchmarks.scale import build
        return build("llama2-7b"), LM, {"zero": ZeRO(3, dp=8)}, {"B": 2, "S": 512}

    out = {"qwen3-next": qwen3_next, "llama-2x32-fsdp2": llama_fsdp, "gru-fitted": gru}
    if deepspeed:
        out["llama2-7b-zero3"] = llama2_7b_zero3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed", action="store_true")
    ap.add_argument("--repeat", type=int, default=2, help="runs each way (the fastest shown)")
    args = ap.parse_args()
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memsim.tracer.fake_cache as fake_cache
    from memsim.strategies.compose import analyze

    warm, inputs, kw, _ = cases(False)["llama-2x32-fsdp2"]()
    analyze(warm, inputs, device="cpu", inference=False, explore=False, **kw)  # first run
    for name, make in cases(args.deepspeed).items():
        model, inputs, kw, point = make()
        secs, figures, info = {True: [], False: []}, [], None
        for on in (False, True) * args.repeat:
            fake_cache.FAKE_CACHE = on
            FakeTensorMode.cache_clear()
            t0 = time.perf_counter()
            rep = analyze(model, inputs, device="cpu", inference=False, explore=False, **kw)
            secs[on].append(time.perf_counter() - t0)
            info = FakeTensorMode.cache_info() if on else info
            figures.append(rep.at(**point)["train"])
        fake_cache.FAKE_CACHE = None
        same = all(f == figures[0] for f in figures)
        print(f"{name}  cache off {min(secs[False]):.1f} s  cache on {min(secs[True]):.1f} s "
              f"({info.hits} hits, {info.misses} misses)  "
              f"{'same figures' if same else 'FIGURES DIFFER'}", flush=True)

if __name__ == "__main__":
    main()
