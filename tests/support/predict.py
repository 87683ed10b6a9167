"""Compare memsim's prediction with a real eager CPU run of the same model (the oracle in
``oracles/measure.py``): the prediction, the check at each point, the figures a report gives
there, and the grid of points to check."""

from __future__ import annotations

import itertools

import torch

from memsim.analysis import analyze
from memsim.tracer import CpuIsa

from tests.support.oracles.measure import (example_inputs, materialize, measure_inference,
                                           measure_train)


def predict(factory, inputs, **kw):
    """Analyse the model built on the meta device (never materialized), modelling this
    machine's CPU (the real run's), unless ``cpu_isa`` says otherwise."""
    with torch.device("meta"):
        model = factory()
    kw.setdefault("cpu_isa", CpuIsa.host())
    return analyze(model, inputs, device="cpu", **kw)


def check(report, factory, inputs, points, *, module_name=None, real_inputs=None, **kw):
    """Assert prediction == measurement at every point, for every figure the oracle has.

    ``module_name`` maps a module path of the real model to memsim's (the real model may be
    wrapped differently: peft's ``base_model.model.h.0.attn.c_attn.lora_A.default`` is memsim's
    ``h.0.attn.c_attn.lora_A``); a path it maps to ``None`` is left out. ``real_inputs(point)``
    makes the real run's inputs where their values matter (else random ones of the specs)."""
    for pt in points:
        torch.manual_seed(0)
        real = materialize(factory())
        x = real_inputs(pt) if real_inputs is not None else example_inputs(inputs, pt)
        got = figures(report, **pt)
        if report.train is not None:
            m = measure_train(real, x, **kw)
            want = {"peak": m.peak, "parameters": m.parameters, "gradients": m.gradients,
                    "optimizer_states": m.optimizer_states, "activation_peak": m.activation_peak,
                    "saved_activations": m.saved_activations}
            have = {k: got["train"][k] for k in want}
            assert have == want, f"train at {pt}: predicted {have}, measured {want}"
            saved = module_savings(report, pt)
            if saved is not None:
                real_saved = {module_name(k) if module_name else k: v
                              for k, v in m.saved_by_module.items()}
                real_saved.pop(None, None)
                assert saved == real_saved, \
                    f"saved per module at {pt}: predicted {saved}, measured {real_saved}"
        if report.inference is not None:
            mi = measure_inference(real, x, kw.get("precision", "32-true"),
                                   kw.get("keep_outputs", True))
            assert got["inference"]["peak"] == mi, \
                f"inference at {pt}: predicted {got['inference']['peak']}, measured {mi}"


def module_savings(report, point: dict) -> dict | None:
    """Bytes each module's forward saves for backward at ``point`` (zeros left out), from the
    report that covers it; ``None`` where that report has no per-module figures."""
    shown, at = report.for_point(point)
    if not shown.modules:
        return None
    subs = {sym: at[name] for name, sym in shown.symbols.items() if name in at}
    out = {m.path: int(m.saved.xreplace(subs)) for m in shown.modules if m.path}
    return {k: v for k, v in out.items() if v}


def figures(report, **point) -> dict:
    """Every figure at ``point``, from the report that covers it: a point below the formulas'
    range, or where a condition of the trace is false, is traced on its own
    (:meth:`memsim.Report.for_point`)."""
    shown, at = report.for_point(point)
    return shown.at(**at)


def grid(**axes) -> list[dict]:
    """Every combination of the given values: grid(B=(2, 3), S=(4, 9)) -> 4 points."""
    names = list(axes)
    return [dict(zip(names, vals)) for vals in itertools.product(*axes.values())]
