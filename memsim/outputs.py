"""Files a command writes beside its answer: ``--html`` (the whole report), ``--plot``
(memory against size) and ``--timeline`` (the step's live memory)."""

from __future__ import annotations

import sys

from memsim.tracer import UsageError

from .options import alloc_conf

__all__ = ["write_html", "write_plot", "write_timeline", "size_curves", "workspace"]


def workspace(report, setup) -> int:
    """The cuBLAS workspace the budget counts: its GPU's family's, or a generic GPU's."""
    from memsim.analysis.budget import Overheads
    overheads = setup[2] if setup is not None else Overheads()
    family = setup[0].family if setup is not None and setup[0] is not None else "unknown"
    return overheads.fixed(report.device, family)["cublas_workspace"]


def write_html(args, report, point, setup, text: str, budget) -> None:
    from memsim.analysis.timeline import timeline

    from .plots import report_html, scaling_figure
    tl = scaling = None
    if getattr(report, "fit", None) is None:
        tl = timeline(report, point, alloc_conf=alloc_conf(args),
                      workspace=workspace(report, setup))
        curves, caps = size_curves(args, [("", report, point)], setup)
        if curves:
            scaling = scaling_figure(curves, caps, args.margin, _names(args))
    from .formats import answer
    title = f"memsim: {args.target} at " + ", ".join(f"{k}={v}" for k, v in point.items())
    verdict = answer(report, budget, {**report.fixed, **point}, args.target) \
        if budget is not None else None
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(report_html(title, text, tl, scaling, budget, verdict))
    print(f"memsim: report written to {args.html}", file=sys.stderr)


def write_plot(args, rows, setup) -> None:
    """``--plot``: each row's (label, report, point) total against the batch and sequence."""
    from .plots import save_figure, scaling_figure
    curves, caps = size_curves(args, rows, setup)
    if not curves:
        raise UsageError(f"--plot draws against {args.batch_symbol} or {args.seq_symbol}, "
                         "which no input uses",
                         hint="name the symbols with --batch-symbol / --seq-symbol")
    path = save_figure(scaling_figure(curves, caps, args.margin, _names(args)), args.plot)
    print(f"memsim: memory against size written to {path}", file=sys.stderr)


def _names(args) -> dict:
    return {args.batch_symbol: "batch size", args.seq_symbol: "sequence length"}


def size_curves(args, rows, setup):
    """Each row's ``(label, report, point)`` total against the batch and the sequence, and the
    capacities drawn: ``({symbol: [Curve]}, {label: GPU})``."""
    from memsim.analysis.gpus import GPU, catalog
    from memsim.analysis.scaling import curve

    from .plots import COMMON_GPUS
    device, cap, overheads = setup if setup is not None else (None, None, None)
    if device is not None:
        caps = {device.name: device}
    elif cap is not None:
        caps = {args.memory: GPU("memory", args.memory, cap // 2 ** 20, "unknown",
                                 source="--memory")}
    else:
        caps = {catalog()[k].name: catalog()[k] for k in COMMON_GPUS}
    curves: dict = {}
    for label, report, point in rows:
        if getattr(report, "fit", None) is not None:
            raise UsageError("--plot needs traced formulas; this report's are fitted",
                             hint="analyse without --plot, or give the pinned symbol a size")
        for sym in (args.batch_symbol, args.seq_symbol):
            if sym in report.symbols and sym in point:
                curves.setdefault(sym, []).append(
                    curve(report, point, sym, label=label, capacities=caps, gpu=device,
                          overheads=overheads, margin=args.margin))
    return curves, caps


def write_timeline(args, report, point, setup) -> None:
    from memsim.analysis.timeline import timeline
    from .plots import save_timeline
    if getattr(report, "fit", None) is not None:
        raise UsageError("--timeline needs a traced step; this report's formulas are fitted "
                         "(a symbol the model's code pins)",
                         hint="give --at with the sizes you want drawn; memsim traces them")
    tl = timeline(report, point, alloc_conf=alloc_conf(args),
                  workspace=workspace(report, setup))
    path = save_timeline(tl, args.timeline)
    print(f"memsim: timeline of the {tl.step} step written to {path}", file=sys.stderr)
