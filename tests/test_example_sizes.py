"""Example sizes the model accepts: where a trace fails at memsim's small example sizes, the
sizes asked for (``--at``) are tried first, then multiples of the sizes the failure names, then
larger ones, all within the model's limits (``tracer/example_sizes.py``); each
answer is checked against real runs."""

import pytest

from memsim.tracer import SpecializationError, StepConfig, TraceError
from memsim.tracer.example_sizes import larger_sizes
from tests.support import zoo
from tests.support.predict import check, predict

SEQ = {"x": ("float32", ["B", "S", 8])}


def test_the_sizes_asked_for_are_tried_first():
    """The model's own check refuses S = 7 and names no size: with ``points`` (``--at``) at
    S = 30 the trace is made there, whole tens hold as a condition, and the figures equal real
    runs at S = 30 and 50. Without points the larger primes fail too, and the error says which
    sizes were tried."""
    report = predict(zoo.WholeTens, SEQ, points=[{"B": 2, "S": 30}])
    assert report.train.trace.hints["S"] == 30
    check(report, zoo.WholeTens, SEQ, [{"B": 2, "S": 30}, {"B": 3, "S": 50}])
    with pytest.raises(TraceError, match="whole chunks") as e:
        predict(zoo.WholeTens, SEQ)
    assert "tried the larger example sizes" in e.value.hint


def test_multiples_of_a_size_the_failure_names():
    """``view`` into quarters fails at S = 7 naming 4 among its sizes: S = 8 is tried next
    and holds (a condition that S is a multiple of 4), equal to real runs."""
    report = predict(zoo.Quarters, SEQ)
    assert report.train.trace.hints["S"] == 8, report.train.trace.hints
    check(report, zoo.Quarters, SEQ, [{"B": 2, "S": 12}, {"B": 3, "S": 40}])


def test_retried_sizes_stay_within_limits_and_steps():
    """Past a limit no size is tried (Reformer's 64 positions: it was tried at S = 128 and the
    error blamed its positions); a stepped symbol is tried at multiples of its step."""
    cfg = StepConfig(limits={"S": 64}, multiples={"H": 8})
    sizes = larger_sizes({"B": 5, "S": 7, "H": 88}, cfg, [{"B": 2, "S": 30, "H": 40}],
                          "shape '[5, 1, 4, 8]' is invalid for input of size 280")
    assert sizes[0] == {"B": 2, "S": 30, "H": 40}
    assert all(s["S"] <= 64 and s["H"] % 8 == 0 for s in sizes), sizes
    assert {"B": 5, "S": 8, "H": 88} in sizes   # a multiple of 4 (named) past S = 7


@pytest.fixture(scope="module")
def reformer():
    pytest.importorskip("transformers")
    from tests.support import hf_models as hf
    return hf.reformer


LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def test_reformer_at_its_fixed_length(reformer):
    """Reformer's training takes exactly its 64 axial positions. With S symbolic the model
    fails at S = 7; the size its error names (64) is tried, where S is pinned, and the
    error says so and that its limit leaves no sizes to fit (it blamed B at S = 128 before).
    With S given as 64, B is symbolic and equal to real runs, inference too (it reads the
    largest position id with ``.item()``: that of ``arange(64)`` expanded over the batch)."""
    with pytest.raises(SpecializationError, match="ties symbol S to 64") as e:
        predict(reformer, LM, inference=False)
    assert "S <= 64 leaves too few sizes" in str(e.value)
    fixed = {"input_ids": ("int64", ["B", 64]), "labels": ("int64", ["B", 64])}
    report = predict(reformer, fixed)
    assert report.inference is not None, report.notes
    check(report, reformer, fixed, [{"B": 2}, {"B": 5}])
