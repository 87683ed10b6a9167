"""A Hugging Face model from its configuration on disk (``hf:PATH``), with no Python file: the
class from ``architectures`` (or ``--hf-class``), a causal LM's inputs filled in, its figures a
real run's; a configuration given where a model is expected names the fix."""

import json

import pytest
import torch
import transformers

from memsim.cli import main
from tests.support.oracles.measure import example_inputs, materialize, measure_train

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


@pytest.fixture
def llama_config(tmp_path):
    config = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **SMALL)
    config.to_json_file(str(tmp_path / "config.json"))
    return config, tmp_path


def test_a_config_on_disk_is_answered_as_a_real_run(llama_config, capsys):
    config, folder = llama_config
    args = ["--device", "cpu", "--at", "B=2,S=8", "--json", "--train"]
    assert main(["analyze", f"hf:{folder / 'config.json'}"] + args) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert "--input input_ids=int64[B,S] --input labels=int64[B,S]" in err
    assert doc["symbols"] == ["B", "S"]
    assert main(["analyze", f"hf:{folder}"] + args) == 0    # the folder holding it
    assert json.loads(capsys.readouterr().out)["train"] == doc["train"]
    torch.manual_seed(0)
    real = materialize(transformers.LlamaForCausalLM(config))
    m = measure_train(real, example_inputs(LM, {"B": 2, "S": 8}))
    for k in ("peak", "parameters", "gradients", "optimizer_states", "activation_peak"):
        assert doc["train"][k]["bytes"] == getattr(m, k), k
    # another class of the same configuration: the base model, whose forward takes no labels
    assert main(["analyze", f"hf:{folder}", "--hf-class", "LlamaModel"] + args) == 0
    out, err = capsys.readouterr()
    assert "--input input_ids=int64[B,S] (" in err
    assert json.loads(out)["train"]["parameters"]["bytes"] < doc["train"]["parameters"]["bytes"]


def test_hf_target_errors_name_the_fix(llama_config, tmp_path, capsys):
    _, folder = llama_config
    assert main(["analyze", "hf:no/such/org-model", "--at", "B=2,S=8"]) == 2
    err = capsys.readouterr().err
    assert "no such model in the local Hugging Face cache (memsim never downloads)" in err
    assert main(["analyze", f"hf:{folder}", "--hf-class", "NoSuchModel", "--at", "B=2,S=8"]) == 2
    assert "transformers has no model class 'NoSuchModel'" in capsys.readouterr().err
    assert main(["analyze", "tests.support.zoo:MLP", "--hf-class", "LlamaModel",
                 "--input", "x=float32[B,16]"]) == 2
    assert "--hf-class names the class of an hf: target" in capsys.readouterr().err
    # a configuration object where a model is expected: its type, and how to build the model
    f = tmp_path / "target.py"
    f.write_text("import transformers\nconfig = transformers.LlamaConfig()\n")
    assert main(["analyze", f"{f}:config", "--input", "input_ids=int64[B,S]"]) == 2
    err = capsys.readouterr().err
    assert "is a LlamaConfig: neither an nn.Module" in err
    assert "build the model from it" in err and "hf:config.json" in err


def test_an_answer_kept_for_a_config_depends_on_its_content(llama_config):
    """The command's answer cache keys an hf: target by its configuration's content (a changed
    config.json is traced again, not answered from the cache)."""
    from memsim import entry
    _, folder = llama_config
    want = [str((folder / "config.json").resolve())]
    assert entry._paths_in(["analyze", f"hf:{folder}"]) == want
    assert entry._paths_in(["analyze", f"hf:{folder / 'config.json'}"]) == want


def test_a_checkpoint_plan_states_the_kv_cache_it_assumes(llama_config, capsys):
    """A Hugging Face model's plan is exact with its KV cache off, as apply_checkpointing sets
    it (tests/test_checkpoint.py measures how much more a real run holds with it on): the text
    and the JSON say so."""
    _, folder = llama_config
    args = ["checkpoint", f"hf:{folder}", "--device", "cpu", "--at", "B=2,S=8", "--plan", "blocks"]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"] == ["model.layers.0", "model.layers.1"]
    assert any("KV cache is off" in c for c in doc["conditions"])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "These figures assume:" in text and "use_cache = False" in text
