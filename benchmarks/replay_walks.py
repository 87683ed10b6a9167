"""How many steady steps the CUDA caching-allocator replay needs before its figures settle.

The replay (``analysis/reserved.py``) walks the step's allocations through PyTorch's caching
allocator: a first step, then the steady step again until a walk changes no figure (at most
``STEADY_WALKS``). Since the previous step's output is alive into the next forward
(``tracer/previous.py``), the cache takes more than one steady step to settle. This prints the
figures with the walks capped at 1, 2, 3, 4 and 6, for two models modelling CUDA:

* plain: 2 layers of Llama-2-7B's widths (Hugging Face's config on meta), bf16-mixed;
* DeepSpeed ZeRO-3 over 8 ranks, the same 2 layers, bf16-master (needs ``deepspeed``; after
  its one traced warm-up step and the replayed one, :class:`DeepSpeedDriver`'s ``replays``).

Run on demand (about a minute on 2 cores)::

    python -m benchmarks.replay_walks
"""

from __future__ import annotations

from memsim.analysis import reserved as R
from memsim.analysis.reserved import replay
from memsim.strategies import ZeRO
from memsim.strategies.compose import analyze

from benchmarks.fold_check import llama  # Llama-2-7B's widths, N layers

LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
POINTS = ({"B": 2, "S": 512}, {"B": 4, "S": 2048})


def main() -> None:
    cases = [("plain, bf16-mixed", dict(precision="bf16-mixed"))]
    try:
        import deepspeed  # noqa: F401
        cases.append(("ZeRO-3 x 8, bf16-master", dict(precision="bf16-master",
                                                        zero=ZeRO(stage=3, dp=8))))
    except ImportError:
        print("(deepspeed not installed: its rows are left out)")
    cap = R.STEADY_WALKS
    print(f"{'case':<24} {'point':<12} {'walks':>5} {'reserved':>15} {'allocated':>15} "
          f"{'reserved@peak':>15} {'largest free':>13}")
    try:
        for name, kw in cases:
            report = analyze(llama(2), LM, device="cuda", inference=False, **kw)
            for pt in POINTS:
                sub, at = report.for_point(pt)
                for walks in (1, 2, 3, 4, 6):
                    R.STEADY_WALKS = walks
                    r = replay(sub.train, at)
                    print(f"{name:<24} {'B=%d, S=%d' % (pt['B'], pt['S']):<12} {walks:>5} "
                          f"{r.reserved:>15,} {r.allocated:>15,} {r.reserved_at_peak:>15,} "
                          f"{r.largest_free_at_peak:>13,}", flush=True)
    finally:
        R.STEADY_WALKS = cap


if __name__ == "__main__":
    main()
