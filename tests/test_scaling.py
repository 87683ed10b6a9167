"""Memory against a size (analysis/scaling.py) and its picture (memsim/plots.py, --plot).

The curve's totals are the budget's at each size; on the CPU those are real runs' peaks
(checked here at three sizes), and the largest fitting size is the budget's solver's answer.
"""

import pytest
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
    from memsim.plots import scaling_figure
    r = _report("cuda")
    caps = {"H100": gpu("h100-80gb"), "4090": gpu("rtx-4090")}
    curves = {s: [curve(r, {"B": 4, "S": 64}, s, label="one", capacities=caps)]
              for s in ("B", "S")}
    fig = scaling_figure(curves, caps, 0.1)
    assert len(fig.axes) == 2
    for ax, s in zip(fig.axes, ("B", "S")):
        c = curves[s][0]
        line = [ln for ln in ax.get_lines() if ln.get_label() == "one"][0]
        assert list(line.get_xdata()) == c.sizes
        div = {"GiB": 2 ** 30, "MiB": 2 ** 20}[ax.get_ylabel().split("(")[1].rstrip(")")]
        assert list(line.get_ydata()) == [t / div for t in c.totals]
        hlines = sorted(ln.get_ydata()[0] for ln in ax.get_lines()
                        if ln.get_linestyle() == "--")
        assert hlines == sorted(g.bytes * 0.9 / div for g in caps.values())
        labels = [t.get_text() for t in ax.texts]
        assert any(t.strip().startswith("H100") for t in labels)
        for name, got in c.fits.items():
            if got:
                assert f"{s}<={got}" in labels
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
