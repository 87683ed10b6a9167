"""Benchmark: memsim's traced DeepSpeed ZeRO against real DeepSpeed steps, per rank, on CPU.

For each configuration (model × stage × precision × overlap_comm), memsim traces DeepSpeed's
engine on a fake process group (``strategies.analyze(..., zero=ZeRO(...), device="cpu")``) and
``tests/support/oracles/dist.py`` runs the same DeepSpeed step for real on 2 gloo ranks (CPU
accelerator, two warm-up steps), counting live storages. Printed: each rank's predicted and
measured peak, their ratio, and the time each side took. Run on demand (needs ``pip install
deepspeed``):

    python -m benchmarks.zero_vs_deepspeed [--models mlp llama] [--stages 1 2 3]

The 2-rank tests in ``tests/test_zero.py`` are a subset of this matrix.
"""

from __future__ import annotations

import argparse
import time

import torch

from memsim.strategies import ZeRO
from memsim.strategies.compose import analyze

from tests.support.oracles import dist as O

BUCKETS = {"reduce_bucket_size": 10_000, "allgather_bucket_size": 10_000}
STAGE3 = {"stage3_prefetch_bucket_size": 10_000, "stage3_param_persistence_threshold": 100}


def bf16_mlp_inputs():
    return {"input": O.mlp_inputs()["input"].to(torch.bfloat16)}


def run(model: str, stage: int, prec: str, overlap: bool) -> list[str]:
    if model == "llama":
        factory, inputs_fn, point = O.llama_model, O.llama_inputs, {"B": 2, "S": 16}
        spec = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
    else:
        factory, point, spec = O.mlp_model, {"B": 8}, {"input": ("float32", ["B", 64])}
        inputs_fn = bf16_mlp_inputs if prec == "bf16-master" else O.mlp_inputs
    t0 = time.perf_counter()
    with torch.device("meta"):
        m = factory()
    report = analyze(m, spec, zero=ZeRO(stage=stage, dp=2, overlap_comm=overlap, **BUCKETS,
                                        **STAGE3),
                     device="cpu", inference=False, precision=prec)
    t_pred = time.perf_counter() - t0
    pred = {r: report.at(**point)["train"]["peak"] for r in range(2)}
    for rc in report.ranks:
        for r in rc.ranks:
            pred[r] = rc.report.at(**point)["train"]["peak"]
    cfg = {"zero_optimization": {"stage": stage, "overlap_comm": overlap, **BUCKETS, **STAGE3}}
    if prec == "bf16-master":
        cfg["bf16"] = {"enabled": True}
    t0 = time.perf_counter()
    real = O.measure(factory, inputs_fn, strategy=O.DeepSpeed(cfg), world_size=2)
    t_real = time.perf_counter() - t0
    rows = []
    for r in real:
        rows.append(f"{model:6} z{stage} {prec:12} overlap={int(overlap)} rank {r.rank}  "
                    f"predicted {pred[r.rank]:>10,}  measured {r.peak:>10,}  "
                    f"ratio {pred[r.rank] / r.peak:.6f}  memsim {t_pred:5.1f} s  "
                    f"real {t_real:5.1f} s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "llama"])
    ap.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--precisions", nargs="+", default=["32-true", "bf16-master"])
    args = ap.parse_args()
    for model in args.models:
        for stage in args.stages:
            for prec in args.precisions:
                for overlap in ((False, True) if stage == 2 else (False,)):
                    print("\n".join(run(model, stage, prec, overlap)), flush=True)


if __name__ == "__main__":
    main()
