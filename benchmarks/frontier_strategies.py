"""The `memsim` command on frontier models under the strategies people train them with.

``benchmarks/scale.py`` times one analysis per model with FSDP2 or ZeRO-3 over 8 ranks. Real
runs of these models combine strategies over hundreds of ranks, and what costs time there is
not the trace alone: grouping 1,024 ranks by their shards, tracing each group, crossing the
trace's guards, solving the largest sizes. This runs the command, as a user would (a new
process each, through the ``memsim`` script's own entry point, ``--no-cache``), on Hugging
Face configs built on meta:

* Llama-3.1-405B, TP 8 x FSDP2 128 (1,024 ranks), bf16 parameters, bf16-mixed, every block
  checkpointed, the logits dropped: ``analyze`` at B=2, S=8192, and ``fit`` on an H100 at
  B=1, S=8192 (B=1 is below the formulas' range: traced beside them);
* Llama-3.1-405B, FSDP2 over 512 ranks, the same settings, ``analyze`` at B=1, S=8192;
* Llama-3-70B, TP 8 with sequence parallelism x FSDP2 8, ``analyze`` at B=2, S=8192.

Each line: the command's wall time and peak RSS, its exit status (``fit`` exits 1 where the
step does not fit). Run on demand (about 6 minutes on 2 cores)::

    python -m benchmarks.frontier_strategies [--only NAME]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the command's target: scale.py's configs, built on meta (the command runs from the
# repository's root, where ``benchmarks`` is importable)
MODELS = """from benchmarks.scale import build

def llama31_405b():
    return build("llama31-405b")

def llama3_70b():
    return build("llama3-70b")
"""

LM = ["--input", "input_ids=int64[B,S]", "--input", "labels=int64[B,S]"]
COMMON = ["--precision", "bf16-mixed", "--param-dtype", "bf16", "--checkpoint", "blocks",
          "--drop-outputs", "--no-cache", "--quiet"]
RUNS = {
    "405b-tp8-fsdp128-analyze": ["analyze", "models.py:llama31_405b", "--at", "B=2,S=8192",
                                 "--tp", "8", "--fsdp", "--dp", "128"],
    "405b-tp8-fsdp128-fit-b1": ["fit", "models.py:llama31_405b", "--at", "B=1,S=8192",
                                "--gpu", "h100-80gb", "--tp", "8", "--fsdp", "--dp", "128"],
    "405b-fsdp512-analyze-b1": ["analyze", "models.py:llama31_405b", "--at", "B=1,S=8192",
                                "--fsdp", "--dp", "512"],
    "70b-tp8-sp-fsdp8-analyze": ["analyze", "models.py:llama3_70b", "--at", "B=2,S=8192",
                                 "--tp", "8", "--sp", "--fsdp", "--dp", "8"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(RUNS), help="one of the runs")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "models.py"), "w") as f:
            f.write(MODELS)
        for name, argv in RUNS.items():
            if args.only and name != args.only:
                continue
            cmd = [sys.executable, "-c", "from memsim.entry import script; script()",
                   argv[0], os.path.join(tmp, argv[1]), *LM, *argv[2:], *COMMON]
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            timer = threading.Timer(args.timeout, proc.kill)
            timer.start()
            _, status, usage = os.wait4(proc.pid, 0)    # as scale.py's run_child: its RSS
            timer.cancel()
            took = time.perf_counter() - t0
            if took >= args.timeout:
                print(f"{name:28} over {args.timeout} s", flush=True)
                continue
            print(f"{name:28} {took:7.1f} s  peak RSS {usage.ru_maxrss / 1024:,.0f} MiB  "
                  f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
