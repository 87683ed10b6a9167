"""A strategy is one file: a class registered from a file of its own (here, this test file)
reaches the command line, the text and JSON reports, `memsim.analyze`'s keywords and `memsim
compare` with no line elsewhere; a step option is one field of StepConfig."""

import copy
import dataclasses
import fnmatch
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import memsim
from memsim.cli import main
from memsim.strategies import base
from memsim.strategies.base import Strategy, register_strategy
from memsim.tracer import StepConfig

MLP = ["tests.support.zoo:MLP", "--input", "x=float32[B,16]", "--device", "cpu", "--at", "B=4"]


@pytest.fixture
def freeze_registered(monkeypatch):
    """``Freeze``: requires_grad=False on the parameters whose names match a pattern, as people
    freeze an embedding or a backbone; registered for one test only."""
    monkeypatch.setattr(base, "_STRATEGIES", dict(base._STRATEGIES))

    @register_strategy
    @dataclass(frozen=True)
    class Freeze(Strategy):
        key: ClassVar[str] = "freeze"
        order: ClassVar[int] = 5
        flags: ClassVar[tuple[str, ...]] = ("--freeze",)
        pattern: str = "*"

        @classmethod
        def add_options(cls, group):
            group.add_argument("--freeze", metavar="PATTERN", help="freeze these parameters")

        @classmethod
        def from_options(cls, opts, step):
            return cls(opts.freeze) if opts.freeze else None

        @classmethod
        def summary(cls, d):
            return f"frozen {d['pattern']}"

        def apply(self, plan):
            model = copy.deepcopy(plan.model)
            for name, p in model.named_parameters():
                if fnmatch.fnmatch(name, self.pattern):
                    p.requires_grad_(False)
            return plan.but(model=model)

    return Freeze


def test_a_strategy_from_its_own_file_reaches_every_front(freeze_registered, capsys):
    Freeze = freeze_registered
    # the command line: its option, the JSON section and the text line
    assert main(["analyze"] + MLP + ["--freeze", "fc1.*", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["strategy"]["freeze"] == {"pattern": "fc1.*"}
    assert main(["analyze"] + MLP + ["--freeze", "fc1.*", "--train"]) == 0
    assert "strategy: frozen fc1.*; world size 1" in capsys.readouterr().out
    # memsim.analyze's keyword, the same figures; they are those of the model frozen by hand
    # and of a real step of it
    from tests.support.zoo import MLP as Net
    with torch.device("meta"):
        model = Net()
    inputs = {"x": ("float32", ["B", 16])}
    by_key = memsim.analyze(model, inputs, device="cpu", freeze=Freeze("fc1.*")).at(B=4)
    assert by_key["train"]["gradients"] == doc["train"]["gradients"]["bytes"]
    assert by_key["train"]["peak"] == doc["train"]["peak"]["bytes"]
    from tests.support.oracles.measure import example_inputs, materialize, measure_train
    torch.manual_seed(0)
    real = materialize(Net())
    real.fc1.requires_grad_(False)
    m = measure_train(real, example_inputs(inputs, {"B": 4}))
    assert (m.peak, m.gradients, m.optimizer_states) == (
        by_key["train"]["peak"], by_key["train"]["gradients"],
        by_key["train"]["optimizer_states"])
    plain = memsim.analyze(model, inputs, device="cpu").at(B=4)
    assert by_key["train"]["gradients"] < plain["train"]["gradients"]
    # memsim compare: a configuration may use it
    assert main(["compare"] + MLP + ["--config", "--freeze fc1.*", "--config", "", "--json"]) == 0
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)["configs"]}
    assert rows["--freeze fc1.*"]["strategy"]["freeze"] == {"pattern": "fc1.*"}
    assert rows["--freeze fc1.*"]["figures"]["gradients"] == by_key["train"]["gradients"]
    assert rows[""]["figures"]["gradients"] == plain["train"]["gradients"]


def test_registered_order_and_the_front_door_export(freeze_registered):
    keys = list(base.registered_strategies())
    assert keys[0] == "freeze"     # order 5 applies before LoRA's 10, though registered last
    assert keys[1:] == ["lora", "checkpoint", "tp", "ep", "fsdp", "zero", "pp", "ddp"]
    assert memsim.Freeze is freeze_registered


def test_shared_dp_option_needs_a_data_parallel_strategy(capsys):
    assert main(["analyze"] + MLP + ["--dp", "8"]) == 2
    assert "--dp given without --fsdp, --zero, --deepspeed or --ddp" in capsys.readouterr().err
    assert main(["analyze"] + MLP + ["--fsdp"]) == 2
    assert "--fsdp needs --dp N" in capsys.readouterr().err


def test_world_size_is_the_product_over_mesh_dimensions():
    from memsim.strategies import FSDP, LoRA, TensorParallel, world_size
    assert world_size({"fsdp": FSDP(dp=4), "tp": TensorParallel(2), "lora": LoRA()}) == 8
    assert world_size({"lora": LoRA()}) == 1


def test_unknown_keyword_names_strategies_and_step_options():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(memsim.InputError, match="unknown option 'fdsp' \\(did you mean 'fsdp'"):
        memsim.analyze(model, {"x": ("float32", ["B", 4])}, fdsp=8)


def test_step_options_come_from_the_fields():
    """Every StepConfig field with a command-line option has its flag on every subcommand
    that traces; the hash covers every field (a field left out of it would collide)."""
    from memsim.options import parser
    flags = [opt.flag for _, opt, _ in StepConfig.cli_options()]
    assert {"--device", "--precision", "--optimizer", "--drop-outputs", "--accumulate",
            "--compiled", "--hint", "--no-fold", "--cpu-isa", "--data-dependent",
            "--assume", "--multiple-of"} == set(flags)
    args = parser().parse_args(["analyze"] + MLP + ["--drop-outputs", "--no-fold",
                                                      "--hint", "B=3"])
    cfg = StepConfig(**StepConfig.from_options(args))
    assert cfg == StepConfig(device="cpu", loop="dropped", fold=False, hints={"B": 3})
    base_cfg = StepConfig()
    for f in dataclasses.fields(StepConfig):
        other = {"device": "cpu", "cpu_isa": "avx2", "precision": "bf16-mixed",
                 "optimizer": "sgd", "loss_fn": len, "loop": "dropped", "accumulate": 2,
                 "compiled": True, "hints": {"B": 3}, "limits": {"S": 9}, "fold": False,
                 "data_dependent": "0.5", "assume": {"m.py:3": False},
                 "multiples": {"H": 32}}[f.name]
        assert hash(base_cfg.replace(**{f.name: other})) != hash(base_cfg), f.name
