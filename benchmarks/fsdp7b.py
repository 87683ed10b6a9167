"""Benchmark: memsim's per-rank FSDP2 peak for a Llama-2-7B-sized config vs. PyTorch's own
(``--model mixtral-8x22b`` / ``deepseek-v3``: those published configs, their stacked experts
optionally sharded on another dimension with ``--shard-dim``).

The model (Hugging Face ``LlamaConfig`` with Llama-2-7B sizes: hidden 4096, intermediate 11008,
32 layers, 32 heads, vocab 32000) is built on the meta device (memsim) or under
``FakeTensorMode`` (PyTorch); it is never materialized. Both sides shard it with PyTorch's
``fully_shard`` (each decoder layer, then the root) over a *fake* process group of ``--dp``
ranks and run one steady-state training step (``zero_grad(set_to_none=True)``, forward with
labels, ``out.loss.backward()``, ``AdamW.step()``; optimizer state and gradients already exist):

* memsim: ``strategies.analyze(..., fsdp=FSDP(dp), device="cpu", optimizer=AdamW(foreach=False))``
  symbolically in S, then the formula evaluated at B=1, S=--seq;
* PyTorch: ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) under
  ``FakeTensorMode`` with ``dist.init_process_group("fake")``, the device mesh built outside
  the fake mode, one warm-up step first (its output and loss alive until the measured step's
  forward returns, as in a loop that rebinds them), then the measured step.

Each side runs in its own subprocess (the fake process group is global per process), so each
side's time and peak RSS are its own. Run on demand (not a test):

    python -m benchmarks.fsdp7b [--layers 32] [--dp 8 [16 ...]] [--seq 2048]
                                [--model llama2-7b|mixtral-8x22b|deepseek-v3] [--bf16]
                                [--shard-dim PATTERN=DIM ...]

``--shard-dim '*.experts.*=1'`` is ``FSDP(shard_dims=...)`` on memsim's side and the same
``shard_placement_fn`` (``Shard(DIM)`` for the parameters whose names match, by ``fnmatch``) on
PyTorch's. ``--bf16``: the model in bf16 on both sides (memsim's ``bf16-true``); the fake
kernel of transformers' grouped expert matmul (``torch._grouped_mm``) takes bf16 only, so the
Mixtral comparison needs it.

Why ``device="cpu"`` in memsim: the PyTorch simulation runs on CPU fake tensors (a CPU build),
so it has CPU kernels and no allocator rounding; memsim's default ``device="cuda"`` models CUDA
kernel choices and the caching allocator's 512-byte rounding, which the CPU simulation lacks.

The optimizer is ``torch.optim.AdamW(foreach=False)`` on both sides. Its single-tensor step reads
the step count with ``.item()``, which a plain ``FakeTensorMode`` refuses; the PyTorch side
therefore answers that read with the value 1.0 (``torch.optim.adam._get_value`` is wrapped for
fake tensors only), as memsim's ``_local_scalar_dense`` rule does. A real ``.item()`` allocates
nothing, so the memory is unaffected. Nothing else of memsim is used on the PyTorch side (memsim's
Hugging Face mask patches, ``tracer.hf``, make no difference for this model and input: checked).

Measured on a 2-core CPU machine (torch 2.13.0+cpu, transformers 5.24.0), 32 layers, S=2048,
2026-12-06: dp=8: 37,622,668,944 B on both sides (ratio 1.000000), memsim's analysis 2.6 s
(subprocess 6.5 s), FSDPMemTracker 7.6 s (subprocess 10.8 s); dp=16: 32,568,857,232 B on both
sides; the whole script about 20 s per world size. Until that day the PyTorch side deleted the
warm-up's output before the measured step, which memsim models with ``keep_outputs=False``
only; both sides read 36,549,201,556 (dp=8) and 31,444,794,004 B (dp=16) before memsim's default
loop kept the previous output (2026-12-06, 637c9e8), and the benchmark was not re-run in between.

``--model mixtral-8x22b --layers 56 --dp 64 --bf16 --seq 4096`` (2026-12-06): 323,718,381,460 B
on both sides, 301.486 GiB (parameters 33,990,300,864 B per rank: the 8 experts of each layer
padded to one per rank); with ``--shard-dim '*.experts.*=1'`` 133,965,389,328 B on both sides,
124.765 GiB (parameters 4,395,291,840 B); memsim's analysis 8-9 s, the tracker 18-25 s. The
``--model deepseek-v3 --layers 61 --dp 256 --bf16 --seq 4096`` (the same day): 846,907,178,852 B
(788.744 GiB: no checkpointing) on both sides, parameters 5,243,049,656 B per rank; memsim 18.9 s
of analysis (660 MiB), the tracker 41.0 s; with ``--layers 4`` (one MoE layer) 114,059,676,168 B
on both. The
PyTorch side casts the model built in fp32 to bf16, as memsim's ``bf16-true`` does: built under
a bf16 default dtype instead, the rotary ``inv_freq`` buffer stays fp32 and that program's
peak is 256 B lower.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


MODELS = {
    "llama2-7b": ("Llama", dict(hidden_size=4096, intermediate_size=11008,
                                num_attention_heads=32, num_key_value_heads=32,
                                vocab_size=32000, max_position_embeddings=4096)),
    # Mixtral-8x22B's published config (mistralai/Mixtral-8x22B-v0.1: 56 layers)
    "mixtral-8x22b": ("Mixtral", dict(hidden_size=6144, intermediate_size=16384,
                                      num_attention_heads=48, num_key_value_heads=8,
                                      num_local_experts=8, num_experts_per_tok=2,
                                      vocab_size=32768, max_position_embeddings=65536,
                                      rope_theta=1e6)),
    # DeepSeek-V3's published config (deepseek-ai/DeepSeek-V3: 61 layers, the first 3 dense)
    "deepseek-v3": ("DeepseekV3", dict(hidden_size=7168, intermediate_size=18432,
                                       moe_intermediate_size=2048, n_routed_experts=256,
                                       n_shared_experts=1, num_experts_per_tok=8,
                                       num_attention_heads=128, num_key_value_heads=128,
                                       kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                       qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
                                       first_k_dense_replace=3, n_group=8, topk_group=4,
                                       routed_scaling_factor=2.5,
                                       max_position_embeddings=163840)),
}


def build(args) -> torch.nn.Module:
    kind, kw = MODELS[args.model]
    cfg = getattr(transformers, f"{kind}Config")(num_hidden_layers=args.layers, **kw)
    return getattr(transformers, f"{kind}ForCausalLM")(cfg)


def shard_dims(args) -> tuple:
    out = []
    for text in args.shard_dim or ():
        pattern, _, dim = text.rpartition("=")
        out.append((pattern, int(dim)))
    return tuple(out)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- memsim ---------------------------------------------------------------------------------------
def run_memsim(args) -> dict:
    from memsim.strategies import FSDP, analyze

    with torch.device("meta"):
        model = build(args)
    t0 = time.perf_counter()
    report = analyze(model, {"input_ids": ("int64", [1, "S"]), "labels": ("int64", [1, "S"])},
                     fsdp=FSDP(dp=args.dp[0], shard_dims=shard_dims(args)), device="cpu",
                     inference=False, optimizer=adamw,
                     precision="bf16-true" if args.bf16 else "32-true")
    t_sym = time.perf_counter() - t0
    t0 = time.perf_counter()
    at = report.at(S=args.seq)["train"]
    t_eval = time.perf_counter() - t0
    return {"time_s": t_sym, "eval_s": t_eval, "rss_mib": rss_mib(),
            "regimes": len(report.train.candidates),
            "peak_formula": str(report.train.peak),
            **{k: int(v) for k, v in at.items()}}


# -- PyTorch: FSDPMemTracker under FakeTensorMode ---------------------------------------------
@contextlib.contextmanager
def item_reads_one():
    """AdamW's single-tensor step calls ``_get_value(step_t)`` (``.item()``): 1.0 for fakes."""
    import torch.optim.adam as adam_mod
    from torch._subclasses.fake_tensor import FakeTensor

    orig = adam_mod._get_value

    def _get_value(x):
        if isinstance(x, FakeTensor):
            return 1.0
        return orig(x)

    adam_mod._get_value = _get_value
    try:
        yield
    finally:
        adam_mod._get_value = orig


def run_pytorch(args) -> dict:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fnmatch

    from torch.distributed.tensor import Shard

    dp, seq = args.dp[0], args.seq
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    mesh = init_device_mesh("cpu", (dp,))          # outside FakeTensorMode
    t0 = time.perf_counter()
    with FakeTensorMode(), item_reads_one():
        model = build(args)
        if args.bf16:
            # cast after building, as memsim's bf16-true does (model.to(dtype): floating
            # buffers too, such as the rotary inv_freq, which a model built under a bf16
            # default dtype keeps in fp32: its peak differs by a few hundred bytes); by hand,
            # as Module.to cannot swap FakeTensor parameters
            for mod in model.modules():
                for k, t in mod._parameters.items():
                    if t is not None and t.is_floating_point():
                        mod._parameters[k] = torch.nn.Parameter(t.to(torch.bfloat16),
                                                                t.requires_grad)
                for k, t in mod._buffers.items():
                    if t is not None and t.is_floating_point():
                        mod._buffers[k] = t.to(torch.bfloat16)
        placed = {}
        for name, p in model.named_parameters():
            dim = next((d for pat, d in shard_dims(args) if fnmatch.fnmatchcase(name, pat)), 0)
            if dim:
                placed[id(p)] = Shard(dim)
        kw = {"shard_placement_fn": lambda p: placed.get(id(p))} if placed else {}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        opt = adamw(model.parameters())
        ids = torch.zeros(1, seq, dtype=torch.int64)
        labels = torch.zeros(1, seq, dtype=torch.int64)
        mt = FSDPMemTracker(model, opt)
        mt.track_inputs((ids, labels))

        with mt:                  # warm-up: optimizer state and gradients come to exist
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels)
            loss = out.loss
            loss.backward()
            opt.step()            # out and loss still referenced, as in a plain loop
        t_warm = time.perf_counter() - t0
        t1 = time.perf_counter()
        mt.reset_mod_stats()      # per-module stats of the warm-up (it refuses a second call)
        with mt:                  # re-entering resets the peak to the current figure
            start = mt.get_tracker_snapshot("current")
            # the loop's next step, inline: the warm-up's out and loss are rebound when the
            # forward returns, as memsim's default loop models (until 2026-12-06 they were
            # deleted first, a loop memsim models with keep_outputs=False)
            opt.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels)
            loss = out.loss
            loss.backward()
            opt.step()
        t_step = time.perf_counter() - t1
        del out, loss
        peak = mt.get_tracker_snapshot("peak")
    dev = torch.device("cpu")
    by_type = {str(getattr(k, "value", k)): int(v) for k, v in peak.get(dev, {}).items()}
    start = {str(getattr(k, "value", k)): int(v) for k, v in start.get(dev, {}).items()}
    dist.destroy_process_group()
    return {"time_s": t_warm + t_step, "warmup_s": t_warm, "step_s": t_step, "rss_mib": rss_mib(),
            "peak": by_type.get("Total", 0), "peak_by_type": by_type, "start_by_type": start}


# -- driver ---------------------------------------------------------------------------------------
def child(part: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.fsdp7b", "--_part", part, "--layers",
           str(args.layers), "--dp", str(args._dp), "--seq", str(args.seq),
           "--threads", str(args.threads), "--model", args.model]
    cmd += ["--bf16"] if args.bf16 else []
    for text in args.shard_dim or ():
        cmd += ["--shard-dim", text]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"{part} subprocess failed (rc {p.returncode})")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def gib(n: int) -> str:
    return f"{n:,} B ({n / 2**30:.3f} GiB)"


def report(args, dp: int, ms: dict, pt: dict) -> None:
    dims = f", shard_dims {shard_dims(args)}" if args.shard_dim else ""
    print(f"\n=== {args.model} sizes, {args.layers} layers, FSDP2 dp={dp}{dims}, B=1, "
          f"S={args.seq}, {'bf16' if args.bf16 else 'fp32'}, AdamW(foreach=False), memsim "
          f"device='cpu' ===")
    print(f"memsim symbolic analysis (train only): {ms['time_s']:.1f} s "
          f"(subprocess wall {ms['wall_s']:.1f} s), peak RSS {ms['rss_mib']:.0f} MiB, "
          f"{ms['regimes']} regime(s); evaluating at the point: {ms['eval_s'] * 1e3:.1f} ms")
    f = ms["peak_formula"]
    print(f"memsim train.peak formula: {f if len(f) <= 300 else f[:300] + ' ...'}")
    print(f"memsim train.peak at S={args.seq}: {gib(ms['peak'])}")
    print(f"FSDPMemTracker (FakeTensorMode, fake PG, one point): {gib(pt['peak'])}; "
          f"{pt['time_s']:.1f} s (warm-up step incl. model build and sharding "
          f"{pt['warmup_s']:.1f} s, measured step {pt['step_s']:.1f} s; subprocess wall "
          f"{pt['wall_s']:.1f} s), peak RSS {pt['rss_mib']:.0f} MiB")
    diff = ms["peak"] - pt["peak"]
    print(f"ratio memsim/FSDPMemTracker: {ms['peak'] / pt['peak']:.6f}; difference "
          f"{diff:+,} B ({diff / 2**20:+.3f} MiB)")
    s = pt["start_by_type"]
    ref = {"parameters": s.get("Sharded Param", 0),
           "gradients": s.get("Sharded Grad", 0) + s.get("Unsharded Grad", 0),
           "optimizer_states": s.get("OptState", 0)}
    print("per rank at the start of the step      memsim        FSDPMemTracker   diff")
    for k, v in ref.items():
        print(f"  {k:<20} {ms[k]:>18,} {v:>18,} {ms[k] - v:>+10,}")
    print(f"  (memsim gradients: those alive at the optimizer step; FSDPMemTracker's: the "
          f"previous step's, alive when this one starts)")
    print(f"FSDPMemTracker peak by type: "
          + ", ".join(f"{k} {v:,}" for k, v in pt["peak_by_type"].items() if v))
    print(f"FSDPMemTracker start by type: "
          + ", ".join(f"{k} {v:,}" for k, v in s.items() if v))
    print(f"memsim activation_peak {ms['activation_peak']:,}, saved_activations "
          f"{ms['saved_activations']:,}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dp", type=int, nargs="+", default=[8])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama2-7b")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--shard-dim", action="append", metavar="PATTERN=DIM")
    ap.add_argument("--_part", choices=["memsim", "pytorch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args._part:
        res = run_memsim(args) if args._part == "memsim" else run_pytorch(args)
        print(json.dumps(res))
        return
    for dp in args.dp:
        args._dp = dp
        ms = child("memsim", args)
        pt = child("pytorch", args)
        report(args, dp, ms, pt)


if __name__ == "__main__":
    main()
