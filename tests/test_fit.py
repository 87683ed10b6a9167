"""A symbol the model's code pins: formulas fitted from traces with it fixed
(memsim.analysis.fitted), compared with real eager CPU runs at sizes that were not traced."""

import json
import os

import pytest
import torch

from memsim.analysis.fitted import FittedReport, fit_windows

from tests.conftest import HOST_SKIP
from tests.support import zoo
from tests.support.oracles.measure import (example_inputs, materialize, measure_inference,
                                           measure_train)
from tests.support.predict import predict


def _real(factory, inputs, point):
    torch.manual_seed(0)
    model = materialize(factory())
    x = example_inputs(inputs, point)
    m = measure_train(model, x)
    return {"train": {"peak": m.peak, "parameters": m.parameters, "gradients": m.gradients,
                      "optimizer_states": m.optimizer_states,
                      "activation_peak": m.activation_peak,
                      "saved_activations": m.saved_activations},
            "inference": {"peak": measure_inference(model, x, "32-true")}}


def _assert_fitted_equal_real(report, factory, inputs, points):
    for pt in points:
        got = report.at(**pt)
        want = {k: v for k, v in _real(factory, inputs, pt).items() if k in got}
        have = {step: {k: got[step][k] for k in want[step]} for step in want}
        assert have == want, f"at {pt}: fitted {have}, measured {want}"


def test_python_loop_over_time_is_fitted_and_equals_real_runs():
    """The loop pins S: the step is traced at S = 7, 14, 21 (B symbolic), the quadratic through
    them checked at S = 28; at untraced sizes inside and far past them the fitted figures equal
    real runs."""
    inputs = {"x": ("float32", ["B", "S", 8])}
    report = predict(zoo.Scan, inputs)
    assert isinstance(report, FittedReport)
    assert (report.fit.symbol, report.fit.sizes, report.fit.check) == ("S", (7, 14, 21), 28)
    assert report.basis == "fitted in S" and report.ranges["S"] == (7, None)
    assert any("fitted" in n and "S=7, 14, 21" in n for n in report.notes)
    traced = set(report.fit.reports)
    points = [{"B": 3, "S": 9}, {"B": 3, "S": 40}, {"B": 6, "S": 101}]
    _assert_fitted_equal_real(report, zoo.Scan, inputs, points)
    assert set(report.fit.reports) == traced  # answered by the fit: nothing traced again
    # at B = 2 the peak moves between S = 7 and 28 (to forward, where the previous step's
    # output is alive): not one quadratic, the fit misses its check, and S = 9 is traced
    assert not report.holds(B=2) and report.holds(B=3)
    _assert_fitted_equal_real(report, zoo.Scan, inputs, [{"B": 2, "S": 9}])
    assert set(report.fit.reports) == traced | {9}
    # below the fit's first size: traced (exact there)
    _assert_fitted_equal_real(report, zoo.Scan, inputs, [{"B": 2, "S": 3}])
    assert 3 in report.fit.reports
    view = report.view()
    assert report.formula("train", "peak").free_symbols == {report.symbols["B"],
                                                             report.symbols["S"]}
    assert view.train.peak == report.formula("train", "peak")


def test_a_fits_sizes_are_traced_two_at_a_time(monkeypatch):
    """Each of a fit's next sizes is traced in a forked child beside the parent's trace of the
    one before it (two CPUs or more): children start, and the fit, its sizes and formulas are
    those traced one after the other (``MEMSIM_PARALLEL=0``)."""
    from memsim.analysis.explore import Retracer
    from memsim.tracer import fork
    monkeypatch.setenv("MEMSIM_PARALLEL", "1")   # the suite turns it off (tests/conftest.py)
    if not fork.parallel():
        pytest.skip(f"{HOST_SKIP}: fewer than two CPUs, no child is forked")
    started = []
    ahead = Retracer.ahead
    monkeypatch.setattr(Retracer, "ahead", lambda self, *a: started.append(ahead(self, *a)))
    inputs = {"x": ("float32", ["B", "S", 8])}
    pairs = predict(zoo.Scan, inputs)
    assert any(started), started
    monkeypatch.setenv("MEMSIM_PARALLEL", "0")
    started.clear()
    alone = predict(zoo.Scan, inputs)
    assert not any(started)
    assert (pairs.fit.sizes, pairs.fit.check) == (alone.fit.sizes, alone.fit.check)
    for step in ("train", "inference"):
        assert pairs.formula(step, "peak") == alone.formula(step, "peak")


def test_fit_windows_move_past_a_piece_and_other_example_sizes():
    """Windows of four sizes growing about 1.5x, skipping another symbol's example size."""
    windows = list(fit_windows(5, {10}, None))
    assert windows[0] == ((5, 11, 15), 20)
    assert windows[1] == ((11, 15, 20), 30)
    assert all(w[1] <= 160 for w in windows)
    assert list(fit_windows(5, set(), 22)) == [((5, 10, 15), 20)]


@pytest.mark.slow
@pytest.mark.heavy
def test_gru_is_fitted_in_time_and_equals_real_runs():
    """nn.GRU on CPU: PyTorch's C++ loop read the batch size; issued from Python
    (tracer/functions.py) B stays symbolic, and the loop over time steps pins S, which is
    fitted. At untraced sizes inside and past the fit, equal to real runs. Example sizes where
    the activations' piece of the peak holds from the first window (B = 64, S = 4: four short
    traces; the window moving up is the scan test's)."""
    inputs = {"x": ("int64", ["B", "S"])}
    report = predict(zoo.GRULM, inputs, inference=False, hints={"B": 64, "S": 4})
    assert report.fit.symbol == "S" and set(report.symbols) == {"B", "S"}
    assert (report.fit.sizes, report.fit.check) == ((4, 8, 12), 16)
    traced = set(report.fit.reports)
    _assert_fitted_equal_real(report, zoo.GRULM, inputs, [{"B": 64, "S": 10}, {"B": 70, "S": 30}])
    assert set(report.fit.reports) == traced  # answered by the fit: nothing traced again
    # at B = 3 the optimizer step's piece holds at S = 4: the fit misses, S = 9 is traced
    assert not report.holds(B=3)
    _assert_fitted_equal_real(report, zoo.GRULM, inputs, [{"B": 3, "S": 9}])


@pytest.mark.slow
def test_mamba_slow_path_is_fitted_in_sequence_length():
    """HF Mamba without its CUDA kernels scans over the time steps in Python (pins S, at
    modeling_mamba.py's recurrent loop). Fitted in S, symbolic in B; equal to real runs at
    untraced sizes, and the error names the mixer's module path, not transformers' ``Func``
    wrapper."""
    T = pytest.importorskip("transformers")
    T.logging.set_verbosity_error()

    def factory():
        return T.MambaForCausalLM(T.MambaConfig(
            vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2,
            conv_kernel=4, time_step_rank=4))
    inputs = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}
    report = predict(factory, inputs, inference=False)
    assert report.fit.symbol == "S" and "backbone.layers.0.mixer" in report.fit.reason
    _assert_fitted_equal_real(report, factory, inputs,
                              [{"B": 2, "S": 40}, {"B": 3, "S": 9}, {"B": 4, "S": 31}])


def test_cli_json_says_what_is_fitted(capsys):
    from memsim.cli import main
    target = os.path.join(os.path.dirname(__file__), "support", "zoo.py") + ":Scan"
    assert main(["analyze", target, "--input", "x=float32[B,S,8]", "--device", "cpu",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fitted"] == {"symbol": "S", "sizes": [7, 14, 21], "checked_at": 28,
                             "reason": doc["fitted"]["reason"]}
    assert "zoo.py" in doc["fitted"]["reason"]
    assert set(doc["symbols"]) == {"B", "S"}
    assert "S" in doc["train"]["peak"]["formula"]
