"""``memsim plan`` as text and JSON (docs/plan.md)."""

from __future__ import annotations

from tabulate import tabulate

from .formats import human
from .plan import PlanResult

__all__ = ["plan_text", "plan_json"]


def _title(r: PlanResult, model, gpu, seq, precision, margin) -> str:
    nodes = max(1, r.world // r.per_node)
    on = (f"{gpu} ({human(r.usable)} usable each, margin {margin:.0%})" if gpu else
          f"{human(r.usable)} usable each (margin {margin:.0%})")
    return (f"memsim plan: {model} on {r.world} GPUs ({nodes} node{'s' * (nodes > 1)} of "
            f"{min(r.per_node, r.world)}), {on}, global batch "
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


# -- the HTML page ----------------------------------------------------------------------------

def plan_figure(r: PlanResult, capacity: int | None, most: int = 40):
    """Each answered layout's total per rank (the best ``most``: those that fit first, in the
    plan's order), a bar against the card's memory and the usable line; green where it fits."""
    from .plots import _unit, pyplot
    plt = pyplot()
    rows = [x for x in r.rows if x.total is not None][:most]
    top = max([x.total for x in rows] + [r.usable] + ([capacity] if capacity else []))
    div, unit = _unit(top)
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.6), layout="constrained")
    labels = [f"{x.layout.flags()}  (mb {x.layout.micro_batch})" for x in rows]
    ax.barh(range(len(rows)), [x.total / div for x in rows],
            color=["#2e7d32" if x.fits else "#c62828" for x in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(r.usable / div, color="#444", linestyle="--",
               label=f"usable ({human(r.usable)})")
    if capacity:
        ax.axvline(capacity / div, color="#000", label=f"the GPU's memory ({human(capacity)})")
    ax.set_xlabel(f"total per rank ({unit})")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def plan_html(r: PlanResult, text: str, *, model, gpu, seq, precision, margin,
              capacity: int | None) -> str:
    """One self-contained page: the answer (a badge: how many layouts fit, the best), the
    layouts' totals against the card, the table of those that fit, the reasons of the others,
    and the text output collapsed at the end."""
    import html

    from .plots import _page, svg_of
    fit = r.fitting
    title = _title(r, model, gpu, seq, precision, margin)
    if fit:
        best = fit[0]
        head = (f'<p class="verdict fits"><span class=badge>{len(fit)} of {len(r.rows)} FIT'
                f'</span> best: <code>{html.escape(best.layout.flags())}</code> at micro-batch '
                f'{best.layout.micro_batch} x {best.layout.accumulate}, '
                f'{html.escape(human(best.total))} per rank, headroom {best.headroom:.1%}</p>')
    else:
        head = (f'<p class="verdict nofit"><span class=badge>NONE FITS</span> none of the '
                f'{len(r.rows)} layouts fits {html.escape(human(r.usable))} usable</p>')
    parts = [head, f"<p>{r.traces} traces answered "
                   f"{sum(1 for x in r.rows if x.total is not None)} layouts; ranked by "
                   f"{html.escape(_rule(r.rule))}.</p>"]
    fig = plan_figure(r, capacity)
    parts.append("<h2>Total per rank, each layout</h2>\n" + svg_of(fig))
    from .plots import pyplot
    pyplot().close(fig)
    if fit:
        body = "".join(
            f"<tr><td class=n>{i}</td><td><code>{html.escape(x.layout.flags())}</code></td>"
            f"<td class=n>{x.layout.micro_batch} x {x.layout.accumulate}</td>"
            f"<td class=n>{html.escape(human(x.peak))}</td>"
            f"<td class=n>{html.escape(human(x.total))}</td>"
            f"<td class=n>{x.headroom:.1%}</td></tr>" for i, x in enumerate(fit, 1))
        parts.append("<h2>Layouts that fit, best first</h2><table><tr><th></th><th>options"
                     "</th><th>micro-batch x accumulation</th><th>peak per rank</th><th>total "
                     f"per rank</th><th>headroom</th></tr>{body}</table>")
    reasons = r.reasons()
    if reasons:
        items = "".join(f"<li>{html.escape(why)} ({len(rows)}): " + ", ".join(
            f"<code>{html.escape(x.layout.flags())}</code>"
            + (f" at micro-batch {x.layout.micro_batch}" if x.layout.micro_batch else "")
            for x in rows[:6]) + (f", and {len(rows) - 6} more" if len(rows) > 6 else "")
            + "</li>" for why, rows in reasons.items())
        parts.append(f"<h2>Layouts that do not fit, by reason</h2><ul>{items}</ul>")
    parts.append("<details id=report><summary>The text output</summary>\n<pre>"
                 + html.escape(text) + "</pre></details>")
    return _page(title, "\n".join(parts))
