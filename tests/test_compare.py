"""memsim compare: several configurations of one model side by side.

Each row is the same analysis `memsim analyze` gives for those options (checked here option by
option); on the CPU the budget's total is the real run's peak (tests/test_budget.py's oracle),
so the order of the rows is the order of real peaks.
"""

import json

import pytest
import torch

from memsim.cli import main

from tests.support.examples import example
from tests.support.oracles.measure import example_inputs, materialize, measure_train

ARGS = ["examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]", "--at", "B=2,S=8",
        "--device", "cpu", "--memory", "1GiB"]
CONFIGS = ["", "--optimizer sgd", "--accumulate 2"]


def _analyze_json(capsys, extra: list[str]) -> dict:
    assert main(["analyze", *ARGS, "--train", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _real_peak(optimizer=None):
    mod = example("nanogpt_block")
    torch.manual_seed(0)
    return measure_train(materialize(mod.small()),
                         example_inputs({"x": ("float32", ["B", "S", 64])}, {"B": 2, "S": 8}),
                         optimizer=optimizer).peak


def test_compare_rows_are_the_analyses_sorted_by_total(capsys):
    argv = ["compare", *ARGS, "--json"]
    for c in CONFIGS:
        argv += ["--config", c]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["configs"]
    assert doc["at"] == {"B": 2, "S": 8} and len(rows) == 3
    totals = [r["budget"]["total"] for r in rows]
    assert totals == sorted(totals)
    for r in rows:
        one = _analyze_json(capsys, r["config"].split())
        assert r["figures"]["peak"] == one["train"]["peak"]["bytes"]
        assert r["figures"]["optimizer_states"] == one["train"]["optimizer_states"]["bytes"]
        assert r["budget"] == one["budget"]
    # on the CPU the total is the real step's peak: AdamW and SGD (no state) measured
    by = {r["config"]: r for r in rows}
    assert by[""]["budget"]["total"] == _real_peak()
    assert by["--optimizer sgd"]["budget"]["total"] == _real_peak(
        lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_compare_text_table(capsys):
    assert main(["compare", *ARGS, "--config", "", "--config", "--optimizer sgd"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("training step per device at B=2, S=8 against 1GiB")
    assert "(the common options)" in out and "--optimizer sgd" in out


@pytest.mark.parametrize("config,message", [
    ("--at B=4,S=8", "sets --at"),
    ("--gpu h100-80gb", "sets --gpu"),
    ("--no-such-option", "unknown option(s) --no-such-option"),
    ("--accumulate two", "invalid int value"),
    ('--precision "bf16', "No closing quotation"),
])
def test_compare_refuses_bad_configs_before_tracing(capsys, config, message):
    assert main(["compare", *ARGS, "--config", "", "--config", config]) == 2
    assert message in capsys.readouterr().err


def test_compare_needs_configs_and_a_point(capsys):
    assert main(["compare", *ARGS]) == 2
    assert "needs --config" in capsys.readouterr().err
    no_at = [a for a in ARGS if a not in ("--at", "B=2,S=8")]
    assert main(["compare", *no_at, "--config", ""]) == 2
    assert "needs a point" in capsys.readouterr().err


def test_a_failing_configuration_is_a_row(capsys):
    assert main(["compare", *ARGS, "--config", "", "--config", "--fsdp --dp 2 --zero 2"]) == 2
    out, err = capsys.readouterr()
    assert "(the common options)" in out
    assert "error: --fsdp --dp 2 --zero 2: fsdp and zero both" in out
