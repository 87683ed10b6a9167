"""LoRA: the wrapped model traced on meta == a real CPU run of the same wrapped model."""

import pytest
import torch

import zoo
from oracle import check, predict
from strategies.lora import LoRA, apply_lora, lora_targets, parse_lora
from tracer import StrategyError, UsageError

GPT = {"idx": ("int64", ["B", "S"]), "targets": ("int64", ["B", "S"])}
LM = {"input_ids": ("int64", ["B", "S"]), "labels": ("int64", ["B", "S"])}


def tiny_lora(**kw):
    def factory():
        return apply_lora(zoo.TinyGPT(layers=2, sdpa=False), LoRA(**kw))
    return factory


@pytest.mark.parametrize("kw", [dict(r=4), dict(r=2, dropout=0.1, targets="all-linear")],
                         ids=["attention", "all-linear-dropout"])
def test_lora_matches_real_run(kw):
    report = predict(tiny_lora(**kw), GPT, inference=False)
    check(report, tiny_lora(**kw), GPT, [{"B": 2, "S": 8}, {"B": 3, "S": 21}])


def test_frozen_base_has_no_gradients_or_state():
    full = predict(lambda: zoo.TinyGPT(layers=2, sdpa=False), GPT, inference=False)
    lora = predict(tiny_lora(r=4), GPT, inference=False)
    pt = {"B": 3, "S": 21}
    f, l = full.at(**pt)["train"], lora.at(**pt)["train"]
    # adapters on attn.c_attn (32 -> 96) and attn.c_proj (32 -> 32), rank 4, fp32, 2 blocks
    adapters = 2 * 4 * ((32 + 96) * 4 + (32 + 32) * 4)
    assert l["gradients"] == adapters
    assert l["optimizer_states"] == 2 * adapters + 4 * 4 * 2  # exp_avg, exp_avg_sq, steps
    assert l["parameters"] == f["parameters"] + adapters
    assert l["saved_activations"] < f["saved_activations"] + 2 * 3 * 21 * 4 * 4 * 2


@pytest.mark.slow
def test_lora_on_hf_llama_matches_real_run():
    T = pytest.importorskip("transformers")

    def base():
        return T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))

    def factory():
        return apply_lora(base(), LoRA(r=8))

    with torch.device("meta"):
        m = factory()
    assert {n.rsplit(".", 2)[-2] for n, p in m.named_parameters() if p.requires_grad} == \
        {"lora_A", "lora_B"}
    assert {n.rsplit(".", 1)[-1] for n in lora_targets(base(), "attention")} <= {
        "q_proj", "k_proj", "v_proj", "o_proj"}
    report = predict(factory, LM, inference=False)
    check(report, factory, LM, [{"B": 2, "S": 8}, {"B": 3, "S": 13}])


def test_lora_targets_and_errors():
    m = zoo.TinyGPT(layers=2)
    assert lora_targets(m, "attention") == [f"h.{i}.attn.{n}" for i in range(2)
                                            for n in ("c_attn", "c_proj")]
    assert "lm_head" not in lora_targets(m, "all-linear")
    assert lora_targets(m, ("c_attn",)) == ["h.0.attn.c_attn", "h.1.attn.c_attn"]
    with pytest.raises(StrategyError, match="'q_proj' matches no linear layer"):
        apply_lora(m, LoRA(targets=("q_proj",)))
    with pytest.raises(StrategyError, match="rank"):
        LoRA(r=0)
    assert parse_lora("r=16,alpha=32,targets=q_proj+v_proj") == LoRA(
        r=16, alpha=32.0, targets=("q_proj", "v_proj"))
    with pytest.raises(UsageError, match="unknown key"):
        parse_lora("rank=4")
