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
