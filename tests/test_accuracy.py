"""Predicted peaks equal a real eager CPU run, byte for byte, from one symbolic trace per model.

The oracle (analysis/measure.py) counts live untyped storages of a real run; each model is traced
once on the meta device and the same formula is evaluated at every point.
"""

import functools

import pytest

import zoo
from conftest import grid
from oracle import check, predict

SEQ = {"x": ("float32", ["B", "S", 32])}
CASES = {
    "mlp": (zoo.MLP, {"x": ("float32", ["B", 16])}, grid(B=(2, 3, 8, 64))),
    "cnn_bn_pool": (zoo.CNN, {"x": ("float32", ["B", 3, 16, 16])}, grid(B=(2, 3, 8))),
    "cnn_symbolic_hw": (zoo.CNN, {"x": ("float32", ["B", 3, "H", "H"])},
                        grid(B=(2, 4, 5), H=(8, 12, 17))),
    "block_softmax": (zoo.Block, SEQ, grid(B=(2, 3, 6), S=(4, 9, 16))),
    "block_sdpa": (lambda: zoo.Block(sdpa=True), SEQ, grid(B=(2, 3, 6), S=(4, 9, 16))),
    "block_dropout": (lambda: zoo.Block(dropout=0.1), SEQ, grid(B=(2, 3, 5), S=(3, 8, 13))),
    "inplace_views": (zoo.InPlaceViews, {"x": ("float32", ["B", "S", 24])},
                      grid(B=(2, 3, 7), S=(2, 5, 11))),
    "full_slices": (zoo.FullSlices, {"x": ("float32", ["B", "S", 24])},
                    grid(B=(2, 8), S=(5, 64, 111))),
    "tiny_gpt": (zoo.TinyGPT, {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])},
                 grid(B=(2, 3, 4), S=(4, 9, 33))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_real_run(name):
    factory, inputs, points = CASES[name]
    report = predict(factory, inputs)
    check(report, factory, inputs, points)


def test_other_optimizers_match():
    import torch

    for opt in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                lambda ps: torch.optim.Adam(ps, foreach=True),
                lambda ps: torch.optim.RMSprop(ps), lambda ps: torch.optim.Adagrad(ps)):
        report = predict(zoo.Block, SEQ, optimizer=opt, inference=False)
        check(report, zoo.Block, SEQ, grid(B=(2, 5), S=(3, 10)), optimizer=opt)


def test_dropped_outputs_match():
    report = predict(zoo.TinyGPT, {"idx": ("int64", ["B", "S"]),
                                   "targets": ("int64", ["B", "S"])},
                     keep_outputs=False, inference=False)
    check(report, zoo.TinyGPT, {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])},
          grid(B=(2, 3), S=(5, 17)), keep_outputs=False)


@pytest.mark.parametrize("name", ["mlp", "cnn_bn_pool", "block_softmax", "tiny_gpt"])
def test_size_one_is_traced_on_its_own(name):
    """B = 1 or S = 1 take other paths in PyTorch; report.at retraces them with the size fixed."""
    factory, inputs, _ = CASES[name]
    report = predict(factory, inputs)
    names = list(report.symbols)
    points = [{n: 1 if n == k else 5 for n in names} for k in names]
    points.append({n: 1 for n in names})
    check(report, factory, inputs, points)
    # one retrace per set of fixed sizes, cached: asking again traces nothing
    fixings = {("fixed",) + tuple(sorted((n, v) for n, v in p.items() if v == 1))
               for p in points}
    assert sorted(k for k in report.retracer.cache if k[0] == "fixed") == sorted(fixings)
    assert report.for_point(points[0])[0] is report.for_point(points[0])[0]


RESIZES = [("nearest", 1, 2.0), ("nearest", 2, 2.0), ("nearest", 3, 2.0),
           ("nearest-exact", 2, 0.5), ("linear", 1, 1.5), ("bilinear", 2, 2.0),
           ("bilinear", 2, 0.5), ("bicubic", 2, 2.0), ("trilinear", 3, 2.0)]


@pytest.mark.parametrize("mode, dims, scale", RESIZES, ids=[f"{m}{d}d-x{s}" for m, d, s in RESIZES])
def test_interpolate_by_scale_keeps_sizes_symbolic(mode, dims, scale):
    """F.interpolate(scale_factor=...) pinned every symbol (PyTorch's C++ reads concrete sizes)
    and most resize backwards have meta kernels that take concrete sizes only: both have rules
    now, and batch and image size stay symbolic, equal to real runs."""
    factory = functools.partial(zoo.Resize, mode, dims, scale)
    inputs = {"x": ("float32", ["B", 4] + ["H"] * dims)}
    report = predict(factory, inputs)
    assert set(report.symbols) == {"B", "H"}
    check(report, factory, inputs, grid(B=(2, 3), H=(4, 9)))


def test_unet_up_path_symbolic_in_batch():
    """A UNet's up path (nearest x2 joined by a skip, bilinear x0.5 and x2): B symbolic and
    past the convolution backend's B < 16, equal to real runs."""
    inputs = {"x": ("float32", ["B", 3, 16, 16])}
    report = predict(zoo.TinyUNet, inputs)
    assert report.ranges["B"] == (2, None)
    check(report, zoo.TinyUNet, inputs, [{"B": 1}, {"B": 2}, {"B": 3}, {"B": 17}, {"B": 32}])
