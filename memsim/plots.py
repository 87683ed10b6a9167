"""Pictures of a step: the timeline (live memory over the step, stacked by category).

Plotting is optional: matplotlib is imported only here, when a picture is asked for
(``pip install 'memsim[plot]'``). The data comes from :mod:`memsim.analysis.timeline`; nothing
here computes a figure of its own.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

from memsim.render import largest
from memsim.tracer import UsageError

# one colour per category, stable across pictures (matplotlib's tab10 order)
COLORS = {"parameter": "#1f77b4", "gradient": "#ff7f0e", "optimizer_state": "#2ca02c",
          "activation": "#d62728", "temporary": "#9467bd", "input": "#8c564b",
          "buffer": "#e377c2", "strategy buffers": "#7f7f7f"}
LABELS = {"optimizer_state": "optimizer states", "parameter": "parameters",
          "gradient": "gradients", "activation": "activations (saved for backward)",
          "temporary": "temporaries", "input": "inputs", "buffer": "buffers"}
FORMATS = (".png", ".svg", ".pdf", ".html")


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("pictures need matplotlib, which is not installed",
                         hint="pip install 'memsim[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _unit(peak: int) -> tuple[float, str]:
    for div, name in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if peak >= div:
            return float(div), name
    return 1.0, "B"


def _point(tl) -> str:
    return ", ".join(f"{k}={v}" for k, v in tl.point.items()) or "-"


def timeline_figure(tl):
    """A matplotlib Figure of :class:`memsim.analysis.timeline.Timeline` ``tl``."""
    plt = pyplot()
    div, unit = _unit(max(tl.peak, max(tl.reserved or [0])))
    fig, ax = plt.subplots(figsize=(13, 5.5), layout="constrained")
    x = list(range(len(tl.ops)))
    names = list(tl.series)
    ax.stackplot(x, *[[v / div for v in tl.series[c]] for c in names],
                 labels=[LABELS.get(c, c) for c in names],
                 colors=[COLORS.get(c, "#bcbd22") for c in names], step="post", alpha=0.9)
    # the total as a line too: a one-event spike is thinner than a pixel in a long step
    ax.step(x, [v / div for v in tl.totals], where="post", color="0.15", linewidth=0.6,
            label="live in all")
    if tl.reserved is not None:
        ax.step(x, [v / div for v in tl.reserved], where="post", color="black",
                linestyle="--", linewidth=1.2, label="reserved by the caching allocator")
    top = max(tl.peak, max(tl.reserved or [0])) / div * 1.12
    for k, (name, lo, hi) in enumerate(tl.phases):
        if k % 2:
            ax.axvspan(lo - 0.5, hi + 0.5, color="0.93", zorder=0)
        ax.text((lo + hi) / 2, top * 0.985, name, ha="center", va="top", fontsize=8,
                color="0.3")
    if tl.peak_index >= 0:
        ax.plot([tl.peak_index], [tl.peak / div], marker="v", color="black", markersize=8,
                linestyle="none", zorder=5)
        ax.annotate(f"peak {tl.peak / div:.3g} {unit}\n{tl.peak_where}",
                    (tl.peak_index, tl.peak / div), xytext=(0.5, 0.90),
                    textcoords="axes fraction", ha="center", va="top", fontsize=8,
                    bbox={"boxstyle": "round", "fc": "white", "ec": "0.6"},
                    arrowprops={"arrowstyle": "->", "color": "0.3"})
    ax.set_ylim(0, top)
    ax.set_xlim(-0.5, max(len(x) - 0.5, 0.5))
    ax.set_xlabel("allocations and frees of the step, in order")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(f"{tl.step} step at {_point(tl)} on {tl.device} (predicted by memsim)",
                 fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def _human(n: int) -> str:
    div, unit = _unit(n)
    return f"{n / div:.2f} {unit}" if unit != "B" else f"{n} B"


def _at_peak_table(tl, heading: str) -> str:
    """What is live at the timeline's peak, by module and category, as an HTML table."""
    rows = "\n".join(
        f"<tr><td>{html.escape(g.module)}</td><td>{html.escape(LABELS.get(g.category, g.category))}"
        f"</td><td class=n>{g.count}</td><td class=n>{_human(g.bytes)}</td></tr>"
        for g in tl.at_peak)
    return (f"{heading}\n<table><tr><th>module</th><th>category</th><th>tensors</th>"
            f"<th>bytes</th></tr>\n{rows}</table>")


def timeline_html(tl, title: str = "memsim timeline") -> str:
    """One self-contained HTML page: the picture (inline SVG), what is live at the peak and
    the phases."""
    plt = pyplot()
    fig = timeline_figure(tl)
    svg = svg_of(fig)
    plt.close(fig)
    phases = "\n".join(f"<tr><td>{html.escape(n)}</td><td class=n>{lo}</td><td class=n>{hi}</td>"
                       f"<td class=n>{_human(max(tl.totals[lo:hi + 1]))}</td></tr>"
                       for n, lo, hi in tl.phases)
    reserved = (f"<p>Reserved by the caching allocator (replayed): at most "
                f"{_human(max(tl.reserved))}.</p>" if tl.reserved else "")
    return _page(title, f"""<p>{html.escape(tl.step)} step at {html.escape(_point(tl))} on \
{html.escape(tl.device)}: peak {_human(tl.peak)} at {html.escape(str(tl.peak_where))}. Predicted \
from the traced step, not measured.</p>{reserved}
{svg}
{_at_peak_table(tl, "<h2>Live at the peak, by module and category</h2>")}
<h2>Phases</h2>
<table><tr><th>phase</th><th>first event</th><th>last event</th><th>most live</th></tr>
{phases}</table>""")


def save_timeline(tl, path: str) -> Path:
    """Write the timeline to ``path``: .png, .svg, .pdf (the picture) or .html (a page)."""
    if Path(path).suffix.lower() == ".html":
        p = Path(path)
        p.write_text(timeline_html(tl), encoding="utf-8")
        return p
    return save_figure(timeline_figure(tl), path)


# -- memory against a size ----------------------------------------------------------------------

# the capacities drawn when no --gpu is given: one card per common memory size
COMMON_GPUS = ("rtx-4090", "a100-40gb", "h100-80gb", "h200")


def scaling_figure(curves: dict, capacities: dict, margin: float):
    """Total against each symbol (a subplot per symbol), one line per configuration, each
    capacity's usable memory as a horizontal line, the largest fitting size of each
    configuration marked on it, and where the peak's regime changes."""
    plt = pyplot()
    syms = list(curves)
    fig, axes = plt.subplots(1, len(syms), figsize=(6.5 * len(syms), 5), layout="constrained",
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, sym in zip(axes[0], syms):
        peak = max(max(c.totals) for c in curves[sym])
        top = max([peak] + [int(g.bytes * (1 - margin)) for g in capacities.values()])
        div, unit = _unit(top)
        for k, c in enumerate(curves[sym]):
            col = colors[k % len(colors)]
            ax.plot(c.sizes, [t / div for t in c.totals], marker="o", markersize=3, color=col,
                    label=c.label or "total")
            for v, where in c.regimes[1:]:
                ax.axvline(v, color=col, linestyle=":", linewidth=0.8)
                ax.text(v, peak / div * 0.02, f" {where.split(':')[0]} from {sym}={v}",
                        rotation=90, fontsize=6, color=col, va="bottom")
            for name, g in capacities.items():
                got = c.fits.get(name)
                if got:
                    ax.plot([got], [g.bytes * (1 - margin) / div], marker="|", markersize=12,
                            color=col)
                    ax.annotate(f"{sym}<={got}", (got, g.bytes * (1 - margin) / div),
                                xytext=(2, 3 + 9 * k), textcoords="offset points", fontsize=7,
                                color=col)
        for name, g in capacities.items():
            y = g.bytes * (1 - margin) / div
            ax.axhline(y, color="0.5", linestyle="--", linewidth=0.8)
            ax.text(1.0, y, f" {name} ({1 - margin:.0%})", transform=ax.get_yaxis_transform(),
                    fontsize=7, va="center", ha="left", color="0.3")
        ax.set_xlim(0, max(max(c.sizes) for c in curves[sym]) * 1.05)
        ax.set_xlabel(sym)
        ax.set_ylabel(f"total per device ({unit})")
        ax.set_ylim(0, top / div * 1.08)
        ax.set_title(f"memory against {sym} (predicted by memsim)", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    return fig


def save_figure(fig, path: str) -> Path:
    """Write a figure to .png/.svg/.pdf, or an .html page holding it as inline SVG."""
    plt = pyplot()
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise UsageError(f"cannot write a picture to {path!r}",
                         hint="give a file ending in " + ", ".join(FORMATS))
    if p.suffix.lower() == ".html":
        p.write_text(_page("memsim: memory against size", svg_of(fig)), encoding="utf-8")
    else:
        fig.savefig(p)
    plt.close(fig)
    return p


def svg_of(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
            f'{html.escape(title)}</title><style>{_CSS}</style></head>\n<body><h1>'
            f'{html.escape(title)}</h1>\n{body}\n</body></html>\n')


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:1300px}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
        "padding:3px 8px}td.n{text-align:right}svg{max-width:100%;height:auto}"
        "pre{background:#f6f6f6;padding:8px;overflow-x:auto}"
        ".verdict{font-size:1.15em;padding:.6em .8em;border-radius:6px}"
        ".verdict .badge{font-weight:bold;color:#fff;padding:.15em .5em;border-radius:4px;"
        "margin-right:.4em}.fits{background:#e8f5e9}.fits .badge{background:#2e7d32}"
        ".nofit{background:#ffebee}.nofit .badge{background:#c62828}")


# -- the whole report as one page -------------------------------------------------------------

def report_html(title: str, text: str, tl=None, scaling=None, budget=None,
                answer: dict | None = None) -> str:
    """One self-contained page (no external resource): the verdict (``answer``:
    :func:`memsim.formats.answer`, a green or red badge and the line that says what was
    modelled), the timeline and the memory-against-size pictures as inline SVG, what is live
    at the peak by module, and the full text report (every table, the approximate and the
    exact formulas, the notes)."""
    from .formats import answer_line, option_phrase
    plt = pyplot()
    parts = []
    if answer is not None:
        said, line = answer_line(answer).split(": ", 1)
        parts.append(f'<p class="verdict {"fits" if answer["fits"] else "nofit"}">'
                     f'<span class=badge>{html.escape(said)}</span> '
                     f'{html.escape(line, quote=False)}</p>')
        if answer.get("options"):
            rows = "".join(f"<tr><td><code>{html.escape(o['change'])}</code></td><td>"
                           f"{html.escape(option_phrase(o))}</td></tr>"
                           for o in answer["options"])
            parts.append("<p>What would make it fit, each traced at this point (best first):"
                         f"</p><table class=options>{rows}</table>")
    elif budget is not None:
        verdict = "FITS" if budget.fits else "DOES NOT FIT"
        where = budget.gpu.name if budget.gpu else _human(budget.capacity)
        reserved = (f", {_human(budget.reserved)} reserved by the caching allocator"
                    if budget.reserved is not None else "")
        parts.append(f'<p class=verdict><b>{verdict}</b> on {html.escape(where)}: total '
                     f'{_human(budget.total)}{reserved}; headroom {budget.headroom:.1%}'
                     + (f"; largest batch {html.escape(largest(budget, 'batch'))}"
                        if budget.max_batch is not None else "")
                     + (f"; largest sequence {html.escape(largest(budget, 'seq'))}"
                        if budget.max_seq is not None else "") + ".</p>")
    if tl is not None:
        fig = timeline_figure(tl)
        parts.append("<h2>The step, allocation by allocation</h2>\n" + svg_of(fig))
        plt.close(fig)
        parts.append(_at_peak_table(
            tl, f"<h3>Live at the peak ({html.escape(str(tl.peak_where))}), by module and "
                "category</h3>"))
    if scaling is not None:
        parts.append("<h2>Memory against size</h2>\n" + svg_of(scaling))
        plt.close(scaling)
    parts.append("<h2>The report</h2>\n<pre>" + html.escape(text) + "</pre>")
    return _page(title, "\n".join(parts))
