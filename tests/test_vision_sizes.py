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
