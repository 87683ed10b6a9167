"""What the previous step's output adds at real widths (tracer/previous.py).

A training loop rebinds ``out`` and ``loss``, so the previous step's output (logits, and a
Hugging Face model's KV cache while ``use_cache`` is on, the default of its configs) is alive
through the next ``zero_grad`` and forward; an evaluation loop's previous output through the
next forward. memsim models both since 2026-12-06. This prints, for the training step and for
inference, memsim's default loop (the output kept) with and without it (the second by turning
``memsim.tracer.trace.add_previous_step`` off in this process), modelling CUDA on one device,
for GPT-2 124M (fp32) and a Llama-2-7B (bf16-mixed; the cache is bf16 under autocast), both
from their configs on meta, with Hugging Face's defaults. Run on demand (about two minutes on 2
cores)::

    python -m benchmarks.previous_output
"""

from __future__ import annotations

import sys

import torch
import transformers

from memsim.analysis import analyze

from benchmarks.fold_check import llama  # Llama-2-7B's widths, N layers

GIB = 2**30
LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def gpt2():
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config())


CASES = [("GPT-2 124M, fp32", gpt2, {}, [(2, 1024), (8, 1024)]),
         ("Llama-2-7B, bf16-mixed", lambda: llama(32), {"precision": "bf16-mixed"},
          [(2, 2048), (8, 2048), (4, 4096)])]


def main() -> None:
    module = sys.modules["memsim.tracer.trace"]
    add = module.add_previous_step
    print(f"{'model':<24} {'step':<10} {'point':<14} {'without':>12} {'with':>12} "
          f"{'change':>8}")
    try:
        for name, build, kw, points in CASES:
            for step in ("train", "inference"):
                got = {}
                for on in (False, True):
                    module.add_previous_step = add if on else (lambda run: None)
                    report = analyze(build(), LM, device="cuda", train=step == "train",
                                     inference=step == "inference", **kw)
                    got[on] = [report.at(B=b, S=s)[step]["peak"] for b, s in points]
                for (b, s), off, on in zip(points, got[False], got[True]):
                    print(f"{name:<24} {step:<10} {f'B={b}, S={s}':<14} {off / GIB:>8.2f} GiB "
                          f"{on / GIB:>8.2f} GiB {100 * (on - off) / off:>+7.2f}%", flush=True)
    finally:
        module.add_previous_step = add


if __name__ == "__main__":
    main()
