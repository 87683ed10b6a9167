"""Vision transformers with a symbolic image size: position embeddings and decoder heads resized
with ``F.interpolate(size=...)`` of symbolic sizes (its C++ composite takes concrete sizes
only), checked against real runs at image sizes memsim did not trace."""

import pytest

from tests.support.predict import check, predict

pytest.importorskip("transformers")
from tests.support import hf_models as hf  # noqa: E402  (imports transformers)


@pytest.mark.heavy
@pytest.mark.parametrize("factory, labels, points", [
    (hf.dinov2, ["B"], [{"B": 2, "H": 24}, {"B": 3, "H": 40}]),
    (hf.segformer, ["B", "H", "H"], [{"B": 2, "H": 24}, {"B": 2, "H": 37}]),
], ids=["dinov2", "segformer"])
def test_symbolic_image_size(factory, labels, points):
    inputs = {"pixel_values": ("float32", ["B", 3, "H", "H"]), "labels": ("int64", labels)}
    report = predict(factory, inputs)
    assert set(report.symbols) == {"B", "H"}
    check(report, factory, inputs, points)


@pytest.mark.heavy
def test_swin_is_traced_at_multiples_of_its_step():
    """Swin pads each stage's grid to whole windows: traced with H free, each padding is a
    remainder of a remainder and PyTorch's symbolic shapes took over 400 s without an answer.
    Its step (patch 4 x window 4 x 2 for the second stage: 32) is found from the config; the
    formulas are polynomials in B and H, equal to real runs at multiples of 32 not traced, and
    a size that is no multiple is traced at that size, exact too."""
    import sympy

    inputs = {"pixel_values": ("float32", ["B", 3, "H", "H"]), "labels": ("int64", ["B"])}
    report = predict(hf.swin, inputs)
    assert report.config.multiples == {"H": 32}, report.config.multiples
    assert any(n.startswith("H is traced at multiples of 32") for n in report.notes)
    assert report.train.peak.is_polynomial(*report.symbols.values()), report.train.peak
    assert sympy.Eq(sympy.Mod(report.symbols["H"], 32), 0) in report.train.violated(
        {"B": 2, "H": 48})
    check(report, hf.swin, inputs, [{"B": 2, "H": 64}, {"B": 3, "H": 96}, {"B": 2, "H": 48}])


@pytest.mark.heavy
def test_mobilenet_v2_is_fitted_at_multiples_of_its_output_stride():
    """MobileNetV2's TensorFlow padding reads the image size in Python (``int()``), pinning H;
    at multiples of its output stride (32, from the config) each padding is the same, and the
    fit in H holds: ``at`` equals real runs at H = 256 (from the fit), and at H = 240, off the
    step, and 96, below the fit's sizes (both traced at that size)."""
    inputs = {"pixel_values": ("float32", ["B", 3, "H", "H"]), "labels": ("int64", ["B"])}
    report = predict(hf.mobilenet_v2, inputs, inference=False)
    assert report.config.multiples == {"H": 32} and report.fit.symbol == "H"
    assert all(s % 32 == 0 for s in (*report.fit.sizes, report.fit.check)), report.fit
    import torch

    from tests.support.oracles.measure import example_inputs, materialize, measure_train
    for pt in ({"B": 2, "H": 256}, {"B": 2, "H": 240}, {"B": 3, "H": 96}):
        torch.manual_seed(0)
        real = measure_train(materialize(hf.mobilenet_v2()), example_inputs(inputs, pt))
        assert report.at(**pt)["train"]["peak"] == real.peak, pt
    assert 256 not in report.fit.reports and {240, 96} <= set(report.fit.reports)
