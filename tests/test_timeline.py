"""The step's timeline (analysis/timeline.py) and its pictures (memsim/plots.py).

The data is checked against real CPU runs: the live bytes after every allocation and free of
the predicted step are the real step's, change by change (tests/support/oracles/measure.py records
them). The pictures are checked by their data (series, peak marker, labels), not pixels.
"""

import json

import pytest
import torch

from memsim.analysis import analyze
from memsim.analysis.timeline import timeline
from memsim.cli import main

from tests.support import zoo
from tests.support.oracles.measure import example_inputs, materialize, measure_train

SEQ = {"x": ("float32", ["B", "S", 32])}
LM = {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])}
MLP_IN = {"x": ("float32", ["B", 16])}


def _report(factory, inputs, device="cpu", **kw):
    with torch.device("meta"):
        m = factory()
    return analyze(m, inputs, device=device, inference=False, **kw)


def _changes(series: list[int]) -> list[int]:
    """The live bytes after each change: repeats (an empty storage's events) dropped."""
    return [v for i, v in enumerate(series) if i == 0 or v != series[i - 1]]


@pytest.mark.parametrize("factory,inputs,point", [
    (zoo.Block, SEQ, {"B": 2, "S": 8}), (zoo.Block, SEQ, {"B": 4, "S": 64}),
    (zoo.MLP, MLP_IN, {"B": 5}), (zoo.TinyGPT, LM, {"B": 3, "S": 16}),
    (zoo.Layouts, {"x": ("float32", ["B", "S", 8])}, {"B": 5, "S": 10})])
def test_timeline_is_the_real_runs_sequence(factory, inputs, point):
    tl = timeline(_report(factory, inputs), point)
    torch.manual_seed(0)
    real = measure_train(materialize(factory()), example_inputs(inputs, point))
    assert _changes(tl.totals) == _changes(real.series)
    assert tl.peak == real.peak == max(tl.totals)


def test_timeline_peak_breakdown_phases_and_reserved_on_cuda():
    from memsim.analysis.reserved import replay
    r = _report(zoo.Block, SEQ, device="cuda")
    pt = {"B": 4, "S": 64}
    tl = timeline(r, pt, workspace=2 ** 20)
    sub, spt = r.for_point(pt)
    assert tl.peak == sub.train.value("peak", spt)
    bd = sub.train.breakdown(spt)
    got = {c: v[tl.peak_index] for c, v in tl.series.items()}
    # the output the loop holds (the block's, saved for backward too) has its own series; the
    # breakdown counts it as an activation
    out = got.pop("output")
    assert out > 0
    got["activation"] += out
    assert got == {c: v for c, v in bd.items() if v}
    assert [p[0] for p in tl.phases] == ["zero_grad", "forward", "loss", "backward",
                                         "optimizer"]
    assert tl.phases[0][1] == 0 and tl.phases[-1][2] == len(tl.ops) - 1
    assert all(a[2] + 1 == b[1] for a, b in zip(tl.phases, tl.phases[1:]))
    # the reserved line is the replay's, after each event of the steady step
    rr = replay(sub.train, spt, workspace=2 ** 20)
    assert len(tl.reserved) == len(tl.ops)
    assert tl.reserved[tl.peak_index] == rr.reserved_at_peak
    assert max(tl.reserved) <= rr.reserved
    assert all(res >= tot for res, tot in zip(tl.reserved, tl.totals))
    # what is live at the peak, by module: the attention's saved activations lead
    assert sum(g.bytes for g in tl.at_peak) <= tl.peak
    assert any(g.module == "attn" and g.category == "activation" for g in tl.at_peak)


def test_accumulation_repeats_the_phases():
    tl = timeline(_report(zoo.MLP, MLP_IN, accumulate=2), {"B": 4})
    assert [p[0] for p in tl.phases] == ["zero_grad", "forward", "loss", "backward",
                                         "forward", "loss", "backward", "optimizer"]


def test_timeline_figure_data():
    from memsim.plots import timeline_figure
    tl = timeline(_report(zoo.Block, SEQ, device="cuda"), {"B": 4, "S": 64})
    fig = timeline_figure(tl)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert labels[:len(tl.series)] == ["parameters", "inputs", "gradients", "optimizer states",
                                       "activations (saved for backward)", "temporaries",
                                       "output and loss the loop holds"]
    reserved_label = next(t for t in labels if t.startswith("reserved by the caching"))
    assert "live in all" in labels
    total = [ln for ln in ax.get_lines() if ln.get_label() == "live in all"][0]
    assert max(total.get_ydata()) == tl.peak / 2 ** 20
    div = 2 ** 20  # the axis is in MiB at this size
    reserved = [ln for ln in ax.get_lines() if ln.get_label() == reserved_label][0]
    assert list(reserved.get_ydata()) == [v / div for v in tl.reserved]
    # the axis is scaled to what a reader must see: the tensors' peak fills most of it; where
    # the reserved bytes are over three times the peak, the line leaves the plot, saying so
    clipped = max(tl.reserved) > 3 * tl.peak
    assert clipped == reserved_label.endswith("above the plot)")
    drawn = tl.peak if clipped else max(tl.peak, max(tl.reserved))
    assert abs(drawn / div * 1.12 - ax.get_ylim()[1]) < 1e-9
    assert tl.peak / div >= ax.get_ylim()[1] / 1.12 / 3
    marker = [ln for ln in ax.get_lines() if ln.get_marker() == "v"][0]
    assert (list(marker.get_xdata()), list(marker.get_ydata())) == ([tl.peak_index],
                                                                    [tl.peak / div])
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("peak ") and str(tl.peak_where) in t for t in texts)
    # the phases' names above the plot, in order; one wider than its phase that would run
    # into another's left out
    named = [t for t in texts if not t.startswith("peak ")]
    assert named and all(n in [p[0] for p in tl.phases] for n in named)
    assert "forward" in named and "backward" in named
    import matplotlib.pyplot as plt
    plt.close(fig)


ARGS = ["analyze", "examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]",
        "--train"]


def test_cli_timeline_files(tmp_path, capsys):
    page = tmp_path / "t.html"
    assert main(ARGS + ["--at", "B=2,S=8", "--timeline", str(page), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout stays the JSON document
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<svg" in text
    assert "Live at the peak, by module and category" in text and "forward" in text
    from memsim.plots import _human
    assert f"peak {_human(doc['train']['peak']['bytes'])} at" in text  # the peak, in words
    for suffix in (".png", ".svg"):
        out = tmp_path / f"t{suffix}"
        assert main(ARGS + ["--at", "B=2,S=8", "--timeline", str(out)]) == 0
        assert out.stat().st_size > 10_000
    capsys.readouterr()
    assert main(ARGS + ["--at", "B=2,S=8", "--timeline", str(tmp_path / "t.gif")]) == 2
    assert "unknown file type" in capsys.readouterr().err
    assert main(ARGS + ["--timeline", str(page)]) == 2
    assert "--timeline needs a point" in capsys.readouterr().err


def test_a_long_step_is_drawn_at_its_highs_and_the_svg_is_compact():
    """Past ``columns`` events, each column keeps its highest event (the peak too), and only
    where something changes; the SVG's coordinates are hundredths."""
    import re
    from types import SimpleNamespace

    from memsim.plots import _thin, svg_of, timeline_figure
    n = 5000
    totals = [(i * 7919) % 1000 for i in range(n)]
    totals[4321] = 5000
    tl = SimpleNamespace(totals=totals, series={"activation": totals}, reserved=None,
                         peak=5000, peak_index=4321)
    kept = _thin(tl, 600)
    assert 4321 in kept and len(kept) <= 603 and kept[0] == 0 and kept[-1] == n - 1
    for a, b in zip(kept, kept[1:]):     # the highest event of each column is kept
        assert all(totals[j] <= max(totals[a], totals[b]) or j in kept for j in range(a, b))
    flat = SimpleNamespace(totals=[1] * 100, series={"activation": [1] * 100}, reserved=None,
                           peak=1, peak_index=0)
    assert _thin(flat, 600) == [0, 99]
    real = timeline(_report(zoo.Block, SEQ, device="cuda"), {"B": 4, "S": 64})
    fig = timeline_figure(real)
    svg = svg_of(fig)
    coords = re.findall(r"\d+\.\d+", " ".join(re.findall(r' d="([^"]*)"', svg)))
    assert coords and all(len(c.split(".")[1]) <= 2 for c in coords)
    assert "<text" in svg                # its words as text, which a browser lays out
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_a_reserved_line_far_above_the_step_leaves_the_plot():
    """A few MiB of tensors and a 20 MiB segment plus the cuBLAS workspace reserved: the axis
    is the tensors', the reserved line leaves it, saying how high it goes."""
    from memsim.plots import timeline_figure
    tl = timeline(_report(zoo.MLP, MLP_IN, device="cuda"), {"B": 4}, workspace=9 * 2 ** 20)
    assert max(tl.reserved) > 3 * tl.peak
    fig = timeline_figure(tl)
    ax = fig.axes[0]
    label = next(t for t in ax.get_legend_handles_labels()[1] if t.startswith("reserved"))
    assert label.endswith("above the plot)")
    unit = ax.get_ylabel().split("(")[1].rstrip(")")
    div = {"KiB": 2 ** 10, "MiB": 2 ** 20, "B": 1}[unit]
    assert abs(tl.peak / div * 1.12 - ax.get_ylim()[1]) < 1e-9
    import matplotlib.pyplot as plt
    plt.close(fig)
