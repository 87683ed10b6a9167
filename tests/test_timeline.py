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
    assert {c: v[tl.peak_index] for c, v in tl.series.items()} == {
        c: v for c, v in bd.items() if v}
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
                                       "activations (saved for backward)", "temporaries"]
    assert "reserved by the caching allocator" in labels and "live in all" in labels
    total = [ln for ln in ax.get_lines() if ln.get_label() == "live in all"][0]
    assert max(total.get_ydata()) == tl.peak / 2 ** 20
    div = 2 ** 20  # the axis is in MiB at this size
    reserved = [ln for ln in ax.get_lines() if ln.get_label() ==
                "reserved by the caching allocator"][0]
    assert list(reserved.get_ydata()) == [v / div for v in tl.reserved]
    marker = [ln for ln in ax.get_lines() if ln.get_marker() == "v"][0]
    assert (list(marker.get_xdata()), list(marker.get_ydata())) == ([tl.peak_index],
                                                                    [tl.peak / div])
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("peak ") and str(tl.peak_where) in t for t in texts)
    assert [p[0] for p in tl.phases] == [t for t in texts if not t.startswith("peak ")]
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
    assert f"{doc['train']['peak']['bytes'] / 2 ** 20:.2f} MiB" in text  # the peak, in words
    for suffix in (".png", ".svg"):
        out = tmp_path / f"t{suffix}"
        assert main(ARGS + ["--at", "B=2,S=8", "--timeline", str(out)]) == 0
        assert out.stat().st_size > 10_000
    capsys.readouterr()
    assert main(ARGS + ["--at", "B=2,S=8", "--timeline", str(tmp_path / "t.gif")]) == 2
    assert "unknown file type" in capsys.readouterr().err
    assert main(ARGS + ["--timeline", str(page)]) == 2
    assert "--timeline needs a point" in capsys.readouterr().err
