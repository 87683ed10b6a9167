"""Near the largest size that fits, whether a size fits is not monotone in the size.

The budget's largest batch and sequence (``analysis/budget.py``, ``largest_fitting``) are found by
exponential search and bisection over the total, which assumes that a size fits when a larger
one does. The allocated peak grows with the size; but on CUDA the verdict is the caching
allocator's replay confined to the budget (``analysis/reserved.py``), and near the limit that
replay runs out of memory or not according to how its live blocks fall across segments: a
size can fail where a larger one fits. The same goes for the size the cache needs no release
at (``max_*_no_release``).

This prints, for Llama-3-70B (Hugging Face's config on meta, 80 layers) under FSDP2 over 64
ranks with bf16 parameters, bf16-mixed, on an H100 (90% usable) at B = 2, the solver's
answers and then every sequence length in a window below the largest that fits: whether it
fits, the cache releases the replay made, and the request it could not place where it ran
out. Run on demand (about half a minute on 2 cores)::

    python -m benchmarks.limit_band [--below 24]
"""

from __future__ import annotations

import argparse

from memsim.analysis.budget import Overheads, TotalModel, against
from memsim.analysis.gpus import gpu
from memsim.strategies import FSDP
from memsim.strategies.compose import analyze

from benchmarks import scale  # the models' configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--below", type=int, default=24, help="sizes below the answer to replay")
    args = ap.parse_args()
    model = scale.build("llama3-70b")
    report = analyze(model, {"input_ids": ("int64", ["B", "S"]),
                             "labels": ("int64", ["B", "S"])},
                     fsdp=FSDP(64, param_dtype="bfloat16"), precision="bf16-mixed",
                     inference=False)
    card = gpu("h100-80gb")
    b = against(report, {"B": 2, "S": 4096}, gpu=card)
    print(f"solver at B=2 on {card.name}: largest S that fits {b.max_seq}, without a release "
          f"of the cache {b.max_seq_no_release}")
    usable = int(card.bytes * 0.9)
    m = TotalModel(report, "train", Overheads(), card.family, usable)
    fails = []
    print("S      fits  releases  request it could not place")
    for s in range(b.max_seq - args.below, b.max_seq + 2):
        pt = {"B": 2, "S": s}
        r = m.replayed(pt)
        ok = m.total(pt) <= usable
        if not ok and s <= b.max_seq:
            fails.append(s)
        print(f"{s:<6} {'yes' if ok else 'no':<5} {r.retries:<9} "
              f"{'' if r.oom is None else f'{r.oom:,} B'}")
    print(f"sizes below the answer that do not fit: {fails or 'none'}")


if __name__ == "__main__":
    main()
