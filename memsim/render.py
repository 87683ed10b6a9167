"""Rendering of a :class:`memsim.analysis.Report`: tabulate tables and the stable JSON document.

This is the edge of the data flow: only here (and in the CLI) is anything formatted for people.
``memsim compare`` and ``memsim checkpoint`` have their own renderers
(:mod:`memsim.render_compare`, :mod:`memsim.render_checkpoint`); numbers and formulas are
written by :mod:`memsim.formats` (``human``, ``largest`` and ``verdict`` are importable from
here too, as the examples do).
"""

from __future__ import annotations

import sympy
from tabulate import tabulate

from memsim._version import __version__ as VERSION
from memsim.analysis import TRAIN_FIELDS, Report
from memsim.tracer import Loop

from .formats import (answer, answer_line, options_lines, approx, at_cells, figure_json, formula, human,
                      largest, short, verdict, wrapped)

__all__ = ["to_text", "to_json", "budget_text", "budget_json", "gpu_table", "strategy_text",
           "human", "largest", "verdict"]

LABELS = {
    "peak": "peak (everything live)",
    "activation_peak": "activation peak (not model state)",
    "saved_activations": "saved for backward",
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
}

DEVICE_NOTES = {
    "cpu": "CPU kernels as torch picks them on CPU; sizes are live tensor storages",
    "cuda": ("CUDA kernel choices (foreach optimizers, fused attention where modelled); "
             "sizes are live tensor storages in the caching allocator's 512-byte blocks; "
             "not checked on a GPU yet"),
}


def budget_json(b) -> dict:
    """The ``"budget"`` section (docs/json.md)."""
    return {"gpu": b.gpu.key if b.gpu else None, "capacity": b.capacity, "step": b.step,
            "allocated": b.allocated, "overhead": dict(b.overhead), "total": b.total,
            "margin": b.margin, "fits": b.fits, "headroom": round(b.headroom, 6),
            "dominant": b.dominant, "max_batch": b.max_batch, "max_seq": b.max_seq,
            "max_batch_no_release": b.max_batch_no_release,
            "max_seq_no_release": b.max_seq_no_release,
            "notes": list(b.notes), "basis": b.basis, "reserved": b.reserved,
            "reserved_card": b.reserved_card,
            "replay": b.replay.as_dict() if b.replay is not None else None}


def to_json(report: Report, point: dict[str, int] | None = None, budget=None,
            full: Report | None = None, model: str | None = None) -> dict:
    """The stable JSON document (docs/json.md). ``report`` covers ``point``
    (:meth:`Report.for_point`); ``full`` is the report asked for, whose code paths are listed;
    ``model`` names it in the verdict (the command's target)."""
    at = {**report.fixed, **(point or {})}
    doc: dict = {"memsim": VERSION}
    if budget is not None:
        doc["verdict"] = answer(report, budget, at, model)
    doc |= {"device": report.device,
            **({"cpu_isa": report.config.cpu_isa.value} if report.device == "cpu" else {}),
            "precision": report.precision, "accumulate": report.accumulate,
            "outputs": report.config.loop.value,
            "data_dependent": str(report.config.data_dependent),
            "compiled": report.compiled, "symbols": list(report.symbols), "at": at or None,
            "fixed": dict(report.fixed),
            "ranges": {n: {"min": lo, "max": hi} for n, (lo, hi) in report.ranges.items()}}
    doc.update(_figures(report, point))
    if report.train is not None:
        doc["train"]["regimes"] = [
            {"formula": formula(c.expr), "where": str(c.label)} for c in report.train.candidates]
        depth = _depth(report)
        if depth is not None:
            st = report.train.trace.folded.stack
            doc["train"]["by_depth"] = {
                "symbol": str(depth.symbol), "stack": st.path, "blocks": st.size,
                "min": depth.low, "formula": formula(depth.peak)}
    step = report.train or report.inference
    doc["modules"] = [{"path": m.path, "type": m.type, "saved": figure_json(step, m.saved, point)}
                      for m in report.modules]
    doc["other_ops"] = dict(report.other_ops)
    doc.update(_code_paths_json(full or report))
    fit = getattr(full or report, "fit", None)
    doc["fitted"] = None if fit is None else {
        "symbol": fit.symbol, "sizes": list(fit.sizes), "checked_at": fit.check,
        "reason": fit.reason}
    if report.strategy:
        doc["strategy"] = dict(report.strategy)
        doc["ranks"] = [_rank_json(rc, point) for rc in report.ranks]
    notes = list(dict.fromkeys((*report.notes, *(full or report).notes)))
    if notes:
        doc["notes"] = notes
    if budget is not None:
        doc["budget"] = budget_json(budget)
    return doc


def _depth(report: Report):
    """The training peak as a function of depth too, where the trace was folded and no
    strategy edits the step after the trace (:func:`memsim.analysis.memory.depth_peak`)."""
    from memsim.analysis.memory import StepMemory, depth_peak
    if report.train is None or type(report.train) is not StepMemory:
        return None
    return depth_peak(report.train)


def _figures(report: Report, point) -> dict:
    """Each step's figures, with where its formulas hold: ``valid``, each symbol's range and the
    trace's other conditions (sympy-parsable; ``Report.at`` refuses a point outside them)."""
    out = {}
    if report.train is not None:
        out["train"] = {f: figure_json(report.train, getattr(report.train, f), point)
                        for f in TRAIN_FIELDS}
        out["train"]["valid"] = _valid(report, report.train)
    if report.inference is not None:
        out["inference"] = {"peak": figure_json(report.inference, report.inference.peak, point),
                            "valid": _valid(report, report.inference)}
    return out


def _valid(report: Report, step) -> dict:
    trace = getattr(step, "trace", None)
    return {"ranges": {n: {"min": lo, "max": hi} for n, (lo, hi) in report.ranges.items()},
            "conditions": [formula(c) for c in ((*trace.conditions, *trace.step_conditions())
                                                if trace is not None else ())]}


def _code_paths_json(report: Report) -> dict:
    """``checked`` (example sizes whose formulas were equal), ``code_paths`` (each regime: its
    sizes and formulas) and ``piecewise`` (every train/inference figure over the regimes)."""
    out: dict = {"checked": {n: list(v) for n, v in report.checked.items()}, "code_paths": [],
                 "piecewise": None}
    if not report.regimes:
        return out
    base = {n: r for n, r in report.ranges.items()}
    for g in report.regimes:
        out["code_paths"].append({"symbol": g.symbol, "from": g.lo, "to": g.hi,
                                  "traced_at": g.hint, **_figures(g.report, None)})
    pieces: dict = {}
    for step_name, fields in (("train", TRAIN_FIELDS), ("inference", ("peak",))):
        step = getattr(report, step_name)
        if step is None:
            continue
        for f in fields:
            args = []
            for rep, n, lo, hi in [(report, g.symbol, *base[g.symbol]) for g in
                                   report.regimes[:1]] + [(g.report, g.symbol, g.lo, g.hi)
                                                          for g in report.regimes]:
                sym = report.symbols[n]
                cond = sympy.And(sym >= lo, *(() if hi is None else (sym <= hi,)))
                args.append((getattr(getattr(rep, step_name), f), cond))
            one = len({e for e, _ in args}) == 1
            pieces.setdefault(step_name, {})[f] = formula(
                args[0][0] if one else sympy.Piecewise(*args, evaluate=False))
    out["piecewise"] = pieces
    return out


def _rank_json(rc, point) -> dict:
    """One entry of ``"ranks"``: a group of ranks with equal memory and their figures."""
    report, pt = rc.report.for_point(point) if point is not None else (rc.report, None)
    return {"ranks": list(rc.ranks), **_figures(report, pt)}


def _range_text(report: Report) -> str:
    parts = []
    for n, (lo, hi) in report.ranges.items():
        parts.append(f"{lo} <= {n}" + (f" <= {hi}" if hi is not None else ""))
    return ", ".join(parts) or "(no symbols)"


def _code_paths_text(report: Report) -> list[str]:
    """Where a guard of the code path was crossed: equal formulas on both sides, or another
    regime of formulas."""
    out = []
    for n, sizes in report.checked.items():
        out.append(f"  {n}: the same formulas traced at {n} = {', '.join(map(str, sizes))}, on "
                   "both sides of a guard of the code path (e.g. a kernel choice)")
    if report.regimes:
        out.append("  code paths with their own formulas (guards of the trace crossed; JSON: "
                   "code_paths, piecewise):")
        first = report.regimes[0].symbol
        lo, hi = report.ranges[first]
        base = (report.train or report.inference).trace.hints[first]
        rows = [(first, lo, hi, base, report)] + [(g.symbol, g.lo, g.hi, g.hint, g.report)
                                                 for g in report.regimes]
        for n, lo, hi, hint, rep in rows:
            step = rep.train or rep.inference
            out.append(f"    {n} = {lo}..{hi if hi is not None else ''}: traced at {n}={hint}; "
                       f"peak {short(step.peak)}")
    return out


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def budget_text(b, device: str) -> str:
    """The verdict: fits or not, the terms, the headroom and the limits."""
    what = f"{b.gpu.name} ({b.gpu.mib:,} MiB as reported by the device)" if b.gpu else \
        f"{b.capacity:,} bytes ({human(b.capacity)})"
    said = "FITS" if b.fits else "DOES NOT FIT"
    rows = [[f"allocated by tensors ({b.basis})", human(b.allocated)]]
    est = {"allocator_cache": "cached by the allocator, not allocated (replayed)",
           "fragmentation": "extra margin (--fragmentation)",
           "cuda_context": "CUDA context (estimate)",
           "cublas_workspace": "cuBLAS workspace (PyTorch's default)",
           "comm_buffers": "communication buffers (not in the trace)"}
    order = ["cublas_workspace", "allocator_cache"] + [
        k for k in b.overhead if k not in ("cublas_workspace", "allocator_cache")]
    for k in order:
        v = b.overhead.get(k)
        if v is None or (k == "fragmentation" and not v):
            continue
        if k == "allocator_cache" and b.replay is not None and b.replay.oom is not None:
            # the replay stopped where the step runs out: no cache to speak of
            rows.append(["cached by the allocator: not known, the replay ran out of memory "
                         "(a note says where); counted as", human(v)])
        elif v or device == "cuda":
            rows.append([est.get(k, k), human(v)])
        if k == "allocator_cache" and b.reserved is not None:
            rows.append(["= reserved (max_memory_reserved)", human(b.reserved)])
    rows += [["total", human(b.total)],
             [f"usable ({1 - b.margin:.0%} of capacity)", human(b.usable)],
             ["capacity", human(b.capacity)]]
    out = [f"{b.step} step on {what}: {said}; headroom {b.headroom:.1%} of the capacity; "
           f"largest category at the peak: {b.dominant}",
           tabulate(rows, headers=["term", "bytes"])]
    lim = []
    if b.max_batch is not None:
        lim.append(f"largest batch that fits: {largest(b, 'batch')}")
    if b.max_seq is not None:
        lim.append(f"largest sequence that fits: {largest(b, 'seq')}")
    if lim:
        out.append("; ".join(lim) + " (the other sizes as given; solved from the formula, "
                                    "checked at the answer and the next size)")
    if b.replay is not None and b.replay.oom is None:
        r = b.replay
        out.append(f"caching allocator at the allocated peak: {human(r.reserved_at_peak)} "
                   f"reserved, largest cached free block {human(r.largest_free_at_peak)}; "
                   f"max_memory_allocated {human(r.allocated)} (whole blocks, cuBLAS "
                   f"workspace included); {r.segments} segments")
    out += [f"note: {n}" for n in b.notes]
    return "\n".join(out)


def gpu_table() -> str:
    """The GPU catalog as a table."""
    from memsim.analysis.gpus import catalog
    rows = [[g.key, g.name, f"{g.mib:,}", f"{g.bytes / 2 ** 30:.2f}", f"{g.bytes / 1e9:.2f}",
             g.family, g.source] for g in catalog().values()]
    return tabulate(rows, headers=["key", "name", "MiB", "GiB", "GB", "family", "capacity source"])


def _sweep_text(report, point, b, batch, seq) -> list[str]:
    from memsim.analysis.budget import sweep
    if seq not in report.symbols:
        return []
    batches, seqs, rows = sweep(report, point, gpu=b.gpu, capacity=b.capacity, batch=batch,
                                seq=seq, overheads=b.overheads, margin=b.margin)
    usable = b.usable
    table = []
    for bv, row in zip(batches, rows):
        table.append([bv if bv is not None else "-"] + [
            gib(v) + ("" if v <= usable else " x") for v in row])
    return ["", f"Total memory by {seq} (x: over the usable {human(usable)})",
            tabulate(table, headers=[batch] + [str(s) for s in seqs])]


def _ranks_table(report: Report, point) -> str:
    rows, fields = [], ("peak",)
    for rc in report.ranks:
        r, pt = rc.report.for_point(point) if point is not None else (rc.report, None)
        step = r.train or r.inference
        fields = ("peak", "parameters", "gradients", "optimizer_states") if r.train else ("peak",)
        rows.append([",".join(map(str, rc.ranks))] + [
            human(step.evaluate(getattr(step, f), pt)) if point else short(getattr(step, f))
            for f in fields])
    return tabulate(rows, headers=["ranks"] + [LABELS[f] for f in fields])


def strategy_text(st: dict) -> str:
    """One line: ``FSDP2 dp=8 (reshard after forward) x TP 2 x LoRA r=16; world size 16``
    (each registered strategy's summary, the mesh dimensions outermost first)."""
    from memsim.strategies import summary_order
    parts = [cls.summary(st[cls.key]) for cls in summary_order() if cls.key in st]
    return " x ".join(parts or ["none"]) + f"; world size {st.get('world_size', 1)}"


def to_text(report: Report, point: dict[str, int] | None = None, top: int = 8, budget=None,
            full: Report | None = None, full_point: dict | None = None, batch: str = "B",
            seq: str = "S", model: str | None = None) -> str:
    """Readable tables: with a budget, the verdict first (:func:`memsim.formats.answer_line`);
    figures with formulas, the peak's regimes, breakdown, top modules."""
    verdict = None if budget is None else answer(report, budget,
                                                 {**report.fixed, **(point or {})}, model)
    out = [] if verdict is None else [answer_line(verdict), *options_lines(verdict), ""]
    out += _header_text(report, point, full)
    if report.train is not None:
        out += _train_text(report.train, report.symbols, point)
    if report.inference is not None:
        i = report.inference
        val = i.evaluate(i.peak, point) if point else None
        out += ["", "Inference (eval, no_grad)",
                tabulate([["peak", approx(i.peak, point, i.trace.symbols)]
                          + at_cells(point, human(val))],
                         headers=["", "formula, approximately"] + at_cells(point, "at point")),
                wrapped("peak (exact)", i.peak)]
    out += _modules_text(report, point, top)
    if report.other_ops:
        out += ["", "Ops outside ATen (memory from their fake kernels, not checked against a "
                    "real run): " + ", ".join(f"{k} x{v}" for k, v in report.other_ops.items())]
    guards = sorted({g for s in (report.train, report.inference) if s for g in s.trace.guards})
    if guards:
        out += ["", "Also assumed by the trace: " + "; ".join(guards)]
    if budget is not None:
        out += ["", "Budget", budget_text(budget, report.device)]
        out += _sweep_text(full or report, full_point or point, budget, batch, seq)
    return "\n".join(out)


def _header_text(report: Report, point, full: Report | None) -> list[str]:
    """What was modelled, where the formulas hold, the code paths, strategy, notes, ranks."""
    out = [f"memsim {VERSION} — device modelled: {report.device} "
           f"({DEVICE_NOTES[report.device]}"
           + (f", a CPU with{'out' if report.config.cpu_isa.value == 'avx2' else ''} AVX-512"
              if report.device == "cpu" else "") + f"); precision {report.precision}"
           + (f"; {report.accumulate} micro-batches per step" if report.accumulate > 1 else "")
           + ("; the loop drops the forward output once the loss exists, and in inference "
              "before the next forward (--drop-outputs)"
              if report.config.loop is Loop.DROP else
              "; the loop keeps the forward output to the end of the step, and in inference "
              "until the next forward returns (a plain loop; --drop-outputs for Trainer-style "
              "loops)"),
           f"formulas in bytes, valid for {_range_text(report)}"
           + (f"; evaluated at {', '.join(f'{k}={v}' for k, v in {**report.fixed, **point}.items())}"
              if point is not None else "")]
    out += _code_paths_text(full or report)
    if report.strategy:
        out.append("strategy: " + strategy_text(report.strategy))
    out += [f"  note: {n}" for n in dict.fromkeys((*report.notes, *(full or report).notes))]
    depth = _depth(report)
    if depth is not None:
        st = report.train.trace.folded.stack
        at = {**report.fixed, **(point or {}), str(depth.symbol): st.size}
        syms = {**report.train.trace.symbols, str(depth.symbol): depth.symbol}
        out.append(f"  training peak by depth ({depth.symbol} blocks of {st.path}, exact for "
                   f"{depth.symbol} >= {depth.low}): {approx(depth.peak, at, syms)}"
                   f"{' at ' + str(depth.symbol) + '=' + str(st.size) if point else ''} "
                   "(--json: the formula)")
    if report.strategy and report.ranks:
        out += ["", "Per rank (groups of ranks with equal memory)", _ranks_table(report, point)]
    if report.fixed:
        fixed = ", ".join(f"{k}={v}" for k, v in report.fixed.items())
        out.append(f"traced with {fixed} fixed: a size the general formulas do not cover (a "
                   "size of 1, a code path of one size, a point where a condition of their trace "
                   "is false) or a symbol the model's code pins (see the notes)")
    return out


def _train_text(t, symbols, point) -> list[str]:
    """The training step's figures, its peak's regimes, what is live at the peak, the exact
    formulas."""
    rows = []
    for f in TRAIN_FIELDS:
        expr = getattr(t, f)
        val = t.evaluate(expr, point) if point else None
        rows.append([LABELS[f], approx(expr, point, t.trace.symbols)] + at_cells(point, human(val)))
    out = ["", "Training step",
           tabulate(rows, headers=["", "formula, approximately (exact below)"]
                    + at_cells(point, "at point"))]
    exact = [(LABELS[f], getattr(t, f)) for f in TRAIN_FIELDS]
    changes = {n: t.regimes(n, point) for n in symbols} if point else {}
    shown, win = t.candidates, None
    if point:
        win = t.winner(point)
        keep = {id(win)} | {id(c) for ch in changes.values() for _, c in ch}
        shown = [c for c in t.candidates if id(c) in keep]
    if len(t.candidates) > 1 or point:
        rows = []
        for c in shown:
            val = t.evaluate(c.expr, point) if point else None
            rows.append(["*" if c is win else "", approx(c.expr), str(c.label)]
                        + at_cells(point, human(val)))
        more = len(t.candidates) - len(shown)
        out += ["", f"Peak regimes: the peak is the largest of {len(t.candidates)} "
                    "candidates" + (f"; the {len(shown)} that are largest along some "
                                    "symbol from this point are shown" if more else ""),
                tabulate(rows, headers=["", "bytes, approximately", "reached at"]
                         + at_cells(point, "at point"))]
    if point:
        for n, ch in changes.items():
            if len(ch) > 1:
                out.append("  as " + n + " grows: " + "; ".join(
                    f"from {n}={v}: {c.label}" for v, c in ch))
        bd = t.breakdown(point)
        rows = [[k, human(v)] for k, v in bd.items() if v]
        out += ["", f"Live at the peak ({win.label})",
                tabulate(rows + [["total", human(sum(bd.values()))]],
                         headers=["category", "bytes"])]
    out += ["", "Exact formulas (bytes; 512*ceiling(n/512) is the CUDA allocator's "
                "512-byte rounding)"] + [wrapped(name, e) for name, e in exact]
    return out


def _modules_text(report: Report, point, top: int) -> list[str]:
    """The modules that save the most for backward."""
    if not report.modules:
        return []
    step = report.train
    rows = []
    mods = [(m, step.evaluate(m.saved, point) if point else None)
            for m in report.modules if m.path]
    if point:
        mods.sort(key=lambda mv: -mv[1])
    for m, val in mods[:top]:
        rows.append([m.path, m.type, approx(m.saved)] + at_cells(point, human(val)))
    return ["", f"Top modules by bytes saved for backward (inclusive; top {top})",
            tabulate(rows, headers=["module", "type", "saved, approximately"]
                     + at_cells(point, "at point"))]


