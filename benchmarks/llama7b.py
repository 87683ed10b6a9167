"""Benchmark: a Llama-2-7B-sized config (32 layers, hidden 4096), analysed symbolically.

Prints the time and peak RSS of memsim's symbolic analysis, then compares its formula at
B=1, S=2048 with PyTorch's own MemTracker run under FakeTensorMode at that one point (time and
bytes of each, and their ratio). Run on demand (not a test):

    python benchmarks/llama7b.py [--layers 32]

The optimizer is SGD with momentum in both runs: AdamW reads its step count with .item(), which
MemTracker under a plain FakeTensorMode cannot do (memsim handles it with a rule).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from memsim.analysis import analyze


def config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                    num_hidden_layers=layers, num_attention_heads=32,
                                    num_key_value_heads=32, vocab_size=32000,
                                    max_position_embeddings=4096)


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def memtracker_peak(cfg, b: int, s: int) -> tuple[int, float]:
    """MemTracker's peak of the second (steady-state) step, under FakeTensorMode."""
    t0 = time.perf_counter()
    with FakeTensorMode():
        model = transformers.LlamaForCausalLM(cfg)
        opt = sgd(model.parameters())
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            ids = torch.zeros(b, s, dtype=torch.int64)     # inside: the inputs count too
            labels = torch.zeros(b, s, dtype=torch.int64)
            for i in range(2):
                if i == 1:
                    mt.reset_mod_stats()
                opt.zero_grad(set_to_none=True)
                out = model(input_ids=ids, labels=labels)
                out.loss.backward()
                opt.step()
        peak = sum(v for k, v in mt.get_tracker_snapshot("peak")[torch.device("cpu")].items()
                   if k == "Total")
    return peak, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = config(args.layers)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    t0 = time.perf_counter()
    report = analyze(model, {"input_ids": ("int64", [1, "S"]), "labels": ("int64", [1, "S"])},
                     device="cpu", optimizer=sgd)
    t_memsim = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    got = report.at(S=2048)["train"]["peak"]
    print(f"memsim symbolic analysis (train + inference, {args.layers} layers): "
          f"{t_memsim:.1f} s, peak RSS {rss:.0f} MiB, {len(report.train.candidates)} regimes")
    print(f"memsim train.peak at B=1, S=2048: {got} bytes ({got / 2**30:.2f} GiB)")
    ref, t_ref = memtracker_peak(cfg, 1, 2048)
    print(f"MemTracker (FakeTensorMode, one point): {ref} bytes ({ref / 2**30:.2f} GiB), "
          f"{t_ref:.1f} s")
    print(f"ratio memsim/MemTracker bytes: {got / ref:.6f}; time per formula vs per point: "
          f"{t_memsim / t_ref:.2f}x")


if __name__ == "__main__":
    main()
