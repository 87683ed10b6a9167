"""What would make it fit (memsim.suggest): where the verdict is DOES NOT FIT, each option is
an analysis of its own at the point, and the figure it lists is what a real run with that option
takes (CPU: the total is the measured peak)."""

import importlib.util
import json

import pytest
import torch

from memsim.cli import main
from memsim.strategies import FSDP, ZeRO
from memsim.suggest import _offload
from memsim.tracer import Precision, StepConfig
from memsim.strategies.checkpoint import apply_checkpointing, named_plan
from tests.support import hf_models as hf
from tests.support.oracles.measure import example_inputs, materialize, measure_train

POINT = {"B": 4, "S": 48}
ARGS = ["analyze", "tests.support.hf_models:llama", "--input", "input_ids=int64[B,S]",
        "--input", "labels=int64[B,S]", "--device", "cpu", "--at", "B=4,S=48", "--margin", "0",
        "--train", "--json"]


def _real(checkpointed: bool, precision: str = "32-true") -> int:
    torch.manual_seed(0)
    model = materialize(hf.llama())
    if checkpointed:
        with torch.device("meta"):
            plan = named_plan(hf.llama(), "blocks")
        model = apply_checkpointing(model, plan)
    return measure_train(model, example_inputs(hf.LM, POINT), precision=precision).peak


def test_what_would_make_it_fit_equals_real_runs_with_each_option(capsys):
    plain, ckpt = _real(False), _real(True)
    assert ckpt < plain
    cap = (plain + ckpt) // 2   # the plain step does not fit, the checkpointed one does
    assert main(ARGS + ["--memory", f"{cap}B"]) == 0
    verdict = json.loads(capsys.readouterr().out)["verdict"]
    assert verdict["fits"] is False and verdict["total"] == plain
    options = {o["change"]: o for o in verdict["options"]}
    assert options["--checkpoint blocks"]["total"] == ckpt
    assert options["--checkpoint blocks"]["fits"] is True
    assert options["--precision bf16-mixed"]["total"] == _real(False, "bf16-mixed")
    assert not any(o["kind"] == "offload" for o in options.values())   # one memory on a CPU
    # those that fit come first, cheapest first; then the others by their total
    fits = [o["fits"] for o in verdict["options"]]
    assert fits == sorted(fits, reverse=True)
    assert verdict["options"][0]["fits"]


def test_options_are_listed_under_the_verdict_and_can_be_skipped(capsys):
    cap = (_real(False) + _real(True)) // 2
    text_args = [a for a in ARGS if a != "--json"] + ["--memory", f"{cap}B"]
    assert main(text_args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("DOES NOT FIT")
    assert out[1].startswith("  what would make it fit")
    assert any("--checkpoint blocks" in line and "fits" in line for line in out[2:6])
    assert main(text_args + ["--no-options"]) == 0
    assert "what would make it fit" not in capsys.readouterr().out


def test_offload_is_an_option_traced_on_a_gpu(capsys):
    """On a CUDA device ZeRO-Offload is one of the options (DeepSpeed's engine, traced): on
    one device ``--zero 2 --dp 1 --offload optimizer``, beside a ZeRO given without offload
    ``--offload`` (stage 3: parameters too); its figure is that analysis's total. On the CPU
    host and device are one memory, and it is not listed (the first test's options)."""
    if importlib.util.find_spec("deepspeed") is None:   # (importing it here would print)
        pytest.skip("deepspeed is not installed")
    args = [a for a in ARGS if a not in ("--device", "cpu")] + ["--memory", "3MiB"]
    assert main(args) == 0
    options = {o["change"]: o for o in json.loads(capsys.readouterr().out)["verdict"]["options"]}
    got = options["--zero 2 --dp 1 --offload optimizer"]
    assert main(args + ["--zero", "2", "--dp", "1", "--offload", "optimizer"]) == 0
    assert got["total"] == json.loads(capsys.readouterr().out)["verdict"]["total"]
    assert got["kind"] == "offload"
    # beside a ZeRO given without offload: its own offload, parameters too at stage 3; none
    # where it offloads already, or beside FSDP2 (whose CPUOffloadPolicy is not modelled)
    cuda, bf16 = StepConfig(device="cuda"), StepConfig(device="cuda", precision="bf16-mixed")
    flags, step, extra = _offload(cuda, {"zero": ZeRO(stage=3, dp=2)})
    assert flags == "--offload optimizer+params" and not step
    assert (extra["zero"].offload_optimizer, extra["zero"].offload_param) == ("cpu", "cpu")
    assert _offload(cuda, {"zero": ZeRO(stage=2, dp=2)})[0] == "--offload optimizer"
    assert _offload(cuda, extra) is None and _offload(cuda, {"fsdp": FSDP(dp=2)}) is None
    # DeepSpeed runs bf16 as its bf16 (fp32 master partitions), not autocast's bf16-mixed
    assert _offload(bf16, {})[:2] == ("--zero 2 --dp 1 --offload optimizer --precision "
                                      "bf16-master", {"precision": Precision.BF16_MASTER})
