"""``memsim plan`` as text and JSON (docs/plan.md)."""

from __future__ import annotations

from tabulate import tabulate

from .formats import human
from .plan import PlanResult

__all__ = ["plan_text", "plan_json"]


def _title(r: PlanResult, model, gpu, seq, precision, margin) -> str:
    nodes = max(1, r.world // r.per_node)
    on = f"{gpu} ({human(r.usable)} usable each" if gpu else f"{human(r.usable)} usable (each"
    return (f"memsim plan: {model} on {r.world} GPUs ({nodes} node{'s' * (nodes > 1)} of "
            f"{min(r.per_node, r.world)}), {on}, margin {margin:.0%}), global batch "
            f"{r.global_batch}" + (f" x S={seq}" if seq is not None else "") + f", {precision}")


def plan_text(r: PlanResult, *, model, gpu, seq, precision, margin, top: int = 10) -> str:
    fit = r.fitting
    answered = sum(1 for x in r.rows if x.total is not None)
    out = [_title(r, model, gpu, seq, precision, margin),
           f"{len(fit)} of {len(r.rows)} layouts fit; {r.traces} trace"
           f"{'s' * (r.traces != 1)} answered {answered} (one per program, the same degrees "
           "and checkpointing and accumulation 1 or more, symbolic in the micro-batch; "
           "and sizes below its formulas' range, traced beside)"]
    if fit:
        rows = [(i, x.layout.flags(), f"{x.layout.micro_batch} x {x.layout.accumulate}",
                 human(x.peak), human(x.total), f"{x.headroom:.1%}")
                for i, x in enumerate(fit[:top], 1)]
        out += ["", f"Layouts that fit, best first ({_rule(r.rule)}):",
                tabulate(rows, headers=("", "options", "micro-batch x accumulation",
                                        "peak per rank", "total per rank", "headroom"),
                         disable_numparse=True)]
        if len(fit) > top:
            out.append(f"  {len(fit) - top} more (--top, or --json for all)")
        best = fit[0].layout
        out += ["", f"best: memsim analyze {model} ... --at B={best.micro_batch}"
                    + (f",S={seq}" if seq is not None else "") + f" {best.flags()}"]
    else:
        out += ["", "No layout fits."]
    reasons = r.reasons()
    if reasons:
        out += ["", "Layouts that do not fit, by reason:"]
        for why, rows in reasons.items():
            some = ", ".join(dict.fromkeys(
                x.layout.flags() + (f" at micro-batch {x.layout.micro_batch}"
                                    if x.layout.micro_batch else "") for x in rows[:3]))
            more = f", and {len(rows) - 3} more" if len(rows) > 3 else ""
            out.append(f"  {why} ({len(rows)}): {some}{more}")
    return "\n".join(out)


def _rule(name: str) -> str:
    return {"default": "least recomputation, then the smallest tensor-parallel degree, then "
                       "the fewest accumulation steps, then the largest headroom",
            "headroom": "the largest headroom",
            "throughput": "least recomputation, then the fewest accumulation steps, then the "
                          "smallest tensor-parallel degree, then the largest headroom"}[name]


def plan_json(r: PlanResult, *, model, gpu, seq, precision, margin) -> dict:
    return {"plan": {"model": model, "gpus": r.world, "gpus_per_node": r.per_node,
                     "gpu": gpu, "usable": r.usable, "margin": margin,
                     "global_batch": r.global_batch, "seq": seq, "precision": precision,
                     "rank_by": r.rule, "rule": _rule(r.rule), "traces": r.traces,
                     "layouts": len(r.rows), "fitting": len(r.fitting)},
            "layouts": [x.as_dict() for x in r.rows]}
