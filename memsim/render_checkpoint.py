"""``memsim checkpoint``'s text and JSON: the ranking of what to checkpoint, a plan's new
peak, the plans over a range of sizes."""

from __future__ import annotations

from tabulate import tabulate

from memsim._version import __version__ as VERSION
from memsim.analysis import TRAIN_FIELDS, Report

from .formats import at_cells, figure_json, flops_text, formula, human, short, value_at

__all__ = ["checkpoint_json", "checkpoint_text", "bands_text"]


def checkpoint_json(base: Report, result, ranking, point, budget, conditions=()) -> dict:
    """``memsim checkpoint --json`` (docs/json.md); ``conditions``: what the plan's figures
    assume of the user's code."""
    doc: dict = {"memsim": VERSION, "device": base.device, "precision": base.precision,
                 "symbols": list(base.symbols), "at": dict(point) if point else None,
                 "budget": budget, "fits": None, "plan": None}
    bstep = base.train
    doc["ranking"] = [{"path": r.path, "type": r.type, "count": r.count,
                       "saved": figure_json(bstep, r.saved, point), "forward_flops": figure_json(bstep, r.flops, point)}
                      for r in ranking]
    if result is None:
        doc["fits"] = False
        return doc
    t = result.report.train
    doc["plan"] = list(result.plan)
    doc["conditions"] = list(conditions) if result.plan else []
    doc["train"] = {f: figure_json(t, getattr(t, f), point) for f in TRAIN_FIELDS}
    doc["recompute_flops"] = figure_json(t, result.recompute_flops, point)
    doc["step_flops"] = figure_json(t, result.step_flops, point)
    if budget is not None and point is not None:
        doc["fits"] = t.evaluate(t.peak, point) <= budget
    return doc


def checkpoint_text(base: Report, result, ranking, point, budget, plan: str, top: int = 10,
                    conditions=()) -> str:
    """The ranking of layers worth checkpointing and the chosen plan's effect, with what its
    figures assume (``conditions``)."""
    bstep = base.train
    out = [f"memsim {VERSION} — checkpointing, device modelled: {base.device}; precision "
           f"{base.precision}" + (f"; at {', '.join(f'{k}={v}' for k, v in point.items())}"
                                  if point else "")]
    rows = []
    ranked = ranking
    if point is not None:
        def key(r):
            sv, fl = value_at(bstep, r.saved, point), value_at(bstep, r.flops, point)
            return (0 if not fl else 1, -(sv / fl) if fl else -sv)
        ranked = sorted(ranking, key=key)
    for r in ranked[:top]:
        sv, fl = value_at(bstep, r.saved, point), value_at(bstep, r.flops, point)
        rows.append([r.path, r.type, r.count] + ([] if point else [formula(r.saved)])
                    + at_cells(point, human(sv), flops_text(fl) if fl else "no matmul",
                          f"{sv / fl:.3g}" if fl else "-"))
    out += ["", "Layers worth checkpointing (per module; saved for backward vs the forward "
                "FLOPs recomputing it costs)",
            tabulate(rows, headers=["module", "type", "count"]
                     + ([] if point else ["saved (bytes)"])
                     + at_cells(point, "saved", "forward FLOPs", "bytes/FLOP")),
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
        rows.append([label] + ([human(value_at(bstep, a, point)), human(value_at(t, b, point))]
                               if point is not None else [short(a), short(b)]))
    out += ["", f"Plan {plan}: checkpoint {shown}",
            tabulate(rows, headers=["", "no checkpointing", "with the plan"]),
            "(formulas: --json)" if point is not None else ""]
    if point is not None:
        rc, tot = value_at(t, result.recompute_flops, point), value_at(t, result.step_flops, point)
        out.append(f"recompute: {flops_text(rc)} of {flops_text(tot)} per step "
                   f"({rc / tot:.1%})" if tot else "recompute: -")
        if budget is not None:
            p = value_at(t, t.peak, point)
            out.append(f"budget {human(budget)}: " + ("fits" if p <= budget else "does not fit"))
    if names:
        out += ["", "Apply it:", "    from memsim.strategies.checkpoint import apply_checkpointing",
                f"    apply_checkpointing(model, {names!r})"]
        out += ["", "These figures assume:"] + [f"  - {c}" for c in conditions]
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
