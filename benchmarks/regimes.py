"""Models whose traces take guards of the code path: what memsim answers past them.

    python -m benchmarks.regimes            # about 2 minutes on 2 cores

- ResNet-50's shape (transformers' ResNetConfig, on meta), 224 x 224 images: PyTorch picks a
  convolution backend below a batch of 16, a guard that used to cap the batch at 15 ("the
  model itself does not accept B > 15"); traced on both sides, the formulas are the same.
- Mistral-7B's shape (sliding window 4096, 32k positions), bf16-mixed, the Trainer's loop
  (--drop-outputs), --device cuda: the sliding-window cache takes another code path past the
  window (S > 4094 used to be refused).

Prints, per model: the analysis time, the ranges, the sizes traced on both sides of a guard,
the regimes with other formulas, the notes, and the training peak at a few points. These are
predictions (CUDA modelled); the mechanism is checked against real CPU runs on small configs in
tests/test_budget.py and tests/test_hf.py.
"""

from __future__ import annotations

import time

import torch
import transformers as T

import memsim


def resnet50():
    return T.ResNetForImageClassification(T.ResNetConfig(
        depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck"))


def mistral7b():
    return T.MistralForCausalLM(T.MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
        sliding_window=4096))


CASES = [
    ("ResNet-50 (224 x 224)", resnet50, {"pixel_values": ("float32", ["B", 3, 224, 224]),
                                          "labels": ("int64", ["B"])}, {},
     [{"B": 8}, {"B": 32}, {"B": 256}]),
    ("Mistral-7B (window 4096)", mistral7b, {"input_ids": ("int64", ["B", "S"]),
                                             "labels": ("int64", ["B", "S"])},
     {"precision": "bf16-mixed", "keep_outputs": False},
     [{"B": 2, "S": 2048}, {"B": 2, "S": 4096}, {"B": 2, "S": 32768}]),
]


def main() -> None:
    torch.set_num_threads(2)
    for name, factory, inputs, options, points in CASES:
        with torch.device("meta"):
            model = factory()
        t = time.perf_counter()
        r = memsim.analyze(model, inputs, device="cuda", inference=False, **options)
        took = time.perf_counter() - t
        print(f"{name}: analysed in {took:.1f} s; ranges {r.ranges}; same formulas traced at "
              f"{r.checked or '-'}; regimes "
              f"{[(g.symbol, g.lo, g.hi, g.hint) for g in r.regimes] or '-'}")
        for n in r.notes:
            print(f"  note: {n}")
        for pt in points:
            sub, p = r.for_point(pt)
            print(f"  {pt}: train peak {sub.at(**p)['train']['peak'] / 2 ** 30:.2f} GiB")


if __name__ == "__main__":
    main()
