"""Benchmark: scale. memsim's one symbolic analysis against PyTorch's MemTracker under
FakeTensorMode (one run per (B, S) point), on GPT-2 124M, Llama-2-7B, Llama-3-70B and
Llama-3.1-405B configs built on the meta device (no weights). Run on demand (not a test):

    python -m benchmarks.scale [--models gpt2,llama2-7b,llama3-70b,llama31-405b]
                               [--peer-points N] [--sweep MODEL] [--strategies]

Every measurement is a process of its own: wall time from start to exit (imports included) and
its peak RSS; each child keeps the cycle collector off until its model is built, then freezes
what exists (``gc.freeze``), and leaves with ``os._exit`` once its answer is printed, as the
``memsim`` command does (``memsim.process.own_process`` and ``settle``, ``memsim.entry.script``); the same for
both sides. Both sides model the same step on the CPU (the peer's kernels): SGD with momentum
(MemTracker under a plain FakeTensorMode cannot take AdamW's ``.item()``), the training step
only, the peak of the second step.

- memsim: one ``analyze`` (the stack of blocks folded, :mod:`memsim.tracer.fold`), then its
  formula evaluated at the 16 points of the sweep (B 1, 2, 4, 8 x four sequence lengths; B = 1
  is below the symbolic range and traced once more, folded too, beside the analysis: the
  points are given to ``analyze(points=...)``, as the command gives its ``--at``).
- the peer: one process per point, at ``--peer-points`` points per model (the smallest and
  largest by default; 0 skips it); ``--sweep MODEL`` runs it at all 16 points of one model.
- the bytes of both at every point the peer ran, and the sweep ratio: the peer's time for 16
  points (measured, or its mean per point times 16) over memsim's one process.
- ``--strategies``: memsim's time and RSS with FSDP2 over 8 ranks and ZeRO-3 over 8 ranks
  (DeepSpeed's engine is traced whole: its buckets span blocks, so it is not folded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    # name: (transformers class, config kwargs, sequence lengths of the sweep)
    "gpt2": ("GPT2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                          n_positions=1024), (128, 256, 512, 1024)),
    "llama2-7b": ("Llama", dict(hidden_size=4096, intermediate_size=11008,
                                num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=32, vocab_size=32000,
                                max_position_embeddings=4096), (512, 1024, 2048, 4096)),
    "llama3-70b": ("Llama", dict(hidden_size=8192, intermediate_size=28672,
                                 num_hidden_layers=80, num_attention_heads=64,
                                 num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, rope_theta=500000.0),
                   (512, 1024, 2048, 4096)),
    "llama31-405b": ("Llama", dict(hidden_size=16384, intermediate_size=53248,
                                   num_hidden_layers=126, num_attention_heads=128,
                                   num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=131072, rope_theta=500000.0),
                     (512, 1024, 2048, 4096)),
}
BATCHES = (1, 2, 4, 8)


def build(name: str, meta: bool = True):
    import torch
    import transformers
    kind, kw, _ = MODELS[name]
    cfg = getattr(transformers, f"{kind}Config")(**kw)
    cls = transformers.GPT2LMHeadModel if kind == "GPT2" else transformers.LlamaForCausalLM
    if not meta:
        return cls(cfg)
    with torch.device("meta"):
        return cls(cfg)


def sgd(params):
    import torch
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def points(name: str) -> list[tuple[int, int]]:
    return [(b, s) for b in BATCHES for s in MODELS[name][2]]


# -- the children -------------------------------------------------------------------------------
def child_memsim(name: str, strategy: str) -> dict:
    from memsim.process import settle
    from memsim.strategies import FSDP, ZeRO
    from memsim.strategies.compose import analyze
    model = build(name)
    settle()    # memsim.process.settle, as the command does once its model is built
    kw = {"fsdp": dict(fsdp=FSDP(8)), "zero3": dict(zero=ZeRO(3, dp=8))}.get(strategy, {})
    t0 = time.perf_counter()
    report = analyze(model, {"input_ids": ("int64", ["B", "S"]),
                             "labels": ("int64", ["B", "S"])},
                     device="cpu", optimizer=sgd, inference=False,
                     points=[{"B": b, "S": s} for b, s in points(name)], **kw)
    t_formula = time.perf_counter() - t0
    got = {}
    for b, s in points(name):
        sub, at = report.for_point({"B": b, "S": s})   # B = 1: traced beside analyze
        got[f"{b},{s}"] = sub.at(**at)["train"]["peak"]
    folded = report.train.trace.folded
    return {"analysis_s": t_formula, "total_s": time.perf_counter() - t0, "bytes": got,
            "folded": folded.describe() if folded is not None else "not folded"}


def child_peer(name: str, b: int, s: int) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from memsim.process import settle
    t0 = time.perf_counter()
    with FakeTensorMode():
        model = build(name, meta=False)
        settle()    # memsim.process.settle, as for memsim's side
        opt = sgd(model.parameters())
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            ids = torch.zeros(b, s, dtype=torch.int64)
            labels = torch.zeros(b, s, dtype=torch.int64)
            for i in range(2):
                if i == 1:
                    mt.reset_mod_stats()
                opt.zero_grad(set_to_none=True)
                # rebound, not deleted: the last step's output is alive until the forward
                # returns, as in memsim's default loop (a `del out` here, until 2026-12-06,
                # made the peer model --drop-outputs: 7B at B=8, S=4096 read 28 GiB less)
                out = model(input_ids=ids, labels=labels)
                out.loss.backward()
                opt.step()
        peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"bytes": peak, "point_s": time.perf_counter() - t0}


# -- the parent ---------------------------------------------------------------------------------
def run_child(*args: str) -> tuple[dict, float, float]:
    """A child process: its JSON answer, wall seconds and peak RSS (MiB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.scale", "--child", *args],
                            stdout=subprocess.PIPE, cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"child {args} failed ({status})")
    return json.loads(out.decode().strip().splitlines()[-1]), wall, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--peer-points", type=int, default=2)
    ap.add_argument("--sweep", metavar="MODEL", help="the peer at all 16 points of MODEL")
    ap.add_argument("--peer-skip", default="llama31-405b",
                    help="models the peer is not run on (one 405B point takes many minutes)")
    ap.add_argument("--strategies", metavar="MODELS", nargs="?", const="llama2-7b",
                    help="memsim with FSDP2 dp 8 and ZeRO-3 dp 8 on these models "
                         "(default llama2-7b)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        from memsim.process import own_process
        own_process()   # as the memsim command runs, for both sides: see settle() below
        kind, name, *rest = args.child
        got = child_memsim(name, rest[0] if rest else "") if kind == "memsim" else \
            child_peer(name, int(rest[0]), int(rest[1]))
        print(json.dumps(got), flush=True)
        # out without tearing the heap down object by object, as the memsim command leaves
        # (memsim.entry.script): the same for both sides
        os._exit(0)
    rows = []
    for name in args.models.split(","):
        mine, wall, rss = run_child("memsim", name)
        pts = points(name)
        want = pts if name == args.sweep else (
            [] if args.peer_points <= 0 or name in args.peer_skip.split(",") else
            [pts[0], pts[-1]] if args.peer_points == 2 else pts[:args.peer_points])
        peer = []
        for b, s in want:
            got, pwall, prss = run_child("peer", name, str(b), str(s))
            peer.append((b, s, got["bytes"], pwall, prss))
            same = "identical" if got["bytes"] == mine["bytes"][f"{b},{s}"] else \
                f"DIFFER: memsim {mine['bytes'][f'{b},{s}']}"
            print(f"  {name} B={b} S={s}: peer {got['bytes']} B in {pwall:.1f} s "
                  f"({prss:.0f} MiB); {same}", flush=True)
        per_point = sum(p[3] for p in peer) / len(peer) if peer else None
        sweep = sum(p[3] for p in peer) if len(peer) == 16 else (
            per_point * 16 if per_point else None)
        rows.append((name, wall, mine["analysis_s"], rss, per_point, sweep,
                     all(p[2] == mine["bytes"][f"{p[0]},{p[1]}"] for p in peer) if peer
                     else None, len(peer), mine["folded"]))
        print(f"{name}: memsim {wall:.1f} s ({mine['analysis_s']:.1f} s analysing), "
              f"{rss:.0f} MiB; {mine['folded']}", flush=True)
    print()
    print("| model | memsim, whole process | peak RSS | peer, per point | "
          "16-point sweep: peer / memsim | bytes at the points the peer ran |")
    print("|---|---|---|---|---|---|")
    for name, wall, ana, rss, per, sweep, same, n, _ in rows:
        peer_txt = f"{per:.1f} s" if per else "not run"
        ratio = f"{sweep / wall:.0f}" + ("" if n == 16 else f" (peer: {n} points x 16/{n})") \
            if sweep else "-"
        bytes_txt = "-" if same is None else ("identical" if same else "DIFFER") + f" ({n})"
        print(f"| {name} | {wall:.1f} s | {rss:.0f} MiB | {peer_txt} | {ratio} | {bytes_txt} |")
    if args.strategies:
        print()
        print("| model | strategy | memsim, whole process | peak RSS |")
        print("|---|---|---|---|")
        for name in args.strategies.split(","):
            for strat in ("fsdp", "zero3"):
                got, wall, rss = run_child("memsim", name, strat)
                print(f"| {name} | {strat} dp 8 | {wall:.1f} s | {rss:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
