"""Real per-rank memory of torch.distributed.pipelining schedules on CPU (gloo), standalone.

One process per rank (torch.multiprocessing.spawn, gloo, file:// rendezvous). The model is a
stack of N identical residual MLP blocks  y = x + Linear(4d,d)(GELU(Linear(d,4d)(x)))  plus a
head Linear(d, C) and CrossEntropy on the last stage. The N blocks are split evenly over the
pipeline stages (1 stage per rank for GPipe/1F1B, 2 per rank for the multi-stage schedules:
looped placement r, r+W for Interleaved1F1B / LoopedBFS / InterleavedZeroBubble, V placement
r, 2W-1-r for ZBVZeroBubble / DualPipeV). Every rank builds the full model from the same seed
and keeps its slices, so all configurations train the same network.

Each rank runs two training steps and measures both:
  step 1 ("cold"):   opt.zero_grad(set_to_none=True); schedule.step(...); opt.step()
                     (includes PipelineStage's metadata inference, recv buffer allocation and
                     the lazy creation of AdamW state)
  step 2 ("steady"): the same again; this is the per-step number memsim should model.
step(x) on the rank holding stage 0, step(target=y, losses=[]) on the rank holding the last
stage (both on rank 0 for V schedules), step() elsewhere.

Measurement (exact, storage level): a TorchDispatchMode adds the untyped storage of every tensor
an ATen op returns (once per distinct storage, by its nbytes) and a weakref.finalize on the
storage subtracts it when the storage is released (torch preserves the storage's PyObject while
the C++ storage lives, so the finalizer fires at the real free). Everything live before the step
(parameters, grads, AdamW state, stage recv buffers, inputs, any other tensor gc can see) is
registered at the start. Work.wait() is followed by a 1 ms sleep so gloo's threads drop their
references first; frees on a foreign thread are counted (0 in a clean run). Cyclic GC is
collected before and disabled during the step. Not counted: memory that never is a tensor
storage (gloo scratch, pickled metadata objects from send_object_list's ByteStorage._from_buffer,
allocator overhead).

The oracle memsim's pipeline parallelism is to be checked against (issue 44); its measurements
are in benchmarks/RESULTS.md. Usage (from the repository's root)::

  python3 -m benchmarks.pipeline_real --plain          # single-process tracker check
  python3 -m benchmarks.pipeline_real --world 2 --schedule 1F1B -M 4
  python3 -m benchmarks.pipeline_real --sweep --out results.json   # GPipe/1F1B/Interleaved1F1B
  python3 -m benchmarks.pipeline_real --sweep --schedules all      # every schedule in torch 2.13
  options: --static (give PipelineStage input_args/output_args as meta tensors: no inference),
           --no-return-outputs, --blocks 8 --d 64 --batch 8 --classes 16, --trace (per action)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import weakref
import warnings
warnings.filterwarnings("ignore", category=FutureWarning)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SINGLE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
VSHAPE = ("ZBVZeroBubble", "DualPipeV")
ALL = SINGLE + LOOPED + VSHAPE


# ------------------------------------------------------------------------------------------
# model

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def full_model(n_blocks, d, n_cls, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList([Block(d) for _ in range(n_blocks)] + [nn.Linear(d, n_cls)])


def stage_module(full, stage, num_stages):
    n_blocks = len(full) - 1
    assert n_blocks % num_stages == 0, "blocks must divide evenly over stages"
    k = n_blocks // num_stages
    mods = list(full[stage * k:(stage + 1) * k])
    if stage == num_stages - 1:
        mods.append(full[-1])  # the head
    return nn.Sequential(*mods)


def stage_ids(schedule, rank, world):
    if schedule in SINGLE:
        return [rank], world
    if schedule in LOOPED:
        return [rank, rank + world], 2 * world
    return [rank, 2 * world - 1 - rank], 2 * world  # V placement


# ------------------------------------------------------------------------------------------
# live-storage counter

class StorageCounter(TorchDispatchMode):
    def __init__(self, settle_s=1e-3):
        super().__init__()
        self.sizes, self.fins = {}, {}
        self.cur = self.peak = 0
        self.local_peak = 0
        self.phase, self.peak_phase = "start", "start"
        self.phase_peaks = {}
        self.main = threading.get_ident()
        self.lock = threading.RLock()
        self.foreign_frees = 0
        self.settle_s = settle_s
        self.events = [] if os.environ.get("PP_EVENTS") else None
        self._op = None

    def _bump(self):
        if self.cur > self.peak:
            self.peak, self.peak_phase = self.cur, self.phase
        self.local_peak = max(self.local_peak, self.cur)
        if self.cur > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.cur

    def set_phase(self, name):
        self.phase = name
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.cur)

    def see(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if type(t).__name__ == "FakeTensor":
            return
        st = t.untyped_storage()
        key, n = id(st), st.nbytes()
        with self.lock:
            old = self.sizes.get(key)
            if old is not None:
                if old != n:  # resized in place
                    self.sizes[key] = n
                    self.cur += n - old
                    self._bump()
                return
            self.sizes[key] = n
            self.fins[key] = weakref.finalize(st, self._free, key)
            self.cur += n
            self._bump()
            if self.events is not None and self._op is not None:
                self.events.append(("+", self._op, n, tuple(t.shape)))

    def _free(self, key):
        with self.lock:
            n = self.sizes.pop(key, 0)
            self.fins.pop(key, None)
            self.cur -= n
            if self.events is not None and n:
                self.events.append(("-", self.phase, n))
            if n and threading.get_ident() != self.main:
                self.foreign_frees += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        for t in tree_flatten(out)[0]:
            self.see(t)
        self._op = None
        return out

    def close(self):
        for f in list(self.fins.values()):
            f.detach()
        self.fins.clear()
        self.sizes.clear()


def storage_bytes(tensors):
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values()), set(seen)


def live_tensors():
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def register_all(counter, tensors=None):
    # (a function, so that no loop variable keeps the last tensor alive afterwards)
    for t in (live_tensors() if tensors is None else tensors):
        counter.see(t)


_orig_wait = None


def patch_wait(settle_s=1e-3):
    """Sleep briefly after every Work.wait() so gloo threads release buffers deterministically."""
    global _orig_wait
    Work = torch._C._distributed_c10d.Work
    if _orig_wait is not None:
        return
    _orig_wait = Work.wait

    def wait(self, *a, **k):
        r = _orig_wait(self, *a, **k)
        time.sleep(settle_s)
        return r
    Work.wait = wait


# ------------------------------------------------------------------------------------------
# one rank

def make_schedule(name, stages, M, loss_fn, return_outputs=True):
    import torch.distributed.pipelining as pp
    cls = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B",
           "Interleaved1F1B": "ScheduleInterleaved1F1B", "LoopedBFS": "ScheduleLoopedBFS",
           "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
           "ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}[name]
    cls = getattr(pp, cls)
    if name in SINGLE:
        return cls(stages[0], n_microbatches=M, loss_fn=loss_fn)
    return cls(stages, n_microbatches=M, loss_fn=loss_fn)


def instrument(stages, counter, trace):
    """Wrap the per-chunk stage methods to log live bytes and fwd_cache depth per action."""
    for st in stages:
        for meth, tag in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                          ("backward_weight_one_chunk", "W")):
            orig = getattr(st, meth)

            def wrapped(mb, *a, _orig=orig, _tag=tag, _st=st, **k):
                before = counter.cur
                counter.local_peak = counter.cur
                if counter.events is not None:
                    counter.events.append(("@", f"{_tag}{_st.stage_index}.{mb}", counter.cur))
                if _tag == "B" and k.get("full_backward", True) is False:
                    _tag = "I"
                r = _orig(mb, *a, **k)
                trace.append(dict(a=f"{_tag}{_st.stage_index}.{mb}", before=before,
                                  peak=counter.local_peak, after=counter.cur,
                                  inflight=len(_st.fwd_cache),
                                  inflight_rank=sum(len(x.fwd_cache) for x in stages),
                                  bwd_state=sum(len(x.backward_state) for x in stages)))
                return r
            setattr(st, meth, wrapped)


def rank_main(rank, world, cfg, init_file, out_dir):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        patch_wait()
        res = run_rank(rank, world, cfg)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # report, don't hang the others forever
        res = dict(rank=rank, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
        os._exit_code = 1
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if "error" in res:
        os._exit(1)


def run_rank(rank, world, cfg):
    from torch.distributed.pipelining import PipelineStage
    name, M, B, d = cfg["schedule"], cfg["M"], cfg["batch"], cfg["d"]
    ids, num_stages = stage_ids(name, rank, world)
    full = full_model(cfg["blocks"], d, cfg["classes"])
    mods = [stage_module(full, s, num_stages) for s in ids]
    del full
    stages = []
    mb = B // M
    for s, m in zip(ids, mods):
        kw = {}
        if cfg["static"]:
            # requires_grad=True matters: STATIC mode derives the grad metas from these, and
            # requires_grad=False means "no grad" (no grad recv buffer, no input grad sent)
            kw["input_args"] = torch.empty(mb, d, device="meta", requires_grad=s > 0)
            kw["output_args"] = torch.empty(mb, cfg["classes"] if s == num_stages - 1 else d,
                                            device="meta", requires_grad=True)
        stages.append(PipelineStage(m, s, num_stages, torch.device("cpu"), **kw))
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = make_schedule(name, stages, M, nn.CrossEntropyLoss(), cfg["return_outputs"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, d, generator=g)
    y = torch.randint(0, cfg["classes"], (B,), generator=g)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)

    def one_step():
        losses = [] if has_last else None
        args = (x,) if has_first else ()
        kw = dict(target=y, losses=losses) if has_last else {}
        out = sched.step(*args, return_outputs=cfg["return_outputs"], **kw)
        return out, losses

    results = {}
    for step_name in ["cold", "steady"] + [f"step{i}" for i in range(3, cfg.get("steps", 2) + 1)]:
        gc.collect()
        gc.disable()
        trace = []
        c = StorageCounter()
        # register everything alive now
        p_bytes, p_ids = storage_bytes(params)
        g_bytes, g_ids = storage_bytes([p.grad for p in params if p.grad is not None])
        s_bytes, s_ids = storage_bytes([v for st in opt.state.values() for v in st.values()])
        bufs = []
        for st in stages:
            for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
                bufs += [i.buffer for i in infos if i.buffer is not None]
        b_bytes, b_ids = storage_bytes(bufs)
        del bufs  # holding them would keep V-schedule buffers alive past their local hand-off
        i_bytes, i_ids = storage_bytes([x, y])
        everything = live_tensors()
        register_all(c, everything)
        start = c.cur
        other_ids = set(c.sizes) - p_ids - g_ids - s_ids - b_ids - i_ids
        other = sum(c.sizes[k] for k in other_ids)
        other_detail = sorted({id(t.untyped_storage()): f"{tuple(t.shape)}:{t.dtype}"
                               for t in everything if t.device.type != "meta"
                               and id(t.untyped_storage()) in other_ids}.values())[:10]
        del everything
        instrument(stages, c, trace)
        with c:
            c.set_phase("zero_grad")
            opt.zero_grad(set_to_none=True)
            c.set_phase("schedule.step")
            out, losses = one_step()
            after_pp = c.cur
            grads_after, _ = storage_bytes([p.grad for p in params if p.grad is not None])
            c.set_phase("opt.step")
            opt.step()
            end_with_out = c.cur
            del out, losses
            end = c.cur
        before_gc = c.cur  # gc is still disabled: anything freed by the collect below was cyclic
        garbage_types = None
        if os.environ.get("PP_GCDEBUG"):
            from collections import Counter
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            garbage_types = Counter(type(o).__name__ for o in gc.garbage).most_common(25)
            gc.set_debug(0)
            gc.garbage.clear()
        gc.collect()
        cyclic = before_gc - c.cur
        for st in stages:  # un-instrument
            for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                st.__dict__.pop(meth, None)
        gc.enable()
        bufs = []
        for st in stages:
            for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
                bufs += [i.buffer for i in infos if i.buffer is not None]
        bufs_after, _ = storage_bytes(bufs)
        del bufs
        st_after, _ = storage_bytes([v for st in opt.state.values() for v in st.values()])
        results[step_name] = dict(
            start=start, peak=c.peak, peak_phase=c.peak_phase, phase_peaks=c.phase_peaks,
            end=end, end_with_out=end_with_out, after_schedule_step=after_pp,
            params=p_bytes, grads_at_start=g_bytes, grads_after_step=grads_after,
            opt_states_at_start=s_bytes, opt_states_after=st_after,
            recv_buffers_at_start=b_bytes, recv_buffers_after=bufs_after,
            garbage_types=garbage_types,
            inputs=i_bytes, other_at_start=other, other_detail=other_detail, freed_by_gc_after=cyclic,
            foreign_frees=c.foreign_frees,
            max_inflight={str(s.stage_index): max([t["inflight"] for t in trace
                                                   if t["a"][1:].split(".")[0] == str(s.stage_index)]
                                                  or [0]) for s in stages},
            max_inflight_rank=max([t["inflight_rank"] for t in trace] or [0]),
            max_bwd_state_rank=max([t["bwd_state"] for t in trace] or [0]),
            trace=trace if cfg["trace"] else None,
            events=c.events,
            over_start=c.peak - start,
        )
        c.close()
    return dict(rank=rank, stages=ids, num_stages=num_stages, params=sum(p.numel() for p in params),
                n_param_tensors=len(params), **results)


def run_config(cfg, world):
    """Spawn `world` ranks for one configuration; returns the list of per-rank dicts."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rdzv")
        ctx = mp.spawn(rank_main, args=(world, cfg, init_file, tmp), nprocs=world, join=False)
        deadline = time.time() + cfg.get("timeout", 240)
        while True:
            try:
                if ctx.join(timeout=2):
                    break
            except Exception:  # a rank failed: the others were terminated by spawn
                break
            if time.time() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                break
        out = []
        for r in range(world):
            fn = os.path.join(tmp, f"rank{r}.json")
            out.append(json.load(open(fn)) if os.path.exists(fn) else dict(rank=r, error="no output"))
        return out


# ------------------------------------------------------------------------------------------
# single-process check of the counter

def plain_check(cfg):
    torch.set_num_threads(1)
    full = full_model(cfg["blocks"], cfg["d"], cfg["classes"])
    model = nn.Sequential(*full)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randn(cfg["batch"], cfg["d"])
    y = torch.randint(0, cfg["classes"], (cfg["batch"],))
    P = sum(p.numel() for p in params) * 4
    n = len(params)
    rows = []
    for step in ("cold", "steady"):
        gc.collect(); gc.disable()
        c = StorageCounter()
        register_all(c)
        start = c.cur
        with c:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            del loss
        gc.enable()
        pb, _ = storage_bytes(params)
        gb, _ = storage_bytes([p.grad for p in params])
        sb, _ = storage_bytes([v for s in opt.state.values() for v in s.values()])
        xb, _ = storage_bytes([x, y])
        rows.append((step, start, c.peak, c.cur, pb, gb, sb, xb))
        print(f"{step:6s} start={start} peak={c.peak} end={c.cur} params={pb} grads={gb} "
              f"states={sb} inputs={xb}")
        c.close()
    exp_end = P + P + (2 * P + 4 * n) + rows[0][7]
    print(f"expected at end: params {P} + grads {P} + AdamW (2P + 4 B x {n} step scalars = "
          f"{2 * P + 4 * n}) + inputs {rows[0][7]} = {exp_end}")
    ok = all(r[3] == exp_end for r in rows) and rows[1][1] == exp_end
    print("tracker check:", "OK" if ok else "MISMATCH")
    return ok


# ------------------------------------------------------------------------------------------

def fmt_table(name, world, M, ranks):
    lines = []
    for r in ranks:
        if "error" in r:
            lines.append(f"{name:22s} W={world} M={M} rank {r['rank']}: ERROR {r['error'][:200]}")
            continue
        s, c = r["steady"], r["cold"]
        lines.append(
            f"{name:22s} W={world} M={M} r{r['rank']} st{r['stages']}: params={s['params']} "
            f"grads={s['grads_after_step']} opt={s['opt_states_after']} recvbuf={s['recv_buffers_after']} "
            f"| steady start={s['start']} peak={s['peak']} (+{s['over_start']}, {s['peak_phase']}) "
            f"pp_peak=+{s['phase_peaks']['schedule.step'] - s['start']} "
            f"inflight={s['max_inflight']}/{s['max_inflight_rank']}+W{s['max_bwd_state_rank']} | cold peak={c['peak']} ({c['peak_phase']}) "
            f"gc={s['freed_by_gc_after']} foreign={s['foreign_frees']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--schedule", default="1F1B", choices=ALL)
    ap.add_argument("-M", "--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--no-return-outputs", dest="return_outputs", action="store_false")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--steps", type=int, default=2, help="measured steps (>= 2)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--Ms", default="4,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = dict(schedule=a.schedule, M=a.microbatches, batch=a.batch, d=a.d, blocks=a.blocks,
               classes=a.classes, static=a.static, return_outputs=a.return_outputs,
               trace=a.trace, steps=a.steps)
    if a.plain:
        sys.exit(0 if plain_check(cfg) else 1)
    runs = []
    if a.sweep:
        scheds = ALL if a.schedules == "all" else a.schedules.split(",")
        for w in map(int, a.worlds.split(",")):
            for M in map(int, a.Ms.split(",")):
                for s in scheds:
                    runs.append((dict(cfg, schedule=s, M=M), w))
    else:
        runs.append((cfg, a.world))
    allres = []
    for c, w in runs:
        t0 = time.time()
        ranks = run_config(c, w)
        print(fmt_table(c["schedule"], w, c["M"], ranks), f"  [{time.time() - t0:.1f}s]",
              flush=True)
        allres.append(dict(cfg=c, world=w, ranks=ranks))
        if a.out:  # after every configuration
            with open(a.out, "w") as f:
                json.dump(allres, f, indent=1)


if __name__ == "__main__":
    main()
