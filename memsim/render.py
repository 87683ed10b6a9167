"""Rendering of a :class:`memsim.analysis.Report`: tabulate tables and the stable JSON document.

This is the edge of the data flow: only here (and in the CLI) is anything formatted for people.
"""

from __future__ import annotations

import sympy
from tabulate import tabulate

from memsim._version import __version__ as VERSION
from memsim.analysis import TRAIN_FIELDS, Report
from memsim.tracer import Loop

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


def verdict(b) -> str:
    """A budget in one line: ``peak allocated 1.00 GiB (1,073,741,824 B), reserved ...,
    total ...: FITS, headroom 40.0%`` (the examples' form)."""
    if b.reserved is not None:
        reserved = human(b.reserved)
    elif b.replay is not None and b.replay.oom is not None:
        reserved = (f"over the budget (the caching allocator runs out of memory within "
                    f"{1 - b.margin:.0%} of the card)")
    else:
        reserved = "n/a on CPU" if b.replay is None else "-"
    return (f"peak allocated {human(b.allocated)} ({b.allocated:,} B), reserved {reserved}, "
            f"total {human(b.total)}: {'FITS' if b.fits else 'DOES NOT FIT'}, headroom "
            f"{b.headroom:.1%}")


def largest(b, which: str) -> str:
    """``b.max_batch`` (``which="batch"``) or ``b.max_seq`` (``"seq"``) as printed, with the
    largest size at which the caching allocator never releases its cache where that is
    smaller (above it each step frees cached segments and retries: slower)."""
    v = getattr(b, f"max_{which}")
    text = "none" if v == 0 else str(v)
    clean = getattr(b, f"max_{which}_no_release", None)
    if clean is not None and v and clean < v:
        text += f" ({clean or 'none'} without releasing the allocator's cache)"
    return text


def human(n: int | None) -> str:
    """Bytes as a binary-unit string: ``human(1536) == '1.50 KiB'``."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{n} B"


def formula(expr: sympy.Expr) -> str:
    """A sympy-parsable string in the user's symbols."""
    return sympy.sstr(expr, order="grlex")


_UNITS = ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB"))


def _amount(c: float) -> str:
    for div, unit in _UNITS:
        if abs(c) >= div:
            return f"{c / div:.3g} {unit}"
    return f"{c:.3g} bytes"


def _monomial(m: sympy.Expr) -> str:
    if m == 1:
        return ""
    parts = []
    for base, exp in sorted(m.as_powers_dict().items(), key=lambda be: str(be[0])):
        name = str(base)
        parts.append(name if exp == 1 else f"{name}^{exp}")
    return "·" + "·".join(parts)


def approx(expr: sympy.Expr, point: dict[str, int] | None = None,
           symbols: dict | None = None) -> str:
    """A short, approximate form of a byte formula: the allocator's 512-byte rounding
    (``ceiling``) and integer divisions (``floor``) dropped, each term's coefficient in the
    largest binary unit below it, largest degree first (``1.5 MiB·B·S + 474 MiB``). A ``Max`` of
    regimes shows the regime that is the peak at ``point`` (or the count of regimes).

    >>> B, S = sympy.symbols("B S", positive=True, integer=True)
    >>> approx(512 * sympy.ceiling(3 * B * S / 2) + 3 * 2 ** 20 * B * S + 497664000)
    '3 MiB·B·S + 475 MiB'
    >>> approx(sympy.Max(10 * B * S**2, 2**30 + 24 * B))
    'max(24 bytes·B + 1 GiB, 10 bytes·B·S^2)'
    """
    expr = sympy.sympify(expr)
    if isinstance(expr, sympy.Max):
        if point is not None and symbols:
            subs = {symbols[n]: v for n, v in point.items() if n in symbols}
            values = [int(sympy.sympify(a).xreplace(subs)) for a in expr.args]
            top = max(values)
            tied = [a for a, v in zip(expr.args, values) if v == top]
            # among regimes equal here, the first in sympy's canonical order (the peak's
            # arguments keep the trace's order: analysis.peak.unevaluated_max)
            win = tied[0] if len(tied) == 1 else next(iter(sympy.ordered(tied)))
            return f"{approx(win)} (largest of {len(expr.args)} regimes here)"
        if len(expr.args) <= 2:
            return "max(" + ", ".join(approx(a) for a in expr.args) + ")"
        return f"max of {len(expr.args)} regimes"
    plain = expr.replace(sympy.ceiling, lambda a: a).replace(sympy.floor, lambda a: a)
    terms = sympy.expand(plain).as_coefficients_dict()
    if not terms:
        return "0 B"
    ordered = sorted(terms.items(), key=lambda mc: (-sympy.Poly(mc[0]).total_degree()
                                                     if mc[0] != 1 else 1, -abs(float(mc[1]))))
    out = []
    for m, c in ordered:
        if c == 0:
            continue
        text = _amount(float(c)) + _monomial(m)
        out.append(text if not out else (" - " + text[1:] if text.startswith("-")
                                         else " + " + text))
    return "".join(out) or "0 B"


def _wrapped(name: str, expr: sympy.Expr, width: int = 100) -> str:
    """``name = formula`` wrapped to ``width`` columns (a Max of many regimes summarised)."""
    import textwrap
    return textwrap.fill(f"  {name} = {short(expr)}", width=width, break_on_hyphens=False,
                         subsequent_indent=" " * 6)


def short(expr: sympy.Expr) -> str:
    """A formula for a table cell: a Max of many regimes is summarised."""
    if isinstance(expr, sympy.Max) and len(expr.args) > 2:
        return f"max of {len(expr.args)} regimes (--json has the formula)"
    return formula(expr)


def _e(step, expr, point) -> dict:
    return {"formula": formula(expr),
            "bytes": step.evaluate(expr, point) if point is not None else None}


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
            full: Report | None = None) -> dict:
    """The stable JSON document (docs/json.md). ``report`` covers ``point``
    (:meth:`Report.for_point`); ``full`` is the report asked for, whose code paths are listed."""
    at = {**report.fixed, **(point or {})}
    doc: dict = {"memsim": VERSION, "device": report.device,
                 **({"cpu_isa": report.config.cpu_isa.value} if report.device == "cpu" else {}),
                 "precision": report.precision, "accumulate": report.accumulate,
                 "outputs": report.config.loop.value,
                 "compiled": report.compiled, "symbols": list(report.symbols), "at": at or None, "fixed": dict(report.fixed),
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
    doc["modules"] = [{"path": m.path, "type": m.type, "saved": _e(step, m.saved, point)}
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
    out = {}
    if report.train is not None:
        out["train"] = {f: _e(report.train, getattr(report.train, f), point)
                        for f in TRAIN_FIELDS}
    if report.inference is not None:
        out["inference"] = {"peak": _e(report.inference, report.inference.peak, point)}
    return out


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


def _at(point, *cells) -> list:
    """The "at point" column: its cells when a point is given, else nothing."""
    return list(cells) if point else []


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


def _gb(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def budget_text(b, device: str) -> str:
    """The verdict: fits or not, the terms, the headroom and the limits."""
    what = f"{b.gpu.name} ({b.gpu.mib:,} MiB as reported by the device)" if b.gpu else \
        f"{b.capacity:,} bytes ({human(b.capacity)})"
    verdict = "FITS" if b.fits else "DOES NOT FIT"
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
        if v or device == "cuda":
            rows.append([est.get(k, k), human(v)])
        if k == "allocator_cache" and b.reserved is not None:
            rows.append(["= reserved (max_memory_reserved)", human(b.reserved)])
    rows += [["total", human(b.total)],
             [f"usable ({1 - b.margin:.0%} of capacity)", human(int(b.capacity * (1 - b.margin)))],
             ["capacity", human(b.capacity)]]
    out = [f"{b.step} step on {what}: {verdict}; headroom {b.headroom:.1%} of the capacity; "
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
    usable = int(b.capacity * (1 - b.margin))
    table = []
    for bv, row in zip(batches, rows):
        table.append([bv if bv is not None else "-"] + [
            _gb(v) + ("" if v <= usable else " x") for v in row])
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
            seq: str = "S") -> str:
    """Readable tables: figures with formulas, the peak's regimes, breakdown, top modules."""
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
    if report.strategy:
        if report.ranks:
            out += ["", "Per rank (groups of ranks with equal memory)", _ranks_table(report, point)]
    if report.fixed:
        fixed = ", ".join(f"{k}={v}" for k, v in report.fixed.items())
        out.append(f"traced with {fixed} fixed: a size the general formulas do not cover (a "
                   "size of 1, a code path of one size, a point where a condition of their trace "
                   "is false) or a symbol the model's code pins (see the notes)")
    if report.train is not None:
        t = report.train
        rows = []
        for f in TRAIN_FIELDS:
            expr = getattr(t, f)
            val = t.evaluate(expr, point) if point else None
            rows.append([LABELS[f], approx(expr, point, t.trace.symbols)] + _at(point, human(val)))
        out += ["", "Training step",
                tabulate(rows, headers=["", "formula, approximately (exact below)"]
                         + _at(point, "at point"))]
        exact = [(LABELS[f], getattr(t, f)) for f in TRAIN_FIELDS]
        changes = {n: t.regimes(n, point) for n in report.symbols} if point else {}
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
                            + _at(point, human(val)))
            more = len(t.candidates) - len(shown)
            out += ["", f"Peak regimes: the peak is the largest of {len(t.candidates)} "
                        "candidates" + (f"; the {len(shown)} that are largest along some "
                                        "symbol from this point are shown" if more else ""),
                    tabulate(rows, headers=["", "bytes, approximately", "reached at"]
                             + _at(point, "at point"))]
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
                    "512-byte rounding)"] + [_wrapped(name, e) for name, e in exact]
    if report.inference is not None:
        i = report.inference
        val = i.evaluate(i.peak, point) if point else None
        out += ["", "Inference (eval, no_grad)",
                tabulate([["peak", approx(i.peak, point, i.trace.symbols)]
                          + _at(point, human(val))],
                         headers=["", "formula, approximately"] + _at(point, "at point")),
                _wrapped("peak (exact)", i.peak)]
    if report.modules:
        step = report.train
        rows = []
        mods = [(m, step.evaluate(m.saved, point) if point else None)
                for m in report.modules if m.path]
        if point:
            mods.sort(key=lambda mv: -mv[1])
        for m, val in mods[:top]:
            rows.append([m.path, m.type, approx(m.saved)] + _at(point, human(val)))
        out += ["", f"Top modules by bytes saved for backward (inclusive; top {top})",
                tabulate(rows, headers=["module", "type", "saved, approximately"]
                         + _at(point, "at point"))]
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


def _flops_text(n) -> str:
    if n is None:
        return "-"
    for unit, k in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} FLOP"


def _val(step, expr, point):
    return step.evaluate(expr, point) if point is not None else None


def checkpoint_json(base: Report, result, ranking, point, budget) -> dict:
    """``memsim checkpoint --json`` (docs/json.md)."""
    doc: dict = {"memsim": VERSION, "device": base.device, "precision": base.precision,
                 "symbols": list(base.symbols), "at": dict(point) if point else None,
                 "budget": budget, "fits": None, "plan": None}
    bstep = base.train
    doc["ranking"] = [{"path": r.path, "type": r.type, "count": r.count,
                       "saved": _e(bstep, r.saved, point), "forward_flops": _e(bstep, r.flops, point)}
                      for r in ranking]
    if result is None:
        doc["fits"] = False
        return doc
    t = result.report.train
    doc["plan"] = list(result.plan)
    doc["train"] = {f: _e(t, getattr(t, f), point) for f in TRAIN_FIELDS}
    doc["recompute_flops"] = _e(t, result.recompute_flops, point)
    doc["step_flops"] = _e(t, result.step_flops, point)
    if budget is not None and point is not None:
        doc["fits"] = t.evaluate(t.peak, point) <= budget
    return doc


def checkpoint_text(base: Report, result, ranking, point, budget, plan: str, top: int = 10) -> str:
    """The ranking of layers worth checkpointing and the chosen plan's effect."""
    bstep = base.train
    out = [f"memsim {VERSION} — checkpointing, device modelled: {base.device}; precision "
           f"{base.precision}" + (f"; at {', '.join(f'{k}={v}' for k, v in point.items())}"
                                  if point else "")]
    rows = []
    ranked = ranking
    if point is not None:
        def key(r):
            sv, fl = _val(bstep, r.saved, point), _val(bstep, r.flops, point)
            return (0 if not fl else 1, -(sv / fl) if fl else -sv)
        ranked = sorted(ranking, key=key)
    for r in ranked[:top]:
        sv, fl = _val(bstep, r.saved, point), _val(bstep, r.flops, point)
        rows.append([r.path, r.type, r.count] + ([] if point else [formula(r.saved)])
                    + _at(point, human(sv), _flops_text(fl) if fl else "no matmul",
                          f"{sv / fl:.3g}" if fl else "-"))
    out += ["", "Layers worth checkpointing (per module; saved for backward vs the forward "
                "FLOPs recomputing it costs)",
            tabulate(rows, headers=["module", "type", "count"]
                     + ([] if point else ["saved (bytes)"])
                     + _at(point, "saved", "forward FLOPs", "bytes/FLOP")),
            "(FLOPs by torch.utils.flop_counter's formulas: matmuls, convolutions, attention; "
            "elementwise ops and norms count none, so they rank first: cheap to recompute)"]
    if result is None:
        out += ["", f"plan {plan}: not even checkpointing every block brings the peak under "
                    f"{human(budget)}"]
        return "\n".join(out)
    t = result.report.train
    names = result.plan
    shown = (", ".join(names[:6]) + (f" ... ({len(names)} modules)" if len(names) > 6 else "")
             ) if names else "(nothing)"
    rows = []
    for label, f in (("peak", "peak"), ("saved for backward", "saved_activations"),
                     ("activation peak", "activation_peak")):
        a, b = getattr(bstep, f), getattr(t, f)
        rows.append([label] + ([human(_val(bstep, a, point)), human(_val(t, b, point))]
                               if point is not None else [short(a), short(b)]))
    out += ["", f"Plan {plan}: checkpoint {shown}",
            tabulate(rows, headers=["", "no checkpointing", "with the plan"]),
            "(formulas: --json)" if point is not None else ""]
    if point is not None:
        rc, tot = _val(t, result.recompute_flops, point), _val(t, result.step_flops, point)
        out.append(f"recompute: {_flops_text(rc)} of {_flops_text(tot)} per step "
                   f"({rc / tot:.1%})" if tot else "recompute: -")
        if budget is not None:
            p = _val(t, t.peak, point)
            out.append(f"budget {human(budget)}: " + ("fits" if p <= budget else "does not fit"))
    if names:
        out += ["", "Apply it:", "    from memsim.strategies.checkpoint import apply_checkpointing",
                f"    apply_checkpointing(model, {names!r})"]
    return "\n".join(out)


def bands_text(bands, rng, budget, total: int) -> str:
    """``memsim checkpoint --range``: which plan is optimal for which sizes."""
    name, lo, hi = rng
    rows = [[f"{b.lo}..{b.hi}", f"{b.blocks} of {total}",
             ", ".join(b.plan[:3]) + (" ..." if len(b.plan) > 3 else "") or "(nothing)"]
            for b in bands]
    out = [f"Optimal plan for {name} = {lo}..{hi} under {human(budget)}",
           tabulate(rows, headers=[name, "blocks checkpointed", "modules"])]
    end = bands[-1].hi if bands else lo - 1
    if end < hi:
        out.append(f"{name} = {end + 1}..{hi}: does not fit even with every block checkpointed")
    return "\n".join(out)


# -- memsim compare ---------------------------------------------------------------------------

_COMPARE_FIELDS = ("peak", "parameters", "gradients", "optimizer_states", "activation_peak")


def _compare_figures(row) -> dict:
    shown, pt = row["shown"], row["point"]
    step = shown.train if shown.train is not None else shown.inference
    fields = _COMPARE_FIELDS if shown.train is not None else ("peak",)
    out = {f: (step.value("peak", pt) if f == "peak" else step.evaluate(getattr(step, f), pt))
           for f in fields}
    out["ranks_differ"] = bool(row["report"].ranks)
    return out


def _compare_order(rows) -> list:
    """``(row, its figures or None)`` sorted by total (or peak), failed rows last; each row's
    figures evaluated once."""
    pairs = [(r, None if r["error"] is not None else _compare_figures(r)) for r in rows]

    def key(pair):
        r, f = pair
        if f is None:
            return (1, 0)
        return (0, r["budget"].total if r["budget"] is not None else f["peak"])
    return sorted(pairs, key=key)


def compare_json(rows, args) -> dict:
    """``memsim compare --json`` (docs/json.md)."""
    out = []
    for r, f in _compare_order(rows):
        if f is None:
            out.append({"config": r["config"], "error": str(r["error"])})
            continue
        out.append({"config": r["config"], "strategy": r["report"].strategy,
                    "precision": r["report"].precision, "step": "train" if
                    r["shown"].train is not None else "inference",
                    "figures": f,
                    "budget": budget_json(r["budget"]) if r["budget"] is not None else None,
                    "error": None})
    return {"memsim": VERSION, "at": _point_of(rows), "gpu": args.gpu, "memory": args.memory,
            "configs": out}


def _point_of(rows):
    for r in rows:
        if r["error"] is None:
            return {**r["report"].fixed, **(r["full_point"] or {})}
    return None


def compare_text(rows, args) -> str:
    """One table, a row per configuration, sorted by total (or peak without a budget)."""
    ordered = _compare_order(rows)
    budgeted = any(r["error"] is None and r["budget"] is not None for r in rows)
    head = ["configuration", "peak"]
    if budgeted:
        head += ["reserved", "total", "fits", "headroom", "max B", "max S"]
    head += ["parameters", "gradients", "optimizer", "activations"]
    table, notes = [], []
    for r, f in ordered:
        if f is None:
            table.append([r["config"], "error"] + [""] * (len(head) - 2))
            notes.append(f"{r['config']}: {r['error']}")
            continue
        row = [(r["config"] or "(the common options)") + (" *" if f["ranks_differ"] else ""),
               human(f["peak"])]
        if budgeted:
            b = r["budget"]
            row += ([human(b.reserved) if b.reserved is not None else "-", human(b.total),
                     "yes" if b.fits else "NO", f"{b.headroom:.1%}",
                     _limit(b, "batch"), _limit(b, "seq")] if b is not None else ["-"] * 6)
        row += [human(f[k]) if k in f else "-" for k in ("parameters", "gradients",
                                                          "optimizer_states",
                                                          "activation_peak")]
        table.append(row)
    at = _point_of(rows)
    what = "inference" if args.inference else "training step"
    title = f"{what} per device at {', '.join(f'{k}={v}' for k, v in (at or {}).items())}"
    if budgeted:
        title += (f" against {args.gpu or args.memory} (fits: total <= "
                  f"{1 - args.margin:.0%} of the capacity)")
    out = [title, tabulate(table, headers=head, disable_numparse=True)]
    if any(f is not None and f["ranks_differ"] for _, f in ordered):
        out.append("* ranks differ: the figures are one rank's (memsim analyze ... --json "
                   "lists every group of ranks)")
    if budgeted and any("(" in str(cell) for row in table for cell in row[6:8]):
        out.append("(n): the largest size at which the caching allocator never releases its "
                   "cache; above it each step frees cached segments and retries")
    out += [f"error: {n}" for n in notes]
    return "\n".join(out)


def _limit(b, which: str) -> str:
    """A largest size for the compare table: ``18``, or ``18 (17)`` with the largest size
    without a release of the allocator's cache where that is smaller."""
    v = getattr(b, f"max_{which}")
    if v is None:
        return "-"
    clean = getattr(b, f"max_{which}_no_release", None)
    return f"{v} ({clean})" if clean is not None and clean < v else str(v)
