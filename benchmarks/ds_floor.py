"""Why DeepSpeed's ZeRO-3 is traced whole, and what that costs at Llama-2-7B's size.

memsim runs DeepSpeed's own engine inside the symbolic step (``strategies/ds_engine.py``): one
warm-up step, then the measured one, every block of the stack. Two figures bound what that
design can reach (issue 18 asks for under 10 s on 2 cores):

* the time of the analysis at concrete sizes (B = 1, S = 8: no symbolic size anywhere, so no
  symbolic arithmetic, and tiny activations) beside the same analysis at symbolic ``B, S``:
  the first is what DeepSpeed's Python and its ops on its flat buffers cost under memsim's
  recorder and PyTorch's fake tensors, whatever the sizes;
* the blocks in whose backward the measured step flushes its reduce bucket (a
  ``_reduce_scatter_base`` at DeepSpeed's default ``reduce_bucket_size`` of 5e8 elements): a
  stack can be folded (``tracer/fold.py``) only where its blocks repeat, and the bucket's fill
  as each block starts repeats only with the period these flushes show.

Both steps model the CPU with SGD (as ``benchmarks/scale.py``'s children), train only, without
the point below the formulas' range. Run on demand (about 1.5 minutes on 2 cores; needs
``deepspeed``)::

    python -m benchmarks.ds_floor
"""

from __future__ import annotations

import re
import time

from memsim.strategies import ZeRO
from memsim.strategies.compose import analyze
from memsim.tracer.records import OpRecord, Phase

from benchmarks import scale  # the models' configs, SGD


def main() -> None:
    model = scale.build("llama2-7b")
    runs = {}
    for label, shape in (("symbolic B, S", ["B", "S"]), ("concrete B=1, S=8", [1, 8])):
        t0 = time.perf_counter()
        report = analyze(model, {"input_ids": ("int64", shape), "labels": ("int64", shape)},
                         device="cpu", optimizer=scale.sgd, inference=False,
                         zero=ZeRO(3, dp=8))
        runs[label] = report
        took = time.perf_counter() - t0
        print(f"Llama-2-7B, ZeRO-3 over 8 ranks, {label}: analysis {took:.1f} s", flush=True)
    run = runs["symbolic B, S"].train.trace.run
    block, flushes = None, []
    for op in run.ops:
        if not isinstance(op, OpRecord) or op.phase is not Phase.BACKWARD:
            continue
        m = re.search(r"layers\.(\d+)", op.origin or op.module or "")
        if m:
            block = int(m.group(1))
        if "reduce_scatter" in op.op:
            flushes.append(block)
    gaps = [a - b for a, b in zip(flushes, flushes[1:]) if a is not None and b is not None]
    print(f"the measured step's reduce-bucket flushes, by the block whose backward ran last: "
          f"{flushes}; blocks between them: {gaps}")


if __name__ == "__main__":
    main()
