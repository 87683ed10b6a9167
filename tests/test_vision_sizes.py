"""Vision transformers with a symbolic image size: position embeddings and decoder heads resized
with ``F.interpolate(size=...)`` of symbolic sizes (its C++ composite takes concrete sizes
only), checked against real runs at image sizes memsim did not trace."""

import pytest

from tests.support.predict import check, predict

transformers = pytest.importorskip("transformers")


def _dinov2():
    T = transformers
    return T.Dinov2ForImageClassification(T.Dinov2Config(
        image_size=32, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3))


def _segformer():
    T = transformers
    return T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
        hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
        mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=3))


@pytest.mark.heavy
@pytest.mark.parametrize("factory, labels, points", [
    (_dinov2, ["B"], [{"B": 2, "H": 24}, {"B": 3, "H": 40}]),
    (_segformer, ["B", "H", "H"], [{"B": 2, "H": 24}, {"B": 2, "H": 37}]),
], ids=["dinov2", "segformer"])
def test_symbolic_image_size(factory, labels, points):
    inputs = {"pixel_values": ("float32", ["B", 3, "H", "H"]), "labels": ("int64", labels)}
    report = predict(factory, inputs)
    assert set(report.symbols) == {"B", "H"}
    check(report, factory, inputs, points)
