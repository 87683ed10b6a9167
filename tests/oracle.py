"""Compare memsim's prediction with a real eager CPU run of the same model (the oracle)."""

from __future__ import annotations

import torch

from memsim.analysis import analyze
from oracles.measure import example_inputs, materialize, measure_inference, measure_train


def predict(factory, inputs, **kw):
    """Analyse the model built on the meta device (never materialized)."""
    with torch.device("meta"):
        model = factory()
    return analyze(model, inputs, device="cpu", **kw)


def check(report, factory, inputs, points, **kw):
    """Assert prediction == measurement at every point, for every figure the oracle has."""
    for pt in points:
        torch.manual_seed(0)
        real = materialize(factory())
        x = example_inputs(inputs, pt)
        got = figures(report, **pt)
        if report.train is not None:
            m = measure_train(real, x, **kw)
            want = {"peak": m.peak, "parameters": m.parameters, "gradients": m.gradients,
                    "optimizer_states": m.optimizer_states, "activation_peak": m.activation_peak,
                    "saved_activations": m.saved_activations}
            have = {k: got["train"][k] for k in want}
            assert have == want, f"train at {pt}: predicted {have}, measured {want}"
        if report.inference is not None:
            mi = measure_inference(real, x, kw.get("precision", "32-true"))
            assert got["inference"]["peak"] == mi, \
                f"inference at {pt}: predicted {got['inference']['peak']}, measured {mi}"


def figures(report, **point) -> dict:
    """Every figure at ``point``, from the report that covers it: a point below the formulas'
    range, or where a condition of the trace is false, is traced on its own
    (:meth:`memsim.Report.for_point`)."""
    shown, at = report.for_point(point)
    return shown.at(**at)
