"""``memsim compare``'s text and JSON: a row per configuration, sorted by total (or peak)."""

from __future__ import annotations

from tabulate import tabulate

from memsim._version import __version__ as VERSION

from .formats import human
from .render import budget_json

__all__ = ["compare_json", "compare_text"]


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


def compare_json(rows, gpu: str | None = None, memory: str | None = None) -> dict:
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
    return {"memsim": VERSION, "at": common_point(rows), "gpu": gpu, "memory": memory,
            "configs": out}


def common_point(rows):
    for r in rows:
        if r["error"] is None:
            return {**r["report"].fixed, **(r["full_point"] or {})}
    return None


def compare_text(rows, inference: bool = False, against: str | None = None,
                 margin: float = 0.10) -> str:
    """One table, a row per configuration, sorted by total (or peak without a budget);
    ``against``: the GPU or capacity the budgets are against, ``margin`` their safety margin."""
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
                     largest_cell(b, "batch"), largest_cell(b, "seq")] if b is not None else ["-"] * 6)
        row += [human(f[k]) if k in f else "-" for k in ("parameters", "gradients",
                                                          "optimizer_states",
                                                          "activation_peak")]
        table.append(row)
    at = common_point(rows)
    what = "inference" if inference else "training step"
    title = f"{what} per device at {', '.join(f'{k}={v}' for k, v in (at or {}).items())}"
    if budgeted:
        title += (f" against {against} (fits: total <= {1 - margin:.0%} of the capacity)")
    out = [title, tabulate(table, headers=head, disable_numparse=True)]
    if any(f is not None and f["ranks_differ"] for _, f in ordered):
        out.append("* ranks differ: the figures are one rank's (memsim analyze ... --json "
                   "lists every group of ranks)")
    if budgeted and any("(" in str(cell) for row in table for cell in row[6:8]):
        out.append("(n): the largest size at which the caching allocator never releases its "
                   "cache; above it each step frees cached segments and retries")
    out += [f"error: {n}" for n in notes]
    return "\n".join(out)


def largest_cell(b, which: str) -> str:
    """A largest size for the compare table: ``18``, or ``18 (17)`` with the largest size
    without a release of the allocator's cache where that is smaller."""
    v = getattr(b, f"max_{which}")
    if v is None:
        return "-"
    clean = getattr(b, f"max_{which}_no_release", None)
    return f"{v} ({clean})" if clean is not None and clean < v else str(v)
