"""Can ONE rank's pipelining program run in one process with the fake process group? (The way
memsim traces the other strategies, for pipeline parallelism: issue 44.)

  python3 -m benchmarks.pipeline_fake_rank real --world 2 --rank 1 --schedule 1F1B --mode patched
  python3 -m benchmarks.pipeline_fake_rank fake --world 2 --rank 0 --mode patched
      (the same under FakeTensorMode+ShapeEnv)

mode:
  dynamic  PipelineStage without input_args/output_args (shape inference at the first step)
  static   input_args/output_args given as meta tensors (inference skipped IF the vote says so)
  patched  static + the warm-up vote forced to STATIC (PipelineStage._warmup_backward_result
           returns ones); needed because a fake recv leaves its buffer as allocated (zeros)
  infer    dynamic + _recv_meta answered locally from a shape oracle (no peer needed)
  symstatic (fake-sym only) patched, with input_args/output_args fake tensors whose micro-batch
           size is the symbolic batch // M, so the recv buffers stay symbolic

"real" runs real tensors and measures the rank with real_pipeline.StorageCounter, printing
the same fields as benchmarks/pipeline_real.py so the numbers can be compared with a gloo run.
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks import pipeline_real as rp


def init_fake(rank, world):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def patch_vote(mode_name):
    """Skip the warm-up vote (two dist.recv + a .item() on the result, schedules.py:341-386)
    and set the inference mode every rank would agree on."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    mode = InferenceMode.STATIC if mode_name == "static" else InferenceMode.DYNAMIC

    def _warmup_p2p(self, stages, has_backward, p2p_done):
        for st in stages:
            st._inference_mode = mode
    _PipelineSchedule._warmup_p2p = _warmup_p2p


def patch_vote_static():
    patch_vote("static")


def patch_recv_meta(cfg, num_stages):
    """Answer _recv_meta from a local oracle: the neighbouring stage's boundary tensor metas."""
    from torch.distributed.pipelining._utils import (
        _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas)
    from torch.distributed.pipelining.stage import PipelineStage
    mb = cfg["batch"] // cfg["M"]

    def meta_out(stage):  # output of `stage`
        n = cfg["classes"] if stage == num_stages - 1 else cfg["d"]
        return torch.empty(mb, n, device="meta", requires_grad=True)

    def _recv_meta(self, src_stage):
        if src_stage < self.stage_index:  # forward: outputs of the previous stage
            return _StageForwardMeta(forward_metas=extract_tensor_metas((meta_out(src_stage),)))
        # backward: the grad of this stage's output = input grad of the next stage
        g = torch.empty(mb, cfg["d"], device="meta")
        return _StageBackwardMeta(backward_metas=extract_tensor_metas((g,)))
    PipelineStage._recv_meta = _recv_meta
    PipelineStage._send_meta = lambda self, meta, dst: None
    patch_vote("dynamic")


def patch_hold_sends():
    """Make the fake PG's works hold their tensors like gloo's (memsim's own HeldWork)."""
    from torch.distributed.pipelining import schedules

    from memsim.strategies.pipeline import holding
    schedules._batch_p2p = holding(schedules._batch_p2p)


def build(cfg, rank, world, fake_mode=None):
    from torch.distributed.pipelining import PipelineStage
    name = cfg["schedule"]
    ids, num_stages = rp.stage_ids(name, rank, world)
    full = rp.full_model(cfg["blocks"], cfg["d"], cfg["classes"])
    mods = [rp.stage_module(full, s, num_stages) for s in ids]
    if fake_mode is not None:  # parameters -> fake tensors
        for m in mods:
            for mod in m.modules():
                for k, p in list(mod._parameters.items()):
                    if p is not None:
                        mod._parameters[k] = nn.Parameter(
                            fake_mode.from_tensor(p.detach(), static_shapes=True))
    mb = cfg["batch"] // cfg["M"]
    stages = []
    for s, m in zip(ids, mods):
        kw = {}
        if cfg["mode"] == "symstatic":  # metas with the symbolic micro-batch size
            with fake_mode:
                kw["input_args"] = torch.empty(cfg["mb_sym"], cfg["d"], requires_grad=s > 0)
                kw["output_args"] = torch.empty(
                    cfg["mb_sym"], cfg["classes"] if s == num_stages - 1 else cfg["d"],
                    requires_grad=True)
        if cfg["mode"] in ("static", "patched"):
            kw["input_args"] = torch.empty(mb, cfg["d"], device="meta", requires_grad=s > 0)
            kw["output_args"] = torch.empty(
                mb, cfg["classes"] if s == num_stages - 1 else cfg["d"], device="meta",
                requires_grad=True)
        stages.append(PipelineStage(m, s, num_stages, torch.device("cpu"), **kw))
    params = [p for m in mods for p in m.parameters()]
    sched = rp.make_schedule(name, stages, cfg["M"], nn.CrossEntropyLoss())
    return stages, params, sched, num_stages


def real(cfg, rank, world):
    init_fake(rank, world)
    stages, params, sched, num_stages = build(cfg, rank, world)
    if cfg["mode"] == "patched":
        patch_vote_static()
    if cfg["mode"] == "infer":
        patch_recv_meta(cfg, num_stages)
    if cfg.get("hold_sends"):
        patch_hold_sends()
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["batch"], cfg["d"], generator=g)
    y = torch.randint(0, cfg["classes"], (cfg["batch"],), generator=g)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    res = {}
    for step in ["cold", "steady"] + [f"step{i}" for i in range(3, cfg.get("steps", 2) + 1)]:
        gc.collect(); gc.disable()
        c = rp.StorageCounter()
        rp.register_all(c)
        start = c.cur
        trace = []
        rp.instrument(stages, c, trace)
        with c:
            c.set_phase("zero_grad")
            opt.zero_grad(set_to_none=True)
            c.set_phase("schedule.step")
            losses = [] if has_last else None
            kw = dict(target=y, losses=losses) if has_last else {}
            out = sched.step(*((x,) if has_first else ()), **kw)
            c.set_phase("opt.step")
            opt.step()
            del out, losses, kw
        end_before_gc = c.cur
        gc.collect()
        cyclic = end_before_gc - c.cur
        gc.enable()
        print(f"rank {rank}/{world} {cfg['schedule']} M={cfg['M']} {step}: start={start} "
              f"peak={c.peak} ({c.peak_phase}) pp_peak=+{c.phase_peaks['schedule.step'] - start} "
              f"end={end_before_gc} freed_by_gc={cyclic}")
        if cfg.get("trace"):
            for t in trace:
                print("   ", t)
        res[step] = dict(start=start, peak=c.peak, pp_peak=c.phase_peaks["schedule.step"],
                         end=c.cur, trace=[(t["a"], t["before"], t["peak"], t["after"])
                                           for t in trace])
        if c.events is not None and step == "steady":
            import json
            with open(f"events_fake_r{rank}.json", "w") as f:   # the per-event trace, here
                json.dump(c.events, f)
        for st in stages:
            for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                st.__dict__.pop(meth, None)
        c.close()
    if cfg.get("json"):
        import json
        print("JSON", json.dumps(res))


def fake(cfg, rank, world, symbolic):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, StatelessSymbolicContext, DimDynamic
    init_fake(rank, world)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = torch.randn(cfg["batch"], cfg["d"])
    y = torch.randint(0, cfg["classes"], (cfg["batch"],))
    if symbolic:
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
        fx = mode.from_tensor(x, symbolic_context=ctx)
        fy = mode.from_tensor(y, symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC]))
    else:
        fx, fy = mode.from_tensor(x, static_shapes=True), mode.from_tensor(y, static_shapes=True)
    cfg["mb_sym"] = fx.shape[0] // cfg["M"]
    stages, params, sched, num_stages = build(cfg, rank, world, fake_mode=mode)
    if cfg["mode"] in ("patched", "symstatic"):
        patch_vote_static()
    if cfg["mode"] == "infer":
        patch_recv_meta(cfg, num_stages)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    with mode:
        opt = torch.optim.AdamW(params, lr=1e-3)
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            losses = [] if has_last else None
            kw = dict(target=fy, losses=losses) if has_last else {}
            out = sched.step(*((fx,) if has_first else ()), **kw)
            opt.step()
            print(f"rank {rank}/{world} step {step} OK; out={None if out is None else out.shape} "
                  f"grads={[tuple(p.grad.shape) for p in params[:2]]}")
    print("guards:", [str(g.expr) for g in mode.shape_env.guards][:12])
    print("recv buffer shapes:", [tuple(i.buffer.shape) for st in stages
                                  for infos in list(st.args_recv_info.values())[:1]
                                  + list(st.grad_recv_info.values())[:1]
                                  for i in infos if i.buffer is not None])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["real", "fake", "fake-sym"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--schedule", default="1F1B", choices=rp.ALL)
    ap.add_argument("-M", type=int, default=4)
    ap.add_argument("--mode", default="patched", choices=["dynamic", "static", "patched", "infer", "symstatic"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--hold-sends", action="store_true",
                    help="fake works keep their P2P tensors alive like gloo's works")
    a = ap.parse_args()
    cfg = dict(schedule=a.schedule, M=a.M, batch=a.batch, d=64, blocks=8, classes=16,
               mode=a.mode, trace=a.trace, json=a.json, steps=a.steps, hold_sends=a.hold_sends)
    torch.set_num_threads(1)
    try:
        if a.what == "real":
            real(cfg, a.rank, a.world)
        else:
            fake(cfg, a.rank, a.world, symbolic=a.what == "fake-sym")
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        print(f"FAILED: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
        keep = [fr for fr in tb if "pipelining" in fr.filename or "c10d" in fr.filename
                or "optim" in fr.filename or "fake_pg_probe" in fr.filename]
        for fr in keep[-7:] + tb[-1:]:
            print(f"   {fr.filename.split('site-packages/')[-1]}:{fr.lineno} {fr.name}: {fr.line}")
        sys.exit(1)


if __name__ == "__main__":
    main()
