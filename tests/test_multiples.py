"""Symbols traced at multiples of a step (``StepConfig.multiples``, ``--multiple-of H=8``): a
model that pads its feature map to whole windows, checked against real runs at multiples not
traced and at a size that is no multiple (traced at that size)."""

import pytest
import sympy

from memsim.tracer import InputError, OutOfRangeError
from tests.support import zoo
from tests.support.predict import check, predict

IMG = {"x": ("float32", ["B", 3, "H", "H"])}


def test_a_stepped_symbol_has_polynomial_formulas_equal_to_real_runs():
    """Stride 2 then windows of 4: images of multiples of 8 are padded nowhere. The formulas
    are polynomials in B and H (the steps' count divided back into H), exact at H = 24 and 40;
    H = 20 pads, is outside the formulas (``at`` refuses it) and is traced at that size, as is
    H = 12, below two steps and off the step."""
    report = predict(zoo.PadToWindows, IMG, multiples={"H": 8})
    H = report.symbols["H"]
    assert report.ranges["H"] == (16, None)
    assert report.train.peak.is_polynomial(*report.symbols.values()), report.train.peak
    assert report.train.violated({"B": 2, "H": 20}) == [sympy.Eq(sympy.Mod(H, 8), 0)]
    with pytest.raises(OutOfRangeError, match="condition"):
        report.at(B=2, H=20)
    assert any(n.startswith("H is traced at multiples of 8") for n in report.notes)
    check(report, zoo.PadToWindows, IMG, [{"B": 2, "H": 24}, {"B": 3, "H": 40},
                                          {"B": 2, "H": 20}, {"B": 2, "H": 12}])


def test_an_example_size_off_the_step_is_refused():
    with pytest.raises(InputError, match="not a multiple of H's step 8") as e:
        predict(zoo.PadToWindows, IMG, multiples={"H": 8}, hints={"H": 20})
    assert "--hint H=16" in e.value.hint
    with pytest.raises(InputError, match="a step must be >= 2"):
        predict(zoo.PadToWindows, IMG, multiples={"H": 1})
    with pytest.raises(InputError, match="a step given for 'W'"):
        predict(zoo.PadToWindows, IMG, multiples={"W": 8})


def test_the_largest_stepped_size_that_fits_is_a_multiple_of_its_step():
    """The largest H that fits is searched over multiples of 8 (sizes between them pad, or a
    pipeline's micro-batches would not split): a capacity the real run at H = 48 just exceeds
    gives 40, which fits in a real run, as 48 does not."""
    from memsim.analysis.budget import against
    from tests.support.oracles.measure import example_inputs, materialize, measure_train

    def peak(h):
        return measure_train(materialize(zoo.PadToWindows()),
                             example_inputs(IMG, {"B": 2, "H": h})).peak

    report = predict(zoo.PadToWindows, IMG, multiples={"H": 8}, inference=False)
    cap = peak(48) - 1
    b = against(report, {"B": 2, "H": 24}, capacity=cap, margin=0.0, seq="H")
    assert b.max_seq == 40
    assert peak(40) <= cap
