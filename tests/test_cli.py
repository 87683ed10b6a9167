"""The command line: the table, and the JSON document's stable shape."""

import json
import re

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
    import torch
    from tests.support.examples import example
    from tests.support.oracles.measure import (example_inputs, materialize, measure_inference,
                                               measure_train)
    mod = example("nanogpt_block")
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
    assert main(["analyze", "tests.support.zoo:MLP", "--input", "x=float32[B,16]", "--at", "B=4",
                 "--device", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["train"]["parameters"]["bytes"] == 4 * (16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4)


STACK = '''
import torch.nn as nn


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x.sum()
'''


def test_progress_on_stderr(tmp_path, capsys, monkeypatch):
    """The phase and the block of a repeated stack on stderr (after 2 s of tracing, here made
    immediate); nothing with --quiet or --json, whose stdout stays the JSON document."""
    import memsim.cli as cli
    monkeypatch.setattr(cli, "_PROGRESS_AFTER", 0.0)
    monkeypatch.setattr(cli, "_PROGRESS_EVERY", 0.0)
    f = tmp_path / "stack.py"
    f.write_text(STACK)
    argv = ["analyze", f"{f}:Stack", "--input", "x=float32[B,8]", "--device", "cpu", "--train"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    lines = [re.sub(r" \[trace \d+ of \d+, \d+ s(, about \d+ s left)?\]$", "", ln)
             for ln in err.splitlines()]
    for line in ("memsim: tracing forward: block 1 of 3 (layers.0)",
                 "memsim: tracing forward: block 3 of 3 (layers.2)",
                 "memsim: tracing backward", "memsim: tracing optimizer"):
        assert line in lines
    # each line says which trace of how many the command needs and how long the command has
    # run: the training step alone, then (without --train) the training step and inference,
    # the second with the time left estimated from the first
    assert re.search(r"^memsim: tracing forward: block 1 of 3 \(layers.0\) "
                     r"\[trace 1 of 1, \d+ s\]$", err, re.M)
    assert main(argv[:-1]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^memsim: tracing forward: block 1 of 3 \(layers.0\) "
                     r"\[trace 1 of 2, \d+ s\]$", err, re.M), err
    assert re.search(r"^memsim: tracing forward: block 1 of 3 \(layers.0\) "
                     r"\[trace 2 of 2, \d+ s, about \d+ s left\]$", err, re.M), err
    assert main(argv + ["--quiet"]) == 0
    assert "tracing" not in capsys.readouterr().err
    assert main(argv + ["--json"]) == 0
    out, err = capsys.readouterr()
    assert "tracing" not in err and json.loads(out)["train"]
    # a folded stack of 16: each cut run says of how many blocks, and that the rest are derived
    f.write_text(STACK.replace("range(3)", "range(16)"))
    assert main(argv) == 0
    err = [re.sub(r" \[trace \d+ of \d+, \d+ s(, about \d+ s left)?\]$", "", line)
           for line in capsys.readouterr().err.splitlines() if "layers." in line]
    assert "memsim: tracing forward: block 4 of 16 (layers.3), a run of 4 blocks, the others " \
        "derived from it" in err, err


NOISY = '''
import logging
import warnings

import torch.nn as nn


class Noisy(nn.Module):
    """A model whose library speaks while it runs, as transformers' loss_type notice does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        logging.getLogger("somelib.modeling").warning("loss_type=None is unrecognized")
        warnings.warn("a deprecated argument", FutureWarning)
        return self.fc(x)
'''


def test_other_libraries_warnings_come_after_the_answer(tmp_path, capsys, monkeypatch):
    """Another library's logging warnings and Python warnings while memsim traces are held back
    (they broke the progress line and came before the answer): on stderr after the answer,
    once each, and not at all with --quiet."""
    import memsim.cli as cli
    monkeypatch.setattr(cli, "_PROGRESS_AFTER", 0.0)
    monkeypatch.setattr(cli, "_PROGRESS_EVERY", 0.0)
    f = tmp_path / "noisy.py"
    f.write_text(NOISY)
    argv = ["analyze", f"{f}:Noisy", "--input", "x=float32[B,8]", "--device", "cpu"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    said = [i for i, line in enumerate(err) if line.startswith("memsim: said while tracing")]
    assert [err[i] for i in said] == [
        "memsim: said while tracing: somelib.modeling: loss_type=None is unrecognized",
        "memsim: said while tracing: FutureWarning: a deprecated argument"], err
    progress = [i for i, line in enumerate(err) if "tracing" in line and i not in said]
    assert progress and max(progress) < min(said), err
    assert main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_compare_progress_names_the_configuration(tmp_path, capsys, monkeypatch):
    """``memsim compare`` says which configuration it traces, one after the other."""
    import memsim.cli as cli
    monkeypatch.setattr(cli, "_PROGRESS_AFTER", 0.0)
    monkeypatch.setattr(cli, "_PROGRESS_EVERY", 0.0)
    f = tmp_path / "stack.py"
    f.write_text(STACK)
    assert main(["compare", f"{f}:Stack", "--input", "x=float32[B,8]", "--device", "cpu",
                 "--at", "B=4", "--memory", "1GiB", "--config", "",
                 "--config", "--drop-outputs"]) == 0
    raw = capsys.readouterr().err.splitlines()
    err = [re.sub(r" \[trace \d+ of \d+, \d+ s(, about \d+ s left)?\]$", "", ln) for ln in raw]
    assert "memsim: configuration 1 of 2 (the common options): tracing backward" in err, err
    assert "memsim: configuration 2 of 2 (--drop-outputs): tracing backward" in err, err
    # both configurations' traces are counted from the first
    assert any(ln.startswith("memsim: configuration 1 of 2") and "[trace 1 of 2," in ln
               for ln in raw), raw


def test_the_answer_comes_first(capsys, monkeypatch, tmp_path):
    """With a budget the verdict is the first line, saying what was modelled (the model, the
    point, the precision, one device or per rank, the GPU's usable memory, the total, the
    headroom, the largest sizes), in the text, the JSON (``verdict``) and the HTML (a badge);
    green or red on a terminal, plain in a pipe or under ``NO_COLOR``."""
    import memsim.cli as cli
    assert main(ARGS + ["--at", "B=2,S=8", "--gpu", "a10"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("FITS: train step of examples/nanogpt_block.py:small at B=2, S=8, "
                            "32-true, one device: "), first
    assert "of A10's 20.24 GiB usable, headroom " in first and "largest batch that fits" in first
    assert main(ARGS + ["--at", "B=2,S=8", "--memory", "64KiB", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["verdict"]
    assert v["fits"] is False and v["model"] == "examples/nanogpt_block.py:small"
    assert v["at"] == {"B": 2, "S": 8} and v["per"] == "device" and v["gpu"] is None
    assert v["total"] > v["usable"] == int(2 ** 16 * 0.9) and v["headroom"] < 0
    page = tmp_path / "r.html"
    assert main(ARGS + ["--at", "B=2,S=8", "--gpu", "a10", "--html", str(page)]) == 0
    capsys.readouterr()
    assert '<p class="verdict fits"><span class=badge>FITS</span> train step of' in \
        page.read_text()
    budget = type("B", (), {"fits": False})()
    monkeypatch.setattr(cli.sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert cli._coloured("DOES NOT FIT: x\nrest", budget) == \
        "\033[1;31mDOES NOT FIT: x\033[0m\nrest"
    monkeypatch.setenv("NO_COLOR", "1")
    assert cli._coloured("DOES NOT FIT: x\nrest", budget) == "DOES NOT FIT: x\nrest"
