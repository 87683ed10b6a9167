"""LoRA: the wrapped model traced on meta == a real CPU run of the same wrapped model."""

import pytest
import torch

import zoo
from oracle import check, predict
from memsim.strategies.lora import LoRA, apply_lora, lora_targets, parse_lora
from memsim.tracer import StrategyError, UsageError

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


def _bnb_qlora(model, q):
    """The real thing: bitsandbytes Linear4bit (NF4, double quantization) quantized from the
    model's weights on the CPU, LoRA adapters on the targets. The quantization state lives in
    bitsandbytes' QuantState; it is registered as buffers so the oracle counts it."""
    import bitsandbytes as bnb

    from memsim.strategies.lora import LoRALayer, _head_names
    targets = set(lora_targets(model, q.targets))
    heads = _head_names(model)
    for p in model.parameters():
        p.requires_grad_(False)
    mods = dict(model.named_modules())
    for name, mod in list(mods.items()):
        if not isinstance(mod, torch.nn.Linear) or name in heads:
            continue
        l4 = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                               compute_dtype=getattr(torch, q.compute_dtype), quant_type="nf4",
                               compress_statistics=True)
        l4.weight = bnb.nn.Params4bit(mod.weight.data.clone(), requires_grad=False,
                                      quant_type="nf4", compress_statistics=True,
                                      blocksize=q.blocksize).to("cpu")
        if mod.bias is not None:
            l4.bias = torch.nn.Parameter(mod.bias.data.clone(), requires_grad=False)
        qs = l4.weight.quant_state
        for k, t in (("absmax", qs.absmax), ("absmax2", qs.state2.absmax), ("code", qs.code),
                     ("code2", qs.state2.code), ("offset", qs.offset)):
            l4.register_buffer("_qs_" + k, t)
        layer = l4
        if name in targets:
            layer = LoRALayer(l4, q.r, q.scaling, q.dropout, like=mod.weight,
                              dtype=torch.float32)
        parent, _, child = name.rpartition(".")
        setattr(mods[parent] if parent else model, child, layer)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_qlora_matches_real_bitsandbytes_run(compute):
    pytest.importorskip("bitsandbytes")
    T = pytest.importorskip("transformers")
    from oracles.measure import example_inputs, materialize, measure_train
    from memsim.strategies.lora import QLoRA, apply_qlora

    def base():
        return T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))

    q = QLoRA(r=8, compute_dtype=compute)
    report = predict(lambda: apply_qlora(base(), q), LM, inference=False)
    torch.manual_seed(0)
    real = _bnb_qlora(materialize(base()), q)
    for pt in ({"B": 2, "S": 8}, {"B": 3, "S": 13}):
        m = measure_train(real, example_inputs(LM, pt))
        got = report.at(**pt)["train"]
        assert (got["peak"], got["parameters"], got["gradients"], got["optimizer_states"]) == (
            m.peak, m.parameters, m.gradients, m.optimizer_states), pt
    # the 4-bit base: one byte per two weights, plus the quantization state
    plain = predict(base, LM, inference=False).at(B=2, S=8)["train"]
    assert got["parameters"] < plain["parameters"] / 2
