"""How many warm-up steps memsim traces before DeepSpeed's measured step, and what changes.

A few of Llama-2-7B's layers (Hugging Face's config on meta), DeepSpeed ZeRO over 8 ranks with
its default buckets, modelling CUDA. For each count of traced warm-up steps, at each point:
the traced peak (``max_memory_allocated``) and the caching allocator replay
(``analysis/reserved.py``: reserved, allocated as the allocator counts it, reserved when the
peak is reached, the largest free block then). The step's bytes do not depend on the count
(stage 3's coordinator completes its trace at the start of the second step); the replay starts
from the traced history, so its figures can. ``N+R``: N warm-up steps traced, and the replay
walks the measured step R more times before the one it measures (``RunRecord.replays``; stage
3 on CUDA runs 1+1), then walks it again until a walk changes neither a figure nor the cache's blocks (at most
``STEADY_WALKS``; the figures are the most over the walks). Run on demand (needs ``pip install deepspeed``;
about a minute)::

    python -m benchmarks.ds_warmups [--stage 3] [--layers 2] [--precision bf16-master]
                                    [--warmups 1+0,1+1,2+0,3+0,4+0]

``strategies/ds_engine.py`` quotes its output for stage 3, 2 layers, bf16-master.
"""

from __future__ import annotations

import argparse
import time

import torch

from memsim.analysis.reserved import replay
from memsim.strategies import ZeRO
from memsim.strategies.compose import analyze
from memsim.strategies.ds_engine import DeepSpeedDriver

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
POINTS = ((2, 512), (4, 2048))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--precision", default="bf16-master", help="fp32 or a memsim precision")
    ap.add_argument("--warmups", default="1+0,1+1,2+0,3+0,4+0",
                    help="N+R: N warm-up steps traced, R more replayed")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                      num_hidden_layers=args.layers)
    precision = None if args.precision == "fp32" else args.precision
    print(f"Llama-2-7B widths, {args.layers} layers, ZeRO-{args.stage} over 8 ranks, "
          f"{args.precision}, --device cuda")
    print(f"{'warm-ups':>8} {'B':>2} {'S':>5} {'traced peak':>15} {'reserved':>15} "
          f"{'allocated':>15} {'reserved@peak':>15} {'largest free':>13} {'trace s':>8}")
    init = DeepSpeedDriver.__init__
    for spec in args.warmups.split(","):
        n, _, r = spec.partition("+")
        n, r = int(n), int(r or 0)

        def counted(self, *a, n=n, r=r, **kw):
            init(self, *a, **kw)
            self.warmup, self.replays = n, r

        DeepSpeedDriver.__init__ = counted
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        t0 = time.perf_counter()
        report = analyze(model, LM, device="cuda", precision=precision, inference=False,
                         zero=ZeRO(stage=args.stage, dp=8))
        took = time.perf_counter() - t0
        for b, s in POINTS:
            sub, pt = report.for_point({"B": b, "S": s})
            r = replay(sub.train, pt)
            print(f"{spec:>8} {b:>2} {s:>5} {sub.at(**pt)['train']['peak']:>15,} {r.reserved:>15,} "
                  f"{r.allocated:>15,} {r.reserved_at_peak:>15,} {r.largest_free_at_peak:>13,} "
                  f"{took:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
