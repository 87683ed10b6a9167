"""Benchmark: memsim's optimal checkpointing plan against PyTorch's own SAC estimator + ILP.

For a small GPT (tests/support/zoo.py TinyGPT, more layers) at a fixed (B, S) and budgets that are
fractions of the no-checkpointing peak, prints side by side:

- memsim: ``optimal_plan`` (fewest leading blocks, fully checkpointed), its predicted peak and
  recompute FLOPs as a share of the step's FLOPs;
- PyTorch: ``torch.distributed._tools`` (MemTracker + RuntimeEstimator + SACEstimator ->
  ``ilp_utils.aggregate_stats`` -> ``sac_ilp.sac_milp``): which modules it checkpoints and what
  share of each one's activation memory it discards, its peak bound and its recompute-time
  estimate as a share of the step's estimated time.

Then both plans are applied for real on CPU (memsim's with ``apply_checkpointing``, PyTorch's with
``torch.utils.checkpoint`` + ``create_selective_checkpoint_contexts``, the per-op save/recompute
list from ``sac_ilp.get_optimal_checkpointing_policy_per_module``) and the real peak of one eager
AdamW step is measured with ``analysis.measure.measure_train``. Run on demand (not a test)::

    pip install pulp pwlf      # sac_ilp and SACEstimator's trade-off fit need them
    python -m benchmarks.sac [--layers 8 --d 128 --B 4 --S 128 --fracs 0.85,0.7]

On CPU PyTorch's estimators cannot run as shipped: both runtime modes need CUDA
(``operator-level-cost-model``: "AssertionError: Roofline estimation needs to access CUDA
capabilities to make estimations"; ``operator-level-benchmark``: "RuntimeError: Tried to
instantiate dummy base class Event", torch.cuda.Event). The benchmark checks that, then runs
PyTorch's own roofline formula (``torch.utils._runtime_estimation``: max(FLOP time, transfer
time) per op) without the CUDA check, with H100 SXM datasheet constants (fp32 67 TFLOP/s,
3350 GB/s) in place of the device queries. Everything else (memory tracking, SAC statistics,
trade-off curves, the ILP) is PyTorch's code, unchanged.

The budget is the same number of bytes for both: ``frac`` x the real no-checkpointing peak (which
memsim predicts exactly, checked here). PyTorch's ILP leaves optimizer states out of its memory
model (ilp_utils: "Memory does not include e.g., optimizer states"), so it is given the budget
minus the AdamW states, and its claim is its bound plus those states.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import time
from contextlib import redirect_stdout

import torch

from memsim.analysis import analyze
from memsim.strategies.checkpoint import apply_checkpointing, blocks, optimal_plan, step_flops

from tests.support import zoo
from tests.support.oracles.measure import example_inputs, materialize, measure_train

GPT = {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])}
H100_FP32_TFLOPS, H100_DRAM_GBPS = 67.0, 3350.0


# ---------------------------------------------------------------- PyTorch's estimators on CPU

def cuda_only_errors() -> dict[str, str]:
    """Run PyTorch's two runtime modes as shipped, on this machine: the error each raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.sac_estimator import SACEstimator

    import warnings

    out = {}
    warnings.filterwarnings("ignore", message="global module forward hook")
    for mode in ("operator-level-cost-model", "operator-level-benchmark"):
        try:
            with FakeTensorMode(), redirect_stdout(io.StringIO()):
                m = zoo.TinyGPT(layers=1)
                x = torch.zeros(1, 4, dtype=torch.int64)
                with SACEstimator()(mode):
                    m(x, x)
            out[mode] = "ran"
        except Exception as e:  # noqa: BLE001 - reported as is
            out[mode] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return out


def _roofline_without_cuda_check():
    """PyTorch's ``RuntimeEstimator._roofline_estimate`` minus its CUDA assertion, the device's
    peak FLOP/s and DRAM bandwidth fixed to an H100's datasheet figures."""
    import torch.utils._pytree as pytree
    import torch.utils._runtime_estimation as rt

    rt.get_device_tflops = lambda dtype: H100_FP32_TFLOPS
    rt.get_gpu_dram_gbps = lambda: H100_DRAM_GBPS

    def estimate(func, args, kwargs):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in rt._IGNORE_OPS:
            return out, 0.0
        flat_in, _ = pytree.tree_flatten((args, kwargs))
        flat_out, _ = pytree.tree_flatten(out)
        transfer = rt.get_transfer_time(flat_in, flat_out)
        dtypes = {t.dtype for t in flat_out
                  if isinstance(t, torch.Tensor) and t.dtype in rt._FLOAT_TYPES}
        compute = rt.get_compute_time(func._overloadpacket, args, kwargs, out, dtypes)
        return out, max(transfer, compute) / 1e6  # ms
    return estimate


def pytorch_stats(make, b: int, s: int):
    """PyTorch's pipeline (as in its test_sac_ilp.py) under FakeTensorMode on CPU: the module
    graph for the ILP and the SAC estimator (per-module op statistics)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    estimate = _roofline_without_cuda_check()
    with FakeTensorMode(), redirect_stdout(io.StringIO()):
        model = make()
        # SGD without momentum: no optimizer state (not in the ILP's model anyway); AdamW's
        # step.item() cannot run under a plain FakeTensorMode
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        idx = torch.zeros(b, s, dtype=torch.int64)
        tgt = torch.zeros(b, s, dtype=torch.int64)
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for i in range(2):
                model(idx, tgt).backward()
                opt.step()
                opt.zero_grad()
                if i == 0:
                    mt.reset_mod_stats()
        rt = RuntimeEstimator()
        rt("operator-level-cost-model")
        rt._estimate = estimate
        with rt:
            model(idx, tgt).backward()
        sac = SACEstimator()
        sac("operator-level-cost-model")
        sac._estimate_runtime = estimate
        with sac:
            loss = model(idx, tgt)
        loss.backward()
    graph = parse_module_info(aggregate_stats(model, mt, rt, sac, torch.device("cpu")))
    return graph, sac, type(model).__name__


def rcp(node, r: float) -> float:
    """The ILP's recompute share of a module at discard ratio ``r`` (its piecewise-linear fit,
    the constraint ``rcp_i >= slope * r_i + intercept``)."""
    return max([0.0] + [sl * r + ic for sl, ic in zip(node["slopes"], node["intercepts"])])


def pytorch_recompute_ms(graph, decisions: dict[str, float]) -> float:
    """The ILP objective of ``decisions`` (unrounded: sac_milp rounds it to 0.01 ms)."""
    return sum(graph.name2node[f]["sac_runtime"] * rcp(graph.name2node[f], r)
               for f, r in decisions.items())


# ---------------------------------------------------------------- applying PyTorch's plan

def _sac_forward(mod, policy, names, *args, **kwargs):
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    counters = {False: 0, True: 0}

    def policy_fn(ctx, func, *a, **k):
        if func in OPS_TO_ALWAYS_SKIP:
            return CheckpointPolicy.PREFER_RECOMPUTE
        i = counters[ctx.is_recompute]
        counters[ctx.is_recompute] += 1
        if i >= len(policy) or func._overloadpacket.__name__ != names[i]:
            raise RuntimeError(f"SAC policy out of step at op {i}: {func} vs "
                               f"{names[i] if i < len(names) else 'end'}")
        return CheckpointPolicy.MUST_SAVE if policy[i] else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        counters[False] = counters[True] = 0
        return create_selective_checkpoint_contexts(policy_fn)

    return checkpoint(type(mod).forward, mod, *args, use_reentrant=False,
                      context_fn=context_fn, **kwargs)


def apply_pytorch_plan(model, plan: dict[str, tuple]):
    """``plan``: path -> None (whole module) or (per-op save list, op names)."""
    full = [p for p, v in plan.items() if v is None]
    apply_checkpointing(model, full)
    mods = dict(model.named_modules())
    for path, v in plan.items():
        if v is not None:
            mods[path].forward = functools.partial(_sac_forward, mods[path], *v)
    return model


def pytorch_plan(graph, sac, root: str, decisions: dict[str, float]) -> dict[str, tuple]:
    """Module paths (memsim's spelling) and the per-op policy for each partial decision."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    out = {}
    for fqn, r in decisions.items():
        path = fqn[len(root) + 1:] if fqn.startswith(root + ".") else ""
        if r >= 1 - 1e-4:
            out[path] = None
        else:
            st = sac.sac_mod_stats[fqn]
            with redirect_stdout(io.StringIO()):
                pol = get_optimal_checkpointing_policy_per_module(st, memory_budget=1 - r)
            if not pol:
                raise RuntimeError(f"per-module ILP found no policy for {fqn} at r={r}")
            out[path] = (pol, list(st.func_names))
    return out


def describe(plan: dict[str, tuple]) -> str:
    parts = []
    for p, v in plan.items():
        parts.append(p if v is None else f"{p}[save {sum(v[0])}/{len(v[0])} ops]")
    return ", ".join(parts) or "none"


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--S", type=int, default=128)
    ap.add_argument("--fracs", default="0.85,0.7")
    a = ap.parse_args(argv)
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    fracs = [float(f) for f in a.fracs.split(",")]
    pt = {"B": a.B, "S": a.S}

    def make():
        return zoo.TinyGPT(vocab=a.vocab, d=a.d, heads=a.heads, layers=a.layers,
                           block=max(a.S, 64), sdpa=False)

    def real(factory):
        torch.manual_seed(0)
        return measure_train(materialize(factory()), example_inputs(GPT, pt))

    print(f"TinyGPT layers={a.layers} d={a.d} heads={a.heads} vocab={a.vocab} explicit "
          f"attention, fp32, AdamW, CPU; B={a.B} S={a.S}")
    errs = cuda_only_errors()
    for mode, e in errs.items():
        print(f"PyTorch SACEstimator({mode!r}) as shipped on CPU: {e}")

    t0 = time.perf_counter()
    with torch.device("meta"):
        meta = make()
    base = analyze(meta, GPT, device="cpu", inference=False)
    peak0 = base.at(**pt)["train"]["peak"]
    sf0 = step_flops(base.train)
    flops0 = float(sf0.subs(dict(_syms(sf0, pt))))
    m0 = real(make)
    t_memsim = time.perf_counter() - t0
    opt_states = m0.optimizer_states
    print(f"no checkpointing: memsim peak {peak0:,} B, real {m0.peak:,} B "
          f"({'exact' if peak0 == m0.peak else f'{peak0 - m0.peak:+,}'}); AdamW states "
          f"{opt_states:,} B; step {flops0 / 1e9:.3f} GFLOP")

    t0 = time.perf_counter()
    graph, sac, root = pytorch_stats(make, a.B, a.S)
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline
    from torch.distributed._tools.sac_ilp import sac_milp
    pk_pt, time_pt = get_peak_memory_runtime_baseline(graph)
    t_pt = time.perf_counter() - t0
    print(f"PyTorch's model, no checkpointing: peak {pk_pt:,} B without optimizer states "
          f"(+ states = {pk_pt + opt_states:,} B, {(pk_pt + opt_states) / m0.peak - 1:+.2%} vs "
          f"real); step {time_pt:.4f} ms (roofline, H100 constants)")
    print(f"stats: memsim {t_memsim:.1f} s (trace + real run), PyTorch {t_pt:.1f} s")

    rows = []
    cache: dict = {}
    found = blocks(meta)
    block_fqns = [f"{root}.{p}" for p in found]
    for frac in fracs:
        budget = int(frac * m0.peak)
        # memsim
        res = optimal_plan(meta, GPT, pt, budget, device="cpu", base=base, cache=cache,
                           search="blocks")
        if res is None:
            rows.append((frac, "memsim", "does not fit", *[""] * 7))
        else:
            claim = res.report.at(**pt)["train"]["peak"]
            mr = real(lambda: apply_checkpointing(make(), res.plan))
            rc = float(res.recompute_flops.subs(dict(_syms(res.recompute_flops, pt))))
            ms_pt = pytorch_recompute_ms(graph, {f"{root}.{p}": 1.0 for p in res.plan})
            k = len(res.plan)
            rows.append((frac, "memsim", f"{found[0]}..{found[k - 1]} ({k} blocks)",
                         claim / m0.peak, _vs(claim, mr.peak, m0.peak), mr.peak / m0.peak,
                         mr.peak <= budget,
                         rc / flops0, rc / flops0, ms_pt / time_pt))
        # PyTorch, twice: any module (its default), and only whole blocks as AC units
        for label, units in (("PyTorch ILP", None), ("PyTorch ILP, blocks only", block_fqns)):
            with redirect_stdout(io.StringIO()):
                dec, _, bound = sac_milp(graph, memory_budget=(budget - opt_states) / 2**30,
                                         ac_units=units)
            if bound < 0:
                rows.append((frac, label, "ILP: no solution", *[""] * 7))
                continue
            plan = pytorch_plan(graph, sac, root, dec)
            factory = lambda: apply_pytorch_plan(make(), plan)  # noqa: E731
            pr = real(factory)
            ms = pytorch_recompute_ms(graph, dec)
            try:  # memsim's FLOPs for the same plan: trace it
                with torch.device("meta"):
                    mm = factory()
                rep = analyze(mm, GPT, device="cpu", inference=False)
                sf = step_flops(rep.train)
                rc_m = (float(sf.subs(dict(_syms(sf, pt)))) - flops0) / flops0
                pred = _vs(rep.at(**pt)["train"]["peak"], pr.peak, m0.peak)
                note = ""
            except Exception as e:  # noqa: BLE001 - reported
                rc_m, pred = float("nan"), "failed"
                note = f" (memsim: {type(e).__name__}: {e})"
            desc = ", ".join(f"{f[len(root) + 1:]}:{r:.2f}" for f, r in dec.items())
            rows.append((frac, label, desc + f" -> {describe(plan)}" + note,
                         (bound + opt_states) / m0.peak, pred, pr.peak / m0.peak,
                         pr.peak <= budget, ms / time_pt, rc_m, ms / time_pt))

    print()
    print("budget = frac x real no-checkpointing peak. 'claimed': the tool's own peak figure "
          "(memsim: predicted; PyTorch: ILP bound + AdamW states); 'real': measured eager CPU "
          "step. Recompute: 'own' = memsim FLOPs share / PyTorch roofline-time share; both "
          "metrics given for every plan.")
    hdr = ("frac", "tool", "plan (module:discard ratio)", "claimed/peak0",
           "memsim predicts/peak0", "real/peak0",
           "fits", "recompute own", "recompute FLOPs (memsim)", "recompute time (PyTorch)")
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        cells = [f"{r[0]:.2f}", r[1], r[2]]
        cells += [f"{x:.1%}" if isinstance(x, float) else
                  ({True: "yes", False: "NO"}.get(x, str(x))) for x in r[3:]]
        print(" | ".join(cells))
    return 0


def _vs(pred: int, real: int, peak0: int) -> str:
    return f"{pred / peak0:.1%} ({'= real' if pred == real else f'{pred - real:+,} B vs real'})"


def _syms(expr, pt):
    return [(s, pt[s.name]) for s in getattr(expr, "free_symbols", ()) if s.name in pt]


if __name__ == "__main__":
    raise SystemExit(main())
