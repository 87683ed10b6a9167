"""How memsim writes numbers and formulas for people: sizes (``1.50 GiB``), formulas short
and approximate, a budget's verdict and largest sizes. Used by every renderer and the examples."""

from __future__ import annotations

import sympy

__all__ = ["verdict", "answer", "answer_line", "options_lines", "option_phrase", "largest",
           "human", "formula", "approx", "short", "wrapped", "amount", "monomial", "figure_json",
           "at_cells", "flops_text", "value_at"]


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


def answer(report, b, point, model: str | None = None) -> dict:
    """The answer first (the JSON's ``"verdict"``): whether the step fits, and what was
    modelled: the model, the point, the strategy and degrees, the precision, per rank or per
    device, the GPU and its usable memory, the total, the headroom, and the largest batch and
    sequence that fit (None where not solved)."""
    from .render import strategy_text
    st = report.strategy or {}
    ranks = st.get("world_size", 1)
    return {"fits": b.fits, "model": model, "step": b.step, "at": dict(point or {}),
            "strategy": strategy_text(st) if st else None,
            "per": "rank" if ranks > 1 else "device", "precision": report.precision,
            "gpu": b.gpu.name if b.gpu else None, "capacity": b.capacity,
            "usable": b.usable, "total": b.total,
            "headroom": round(b.headroom, 6), "largest_batch": b.max_batch,
            "largest_seq": b.max_seq,
            "options": [o.as_dict() for o in getattr(b, "options", ())]}


def options_lines(v: dict) -> list[str]:
    """Where the step does not fit: each option :func:`answer` lists, best first, one line
    each (``--checkpoint blocks: 18.20 GiB, fits, headroom 12.0%``)."""
    if not v.get("options"):
        return []
    return ["  what would make it fit, each traced at this point (best first):"] + [
        f"    {o['change']}: {option_phrase(o)}" for o in v["options"]]


def option_phrase(o: dict) -> str:
    """What one option of :func:`answer` gives: ``18.20 GiB, fits, headroom 12.0%``."""
    if o["total"] is None:
        return f"does not apply ({o.get('error', '')})"
    how = f"fits, headroom {o['headroom']:.1%}" if o["fits"] else "does not fit either"
    return f"{human(o['total'])}, {how}"


def answer_line(v: dict) -> str:
    """:func:`answer` in one line, the verdict first: ``FITS: train step of gpt2.py:model at
    B=8, S=1024, bf16-mixed, on one device: 14.20 GiB of NVIDIA A10's 20.24 GiB usable,
    headroom 30.1%; largest batch that fits 12``."""
    at = ", ".join(f"{k}={n}" for k, n in v["at"].items())
    what = " ".join(p for p in (f"{v['step']} step", f"of {v['model']}" if v["model"] else "",
                                f"at {at}" if at else "") if p)
    how = v["strategy"] + ", per rank" if v["strategy"] and v["per"] == "rank" else \
        v["strategy"] or "one device"
    card = f"{v['gpu']}'s " if v["gpu"] else "the "
    out = (f"{'FITS' if v['fits'] else 'DOES NOT FIT'}: {what}, {v['precision']}, {how}: "
           f"{human(v['total'])} of {card}{human(v['usable'])} usable, headroom "
           f"{v['headroom']:.1%}")
    sizes = [f"largest {word} that fits "
             f"{'none' if v[f'largest_{k}'] == 0 else v[f'largest_{k}']}"
             for k, word in (("batch", "batch"), ("seq", "sequence"))
             if v[f"largest_{k}"] is not None]
    return out + ("; " + ", ".join(sizes) if sizes else "")


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
    """A sympy-parsable string in the user's symbols (PyTorch's own integer functions, which
    plain sympy does not know by name, written as sympy's: ``PythonMod`` is ``Mod``)."""
    return sympy.sstr(_plain(expr), order="grlex")


def _plain(expr):
    from torch.utils._sympy import functions as tf
    swap = {tf.PythonMod: sympy.Mod, tf.IntTrueDiv: lambda a, b: a / b,
            tf.CeilToInt: sympy.ceiling, tf.FloorToInt: sympy.floor}
    if not isinstance(expr, sympy.Basic) or not any(expr.has(f) for f in swap):
        return expr
    return expr.replace(lambda e: type(e) in swap, lambda e: swap[type(e)](*e.args))


_UNITS = ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB"))


def amount(c: float) -> str:
    for div, unit in _UNITS:
        if abs(c) >= div:
            return f"{c / div:.3g} {unit}"
    return f"{c:.3g} bytes"


def monomial(m: sympy.Expr) -> str:
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
        text = amount(float(c)) + monomial(m)
        out.append(text if not out else (" - " + text[1:] if text.startswith("-")
                                         else " + " + text))
    return "".join(out) or "0 B"


def wrapped(name: str, expr: sympy.Expr, width: int = 100) -> str:
    """``name = formula`` wrapped to ``width`` columns (a Max of many regimes summarised)."""
    import textwrap
    return textwrap.fill(f"  {name} = {short(expr)}", width=width, break_on_hyphens=False,
                         subsequent_indent=" " * 6)


def short(expr: sympy.Expr) -> str:
    """A formula for a table cell: a Max of many regimes is summarised."""
    if isinstance(expr, sympy.Max) and len(expr.args) > 2:
        return f"max of {len(expr.args)} regimes (--json has the formula)"
    return formula(expr)


def figure_json(step, expr, point) -> dict:
    return {"formula": formula(expr),
            "bytes": step.evaluate(expr, point) if point is not None else None}


def at_cells(point, *cells) -> list:
    """The "at point" column: its cells when a point is given, else nothing."""
    return list(cells) if point else []


def flops_text(n) -> str:
    if n is None:
        return "-"
    for unit, k in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} FLOP"


def value_at(step, expr, point):
    return step.evaluate(expr, point) if point is not None else None
