"""Pictures of a step: the timeline (live memory over the step, stacked by category).

Plotting is optional: matplotlib is imported only here, when a picture is asked for
(``pip install 'memsim[plot]'``). The data comes from :mod:`memsim.analysis.timeline`; nothing
here computes a figure of its own.
"""

from __future__ import annotations

import html
import io
import re
from pathlib import Path

from memsim.render import largest
from memsim.tracer import UsageError

# one colour per category, stable across pictures (matplotlib's tab10 order)
COLORS = {"parameter": "#1f77b4", "gradient": "#ff7f0e", "optimizer_state": "#2ca02c",
          "activation": "#d62728", "temporary": "#9467bd", "input": "#8c564b",
          "buffer": "#e377c2", "strategy buffers": "#7f7f7f", "output": "#bcbd22"}
LABELS = {"optimizer_state": "optimizer states", "parameter": "parameters",
          "gradient": "gradients", "activation": "activations (saved for backward)",
          "temporary": "temporaries", "input": "inputs", "buffer": "buffers",
          "output": "output and loss the loop holds"}
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


def card_lines(budget) -> list[tuple[str, int, str]]:
    """``(label, bytes, style)`` of the card drawn on a timeline: its memory, and what the
    caching allocator may reserve of it (the usable share, less what lives outside the
    allocator: the CUDA context, communication libraries' own buffers)."""
    if budget is None or not budget.capacity:
        return []
    name = budget.gpu.name if budget.gpu is not None else "the memory given"
    usable = budget.limit
    outside = budget.usable - usable
    return [(f"{name}: {_human(budget.capacity)}", budget.capacity, "-"),
            (f"usable by the allocator: {_human(usable)} ({1 - budget.margin:.0%}"
             + (f", less {_human(outside)} outside it" if outside else "") + ")", usable, "-.")]


def _thin(tl, columns: int):
    """The event indices drawn: in a short step every one; in a long one, per run of events
    one column wide, the event whose total is largest (the peak and every local high stay;
    the picture's pixels could not show more); of those, the first, the last and each where
    some line changes (a step drawn "post" holds its value until the next)."""
    n = len(tl.totals)
    if n == 0:
        return []
    keep, per = [], n / columns
    if n <= columns:
        keep = list(range(n))
    for c in range(columns if n > columns else 0):
        lo, hi = int(c * per), max(int((c + 1) * per), int(c * per) + 1)
        keep.append(max(range(lo, min(hi, n)), key=tl.totals.__getitem__))
    keep = sorted(set(keep + [0, n - 1]))   # (the peak is its column's highest)
    # a step drawn "post" needs only the events where some series changes
    rows = [tl.series[c] for c in tl.series] + [tl.totals] + (
        [tl.reserved] if tl.reserved is not None else [])
    return [j for i, j in enumerate(keep)
            if i == 0 or i == len(keep) - 1 or any(r[j] != r[keep[i - 1]] for r in rows)]


def timeline_figure(tl, budget=None, columns: int = 600):
    """A matplotlib Figure of :class:`memsim.analysis.timeline.Timeline` ``tl``; ``budget``
    (:class:`memsim.analysis.budget.Budget`): the card's lines, and where the allocator runs
    out of it. A long step is drawn at ``columns`` events (:func:`_thin`)."""
    plt = pyplot()
    # what the allocator reserves far above what the tensors hold (a small step: a 20 MiB
    # segment and the cuBLAS workspace for a few MiB of tensors) would squash the step to the
    # bottom of the axis: the axis is the tensors', the reserved line leaves it
    most = max(tl.reserved or [0])
    clipped = most > 3 * tl.peak
    data = tl.peak if clipped else max(tl.peak, most)
    # a card far above the step (a small model on a large GPU) would squash the data too: it
    # is named in the legend instead of drawn
    cards, above = [], []
    lines = card_lines(budget)
    for label, b, style in lines:
        (cards if b <= 2 * data else above).append((label, b, style))
    high = max([data] + [b for _, b, _ in cards])
    div, unit = _unit(high)
    fig, ax = plt.subplots(figsize=(13, 5.5), layout="constrained")
    idx = _thin(tl, columns)
    names = list(tl.series)
    ax.stackplot(idx, *[[tl.series[c][j] / div for j in idx] for c in names],
                 labels=[LABELS.get(c, c) for c in names],
                 colors=[COLORS.get(c, "#bcbd22") for c in names], step="post", alpha=0.9)
    # the total as a line too: a one-event spike is thinner than a pixel in a long step
    ax.step(idx, [tl.totals[j] / div for j in idx], where="post", color="0.15", linewidth=0.6,
            label="live in all")
    if tl.reserved is not None:
        ax.step(idx, [tl.reserved[j] / div for j in idx], where="post", color="black",
                linestyle="--", linewidth=1.2, label="reserved by the caching allocator" + (
                    f" (up to {_human(most)}: above the plot)" if clipped else ""))
    for label, b, style in cards:
        ax.axhline(b / div, color="#b71c1c", linestyle=style, linewidth=1.1, label=label)
    for label, b, style in above:
        ax.plot([], [], color="#b71c1c", linestyle=style, linewidth=1.1,
                label=f"{label}: above the plot")
    if lines and tl.reserved is not None and budget.replay is not None \
            and budget.replay.oom is not None:
        # the replay confined to the card ran out: where the step first needs more than the
        # allocator may hold
        limit = lines[1][1]
        first = next((j for j, v in enumerate(tl.totals) if v > limit), None)
        line = tl.totals
        if first is None:   # the cache and the cuBLAS workspace do not fit beside the tensors
            first = next((j for j, v in enumerate(tl.reserved) if v > limit), None)
            line = tl.reserved
        if first is not None:
            ax.plot([first], [line[first] / div], marker="X", color="#b71c1c",
                    markersize=10, linestyle="none", zorder=6,
                    label="out of memory by here (the allocator confined to the card)")
    top = high / div * 1.12
    for k, (name, lo, hi) in enumerate(tl.phases):
        if k % 2:
            ax.axvspan(lo - 0.5, hi + 0.5, color="0.93", zorder=0)
    if tl.peak_index >= 0:
        ax.plot([tl.peak_index], [tl.peak / div], marker="v", color="black", markersize=8,
                linestyle="none", zorder=5)
        ax.annotate(f"peak {tl.peak / div:.3g} {unit}\n{tl.peak_where}",
                    (tl.peak_index, tl.peak / div), xytext=(0.5, 0.97),
                    textcoords="axes fraction", ha="center", va="top", fontsize=8,
                    bbox={"boxstyle": "round", "fc": "white", "ec": "0.6"},
                    arrowprops={"arrowstyle": "->", "color": "0.3"})
    ax.set_ylim(0, top)
    ax.set_xlim(-0.5, max(len(tl.totals) - 0.5, 0.5))
    ax.set_xlabel("allocations and frees of the step, in order")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(f"{tl.step} step at {_point(tl)} on {tl.device} (predicted by memsim)",
                 fontsize=10, pad=16)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _phase_labels(fig, ax, tl.phases)
    return fig


def _phase_labels(fig, ax, phases) -> None:
    """Each phase's name above the plot, over its range; a name wider than its phase that
    would run into another's is left out (the widest phases keep theirs)."""
    import matplotlib.transforms as mtransforms
    where = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    texts = [ax.text((lo + hi) / 2, 1.005, name, ha="center", va="bottom", fontsize=8,
                     color="0.3", transform=where, clip_on=False)
             for name, lo, hi in phases]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes_box = ax.get_window_extent(renderer)
    placed = []
    for k in sorted(range(len(phases)), key=lambda k: phases[k][1] - phases[k][2]):
        box = texts[k].get_window_extent(renderer)
        if any(box.overlaps(o) for o in placed) or box.x0 < axes_box.x0 - 2 \
                or box.x1 > axes_box.x1 + 2:
            texts[k].remove()
        else:
            placed.append(box)


def _human(n: int) -> str:
    div, unit = _unit(n)
    return f"{n / div:.2f} {unit}" if unit != "B" else f"{n} B"


def _natural(text: str) -> list:
    """A key sorting ``h.2`` before ``h.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _module_name(module: str) -> str:
    return {"-": "(no module: the loop, the optimizer)", "": "(the model itself)"}.get(
        module, module)


def at_peak_rows(tl, shown: int = 12) -> tuple[list, int, int]:
    """What is live at the peak by module and category, repeated blocks grouped (``h.*`` for
    ``h.0`` ... ``h.11``): ``([(module, blocks, category, tensors, bytes)], more, total)``,
    largest first then in the model's order, at most ``shown`` rows; ``more``: rows left out,
    ``total``: the bytes of every row."""
    groups: dict = {}
    for g in tl.at_peak:
        key = (re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", g.module), g.category)
        row = groups.setdefault(key, [set(), 0, 0])
        row[0].add(g.module)
        row[1] += g.count
        row[2] += g.bytes
    rows = sorted(((m, len(ms), c, k, b) for (m, c), (ms, k, b) in groups.items()),
                  key=lambda r: (-r[4], _natural(r[0]), r[2]))
    return rows[:shown], max(len(rows) - shown, 0), sum(r[4] for r in rows)


def _at_peak_table(tl, heading: str) -> str:
    """What is live at the peak, by module and category, as an HTML table (:func:`at_peak_rows`:
    repeated blocks grouped, a total row)."""
    rows, more, total = at_peak_rows(tl)
    body = "\n".join(
        f"<tr><td>{html.escape(_module_name(m))}{f' &times; {n}' if n > 1 else ''}</td>"
        f"<td>{html.escape(LABELS.get(c, c))}</td><td class=n>{k}</td>"
        f"<td class=n>{_human(b)}</td></tr>" for m, n, c, k, b in rows)
    if more:
        body += (f"\n<tr><td colspan=3><i>{more} more</i></td><td class=n>"
                 f"{_human(total - sum(r[4] for r in rows))}</td></tr>")
    body += (f"\n<tr class=total><td colspan=3>total live at the peak</td><td class=n>"
             f"{_human(total)}</td></tr>")
    return (f"{heading}\n<table><tr><th>module</th><th>category</th><th>tensors</th>"
            f"<th>bytes</th></tr>\n{body}</table>")


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


def scaling_figure(curves: dict, capacities: dict, margin: float, names: dict | None = None):
    """Total against each symbol (a subplot per symbol), one line per configuration: each
    capacity's usable memory as a horizontal line, the largest fitting size of each
    configuration marked on it, the point asked for, the model's own limit, where the peak's
    regime changes (in the legend). The axes span the useful range: up to twice the point or
    the largest fitting size, whichever is larger. ``names``: ``{symbol: what it is}``
    ("batch size"), for the axis."""
    plt = pyplot()
    syms = list(curves)
    fig, axes = plt.subplots(1, len(syms), figsize=(6.5 * len(syms), 5), layout="constrained",
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, sym in zip(axes[0], syms):
        cs = curves[sym]
        interest = [c.at or 1 for c in cs] + [v for c in cs for v in c.fits.values() if v]
        right = min(max(max(c.sizes) for c in cs), max(2 * max(interest), 8))
        shown = [[(v, t) for v, t in zip(c.sizes, c.totals) if v <= right] for c in cs]
        peak = max(t for pts in shown for _, t in pts)
        # a card far above every curve is named in the legend, not drawn (it would squash them)
        drawn = {n: g for n, g in capacities.items() if g.bytes * (1 - margin) <= 3 * peak}
        top = max([peak] + [int(g.bytes * (1 - margin)) for g in drawn.values()])
        div, unit = _unit(top)
        for k, (c, pts) in enumerate(zip(cs, shown)):
            col = colors[k % len(colors)]
            ax.plot([v for v, _ in pts], [t / div for _, t in pts], marker="o", markersize=3,
                    color=col, label=c.label or "total per device")
            if c.at is not None and c.at <= right:
                at_total = dict(zip(c.sizes, c.totals)).get(c.at)
                if at_total is not None:
                    ax.plot([c.at], [at_total / div], marker="*", markersize=13, color=col,
                            markeredgecolor="black", linestyle="none", zorder=5,
                            label=f"{sym}={c.at} (asked for): {_human(at_total)}")
            for v, where in [r for r in c.regimes[1:] if r[0] <= right][:4]:
                ax.axvline(v, color=col, linestyle=":", linewidth=0.9,
                           label=f"from {sym}={v} the peak is in {where.split(':')[0]}")
            for name, g in drawn.items():
                got = c.fits.get(name)
                if got and got <= right:
                    ax.plot([got], [g.bytes * (1 - margin) / div], marker="|", markersize=14,
                            markeredgewidth=2, color=col, linestyle="none")
                    ax.annotate(f"{sym} <= {got}", (got, g.bytes * (1 - margin) / div),
                                xytext=(4, 5 + 11 * k), textcoords="offset points", fontsize=8,
                                color=col)
        limit = next((c.limit for c in cs if c.limit is not None), None)
        if limit is not None and limit <= right:
            ax.axvline(limit, color="0.2", linewidth=1.4,
                       label=f"the model's limit: {sym} <= {limit}")
        for name, g in capacities.items():
            y = g.bytes * (1 - margin) / div
            if name in drawn:
                ax.axhline(y, color="#b71c1c", linestyle="-.", linewidth=0.9,
                           label=f"{name}: {1 - margin:.0%} usable")
            else:
                usable = _human(int(g.bytes * (1 - margin)))
                ax.plot([], [], color="#b71c1c", linestyle="-.", linewidth=0.9,
                        label=f"{name}: {1 - margin:.0%} usable, {usable}, above the plot")
        ax.set_xlim(0, right * 1.04)
        what = (names or {}).get(sym)
        ax.set_xlabel(f"{what} {sym}" if what else sym)
        ax.set_ylabel(f"total per device ({unit})")
        ax.set_ylim(0, top / div * 1.12)
        ax.set_title(f"memory against {sym} (predicted by memsim)", fontsize=10)
        # below the plot: inside, it would hide the curve and the point asked for
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.13), frameon=False)
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
    """The figure as inline SVG, its text as text (a browser lays it out: smaller, and the
    labels can be found and measured)."""
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "memsim"}):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    # paths' coordinates to a hundredth of a point (matplotlib writes millionths)
    text = re.sub(r' d="[^"]*"', lambda m: re.sub(r"(\.\d\d)\d+", r"\1", m.group(0)), text)
    return text[text.index("<svg"):]


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
            f'{html.escape(title)}</title><style>{_CSS}</style></head>\n<body><h1>'
            f'{html.escape(title)}</h1>\n{body}\n</body></html>\n')


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:1300px}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
        "padding:3px 8px}td.n{text-align:right}svg{max-width:100%;height:auto}"
        "pre{background:#f6f6f6;padding:8px;white-space:pre-wrap;overflow-wrap:anywhere}"
        "tr.total td{font-weight:bold}summary{cursor:pointer;font-weight:bold}"
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
        fig = timeline_figure(tl, budget)
        parts.append("<h2>The step, allocation by allocation</h2>\n" + svg_of(fig))
        plt.close(fig)
        parts.append(_at_peak_table(
            tl, f"<h3>Live at the peak ({html.escape(str(tl.peak_where))}), by module and "
                "category</h3>"))
    if scaling is not None:
        parts.append("<h2>Memory against size</h2>\n" + svg_of(scaling))
        plt.close(scaling)
    parts.append("<details id=report><summary>The full text report (every table, the exact "
                 "formulas, the notes)</summary>\n<pre>" + html.escape(text) + "</pre></details>")
    return _page(title, "\n".join(parts))
