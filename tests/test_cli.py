"""The command line: the table, and the JSON document's stable shape."""

import json

import sympy

from memsim.cli import main

ARGS = ["analyze", "examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]",
        "--device", "cpu"]


def test_json_shape_and_values(capsys):
    assert main(ARGS + ["--at", "B=2,S=8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"memsim", "device", "symbols", "at", "train", "inference", "modules"}
    assert doc["device"] == "cpu" and doc["symbols"] == ["B", "S"] and doc["at"] == {"B": 2, "S": 8}
    assert set(doc["train"]) >= {"peak", "activation_peak", "saved_activations", "parameters",
                                 "gradients", "optimizer_states"}
    B, S = sympy.symbols("B S", positive=True, integer=True)
    for key in ("peak", "parameters", "saved_activations"):
        e = doc["train"][key]
        parsed = sympy.sympify(e["formula"], locals={"B": B, "S": S})
        assert int(parsed.subs({B: 2, S: 8})) == e["bytes"]
    # the figures are a real run's (the CLI's target materialized, run for real on the CPU)
    import importlib.util

    import torch
    from oracles.measure import example_inputs, materialize, measure_inference, measure_train
    spec = importlib.util.spec_from_file_location("nanogpt_block", "examples/nanogpt_block.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    real = materialize(mod.small())
    x = example_inputs({"x": ("float32", ["B", "S", 64])}, {"B": 2, "S": 8})
    assert doc["inference"]["peak"]["bytes"] == measure_inference(real, x, "32-true")
    m = measure_train(real, x)
    for k in ("peak", "activation_peak", "saved_activations", "parameters", "gradients",
              "optimizer_states"):
        assert doc["train"][k]["bytes"] == getattr(m, k), k
    assert {d["path"]: d["saved"]["bytes"] for d in doc["modules"]
            if d["path"] and d["saved"]["bytes"]} == m.saved_by_module


def test_table_without_point(capsys):
    assert main(ARGS + ["--train"]) == 0
    out = capsys.readouterr().out
    assert "Training step" in out and "Inference" not in out
    assert "valid for 2 <= B, 2 <= S" in out


def test_table_at_point(capsys):
    assert main(ARGS + ["--at", "B=2,S=8", "--inference"]) == 0
    out = capsys.readouterr().out
    assert "Inference (eval, no_grad)" in out and "Training step" not in out


def test_package_module_target(capsys):
    assert main(["analyze", "tests.zoo:MLP", "--input", "x=float32[B,16]", "--at", "B=4",
                 "--device", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["train"]["parameters"]["bytes"] == 4 * (16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4)
