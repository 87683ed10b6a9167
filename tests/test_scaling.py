"""Memory against a size (analysis/scaling.py) and its picture (memsim/plots.py, --plot).

The curve's totals are the budget's at each size; on the CPU those are real runs' peaks
(checked here at three sizes), and the largest fitting size is the budget's solver's answer.
"""

import torch

from memsim.analysis import analyze
from memsim.analysis.budget import against
from memsim.analysis.gpus import GPU, gpu
from memsim.analysis.scaling import curve, sizes_for
from memsim.cli import main

from tests.support import zoo
from tests.support.oracles.measure import example_inputs, materialize, measure_train

SEQ = {"x": ("float32", ["B", "S", 32])}


def _report(device):
    with torch.device("meta"):
        m = zoo.Block()
    return analyze(m, SEQ, device=device, inference=False)


def test_cpu_curve_is_real_peaks_and_the_solvers_answer():
    r = _report("cpu")
    card = GPU("small", "a 2 MiB card", 2, "unknown")
    c = curve(r, {"B": 2, "S": 16}, "S", sizes=[8, 32, 64], capacities={"small": card},
              margin=0.0)
    for v, total in zip(c.sizes, c.totals):
        torch.manual_seed(0)
        real = measure_train(materialize(zoo.Block()), example_inputs(SEQ, {"B": 2, "S": v}))
        assert total == real.peak
    assert c.fits["small"] == against(r, {"B": 2, "S": 16}, capacity=2 * 2 ** 20,
                                   margin=0.0).max_seq


def test_cuda_curve_is_the_budgets_total_and_regimes():
    r = _report("cuda")
    h100 = gpu("h100-80gb")
    point = {"B": 4, "S": 64}
    sizes = sizes_for(r, "S", point)
    assert 64 in sizes and sizes == sorted(sizes) and len(sizes) <= 12
    c = curve(r, point, "S", sizes=sizes, capacities={"H100": h100}, gpu=h100)
    for v, total in zip(c.sizes, c.totals):
        assert total == against(r, {**point, "S": v}, gpu=h100).total
    assert c.fits["H100"] == against(r, point, gpu=h100).max_seq
    sub, spt = r.for_point(point)
    assert c.regimes == [(v, str(k.label)) for v, k in sub.train.regimes("S", spt)]


def test_scaling_figure_data():
    """The curve over the useful range (up to twice the point or the largest fitting size),
    the point asked for marked with its total, each card's usable line, each fitting size on
    it, the regime changes in the legend, the axes named."""
    from memsim.plots import scaling_figure
    r = _report("cuda")
    caps = {"H100": gpu("h100-80gb"), "4090": gpu("rtx-4090")}
    curves = {s: [curve(r, {"B": 4, "S": 64}, s, label="one", capacities=caps)]
              for s in ("B", "S")}
    fig = scaling_figure(curves, caps, 0.1, {"B": "batch size", "S": "sequence length"})
    assert len(fig.axes) == 2
    for ax, s in zip(fig.axes, ("B", "S")):
        c = curves[s][0]
        assert c.at == {"B": 4, "S": 64}[s]
        right = min(max(c.sizes), max(2 * max([c.at] + [v for v in c.fits.values() if v]), 8))
        assert ax.get_xlim()[1] == right * 1.04
        line = [ln for ln in ax.get_lines() if ln.get_label() == "one"][0]
        assert list(line.get_xdata()) == [v for v in c.sizes if v <= right]
        div = {"GiB": 2 ** 30, "MiB": 2 ** 20}[ax.get_ylabel().split("(")[1].rstrip(")")]
        assert list(line.get_ydata()) == [t / div for v, t in zip(c.sizes, c.totals)
                                          if v <= right]
        star = [ln for ln in ax.get_lines() if ln.get_marker() == "*"][0]
        assert list(star.get_xdata()) == [c.at]
        assert list(star.get_ydata()) == [dict(zip(c.sizes, c.totals))[c.at] / div]
        assert star.get_label().startswith(f"{s}={c.at} (asked for)")
        # a card within three times the curve's top is drawn; one far above it is named in the
        # legend (drawn, it would squash the curve to the bottom)
        top = max(t for v, t in zip(c.sizes, c.totals) if v <= right)
        near = {n: g for n, g in caps.items() if g.bytes * 0.9 <= 3 * top}
        usable = sorted(ln.get_ydata()[0] for ln in ax.get_lines()
                        if ln.get_label().endswith("usable"))
        assert usable == sorted(g.bytes * 0.9 / div for g in near.values())
        legend = ax.get_legend_handles_labels()[1]
        assert sum(t.endswith("above the plot") for t in legend) == len(caps) - len(near)
        assert top / div >= ax.get_ylim()[1] / 3 / 1.12
        labels = [t.get_text() for t in ax.texts]
        for name, got in c.fits.items():
            if got and got <= right and name in near:
                assert f"{s} <= {got}" in labels
        legend = ax.get_legend_handles_labels()[1]
        shown = [v for v, _ in c.regimes[1:] if v <= right][:4]
        assert [t for t in legend if t.startswith("from ")] == [
            f"from {s}={v} the peak is in {w.split(':')[0]}" for v, w in c.regimes[1:]
            if v in shown]
        assert ax.get_xlabel() == {"B": "batch size B", "S": "sequence length S"}[s]
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_the_size_axis_spans_the_useful_range():
    """A card the batch outgrows early: the B axis runs to twice the largest fitting size (or
    the point), not over every size the curve was computed at."""
    from memsim.plots import scaling_figure
    r = _report("cuda")
    whole = curve(r, {"B": 4, "S": 64}, "B")
    at8 = dict(zip(whole.sizes, whole.totals))[8]
    small = GPU("small", "small", int(at8 / 0.9) // 2 ** 20, "ampere", "test")
    c = curve(r, {"B": 4, "S": 64}, "B", capacities={"small": small})
    fit = c.fits["small"]
    assert 4 <= fit < 8 and max(c.sizes) > 2 * 8
    fig = scaling_figure({"B": [c]}, {"small": small}, 0.1)
    ax = fig.axes[0]
    right = max(2 * fit, 8)
    assert ax.get_xlim()[1] == right * 1.04
    line = [ln for ln in ax.get_lines() if ln.get_label() == "total per device"][0]
    assert max(line.get_xdata()) <= right < max(c.sizes)
    import matplotlib.pyplot as plt
    plt.close(fig)


ARGS = ["examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]", "--at", "B=2,S=8"]


def test_cli_plot(tmp_path, capsys):
    out = tmp_path / "s.html"
    assert main(["analyze", *ARGS, "--train", "--gpu", "h100-80gb", "--plot", str(out)]) == 0
    assert "<svg" in out.read_text()
    png = tmp_path / "c.png"
    assert main(["compare", *ARGS, "--config", "", "--config", "--precision bf16-mixed",
                 "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["analyze", *ARGS, "--plot", str(tmp_path / "s.txt")]) == 2
    assert "unknown file type" in capsys.readouterr().err
    assert main(["compare", *ARGS, "--config", "--plot x.png"]) == 2
    assert "unknown option(s) --plot" in capsys.readouterr().err
